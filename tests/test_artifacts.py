"""The artifact formats (counts, map, stats): round trips, atomic writes, and every way a file can be wrong.

Each bad file must raise ArtifactError whose message names the file and says what is wrong; none may load as a
silent default.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pinsidecar_hook import contract as A
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap, StatsSnapshot
from pinsidecar_hook.contract import io as contract_io

from pinsidecar.testing.artifacts import make_counts, make_map


def _write_doc(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _stats(**over: Any) -> StatsSnapshot:
    base: dict[str, Any] = dict(boot_id="b1", seq=3, layer_ids=[0, 1], num_experts=4, top_k=2, selections=[10, 12],
                                cold_selections=[1, 0], tokens=5, map_hash="sha256:x", histogram=[[1, 2, 3, 4]] * 2,
                                tier_bytes={"hbm": 10, "host": 5})
    base.update(over)
    return StatsSnapshot(**base)


# ---------------------------------------------------------------------------------------------------- round trips


def test_counts_round_trip(tmp_path: Path) -> None:
    c = make_counts(num_layers=3, num_experts=16, top_k=2, tokens=50, layer_ids=[1, 3, 5], expert_bytes=123)
    c.save(tmp_path / "c.json")
    back = A.load_counts(tmp_path / "c.json")
    assert back.layer_ids == [1, 3, 5]
    assert back.counts.dtype == np.int64
    np.testing.assert_array_equal(back.counts, c.counts)
    assert (back.tokens, back.top_k, back.num_experts) == (50, 2, 16)
    assert back.meta["expert_bytes"] == 123
    assert back.digest() == c.digest()
    assert back.consistent and back.selections == 3 * 50 * 2


def test_map_round_trip_and_hash_is_content_only(tmp_path: Path) -> None:
    m = make_map(num_layers=3, num_experts=16, hot_rows=5, seed=4, expert_bytes=77, label="x")
    m.save(tmp_path / "m.json")
    back = A.load_map(tmp_path / "m.json")
    assert back == m
    assert back.content_hash == m.content_hash
    np.testing.assert_array_equal(back.row_maps(), m.row_maps())
    # label, time and meta are not part of the placement: same hash
    relabelled = ExpertMap(**{**m.__dict__, "label": "other", "created_at": "then", "meta": {"a": 1}})
    assert relabelled.content_hash == m.content_hash
    # moving one expert changes it
    lp = m.layers[0]
    swapped = A.LayerPlacement(lp.layer_id, tuple(sorted((*lp.hot[1:], lp.cold[0]))),
                               tuple(sorted((*lp.cold[1:], lp.hot[0]))))
    moved = ExpertMap(**{**m.__dict__, "layers": (swapped, *m.layers[1:])})
    assert moved.content_hash != m.content_hash


def test_row_map_puts_hot_rows_first() -> None:
    lp = A.LayerPlacement(0, hot=(5, 1), cold=(0, 2, 3, 4))
    assert lp.row_map(6).rows == [2, 1, 3, 4, 5, 0]
    assert lp.row_map(6) == A.placement_row_map((5, 1), (0, 2, 3, 4), 6)  # the one row-map builder


def test_row_map_refuses_an_expert_listed_twice_or_out_of_range() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        A.placement_row_map((0, 1), (1,), 4)
    with pytest.raises(ValueError, match=r"in 0\.\.3"):
        A.placement_row_map((0, 4), (), 4)


def test_stats_round_trip(tmp_path: Path) -> None:
    s = _stats()
    s.save(tmp_path / "s.json")
    back = A.load_stats(tmp_path / "s.json")
    assert back == s
    assert (back.total_selections, back.total_cold_selections) == (22, 1)


def test_counts_and_stats_echo_the_request_token_in_one_top_level_field(tmp_path: Path) -> None:
    _stats(flush_token="flush-1-2").save(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["flush_token"] == "flush-1-2" and "flush_token" not in doc["meta"]
    assert A.load_stats(tmp_path / "s.json").flush_token == "flush-1-2"
    counts = make_counts()
    counts.flush_token = "reset-3-4"
    counts.save(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["flush_token"] == "reset-3-4"
    assert A.load_counts(tmp_path / "c.json").flush_token == "reset-3-4"


def test_hook_request_round_trip_and_garbage_is_ignored(tmp_path: Path) -> None:
    art = tmp_path / "counts.json"
    token = A.write_hook_request(art, "flush")
    assert A.read_hook_request(art) == A.HookRequest("flush", token, {})
    A.request_path(art).write_text("{not json")
    assert A.read_hook_request(art) is None
    assert not A.request_path(art).exists()
    with pytest.raises(ValueError, match="unknown hook request"):
        A.write_hook_request(art, "explode")
    A.request_path(art).write_text(json.dumps({"op": "explode", "token": "t"}))
    assert A.read_hook_request(art) is None and not A.request_path(art).exists()  # unknown op: dropped too


def _answer_requests(path: Path, *, after_s: float = 0.3, half_written_first: bool = True) -> threading.Thread:
    """A stand-in hook: waits for a request beside ``path``, writes a half file, then stats echoing the token."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            req = A.read_hook_request(path)
            if req is not None:
                time.sleep(after_s)
                if half_written_first:
                    path.write_text('{"format": "pinsidecar.stats", "vers')  # not yet a valid file
                    time.sleep(0.2)
                _stats(flush_token="someone-else").save(path)
                time.sleep(0.2)
                _stats(flush_token=req.token, tokens=7).save(path)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_request_and_wait_returns_the_artifact_that_answers_the_request(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    helper = _answer_requests(stats)
    snap = A.request_and_wait(stats, "flush", A.load_stats, timeout_s=10, poll_s=0.02)
    helper.join(5)
    assert snap.tokens == 7 and snap.flush_token.startswith("flush-")


def test_request_and_wait_times_out_naming_the_file_and_the_plugin_checks(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    _stats(flush_token="old").save(stats)
    t0 = time.monotonic()
    with pytest.raises(A.HookRequestError) as info:
        A.request_and_wait(stats, "reset", A.load_stats, timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    for fragment in (str(stats), "reset request", "'old'", "VLLM_PLUGINS", "entry point", "PYTHONPATH"):
        assert fragment in message
    assert A.request_path(stats).exists()  # the request stays for a hook that comes up later


def test_request_and_wait_fails_at_once_when_the_engine_is_gone(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(A.HookRequestError, match="the engine exited while waiting"):
        A.request_and_wait(tmp_path / "counts.json", "flush", A.load_counts, timeout_s=60, alive=lambda: False)
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------------------------------------- hook config


def test_pin_backend_accepts_canonical_names_and_short_aliases() -> None:
    for raw, canonical in (("auto", "auto"), ("", "auto"), ("cpu", "cpu"), ("triton", "triton_experts"),
                           (" FlashInfer ", "flashinfer_trtllm"), ("torch", "torch_ref"), ("torch_ref", "torch_ref")):
        cfg = A.HookConfig.from_env({A.ENV["backend"]: raw})
        assert cfg.backend == canonical
        assert A.HookConfig.from_env(cfg.to_env()).backend == canonical
    assert A.HookConfig(backend="triton").backend == "triton_experts"


def test_the_tier_overlap_travels_from_the_engine_table_to_the_hook() -> None:
    from pinsidecar.engine.spec import EngineConfig

    assert not A.HookConfig.from_env({}).overlap_tiers
    on = A.HookConfig.from_env({A.ENV["overlap_tiers"]: "1"})
    assert on.overlap_tiers and A.HookConfig.from_env(on.to_env()).overlap_tiers
    assert A.ENV["overlap_tiers"] not in A.HookConfig().to_env()
    hook = EngineConfig(hook_mode="pin", map=None, pin_overlap=True).hook_config(Path("/state"), Path("/m.json"))
    assert hook is not None and hook.overlap_tiers and hook.to_env()["PINSIDECAR_PIN_OVERLAP"] == "1"


def test_bad_pin_backend_fails_at_config_time_listing_the_accepted_names() -> None:
    with pytest.raises(A.HookConfigError) as info:
        A.HookConfig.from_env({A.ENV["mode"]: "pin", A.ENV["map_path"]: "/m.json", A.ENV["backend"]: "cuda"})
    message = str(info.value)
    assert "PINSIDECAR_PIN_BACKEND='cuda'" in message
    for name in ("auto", *A.PIN_BACKENDS, "triton (= triton_experts)", "flashinfer (= flashinfer_trtllm)",
                 "torch (= torch_ref)"):
        assert name in message
    with pytest.raises(A.HookConfigError, match="not a pin backend"):
        A.HookConfig(backend="triton_expert")


# ---------------------------------------------------------------------------------------------------- atomic writes


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "m.json"
    for i in range(3):
        make_map(seed=i).save(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.json"]
    assert A.load_map(target).label == "random2"


def test_atomic_write_failure_keeps_old_file_and_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    target = tmp_path / "c.json"
    make_counts(seed=1).save(target)
    before = target.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(contract_io.os, "replace", boom)
    with pytest.raises(OSError):
        make_counts(seed=2).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


# ---------------------------------------------------------------------------------------------------- bad counts


def _counts_doc() -> dict[str, Any]:
    return make_counts(num_layers=3, num_experts=8, top_k=2, tokens=20).to_json()


def _mutate_counts(doc: dict[str, Any], case: str) -> dict[str, Any]:
    d = json.loads(json.dumps(doc))
    if case == "unknown version":
        d["version"] = 99
    elif case == "wrong format":
        d["format"] = "pinsidecar.map"
    elif case == "missing counts":
        del d["counts"]
    elif case == "missing layer_ids":
        del d["layer_ids"]
    elif case == "short row":
        d["counts"][1] = d["counts"][1][:-1]
    elif case == "missing row":
        d["counts"] = d["counts"][:-1]
    elif case == "negative":
        d["counts"][0][0] = -1
        d.pop("digest")
    elif case == "float counts":
        d["counts"][0][0] = 1.5
    elif case == "bool num_experts":
        d["num_experts"] = True
    elif case == "top_k too big":
        d["top_k"] = 9
    elif case == "duplicate layer ids":
        d["layer_ids"] = [0, 0, 1]
    elif case == "no layers":
        d["layer_ids"], d["counts"] = [], []
    elif case == "negative tokens":
        d["tokens"] = -3
    elif case == "digest mismatch":
        d["counts"][0][0] += 1
    elif case == "model not object":
        d["model"] = "qwen"
    else:  # pragma: no cover
        raise AssertionError(case)
    return d


COUNTS_CASES = {
    "unknown version": "version 99 is not supported",
    "wrong format": "expected 'pinsidecar.counts'",
    "missing counts": "missing field 'counts'",
    "missing layer_ids": "missing field 'layer_ids'",
    "short row": "counts row 1 has 7 entries, expected 8",
    "missing row": "counts has 2 rows but there are 3 layers",
    "negative": "negative counts",
    "float counts": "counts must be a table of integers",
    "bool num_experts": "'num_experts' has type bool",
    "top_k too big": "top_k must be in 1..num_experts",
    "duplicate layer ids": "layer_ids must be distinct",
    "no layers": "no layers",
    "negative tokens": "tokens must be >= 0",
    "digest mismatch": "digest does not match",
    "model not object": "'model' must be an object",
}


@pytest.mark.parametrize("case", sorted(COUNTS_CASES))
def test_bad_counts_raise_artifact_error_naming_the_file(tmp_path: Path, case: str) -> None:
    path = _write_doc(tmp_path / "bad.counts.json", _mutate_counts(_counts_doc(), case))
    with pytest.raises(ArtifactError, match=COUNTS_CASES[case]) as err:
        A.load_counts(path)
    assert str(path) in str(err.value)
    assert err.value.path == str(path)


@pytest.mark.parametrize("raw, expect", [
    (b"", "file is empty"),
    (b"   \n", "file is empty"),
    (b'{"format": "pinsidecar.counts", "version": 1, "layer_ids": [0, 1', "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "not a JSON object"),
])
def test_corrupt_or_truncated_files(tmp_path: Path, raw: bytes, expect: str) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(raw)
    with pytest.raises(ArtifactError, match=expect) as err:
        A.load_counts(path)
    assert str(path) in str(err.value)


def test_every_truncation_of_a_counts_file_is_refused(tmp_path: Path) -> None:
    full = json.dumps(_counts_doc()).encode()
    path = tmp_path / "c.json"
    for cut in range(0, len(full) - 1, max(1, len(full) // 40)):
        path.write_bytes(full[:cut])
        with pytest.raises(ArtifactError):
            A.load_counts(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="file not found"):
        A.load_map(tmp_path / "nope.json")


# ---------------------------------------------------------------------------------------------------- bad maps


def _map_doc() -> dict[str, Any]:
    return make_map(num_layers=3, num_experts=8, hot_rows=3, top_k=2).to_json()


def _mutate_map(case: str) -> dict[str, Any]:
    d = _map_doc()
    lay = d["layers"]
    if case == "unknown version":
        d["version"] = 0
    elif case == "geometry sum":
        d["geometry"]["cold_rows"] = 4
    elif case == "unequal hot counts":
        lay[1]["hot"].append(lay[1]["cold"].pop())
    elif case == "duplicate expert":
        lay[0]["cold"][0] = lay[0]["hot"][0]
    elif case == "out of range":
        lay[2]["cold"][-1] = 8
    elif case == "negative id":
        lay[2]["cold"][-1] = -1
    elif case == "missing expert":
        lay[0]["cold"].pop()
    elif case == "layer order":
        d["layers"] = [lay[1], lay[0], lay[2]]
    elif case == "missing layer":
        d["layers"] = lay[:2]
    elif case == "missing geometry":
        del d["geometry"]
    elif case == "missing hot":
        del lay[0]["hot"]
    elif case == "hash mismatch":
        a, b = lay[0]["hot"][0], lay[0]["cold"][0]
        lay[0]["hot"][0], lay[0]["cold"][0] = b, a
    elif case == "layer not object":
        lay[0] = [1, 2]
    else:  # pragma: no cover
        raise AssertionError(case)
    return d


MAP_CASES = {
    "unknown version": "version 0 is not supported",
    "geometry sum": "hot_rows=3 \\+ cold_rows=4 != num_experts",
    "unequal hot counts": "layer 1 has 4 hot experts, geometry says 3",
    "duplicate expert": "more than once",
    "out of range": "out-of-range expert ids \\[8\\]",
    "negative id": "out-of-range expert ids \\[-1\\]",
    "missing expert": "does not place experts",
    "layer order": "out of order",
    "missing layer": "2 layer entries for 3 layer_ids",
    "missing geometry": "missing field 'geometry'",
    "missing hot": "missing field 'hot'",
    "hash mismatch": "content hash mismatch",
    "layer not object": "must be an object",
}


@pytest.mark.parametrize("case", sorted(MAP_CASES))
def test_bad_maps_raise_artifact_error_naming_the_file(tmp_path: Path, case: str) -> None:
    path = _write_doc(tmp_path / "bad.map.json", _mutate_map(case))
    with pytest.raises(ArtifactError, match=MAP_CASES[case]) as err:
        A.load_map(path)
    assert str(path) in str(err.value)


def test_map_file_passed_as_counts_names_the_kind(tmp_path: Path) -> None:
    make_map().save(tmp_path / "m.json")
    with pytest.raises(ArtifactError, match=r"format is 'pinsidecar\.map', expected 'pinsidecar\.counts'"):
        A.load_counts(tmp_path / "m.json")


@pytest.mark.parametrize("field, value", [("predicted_cold_rate", "abc"), ("meta", "abc")])
def test_malformed_optional_map_fields_raise_artifact_error(tmp_path: Path, field: str, value: Any) -> None:
    d = _map_doc()
    d[field] = value
    with pytest.raises(ArtifactError):
        A.load_map(_write_doc(tmp_path / "m.json", d))


# ---------------------------------------------------------------------------------------------------- bad stats


@pytest.mark.parametrize("mutate, expect", [
    (lambda d: d.update(cold_selections=[11, 0]), "between 0 and selections"),
    (lambda d: d.update(selections=[1]), "one entry per layer"),
    (lambda d: d.update(histogram=[[1, 2, 3]] * 2), "histogram row 0 must have 4 entries"),
    (lambda d: d.update(histogram=[[1, 2, 3, 4]]), "one row per layer"),
    (lambda d: d.pop("seq"), "missing field 'seq'"),
    (lambda d: d.update(version=2), "version 2 is not supported"),
])
def test_bad_stats(tmp_path: Path, mutate: Any, expect: str) -> None:
    d = _stats().to_json()
    mutate(d)
    with pytest.raises(ArtifactError, match=expect):
        A.load_stats(_write_doc(tmp_path / "s.json", d))


# ---------------------------------------------------------------------------------------------------- cold ratio


def test_cold_selection_ratio_by_hand() -> None:
    counts = CountsArtifact(layer_ids=[0, 1], num_experts=4, top_k=1, tokens=10,
                            counts=np.array([[5, 3, 2, 0], [0, 0, 0, 10]], dtype=np.int64))
    emap = ExpertMap(layer_ids=(0, 1), num_experts=4, top_k=1, hot_rows=2,
                     layers=(A.LayerPlacement(0, (0, 1), (2, 3)), A.LayerPlacement(1, (0, 1), (2, 3))))
    total, per_layer = A.cold_selection_ratio(emap, counts)
    assert per_layer.tolist() == [0.2, 1.0]
    assert total == pytest.approx(12 / 20)
    other = CountsArtifact(layer_ids=[0, 2], num_experts=4, top_k=1, tokens=0, counts=np.zeros((2, 4), np.int64))
    with pytest.raises(ArtifactError, match="different geometries"):
        A.cold_selection_ratio(emap, other)


def test_no_temp_files_anywhere_after_many_writes(tmp_path: Path) -> None:
    for i in range(5):
        make_counts(seed=i).save(tmp_path / "c.json")
        _stats(seq=i).save(tmp_path / "s.json")
    assert sorted(os.listdir(tmp_path)) == ["c.json", "s.json"]
