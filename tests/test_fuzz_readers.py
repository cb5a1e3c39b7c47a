"""Property-based tests of every reader of untrusted bytes: the counts, map and stats files, and the config file.

The property, for each: whatever the bytes (random, a valid file with fields replaced by NaN, huge, negative or
mistyped values, deleted keys, a truncated write, a wrong version, a header claiming 10^12 experts), the reader
either returns a valid object or raises its module's one error type (:class:`ArtifactError`,
:class:`ConfigError`) with a message naming the file or the key. Never another exception, never a hang, never an
allocation sized by the header (checked with tracemalloc). Readers further down the line (the stats reader the
exporter uses, the counts summary, the delta rules) get the same bytes and must not raise either.

Engine-free. Examples are derandomized (:mod:`pinsidecar.testing.fuzz`, profile ``ci``); each test runs a few
seconds.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pinsidecar_hook.contract import (
    COUNTS_FORMAT,
    MAP_FORMAT,
    STATS_FORMAT,
    ArtifactError,
    StatsSnapshot,
    load_counts,
    load_map,
    load_stats,
)
from pinsidecar_hook.contract.io import MAX_EXPERTS, MAX_LAYERS

from pinsidecar.daemon.config import _SECTION_TYPES, ConfigError, load_config, parse_config
from pinsidecar.live_stats import StatsReader, compare
from pinsidecar.placement.counts import counts_summary, load_counts_files, sum_counts
from pinsidecar.schema import TABLE, TOML_KEY
from pinsidecar.testing.artifacts import make_counts, make_map
from pinsidecar.testing.fuzz import EXAMPLES, hostile_values, mutate, to_bytes, toml_values

READERS = {"counts": load_counts, "map": load_map, "stats": load_stats}


def _stats_doc() -> dict[str, Any]:
    layers = [0, 1, 2]
    return StatsSnapshot(boot_id="b1", seq=3, layer_ids=layers, num_experts=6, top_k=2, selections=[40, 40, 40],
                         cold_selections=[5, 0, 40], tokens=20, map_hash="sha256:ab", map_label="A", pid=7,
                         written_at=1.7e9, tier_bytes={"hbm": 10, "host": 20},
                         histogram=[[10, 10, 10, 5, 5, 0], [40, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 40]],
                         errors={"stats_write": 1}, flush_token="flush-1").to_json()


# Small valid documents of each kind; a mutation starts from one of them, with or without its digest (a mutated
# field under a digest is caught by the digest, so half the examples drop it to reach the checks behind it).
BASE = {
    "counts": make_counts(num_layers=3, num_experts=6, top_k=2, tokens=20, seed=1).to_json(),
    "map": make_map(num_layers=3, num_experts=6, hot_rows=2, top_k=2, seed=1).to_json(),
    "stats": _stats_doc(),
}
DIGEST_KEY = {"counts": "digest", "map": "hash", "stats": None}


def _write(tmp: Path, name: str, raw: bytes) -> Path:
    p = tmp / name
    p.write_bytes(raw)
    return p


def _load_or_refuse(kind: str, path: Path) -> Any:
    """The reader's result, or None after checking the refusal is an ArtifactError naming the file."""
    try:
        return READERS[kind](path)
    except ArtifactError as exc:
        assert str(path) in str(exc), exc  # the message names the file
        assert exc.problem, exc
        return None


def _downstream(kind: str, path: Path, obj: Any) -> None:
    """What else reads the same file must not raise on it either."""
    if kind == "counts" and obj is not None:
        summary = counts_summary(obj)
        assert summary["num_experts"] == obj.num_experts
        assert sum_counts([obj, obj]).selections == 2 * obj.selections  # int64 sums: no overflow past the check
        assert load_counts_files([path])[0].digest() == obj.digest()
    if kind == "map" and obj is not None:
        assert obj.row_maps().shape == (obj.num_layers, obj.num_experts)
    if kind == "stats":
        reader = StatsReader(path, use_fallback=False)
        reading = reader.read()  # never raises: a scrape must not fail on a bad file
        if obj is None:
            assert reading is None and reader.last_error and str(path) in reader.last_error
        else:
            assert reading is not None and reading.first
            again = compare(obj, obj, path)  # the delta rules on the same snapshot: zero delta
            assert again.delta_tokens == 0 and not again.restarted


