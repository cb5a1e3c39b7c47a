"""Maps with a cache tier: ``map build --cache-slots/--cache-policy/--trace``, the cache model behind a cached
map's predicted cold rate, and the drift watch / remap candidates using the same model (docs/cache-tier.md).

Fast, no engine: synthetic routing traces and the counts they imply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pinsidecar_hook.contract import CountsArtifact, RoutingTrace, load_map, save_trace

from pinsidecar import placement
from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.signals import compute_signals, map_cold_rate_on
from pinsidecar.drift.windows import Window
from pinsidecar.placement.cache_model import che_hit_probabilities, miss_rates
from pinsidecar.remap.candidates import build_candidate
from pinsidecar.remap.decision import decide
from pinsidecar.testing.cli import assert_user_error, run, run_json

LAYERS, EXPERTS, TOP_K = 3, 32, 4
LAYER_IDS = (1, 3, 5)


def iid_trace(tokens: int, seed: int, *, layers: int = LAYERS, experts: int = EXPERTS, top_k: int = TOP_K,
              layer_ids: tuple[int, ...] | None = LAYER_IDS, alpha: float = 0.9) -> RoutingTrace:
    """Every token draws its top-k independently from fixed per-expert probabilities (without repeats in a row):
    independent references, no temporal reuse. Each layer has its own popularity order."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** alpha
    logp = np.stack([np.log(p / p.sum())[np.random.default_rng(100 + i).permutation(experts)]
                     for i in range(layers)])
    gumbel = logp[None] - np.log(-np.log(rng.random((tokens, layers, experts))))  # Gumbel top-k: no replacement
    experts_ids = np.argsort(-gumbel, axis=2)[:, :, :top_k]
    return RoutingTrace(experts_ids, experts, layer_ids)


def reuse_trace(tokens: int, seed: int, repeat: float = 0.9) -> RoutingTrace:
    """Each token repeats the previous token's experts with probability ``repeat``: strong temporal reuse."""
    base = iid_trace(tokens, seed).experts.copy()
    keep = np.random.default_rng(seed + 7).random((tokens, LAYERS)) < repeat
    for t in range(1, tokens):
        base[t] = np.where(keep[t][:, None], base[t - 1], base[t])
    return RoutingTrace(base, EXPERTS, LAYER_IDS)


def counts_of(trace: RoutingTrace, workload: str = "w") -> CountsArtifact:
    return CountsArtifact(layer_ids=list(trace.layer_ids or range(trace.num_layers)), num_experts=trace.num_experts,
                          top_k=trace.top_k, counts=trace.counts().astype(np.int64), tokens=trace.tokens,
                          workload=workload, meta={"expert_bytes": 1000})


@pytest.fixture()
def workload(tmp_path: Path) -> dict[str, Any]:
    trace = reuse_trace(3000, seed=1)
    counts_path = tmp_path / "w.counts.json"
    trace_path = tmp_path / "w.trace.npz"
    counts_of(trace).save(counts_path)
    save_trace(trace_path, trace)
    return {"trace": trace, "counts": str(counts_path), "trace_path": str(trace_path), "dir": tmp_path}


# ---------------------------------------------------------------------------------------------------- the CLI


def test_build_with_cache_slots_splits_the_budget_and_records_the_model(workload: dict[str, Any]) -> None:
    out = workload["dir"] / "cached.map.json"
    r = run_json("map", "build", workload["counts"], "--hot-rows", "10", "--cache-slots", "4", "--cache-policy",
                 "lfu", "--out", str(out))
    emap = load_map(out)
    assert (emap.hot_rows, emap.cache_slots, emap.cache_policy, emap.hbm_rows) == (6, 4, "lfu", 10)
    assert emap.geometry()["cache_slots"] == 4 and emap.cold_rows == EXPERTS - 6
    assert emap.meta["cache_model"] == "independent" and "temporal reuse" in emap.meta["cache_model_note"]
    assert emap.meta["cache"]["chosen"] == "given"
    assert (r["hot_rows"], r["hbm_rows"], r["cache_slots"], r["cache_policy"], r["cache_model"]) == (
        6, 10, 4, "lfu", "independent")
    assert r["map"]["geometry"]["cache_slots"] == 4 and r["map"]["cache_policy"] == "lfu"
    counts = counts_of(workload["trace"])
    want, _ = miss_rates(emap.hot_mask(), counts.counts, 4, "lfu")
    assert emap.predicted_cold_rate == pytest.approx(want)
    # the hot set is the top H by counts, as without a cache
    plain = placement.build_usage_map([counts], 6)
    assert [lp.hot for lp in emap.layers] == [lp.hot for lp in plain.layers]
    # what prints a map's geometry shows the slots and the policy
    shown = run("map", "show", str(out))
    assert shown.exit_code == 0 and "4 cache slots (lfu)" in shown.stdout
    shown_json = run_json("map", "show", str(out))
    assert shown_json["geometry"]["cache_slots"] == 4 and shown_json["cache_policy"] == "lfu"
    ev = run_json("map", "eval", str(out), workload["counts"])
    assert ev["cache_slots"] == 4 and ev["cache_policy"] == "lfu"
    assert ev["cold_rate"] == pytest.approx(want) and ev["static_cold_rate"] > ev["cold_rate"]


