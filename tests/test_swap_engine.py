"""Remap in place inside a real vLLM CPU engine: the demo model served in pin mode, candidate maps applied through the
hook's request file (``apply``), no reboot.

The session's shared pin engine (``pin_engine``, :mod:`pinsidecar.testing.fixtures`) serves map A, the map it
booted with (a boot costs 40-60 s on the 2-core box). Each test leaves the engine serving map A. What they show:

- an apply answers ``applied`` in ``meta["apply"]``, the stats carry the candidate's hash and label, the counters
  were not reset, and greedy tokens and logprobs are bit for bit what they were before (the CPU backend is
  placement-invariant: rows move, bits do not);
- the live cold-selection count then follows the candidate exactly: every layer's cold selections equal the
  selections the same traffic put on the candidate's cold experts (the offline evaluation of the candidate on
  the live histogram), and differ from what the old map's cold set would give;
- requests in flight while applies run are all answered, with the same tokens (the step lock makes a step wait,
  nothing is dropped);
- twenty applies alternating two maps leave the engine's memory (RSS of its process tree) within 2 %;
- a candidate of another geometry, and a malformed request, are refused and change nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pinsidecar_hook.contract import (
    ApplyResult,
    CountsArtifact,
    ExpertMap,
    StatsSnapshot,
    apply_args,
    cold_selection_ratio,
    load_map,
    load_stats,
    plan_swap,
    request_and_wait,
)

from pinsidecar.testing.artifacts import make_map
from pinsidecar.testing.engine import PARITY_PROMPTS
from pinsidecar.testing.fixtures import ServedPin

pytestmark = pytest.mark.vllm


def _map(num_experts: int, top_k: int, layer_ids: tuple[int, ...], hot_rows: int, seed: int,
         label: str) -> ExpertMap:
    emap = make_map(num_experts=num_experts, hot_rows=hot_rows, seed=seed, top_k=top_k, layer_ids=layer_ids,
                    label=label)
    return dataclasses.replace(emap, predicted_cold_rate=seed / 1000)


@pytest.fixture(scope="module")
def served(pin_engine: ServedPin, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    a = load_map(pin_engine.map_path)
    n, k, layers = a.num_experts, a.top_k, a.layer_ids
    tmp = tmp_path_factory.mktemp("swap-maps")
    maps = {"a": a, "b": _map(n, k, layers, a.hot_rows, 23, "map-b"),
            "wide": _map(n, k, layers, n * 6 // 8, 5, "map-wide")}
    paths = {"a": pin_engine.map_path}
    for name in ("b", "wide"):
        paths[name] = (tmp / f"{name}.json").absolute()
        maps[name].save(paths[name])
    served = {"engine": pin_engine.engine, "stats": pin_engine.stats_path, "maps": maps, "paths": paths,
              "label": pin_engine.label, "reference": pin_engine.reference}
    assert _request(served, "flush").map_hash == a.content_hash, "the shared pin engine does not serve its map"
    yield served


def _request(served: dict[str, Any], op: str, args: dict[str, Any] | None = None) -> StatsSnapshot:
    return request_and_wait(served["stats"], op, load_stats, timeout_s=120, alive=served["engine"].alive, args=args)


def _apply(served: dict[str, Any], name: str) -> tuple[StatsSnapshot, ApplyResult]:
    emap = served["maps"][name]
    snap = _request(served, "apply", apply_args(served["paths"][name], emap.content_hash))
    return snap, ApplyResult.from_json(snap.meta["apply"])


def _cold_per_layer(emap: ExpertMap, histogram: list[list[int]]) -> list[int]:
    return [int(sum(row[e] for e in lp.cold)) for lp, row in zip(emap.layers, histogram, strict=True)]


def _rss(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that exited meanwhile
            total += child.memory_info().rss
    return total


def test_apply_in_place_keeps_the_bits_and_the_live_cold_count_follows_the_candidate(served: dict[str, Any]) -> None:
    a, b = served["maps"]["a"], served["maps"]["b"]
    before = _request(served, "flush")
    assert before.map_hash == a.content_hash and before.map_label == served["label"]
    log_path = Path(served["engine"].spec.log_path)
    applied_before = log_path.read_text().count("pinsidecar pin: applied map")
    snap, result = _apply(served, "b")
    try:
        assert result.outcome == "applied", result.reason
        assert result.token == snap.flush_token and result.rows == plan_swap(a, b).rows > 0
        assert result.bytes_moved > 0 and result.layers == sum(1 for x in plan_swap(a, b).layers if x.rows)
        assert snap.map_hash == b.content_hash and snap.map_label == "map-b"
        assert snap.meta["predicted_cold_rate"] == b.predicted_cold_rate
        assert snap.boot_id == before.boot_id and snap.tokens >= before.tokens  # same boot, counters kept
        assert log_path.read_text().count("pinsidecar pin: applied map") == applied_before + 1

        _request(served, "reset")
        after = served["engine"].greedy_outputs()
        assert after == served["reference"]  # token ids and logprobs, bit for bit as served before the apply
        live = _request(served, "flush")
        assert live.histogram is not None and live.map_hash == b.content_hash
        expected = _cold_per_layer(b, live.histogram)
        assert live.cold_selections == expected  # exactly the candidate's cold set, layer by layer
        assert _cold_per_layer(a, live.histogram) != expected  # and not the old one's
        counts = CountsArtifact(layer_ids=live.layer_ids, num_experts=live.num_experts, top_k=live.top_k,
                                counts=np.asarray(live.histogram, dtype=np.int64), tokens=live.tokens)
        offline, _ = cold_selection_ratio(b, counts)
        assert live.total_cold_selections / live.total_selections == offline
        # and a later write keeps the apply's answer until the next apply
        assert live.meta["apply"] == snap.meta["apply"]
    finally:
        back, result = _apply(served, "a")
        assert result.outcome == "applied" and back.map_hash == a.content_hash


def test_requests_in_flight_during_applies_are_all_answered(served: dict[str, Any]) -> None:
    engine, reference = served["engine"], served["reference"]
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            prompt = PARITY_PROMPTS[i % len(PARITY_PROMPTS)]
            try:
                answers.append({"i": i % len(PARITY_PROMPTS), **engine.greedy(prompt)})
            except BaseException as exc:
                errors.append(exc)
            i += 1

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for name in ("b", "a", "b", "a"):
            _snap, result = _apply(served, name)
            assert result.outcome == "applied", result.reason
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not errors, errors
    assert len(answers) >= 2
    for answer in answers:
        assert {"tokens": answer["tokens"], "logprobs": answer["logprobs"]} == reference[answer["i"]]


def test_twenty_applies_keep_the_engine_memory_flat(served: dict[str, Any]) -> None:
    engine = served["engine"]
    rss_before = _rss(engine.pid)
    held = []
    for i in range(20):
        _snap, result = _apply(served, "b" if i % 2 == 0 else "a")
        assert result.outcome == "applied", (i, result.reason)
        held.append(result.seconds)
    rss_after = _rss(engine.pid)
    print(f"20 applies ({result.rows} rows, {result.bytes_moved} bytes each): step lock held median "
          f"{sorted(held)[10] * 1e3:.2f} ms, max {max(held) * 1e3:.2f} ms; engine RSS {rss_before / 2**20:.1f} -> "
          f"{rss_after / 2**20:.1f} MiB ({(rss_after - rss_before) / rss_before:+.3%})")
    assert abs(rss_after - rss_before) <= 0.02 * rss_before, (rss_before, rss_after)
    assert _request(served, "flush").map_hash == served["maps"]["a"].content_hash
    assert engine.greedy_outputs() == served["reference"]


def test_other_geometry_and_malformed_requests_are_refused_and_change_nothing(served: dict[str, Any]) -> None:
    a = served["maps"]["a"]
    snap, result = _apply(served, "wide")
    assert result.outcome == "refused" and "another geometry" in result.reason and "reboot" in result.reason
    assert snap.map_hash == a.content_hash == result.map_hash and result.rows == 0
    snap = _request(served, "apply", {"map": "relative.json", "hash": a.content_hash})
    result = ApplyResult.from_json(snap.meta["apply"])
    assert result.outcome == "refused" and "absolute path" in result.reason and snap.map_hash == a.content_hash
    assert served["engine"].greedy_outputs() == served["reference"]


def test_apply_engine_bench_runs_on_the_served_engine(served: dict[str, Any]) -> None:
    """bench/apply_engine.py's short form on this engine, so the device's in-engine gap figure does not rot: two
    streaming clients, one round per ordering (the stream order falls back to host syncs on the CPU; ``@5`` asks
    for a 5 ms batch budget), each apply measured against equal windows without one, and the greedy outputs
    identical after the applies."""
    from bench.apply_engine import run_pair

    paths = served["paths"]
    doc = run_pair(served["engine"], paths["a"], paths["b"], [2], reps=1, quiet_s=2.0, max_tokens=8,
                   orderings=("host", "stream@5"))
    assert doc["identity"] == {"greedy_prompts": len(PARITY_PROMPTS), "identical_after_applies": True}
    (level,) = doc["levels"]
    assert level["requests"]["failed"] == level["requests"]["lost"] == 0 and level["requests"]["completed"] > 0
    measured = [a for a in level["applies"] if a["measured"]]
    assert [a["ordering"] for a in measured] == ["host", "stream@5"]
    assert {a["ordering"]: a["hook"]["budget_ms"] for a in measured} == {"host": 20.0, "stream@5": 5.0}
    assert [a["to"] for a in level["applies"]][-1] == "a"  # the level ends where it began
    rows = plan_swap(served["maps"]["a"], served["maps"]["b"]).rows
    for a in level["applies"]:
        assert a["hook"]["outcome"] == "applied" and a["hook"]["rows"] == rows
        assert a["hook"]["stream_batches"] == 0  # no CUDA: host syncs
        assert a["gap_ms"] > 0 and a["window_s"] > 0
    assert any(a["baseline"]["windows"] >= 1 for a in measured)
    assert set(level["summary"]) == {"host", "stream@5"} and level["summary"]["host"]["applies"] == 1
    assert _request(served, "flush").map_hash == served["maps"]["a"].content_hash