@pytest.mark.parametrize("kind", sorted(READERS))
@settings(max_examples=EXAMPLES(60))
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=200).map(str.encode)))
@example(raw=b"")
@example(raw=b"\xff\xfe\x00")
@example(raw=b"[" * 100_000)  # deeper than the JSON parser's stack
@example(raw=b'{"format": "pinsidecar.counts", "version": 1}')
def test_random_bytes_are_refused_with_the_file_named(kind: str, raw: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, f"{kind}.json", raw)
    assert _load_or_refuse(kind, path) is None
    _downstream(kind, path, None)


@pytest.mark.parametrize("kind", sorted(READERS))
@settings(max_examples=EXAMPLES(150))
@given(data=st.data())
def test_mutated_documents_load_valid_or_are_refused_clearly(kind: str, data: st.DataObject, tmp_path: Path) -> None:
    doc = dict(BASE[kind])
    key = DIGEST_KEY[kind]
    if key and data.draw(st.booleans(), label="drop digest"):
        doc.pop(key)
    doc = mutate(data, doc, hostile_values())
    path = _write(tmp_path, f"{kind}.json", to_bytes(data, doc))
    obj = _load_or_refuse(kind, path)
    _downstream(kind, path, obj)


@pytest.mark.parametrize("kind", sorted(READERS))
@settings(max_examples=EXAMPLES(20))
@given(version=hostile_values(max_leaves=2).filter(lambda v: v != 1 or isinstance(v, bool)))
@example(version=2)
@example(version="1")
@example(version=1.0 + 1e-9)
def test_wrong_versions_are_refused_never_guessed(kind: str, version: Any, tmp_path: Path) -> None:
    doc = {**BASE[kind], "version": version}
    path = _write(tmp_path, f"{kind}.json", json.dumps(doc, allow_nan=True).encode())
    with pytest.raises(ArtifactError, match="version") as err:
        READERS[kind](path)
    assert str(path) in str(err.value)


def _huge(kind: str, layers: int, experts: int) -> dict[str, Any]:
    """A header claiming ``layers`` x ``experts`` (with top_k 1) and a body that does not back it."""
    doc = {**BASE[kind], "num_experts": experts, "top_k": 1, "layer_ids": list(range(min(layers, MAX_LAYERS + 1)))}
    doc.pop(DIGEST_KEY[kind] or "", None)
    if kind == "map":
        doc["geometry"] = {**doc["geometry"], "hot_rows": 0, "cold_rows": experts}
        doc["layers"] = [{"layer_id": i, "hot": [], "cold": [0, 1]} for i in doc["layer_ids"]]
    return doc


@pytest.mark.parametrize("kind", sorted(READERS))
@settings(max_examples=EXAMPLES(15))
@given(experts=st.one_of(st.integers(MAX_EXPERTS + 1, 10**15), st.sampled_from([10**12, 2**63, 10**30])),
       layers=st.integers(1, 3))
def test_huge_dimensions_are_refused_before_allocating(kind: str, experts: int, layers: int,
                                                      tmp_path: Path) -> None:
    path = _write(tmp_path, f"{kind}.json", json.dumps(_huge(kind, layers, experts)).encode())
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match=r"num_experts is \d+, more than the 65536") as err:
            READERS[kind](path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) in str(err.value)
    assert peak < 4 * 1024 * 1024, f"{peak} bytes allocated to refuse a {experts}-expert header"


