"""Hypothesis set-up shared by the fuzz suites: the profiles, and strategies for hostile values and mutated documents.

Why mutations of *valid* documents rather than random JSON alone: random JSON is refused at the first field
(``format``), so it never reaches the checks behind it. A valid counts, map or stats document with one to three
fields replaced (by NaN, a huge or negative integer, a string, a nested list...), deleted, or the whole file
truncated, gets as far as the check that should catch it, which is what the suites want to prove.

Profiles (``PINSIDECAR_HYPOTHESIS_PROFILE``):

- ``ci`` (default): derandomized, so CI runs the same examples every time and a failure reproduces; no example
  database (nothing written into the checkout); few examples per test, to keep each test to a few seconds on a
  2-core box;
- ``explore``: random and ten times the examples, for a developer hunting for new failures
  (``PINSIDECAR_HYPOTHESIS_PROFILE=explore pytest tests/test_fuzz_readers.py``).

``hypothesis`` is a test dependency (the ``test`` extra); nothing outside the tests imports this module.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__: list[str] = []  # nothing here is another package's business

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("PINSIDECAR_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
# The per-test example count is scaled by the profile: ``EXAMPLES(n)`` is n on CI, 10n when exploring.
_SCALE = 10 if PROFILE == "explore" else 1


def EXAMPLES(n: int) -> int:
    """Reads as a constant at the call site: ``@settings(max_examples=EXAMPLES(60))``."""
    return n * _SCALE


# Values a corrupt or hostile file may hold where a reader expects something else: the edges of every numeric
# type (NaN, infinities, integers past int64 and past float, negatives), and every other JSON kind.
_EDGE_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**12, 10**400]
_EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]


def hostile_values(max_leaves: int = 4) -> st.SearchStrategy[Any]:
    """Any JSON value, weighted towards the edges of numbers."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.sampled_from(_EDGE_INTS), st.sampled_from(_EDGE_FLOATS),
        st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
    )
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=max_leaves)


def toml_values(max_leaves: int = 3) -> st.SearchStrategy[Any]:
    """Values TOML can hold (no null; tables and arrays), weighted the same way: what a config file may say."""
    scalars = st.one_of(
        st.booleans(), st.sampled_from(_EDGE_INTS), st.sampled_from(_EDGE_FLOATS),
        st.integers(min_value=-(2**64), max_value=2**64), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12), st.sampled_from(["", "/", "..", "../../etc/passwd", "\x00", "~", "nan", "-1"]),
    )
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=max_leaves)


def _containers(doc: Any, trail: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) to a dict or list inside ``doc``, the root included."""
    out: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        out.append(trail)
        for k, v in doc.items():
            out.extend(_containers(v, (*trail, k)))
    elif isinstance(doc, list):
        out.append(trail)
        for i, v in enumerate(doc[:8]):  # the first rows are as good as any; keeps the path list short
            out.extend(_containers(v, (*trail, i)))
    return out


def mutate(data: st.DataObject, doc: Any, values: st.SearchStrategy[Any], max_mutations: int = 3) -> Any:
    """A copy of ``doc`` with 1..``max_mutations`` edits drawn through ``data``: a value replaced by one of
    ``values``, a key deleted, a list cut short or grown."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, max_mutations), label="mutations")):
        trail = data.draw(st.sampled_from(_containers(doc)), label="where")
        node = doc
        for step in trail:
            node = node[step]
        if isinstance(node, dict):
            if not node:
                node[data.draw(st.text(max_size=6), label="new key")] = data.draw(values, label="value")
                continue
            key = data.draw(st.sampled_from(sorted(node, key=str)), label="key")
            if data.draw(st.booleans(), label="delete?"):
                del node[key]
            else:
                node[key] = data.draw(values, label="value")
        else:
            op = data.draw(st.sampled_from(["replace", "cut", "grow"]), label="list op")
            if op == "replace" and node:
                node[data.draw(st.integers(0, len(node) - 1), label="index")] = data.draw(values, label="value")
            elif op == "cut":
                del node[data.draw(st.integers(0, len(node)), label="keep"):]
            else:
                node.append(data.draw(values, label="value"))
    return doc


def to_bytes(data: st.DataObject, doc: Any) -> bytes:
    """``doc`` as the JSON a file would hold (NaN and Infinity written as Python's json writes them), maybe
    truncated at a drawn byte: a torn write, a full disk."""
    raw = json.dumps(doc, allow_nan=True).encode()
    if data.draw(st.booleans(), label="truncate?"):
        raw = raw[:data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut at")]
    return raw