def test_build_without_a_cache_is_unchanged(workload: dict[str, Any]) -> None:
    out = workload["dir"] / "plain.map.json"
    r = run_json("map", "build", workload["counts"], "--hot-rows", "10", "--out", str(out))
    emap = load_map(out)
    same = placement.build_usage_map([counts_of(workload["trace"])], 10, expert_bytes=1000)
    assert emap.content_hash == same.content_hash and emap.predicted_cold_rate == same.predicted_cold_rate
    assert "cache_slots" not in emap.geometry() and "cache_model" not in emap.meta and "cache" not in emap.meta
    assert r["cache_slots"] == 0 and r["cache_policy"] is None
    zero = workload["dir"] / "zero.map.json"
    run_json("map", "build", workload["counts"], "--hot-rows", "10", "--cache-slots", "0", "--out", str(zero))
    assert load_map(zero).content_hash == emap.content_hash


def test_predicted_cold_rate_from_a_trace_is_the_simulators_miss_rate(workload: dict[str, Any]) -> None:
    out = workload["dir"] / "traced.map.json"
    r = run_json("map", "build", workload["counts"], "--hot-rows", "10", "--cache-slots", "4", "--trace",
                 workload["trace_path"], "--out", str(out))
    emap = load_map(out)
    trace = workload["trace"]
    sim = placement.simulate(trace, placement.HotRanking.from_map(emap), 10, 4, "lru")
    assert emap.predicted_cold_rate == sim.miss_rate and r["predicted_cold_rate"] == sim.miss_rate
    # the same as ranking by the counts the map was built from
    ranked = placement.HotRanking.from_counts(trace.counts(), "counts", trace.layer_ids)
    assert placement.simulate(trace, ranked, 10, 4, "lru").miss_rate == sim.miss_rate
    assert emap.meta["cache_model"] == "trace" and r["cache_model"] == "trace"
    assert emap.meta["trace"]["misses"] == sim.misses
    per_layer = emap.meta["predicted_cold_rate_per_layer"]
    assert len(per_layer) == LAYERS and np.mean(per_layer) == pytest.approx(sim.miss_rate, abs=1e-5)
    # on routing with reuse the independent model over-states misses
    indep, _ = miss_rates(emap.hot_mask(), trace.counts(), 4, "lru")
    assert indep > sim.miss_rate


def test_auto_chooses_the_split_on_the_trace_and_records_the_tried_splits(workload: dict[str, Any]) -> None:
    out = workload["dir"] / "auto.map.json"
    r = run_json("map", "build", workload["counts"], "--hot-rows", "8", "--cache-slots", "auto", "--trace",
                 workload["trace_path"], "--out", str(out))
    emap = load_map(out)
    trace = workload["trace"]
    ranked = placement.HotRanking.from_counts(trace.counts(), "counts", trace.layer_ids)
    auto = placement.auto_split(trace, ranked, 8, "lru", train=trace)
    tried = emap.meta["cache"]["tried"]
    assert [t["cache_slots"] for t in tried] == [x.cache_slots for x in auto.results]
    assert [t["miss_rate"] for t in tried] == [x.miss_rate for x in auto.results]
    assert [t["tuning_miss_rate"] for t in tried] == [x.miss_rate for x in auto.tuning]
    assert emap.meta["cache"]["cross_fitted"] is True
    chosen = [t for t in tried if t["chosen"]]
    assert len(chosen) == 1 and chosen[0]["cache_slots"] == emap.cache_slots and emap.cache_slots > 0
    admissible = [t for t in tried if t["cache_slots"] < 8]
    assert chosen[0]["tuning_miss_rate"] == min(t["tuning_miss_rate"] for t in admissible)
    assert emap.hot_rows + emap.cache_slots == 8 and emap.meta["cache"]["chosen"] == "auto"
    assert emap.predicted_cold_rate == pytest.approx(chosen[0]["miss_rate"])
    assert r["cache"]["chosen"] == "auto" and r["cache_slots"] == emap.cache_slots
    human = run("map", "build", workload["counts"], "--hot-rows", "8", "--cache-slots", "auto", "--trace",
                workload["trace_path"], "--out", str(out))
    assert human.exit_code == 0 and "cache slots chosen on trace" in human.stdout


