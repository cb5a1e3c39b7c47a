"""bench/cache_tier.py on the CPU with ``--small``, so the kernel-level cache-tier bench does not rot between device
sessions: every profile x placement x batch runs, every step is bit-identical to the all-HBM reference, the host
fetches counted from the device counters equal the simulator's (checked here once more, from the trace rebuilt
independently), the hybrid split is the one ``map build --cache-slots auto`` takes, and a run whose fills do
not copy is caught by the bit-identity check.

On the CPU every tier is host memory, so its times mean nothing and the figures claim no target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PROFILES = ("stationary", "flat", "short_reuse", "mixed")
PLACEMENTS = ("static", "lru_only", "hybrid")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    from bench import cache_tier

    out = tmp_path_factory.mktemp("cache_tier") / "cache_tier_cpu.json"
    rc = cache_tier.main(["--small", "--device", "cpu", "--out", str(out)])
    return rc, json.loads(out.read_text()), out


def test_every_case_runs_bit_identical_and_counts_what_the_simulator_counts(
        small_run: tuple[int, dict[str, Any], Path]) -> None:
    rc, doc, out = small_run
    assert rc == 0
    assert doc["device_type"] == "cpu" and doc["execution"] == "eager" and doc["execution_note"]
    cases = [c for p in doc["profiles"] for c in p["cases"]]
    assert {(c["profile"], c["placement"], c["batch"]) for c in cases} == {
        (p, pl, b) for p in PROFILES for pl in PLACEMENTS for b in (1, 4)}
    steps = doc["warmup"] + doc["rounds"] * (doc["steps"] // doc["rounds"])
    for c in cases:
        assert c["steps_checked"] == c["bit_identical_steps"] == steps, c["profile"]
        assert c["matches_simulator"], (c["profile"], c["placement"], c["batch"], c["simulator"])
        assert c["misses"] == c["simulator"]["misses"] and c["host_fetches"] == c["simulator"]["host_fetches"]
        assert len(c["per_round"]) == doc["rounds"] and c["mean_ms"] > 0
        if c["cache_slots"]:
            assert c["hits"] + c["misses"] > 0 and c["fills"] <= c["host_fetches"]
    for prof in doc["profiles"]:  # one HBM budget: every placement holds N rows of every layer in HBM
        assert len({p["hbm_bytes"] for p in prof["placements"].values()}) == 1
        assert {p["hot_rows"] + p["cache_slots"] for p in prof["placements"].values()} == {doc["hbm_rows"]}
        assert prof["placements"]["lru_only"]["hot_rows"] == 1
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_the_figures_are_there_and_claim_nothing_on_the_cpu(small_run: tuple[int, dict[str, Any], Path]) -> None:
    _, doc, _ = small_run
    fig = doc["figures"]
    assert fig["claimable"] is False and fig["all_targets_met"] is None and "CPU" in fig["why_not_claimable"]
    assert fig["bit_identical_fraction"] == 1.0 and fig["host_fetches_equal_simulator"]
    assert fig["bookkeeping_outputs_identical"]
    for name in PROFILES:
        for b in ("b1", "b4"):
            row = fig["profiles"][name][b]
            for key in ("hybrid_over_better_step_time", "hybrid_over_static_step_time",
                        "hybrid_over_lru_only_step_time", "step_time_gain", "host_fetch_gain", "host_fetch_ratios"):
                assert key in row, (name, b, key)
            assert row["hybrid_over_better_step_time"]["met"] is None
            assert row["hybrid_over_better_step_time"]["target"] == 1.02
            assert (row["step_time_gain"]["target"] == 1.3) == (name in ("short_reuse", "mixed"))
    cached = [p for p in doc["profiles"] if p["placements"]["hybrid"]["cache_slots"]]
    assert cached, "no profile chose slots at the small geometry: the hybrid cache path went untested"
    for prof in cached:
        books = [x for x in prof["bookkeeping"] if x["placement"] == "hybrid"]
        assert {x["batch"] for x in books} == {1, 4}
        assert all(x["nothing_filled"] and x["outputs_identical_with_and_without"] for x in books)
        assert "bookkeeping_share" in fig["profiles"][prof["name"]]["b1"]


def test_hybrid_takes_the_split_auto_split_picks_and_the_fetches_replay_independently(
        small_run: tuple[int, dict[str, Any], Path]) -> None:
    from bench import routing_sequences
    from pinsidecar.placement import HotRanking, auto_split, simulate

    _, doc, _ = small_run
    g, seeds, n = doc["geometry"], doc["seeds"], doc["hbm_rows"]
    for prof in doc["profiles"]:
        train_ids = routing_sequences.generate(prof["name"], doc["trace_tokens"], g["model_layers"], g["experts"],
                                               g["top_k"], seeds["train"], seeds["model"])
        train = routing_sequences.to_trace(train_ids, g["experts"])
        ranking = HotRanking.from_counts(train.counts(), "train")
        auto = auto_split(train, ranking, n, "lru", 1, train=train)
        # a map keeps one hot row: K = N is tried but not taken
        ok = [i for i, r in enumerate(auto.tuning) if r.cache_slots <= n - 1]
        chosen = auto.chosen if auto.chosen in ok else min(
            ok, key=lambda i: (auto.tuning[i].miss_rate, auto.tuning[i].host_fetches_per_token,
                               auto.tuning[i].cache_slots))
        assert prof["placements"]["hybrid"]["cache_slots"] == auto.tuning[chosen].cache_slots, prof["name"]
        # batch 4 of lru_only, rebuilt from the trace: four stretches, one token of each per step
        test_ids = routing_sequences.generate(prof["name"], doc["trace_tokens"], g["model_layers"], g["experts"],
                                              g["top_k"], seeds["test"], seeds["model"])
        case = next(c for c in prof["cases"] if c["placement"] == "lru_only" and c["batch"] == 4)
        steps, stride = case["steps_checked"], doc["trace_tokens"] // 4
        ids = np.stack([test_ids[j * stride: j * stride + steps, : g["layers"]] for j in range(4)], axis=1)
        sim = simulate(routing_sequences.to_trace(ids.reshape(-1, g["layers"], g["top_k"]), g["experts"]),
                       HotRanking.from_counts(train.counts()[: g["layers"]], "train"), n, n - 1, "lru", 4)
        assert (case["misses"], case["host_fetches"]) == (sim.misses, sim.host_fetches), prof["name"]


def test_fills_that_do_not_copy_break_bit_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the plan flips the row map to slots that were never written. The counts still equal
    the simulator's (the plan ran), the outputs do not equal the reference, and the run fails."""
    from pinsidecar_hook import cache

    from bench import cache_tier

    monkeypatch.setattr(cache, "fill_rows", lambda plan, hot, cold: None)
    out = tmp_path / "broken.json"
    rc = cache_tier.main(["--small", "--device", "cpu", "--profiles", "short_reuse", "--placements", "lru_only",
                          "--batches", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    (case,) = doc["profiles"][0]["cases"]
    assert rc == 1
    assert case["fills"] > 0 and case["matches_simulator"]
    assert case["bit_identical_steps"] < case["steps_checked"]
    assert doc["figures"]["bit_identical_fraction"] < 1.0
