"""Requests from the daemon to the hook: ``flush`` (write the counters now), ``reset`` (zero them, then write) and
``apply`` (swap a candidate map in place, then write; pin mode only).

The protocol, for both counts (count mode) and stats (pin mode):

1. The client drops ``<artifact>.request`` (:func:`request_path`) holding ``{"op": ..., "token": ..., "args":
   {...}}`` (:func:`write_hook_request`). Only ``apply`` takes arguments: ``{"map": <absolute path of the
   candidate map file, as the engine sees it>, "hash": <the candidate's content_hash>}`` (:func:`apply_args`
   builds them, :func:`parse_apply_args` reads them).
2. The hook's side thread looks for it every :data:`REQUEST_POLL_S`, serves it, and writes the artifact with the
   request's token in its top-level ``flush_token`` field. It keeps echoing that token in every later write until
   the next request, so a slow poller cannot miss it; then it removes the request file unless a newer request
   has replaced it meanwhile. A request file the hook cannot read (not JSON, no op or token, an unknown op) is
   dropped, never fatal. An ``apply`` whose arguments are wrong is *answered*, with outcome ``refused`` and the
   reason (``meta["apply"]``, :class:`~pinsidecar_hook.contract.swap.ApplyResult`): the daemon learns what was
   wrong at once instead of waiting out its timeout.
3. The client waits for an artifact whose ``flush_token`` is its token (:func:`request_and_wait`, the one
   client-side wait; every caller uses it).

A file rather than a signal or socket because the engine's worker may be a grandchild process, or live in a
container: the daemon can always reach the artifact's directory, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pinsidecar_hook.contract.io import atomic_write_json

__all__ = [
    "APPLY_ORDERINGS",
    "HOOK_OPS",
    "REQUEST_POLL_S",
    "HookRequest",
    "HookRequestError",
    "apply_args",
    "apply_ordering",
    "parse_apply_args",
    "read_hook_request",
    "request_and_wait",
    "request_path",
    "write_hook_request",
]

HOOK_OPS = ("flush", "reset", "apply")
# How an apply's batches are ordered against the engine's steps (pinsidecar_hook.swap.batches, "Ordering"):
# "host" syncs the device under the step lock before and after each batch; "stream" queues the batch on the
# engine's own CUDA stream and lets the next step wait for it on the device.
APPLY_ORDERINGS = ("host", "stream")
# How often the hook's side thread looks for a request file, in both modes: short enough that commands waiting
# for their request feel immediate (a request is served within this plus one engine step), long enough that the
# stat() calls are noise.
REQUEST_POLL_S = 0.2

T = TypeVar("T")


class HookRequestError(RuntimeError):
    """A hook request got no answer: not within the timeout, or the engine went away while waiting."""


class HookRequest(NamedTuple):
    """A pending request as the hook reads it: ``args`` is ``{}`` for ``flush`` and ``reset``."""

    op: str
    token: str
    args: dict[str, Any]


def apply_args(map_path: str | os.PathLike[str], content_hash: str,
               hold_ms: float | None = None, ordering: str | None = None) -> dict[str, Any]:
    """The arguments of an ``apply`` request: the candidate map's path as the engine sees it (absolute: the engine
    does not share the client's working directory, and may live in a container) and its content hash, which the
    hook checks against the file it reads, so a file replaced in between is refused rather than applied.
    ``hold_ms``, optional, bounds how long one batch of the apply holds the engine's step (the hook's default
    otherwise; see :func:`apply_hold_budget_s`). ``ordering``, optional, is how the batches are ordered against
    the steps, one of :data:`APPLY_ORDERINGS` (the hook's default otherwise; see :func:`apply_ordering`)."""
    args: dict[str, Any] = {"map": str(map_path), "hash": str(content_hash)}
    if hold_ms is not None:
        args["hold_ms"] = float(hold_ms)
    if ordering is not None:
        args["ordering"] = _checked_ordering(ordering)
    return args


def _checked_ordering(raw: Any) -> str:
    if raw not in APPLY_ORDERINGS:
        raise ValueError(f"apply args.ordering must be one of {', '.join(APPLY_ORDERINGS)}, got {raw!r}")
    return str(raw)


def apply_ordering(args: Mapping[str, Any]) -> str | None:
    """The optional ``ordering`` of an ``apply`` request (None: the hook's default); ``ValueError`` when it is not
    one of :data:`APPLY_ORDERINGS`. A field of the request rather than an engine setting because the daemon's
    config owns how its remaps deploy, and an engine keeps serving across many remaps."""
    raw = args.get("ordering") if isinstance(args, Mapping) else None
    return None if raw is None else _checked_ordering(raw)


def apply_hold_budget_s(args: Mapping[str, Any]) -> float | None:
    """The optional ``hold_ms`` of an ``apply`` request, in seconds (None: the hook's default); ``ValueError`` when
    it is not a number >= 0. Kept apart from :func:`parse_apply_args`, whose answer old callers unpack."""
    raw = args.get("hold_ms") if isinstance(args, Mapping) else None
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not raw >= 0 or math.isnan(raw):
        raise ValueError(f"apply args.hold_ms must be a number of milliseconds >= 0, got {raw!r}")
    return float(raw) / 1e3


def parse_apply_args(args: Mapping[str, Any]) -> tuple[Path, str]:
    """``(map path, content hash)`` from an ``apply`` request's arguments; ``ValueError`` saying what is wrong
    (the hook answers such a request with outcome ``refused`` and that message)."""
    if not isinstance(args, Mapping):
        raise ValueError(f"apply arguments must be an object, got {type(args).__name__}")
    raw_map, raw_hash = args.get("map"), args.get("hash")
    if not isinstance(raw_map, str) or not raw_map.strip():
        raise ValueError(f"apply needs args.map, the candidate map's path as the engine sees it (got {raw_map!r})")
    if not os.path.isabs(raw_map):
        raise ValueError(f"apply args.map must be an absolute path (the engine does not share the client's working "
                         f"directory), got {raw_map!r}")
    if not isinstance(raw_hash, str) or not raw_hash.startswith("sha256:"):
        raise ValueError(f"apply needs args.hash, the candidate's content hash 'sha256:...' (got {raw_hash!r})")
    return Path(raw_map), raw_hash


def request_path(artifact_path: str | os.PathLike[str]) -> Path:
    """Where the daemon drops a request for the hook that writes ``artifact_path`` (counts or stats)."""
    p = Path(artifact_path)
    return p.with_name(p.name + ".request")


def write_hook_request(artifact_path: str | os.PathLike[str], op: str,
                       args: Mapping[str, Any] | None = None) -> str:
    """Ask the hook to ``flush`` (write its counters now), ``reset`` (zero them, then write) or ``apply`` (swap
    the candidate map named by ``args`` in place, then write; see :func:`apply_args`).

    Returns a token; the hook copies it into the artifact's ``flush_token``, which is how the caller knows its
    request was served. Most callers want :func:`request_and_wait`, which also waits for the answer. The
    arguments' content is checked by the hook, which answers a bad ``apply`` with a refusal; here only their
    type (an object) is.
    """
    if op not in HOOK_OPS:
        raise ValueError(f"unknown hook request {op!r}; expected one of {HOOK_OPS}")
    if args is not None and not isinstance(args, Mapping):
        raise ValueError(f"hook request arguments must be a mapping, got {type(args).__name__}")
    token = f"{op}-{os.getpid()}-{time.time_ns()}"
    atomic_write_json(request_path(artifact_path), {"op": op, "token": token, "args": dict(args or {})})
    return token


def read_hook_request(artifact_path: str | os.PathLike[str]) -> HookRequest | None:
    """The pending request, or None. A request the hook cannot read (not JSON, no op or token, an unknown op) is
    ignored (and removed) rather than fatal: the hook runs inside the serving engine and must never fail because
    of a stray file. Arguments that are missing or not an object read as ``{}``: an ``apply`` with them is still
    returned, so that the hook answers it with a refusal."""
    p = request_path(artifact_path)
    try:
        doc = json.loads(p.read_bytes())
        op, token = str(doc["op"]), str(doc["token"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            p.unlink()
        return None
    if op not in HOOK_OPS:
        with contextlib.suppress(OSError):
            p.unlink()
        return None
    raw_args = doc.get("args")
    return HookRequest(op, token, dict(raw_args) if isinstance(raw_args, dict) else {})


def request_and_wait(artifact_path: str | os.PathLike[str], op: str, load: Callable[[Path], T], *,
                     timeout_s: float = 60.0, alive: Callable[[], bool] | None = None, poll_s: float = 0.1,
                     args: Mapping[str, Any] | None = None) -> T:
    """Drop a request (``op`` with ``args``) beside ``artifact_path`` and return the first artifact
    (``load(artifact_path)``) whose ``flush_token`` is the request's token. For ``apply`` the outcome is in the
    artifact's ``meta["apply"]`` (:meth:`~pinsidecar_hook.contract.swap.ApplyResult.from_json`).

    ``load`` is the artifact's reader (``load_counts``, ``load_stats``); a missing, corrupt or half-written file
    means "not yet". Pass ``alive`` (e.g. the engine process's ``alive``) to fail at once when the engine exits
    instead of waiting out the timeout. Raises :class:`HookRequestError` in both cases; the timeout message names
    the file and how to check that the hook is loaded.
    """
    path = Path(artifact_path)
    token = write_hook_request(path, op, args)
    deadline = time.monotonic() + timeout_s
    last = "no file yet"
    while True:
        try:
            artifact = load(path)
        except (OSError, ValueError) as exc:  # ArtifactError is a ValueError: missing, corrupt, mid-replace
            last = str(exc)
        else:
            answered = getattr(artifact, "flush_token", None)
            if answered == token:
                return artifact
            last = f"its flush_token is {answered!r}"
        if alive is not None and not alive():
            raise HookRequestError(f"the engine exited while waiting for the hook to answer the {op} request "
                                   f"{token} ({path})")
        if time.monotonic() >= deadline:
            raise HookRequestError(
                f"the hook did not answer the {op} request {token} within {timeout_s:g} s ({path}: {last}). Check "
                "that the engine loads the pinsidecar hook: VLLM_PLUGINS unset or including 'pinsidecar_hook', "
                "the pinsidecar_hook entry point installed or the hook/ folder on PYTHONPATH, and "
                "PINSIDECAR_HOOK_MODE / PINSIDECAR_COUNTS_PATH / PINSIDECAR_STATS_PATH naming this file")
        time.sleep(poll_s)