@pytest.mark.parametrize(("args", "fragments"), [
    (("--hot-rows", "10", "--cache-slots", "10"), ("--cache-slots 10 leaves no hot row", "0..9")),
    (("--hot-rows", "10", "--cache-slots", "many"), ("number of slots or 'auto'",)),
    (("--hot-rows", "10", "--cache-slots", "-1"), ("at least 0",)),
    (("--hot-rows", "10", "--cache-slots", "2", "--cache-policy", "fifo"), ("'fifo' is not one of lru, lfu",)),
    (("--hot-rows", "10", "--cache-slots", "2", "--cache-policy", "static"), ("static is the simulator's",)),
    (("--hot-rows", "10", "--cache-slots", "auto"), ("none was given", "--trace TRACE.npz")),
])
def test_bad_cache_inputs_are_refused(workload: dict[str, Any], args: tuple[str, ...],
                                      fragments: tuple[str, ...]) -> None:
    out = workload["dir"] / "bad.map.json"
    assert_user_error(run("map", "build", workload["counts"], *args, "--out", str(out)), *fragments)
    assert not out.exists()


def test_a_trace_of_another_model_is_refused(workload: dict[str, Any]) -> None:
    out = workload["dir"] / "bad.map.json"
    other = workload["dir"] / "other.trace.npz"
    save_trace(other, iid_trace(200, seed=5, experts=16))
    assert_user_error(run("map", "build", workload["counts"], "--hot-rows", "10", "--cache-slots", "2", "--trace",
                          str(other), "--out", str(out)), "describe different models", "16 experts")
    fewer = workload["dir"] / "fewer.trace.npz"
    save_trace(fewer, iid_trace(200, seed=5, layers=2, layer_ids=(1, 3)))
    assert_user_error(run("map", "build", workload["counts"], "--hot-rows", "10", "--cache-slots", "auto",
                          "--trace", str(fewer), "--out", str(out)), "2 layers in the trace")
    assert not out.exists()


def test_bad_slots_are_refused_by_the_library_too() -> None:
    counts = counts_of(iid_trace(200, seed=3))
    with pytest.raises(Exception, match=r"cache slots must be in 0\.\.22"):
        placement.build_usage_map([counts], 10, cache_slots=23)
    with pytest.raises(Exception, match="not one of lru, lfu"):
        placement.build_usage_map([counts], 10, cache_slots=2, cache_policy="mru")


# ---------------------------------------------------------------------------------------------------- the model


def test_the_independent_lru_model_matches_the_simulator_on_iid_routing() -> None:
    trace = iid_trace(40000, seed=11)
    counts = trace.counts()
    ranked = placement.HotRanking.from_counts(counts, "counts", trace.layer_ids)
    for hbm_rows, slots in ((8, 2), (8, 4), (12, 6), (16, 8)):
        sim = placement.simulate(trace, ranked, hbm_rows, slots, "lru")
        model, _ = miss_rates(ranked.hot_mask(hbm_rows - slots), counts, slots, "lru")
        assert model == pytest.approx(sim.miss_rate, abs=0.01), (hbm_rows, slots)


def test_the_independent_lfu_model_is_the_static_set() -> None:
    trace = iid_trace(5000, seed=12)
    counts = trace.counts()
    ranked = placement.HotRanking.from_counts(counts, "counts", trace.layer_ids)
    for hbm_rows, slots in ((8, 2), (12, 6)):
        static = placement.simulate(trace, ranked, hbm_rows, slots, "static")
        model, _ = miss_rates(ranked.hot_mask(hbm_rows - slots), counts, slots, "lfu")
        assert model == pytest.approx(static.miss_rate, abs=1e-12)


def test_che_edges() -> None:
    assert che_hit_probabilities(np.array([0.5, 0.5, 0.0]), 2).tolist() == [1.0, 1.0, 0.0]
    uniform = che_hit_probabilities(np.full(8, 1 / 8), 2)
    assert uniform == pytest.approx(np.full(8, 2 / 8))  # uniform: each expert held K/C of the time
    assert che_hit_probabilities(np.full(4, 0.25), 0).tolist() == [0.0] * 4
    hot = np.zeros((1, 4), dtype=bool)
    assert miss_rates(hot, np.zeros((1, 4), dtype=np.int64), 2, "lru") == (0.0, pytest.approx([0.0]))


def test_without_slots_the_model_is_the_plain_cold_ratio() -> None:
    counts = counts_of(iid_trace(500, seed=4))
    emap = placement.build_usage_map([counts], 10)
    rate, _ = miss_rates(emap.hot_mask(), counts.counts, 0, "lru")
    assert rate == emap.predicted_cold_rate
    assert map_cold_rate_on(emap, counts.counts) == rate


# ---------------------------------------------------------------------------------------------------- the artifact