@pytest.mark.parametrize("kind", sorted(READERS))
def test_too_many_layers_and_oversized_files_are_refused(kind: str, tmp_path: Path) -> None:
    doc = {**BASE[kind], "layer_ids": list(range(MAX_LAYERS + 1))}
    path = _write(tmp_path, f"{kind}.json", json.dumps(doc).encode())
    with pytest.raises(ArtifactError, match=f"{MAX_LAYERS + 1} layers, more than the {MAX_LAYERS}"):
        READERS[kind](path)
    big = tmp_path / f"big-{kind}.json"
    with open(big, "wb") as fh:  # sparse: 300 MB claimed, nothing written
        fh.truncate(300 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match="over the 268435456-byte limit"):
            READERS[kind](big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


# Specific values each reader must refuse, and the field the message must name.
@pytest.mark.parametrize(("kind", "field", "value", "said"), [
    ("counts", "counts", [[2**62] * 6] * 3, "too large"),  # a layer's sum overflows int64
    ("counts", "counts", [[-1, 0, 0, 0, 0, 0]] * 3, "negative counts"),
    ("counts", "counts", [[1.5, 0, 0, 0, 0, 0]] * 3, "table of integers"),
    ("counts", "counts", [[float("nan")] * 6] * 3, "table of integers"),
    ("counts", "tokens", 2**63, "at most"),
    ("counts", "tokens", -5, "tokens must be >= 0"),
    ("map", "predicted_cold_rate", float("nan"), "predicted_cold_rate"),
    ("map", "predicted_cold_rate", float("inf"), "predicted_cold_rate"),
    ("map", "predicted_cold_rate", 10**400, "predicted_cold_rate"),
    ("map", "predicted_cold_rate", 1.5, "predicted_cold_rate"),
    ("stats", "written_at", float("nan"), "written_at"),
    ("stats", "written_at", 10**400, "written_at"),
    ("stats", "tokens", -1, "seq and tokens must be >= 0"),
    ("stats", "seq", 2**64, "seq and tokens"),
    ("stats", "selections", [2**64, 2**64, 2**64], "64-bit"),
    ("stats", "histogram", [[-1, 0, 0, 0, 0, 0]] * 3, "histogram row 0"),
    ("stats", "tier_bytes", {"hbm": float("inf")}, "malformed field"),
], ids=lambda v: str(v)[:24])
def test_nan_negative_and_overflowing_values_are_named(kind: str, field: str, value: Any, said: str,
                                                      tmp_path: Path) -> None:
    doc = {**BASE[kind], field: value}
    doc.pop(DIGEST_KEY[kind] or "", None)
    path = _write(tmp_path, f"{kind}.json", json.dumps(doc, allow_nan=True).encode())
    with pytest.raises(ArtifactError, match=re.escape(said)) as err:
        READERS[kind](path)
    assert str(path) in str(err.value)


def test_map_expert_bytes_must_be_a_non_negative_integer(tmp_path: Path) -> None:
    for bad in (-1, 1.5, float("inf"), "12"):
        doc = {**BASE["map"]}
        doc["geometry"] = {**doc["geometry"], "expert_bytes": bad}
        path = _write(tmp_path, "map.json", json.dumps(doc, allow_nan=True).encode())
        with pytest.raises(ArtifactError, match="expert_bytes must be a non-negative integer"):
            load_map(path)


def test_every_format_refuses_the_others(tmp_path: Path) -> None:
    for kind, fmt in (("counts", COUNTS_FORMAT), ("map", MAP_FORMAT), ("stats", STATS_FORMAT)):
        for other, doc in BASE.items():
            if other == kind:
                continue
            path = _write(tmp_path, f"{other}-as-{kind}.json", json.dumps(doc).encode())
            with pytest.raises(ArtifactError, match=f"expected {fmt!r}"):
                READERS[kind](path)


# ------------------------------------------------------------------------------------------------ config file

SECTIONS = tuple(_SECTION_TYPES)


def _config_doc(tmp: Path) -> dict[str, Any]:
    return {
        "engine": {"model": str(tmp / "model"), "port": 8251, "vllm": {"max-num-seqs": 4, "enforce-eager": True}},
        "control": {"token_file": str(tmp / "token"), "port": 8252},
        "gate": {"port": 8250},
        "metrics": {"port": 8253},
        "supervisor": {"crash_loop_limit": 5, "advanced": {"health_interval_s": 2.0}},
        "daemon": {"state_dir": str(tmp / "state"), "log_level": "info"},
    }


def _named(msg: str, doc: dict[str, Any]) -> bool:
    """The error names a section or ``section.key`` of the document (or of the known sections)."""
    head = msg.split(":", 1)[0].strip()
    return head.split(".", 1)[0] in set(SECTIONS) | {str(k) for k in doc}


@settings(max_examples=EXAMPLES(200))
@given(data=st.data())
def test_mutated_configs_load_or_name_the_key(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.getbasetemp()
    doc = _config_doc(tmp)
    # a key that exists in some section, or a random one: a type error on a real key is the likelier mistake; a
    # key that moved goes at its place, at its old place (deprecated) or at both (an error naming both)
    section = data.draw(st.sampled_from(SECTIONS), label="section")
    if data.draw(st.booleans(), label="real key?"):
        fields = {f.name: f for f in dataclasses.fields(_SECTION_TYPES[section])}
        f = fields[data.draw(st.sampled_from(sorted(fields)), label="key")]
        table = doc.setdefault(section, {})
        sub = f.metadata.get(TABLE)
        places = ["old", "new", "both"] if sub else ["old"]
        place = data.draw(st.sampled_from(places), label="place")
        if place in ("old", "both"):
            table[f.name] = data.draw(toml_values())
        if place in ("new", "both"):
            table.setdefault(sub, {})[f.metadata.get(TOML_KEY, f.name)] = data.draw(toml_values())
    doc = mutate(data, doc, toml_values(), max_mutations=2)
    try:
        cfg = parse_config(doc, tmp, check_paths=False)
    except ConfigError as exc:
        assert _named(str(exc), doc), f"message names no key: {exc}"
    else:
        assert cfg.control.token_file is not None
        assert all(d.key.split(".", 1)[0] in SECTIONS for d in cfg.deprecations)


@settings(max_examples=EXAMPLES(200))
@given(flags=st.dictionaries(st.sampled_from(["max-num-seqs", "max_model_len", "--seed", "port", "dtype",
                                              "enforce-eager", "no-enforce-eager", "compilation-config", "x y",
                                              "quantization", "enable_prefix_caching", ""]) | st.text(max_size=8),
                             toml_values(), max_size=4))
def test_random_vllm_tables_render_or_name_the_flag(flags: dict[str, Any],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.getbasetemp()
    doc = _config_doc(tmp)
    doc["engine"]["vllm"] = flags
    try:
        cfg = parse_config(doc, tmp, check_paths=False)
    except ConfigError as exc:
        assert str(exc).startswith("engine.vllm"), exc
    else:
        argv = cfg.engine_spec().argv()
        assert all(isinstance(a, str) and "\x00" not in a for a in argv)
        assert argv.count("--port") == 1 and argv.count("--model") == 1  # never a second one from the table


@settings(max_examples=EXAMPLES(60))
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
@example(text="a = " + "[" * 100_000)  # nested deeper than tomllib's stack
@example(text="[engine]\nport = nan\n")
@example(text="[supervisor]\nhealth_interval_s = nan\n")
@example(text="[supervisor]\nhealth_interval_s = inf\n")
@example(text="[gate]\nmax_hold_s = 1" + "0" * 400 + "\n")
@example(text='[daemon]\nstate_dir = "a\\u0000b"\n')
def test_random_config_text_is_refused_naming_the_file(text: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.getbasetemp()
    path = tmp / "fuzz.toml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load_config(path, check_paths=False)
    except ConfigError as exc:
        assert str(exc).startswith(str(path)), exc
    else:  # only possible for text that is a complete config; random text never is
        pytest.fail(f"random text loaded as a config: {text!r}")


@pytest.mark.parametrize(("line", "said"), [
    ("[supervisor]\nhealth_interval_s = nan", "supervisor.health_interval_s: expected a finite number"),
    ("[supervisor]\nbackoff_max_s = inf", "supervisor.backoff_max_s: expected a finite number"),
    ("[gate]\nmax_hold_s = -inf", "gate.max_hold_s: expected a finite number"),
    ("[gate]\nmax_hold_s = 1" + "0" * 400, "gate.max_hold_s: expected a finite number"),
    ("[gate]\ncapture_sample_rate = nan", "gate.capture_sample_rate: expected a finite number"),
    ('[daemon]\nstate_dir = "a\\u0000b"', "daemon.state_dir: expected a path"),
    ("[engine]\nport = 99999999999999999999999", "engine.port: expected an integer 1-65535"),
])
def test_config_nan_inf_overflow_and_nul_are_named(line: str, said: str, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("x" * 32)
    (tmp_path / "token").chmod(0o600)
    base = f'[engine]\nmodel = "{tmp_path}"\n[control]\ntoken_file = "{tmp_path / "token"}"\n'
    section, _, rest = line.partition("\n")
    text = base.replace(f"{section}\n", f"{section}\n{rest}\n") if section in base else base + line + "\n"
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)) as err:
        load_config(path, check_paths=False)
    assert str(err.value).startswith(str(path))