def test_a_cached_map_round_trips_with_the_same_hash(tmp_path: Path) -> None:
    counts = counts_of(iid_trace(500, seed=6))
    emap = placement.build_usage_map([counts], 6, cache_slots=4, cache_policy="lfu", expert_bytes=1000)
    path = tmp_path / "m.map.json"
    placement.save_map(emap, path)
    back = load_map(path)
    assert back.content_hash == emap.content_hash and back.cache_slots == 4 and back.cache_policy == "lfu"
    assert back.predicted_cold_rate == emap.predicted_cold_rate and back.meta["cache_model"] == "independent"
    lru = placement.build_usage_map([counts], 6, cache_slots=4, cache_policy="lru")
    plain = placement.build_usage_map([counts], 6)
    assert len({emap.content_hash, lru.content_hash, plain.content_hash}) == 3  # policy and slots are in the hash
    # the positional baseline gets the same HBM budget: hot rows and slots
    assert placement.positional_for(emap).cold_total == (EXPERTS - 10) * LAYERS


# ---------------------------------------------------------------------------------------------------- drift / remap


def test_a_remap_candidate_keeps_the_active_maps_cache() -> None:
    old, new = iid_trace(2000, seed=20), iid_trace(2000, seed=21)
    active = placement.build_usage_map([counts_of(old, "old")], 6, cache_slots=4, cache_policy="lfu")
    window = Window.from_counts(counts_of(new, "new"), 1)
    cand = build_candidate([window], active, label="cand")
    assert (cand.hot_rows, cand.cache_slots, cand.cache_policy) == (6, 4, "lfu")
    assert cand.same_geometry(active)  # in-place eligible
    assert cand.predicted_cold_rate == pytest.approx(miss_rates(cand.hot_mask(), new.counts(), 4, "lfu")[0])
    held = Window.from_counts(counts_of(iid_trace(2000, seed=22), "held"), 2)
    d = decide(cand, active, held, margin=0.0)
    assert d.candidate_cold_rate == pytest.approx(miss_rates(cand.hot_mask(), held.histogram, 4, "lfu")[0])
    assert d.active_cold_rate == pytest.approx(miss_rates(active.hot_mask(), held.histogram, 4, "lfu")[0])
    # a plain active map still gets a plain candidate and the plain cold ratio
    plain = placement.build_usage_map([counts_of(old, "old")], 10)
    cand_plain = build_candidate([window], plain)
    assert cand_plain.cache_slots == 0 and "cache_slots" not in cand_plain.geometry()


def test_the_drift_watch_predicts_a_cached_maps_rate_with_the_cache_model() -> None:
    ref = counts_of(iid_trace(2000, seed=30), "ref")
    active = placement.build_usage_map([ref], 6, cache_slots=4)
    active = type(active)(**{**active.__dict__, "predicted_cold_rate": None})  # as a map built without a figure
    window = Window.from_counts(counts_of(iid_trace(2000, seed=31), "w1"), 2)
    previous = Window.from_counts(counts_of(iid_trace(2000, seed=32), "w0"), 1)
    sig = compute_signals(window, active, DriftConfig(), reference=ref, previous=previous)
    assert sig.predicted_cold_rate == pytest.approx(miss_rates(active.hot_mask(), ref.counts, 4, "lru")[0])
    assert sig.active_cold_rate == pytest.approx(miss_rates(active.hot_mask(), window.histogram, 4, "lru")[0])
    assert sig.cold_rate == sig.active_cold_rate and sig.cold_rate_source == "histogram"
    assert sig.uniform_cold_rate == (EXPERTS - 10) / EXPERTS
    static, _ = miss_rates(active.hot_mask(), window.histogram)
    assert sig.active_cold_rate < static


def test_a_remap_onto_or_from_a_cached_map_is_not_tried_in_place() -> None:
    """The hook refuses an in-place apply with a cache tier; the pipeline knows it and reboots straight away."""
    import dataclasses
    from types import SimpleNamespace

    from pinsidecar.remap.in_place import swap_plan
    from pinsidecar.testing.artifacts import make_map

    plain = make_map(num_layers=2, num_experts=16, hot_rows=8, seed=1)
    other = make_map(num_layers=2, num_experts=16, hot_rows=8, seed=2)
    cached = dataclasses.replace(other, cache_slots=2)
    host = SimpleNamespace(cfg=SimpleNamespace(remap=SimpleNamespace(in_place=True)), stats_path=Path("stats.json"),
                           served_map=(None, None))
    plan, why = swap_plan(host, SimpleNamespace(active=plain, candidate=other))  # type: ignore[arg-type]
    assert plan is not None and why == ""
    for active, candidate in ((plain, cached), (dataclasses.replace(plain, cache_slots=2), cached)):
        plan, why = swap_plan(host, SimpleNamespace(active=active, candidate=candidate))  # type: ignore[arg-type]
        assert plan is None and "cache tier deploys by drain-reboot" in why
