"""The cache tier inside the vLLM CPU engine: a map with slots boots, fills and hits while serving, keeps every
output bit for bit, keeps the counts exact, reports its counters, and refuses an in-place apply.

One boot, eager like the session's shared pin engine (another map, no cache) it is compared with: placement
invariance says the two must give the same tokens and the same logprobs, and the same routing, so the same
histogram. (A compiled engine computes the rest of the model with other fusions, so it is compared with eager
only through the split's custom op: tests/test_cache_tier.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pinsidecar_hook.contract import ExpertMap, apply_args, load_stats, request_and_wait

from pinsidecar.testing.artifacts import make_map, model_geometry
from pinsidecar.testing.engine import PARITY_PROMPTS, HookedEngine

pytestmark = pytest.mark.vllm

SLOTS = 8


def _request(engine: HookedEngine, op: str, args: Any = None) -> Any:
    assert engine.hook.stats_path is not None
    return request_and_wait(Path(engine.hook.stats_path), op, load_stats, timeout_s=120.0, alive=engine.alive,
                            args=args)


@pytest.fixture(scope="module")
def cached(engine_factory: Callable[..., HookedEngine], demo_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    geo = model_geometry(demo_model_dir)
    base = make_map(num_layers=geo["num_layers"], num_experts=geo["num_experts"], hot_rows=geo["num_experts"] // 4,
                    seed=5, top_k=geo["top_k"], label="cached")
    emap = ExpertMap(**{**base.__dict__, "cache_slots": SLOTS, "cache_policy": "lru"})
    path = tmp_path_factory.mktemp("cache-engine") / "cached.json"
    emap.save(path)
    engine = engine_factory(demo_model_dir, "pin", map_path=path,
                            hook_env={"PINSIDECAR_STATS_HISTOGRAM": "1"})
    return {"engine": engine, "map": emap, "path": path}


def test_a_cached_map_serves_the_same_bits_as_a_map_without_one(cached: dict[str, Any], pin_engine: Any) -> None:
    engine = cached["engine"]
    _request(engine, "reset")
    outputs = engine.greedy_outputs()
    assert outputs == pin_engine.reference  # tokens and logprobs, every one
    snap = _request(engine, "flush")
    cache = snap.cache
    assert cache is not None and cache["slots"] == SLOTS and cache["policy"] == "lru"
    layers = len(snap.layer_ids)
    assert sum(cache["fills"]) > 0 and sum(cache["hits"]) > 0  # it filled and it was used
    assert all(e <= f for e, f in zip(cache["evictions"], cache["fills"], strict=True))
    # every selection of a cold expert is a hit or a miss (cold_selections), and no more
    emap: ExpertMap = cached["map"]
    hot = emap.hot_mask()
    assert snap.histogram is not None
    for i in range(layers):
        cold_sel = sum(c for e, c in enumerate(snap.histogram[i]) if not hot[i][e])
        assert cache["hits"][i] + snap.cold_selections[i] == cold_sel, f"layer {snap.layer_ids[i]}"
    # the counts are exact: the same routing as the uncached engine on the same requests
    _request(pin_engine.engine, "reset")
    assert pin_engine.engine.greedy_outputs() == outputs
    uncached = _request(pin_engine.engine, "flush")
    assert snap.histogram == uncached.histogram
    assert snap.tokens == uncached.tokens and snap.selections == uncached.selections
    assert sum(snap.selections) == layers * snap.tokens * snap.top_k
    # the slots took cold selections off the host: fewer misses than the same hot set without slots
    static_cold = sum(sum(c for e, c in enumerate(snap.histogram[i]) if not hot[i][e]) for i in range(layers))
    assert sum(snap.cold_selections) < static_cold
    assert len(PARITY_PROMPTS) == len(outputs)


def test_stats_report_the_slots_in_the_hbm_tier(cached: dict[str, Any]) -> None:
    snap = _request(cached["engine"], "flush")
    emap: ExpertMap = cached["map"]
    per_row = snap.tier_bytes["host"] // (emap.cold_rows * len(snap.layer_ids))
    assert snap.tier_bytes["hbm"] == per_row * (emap.hot_rows + SLOTS) * len(snap.layer_ids)


def test_an_in_place_apply_on_a_cached_map_is_refused_and_serving_goes_on(cached: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    engine = cached["engine"]
    emap: ExpertMap = cached["map"]
    other = make_map(num_layers=emap.num_layers, num_experts=emap.num_experts, hot_rows=emap.hot_rows, seed=6,
                     top_k=emap.top_k)
    path = tmp_path / "candidate.json"
    other.save(path)
    snap = _request(engine, "apply", apply_args(path, other.content_hash))
    answer = snap.meta["apply"]
    assert answer["outcome"] == "refused" and "cache tier" in answer["reason"]
    assert snap.map_hash == emap.content_hash
    assert engine.greedy(PARITY_PROMPTS[0])["tokens"]


def test_the_exporter_reads_the_live_cache_counters(cached: dict[str, Any]) -> None:
    """The engine's own stats file through the daemon's exporter: the cache's totals, slots and hit ratio."""
    from prometheus_client.parser import text_string_to_metric_families

    from pinsidecar.metrics import Exporter

    engine = cached["engine"]
    engine.greedy(PARITY_PROMPTS[0])
    snap = _request(engine, "flush")
    exp = Exporter(stats_path=Path(engine.hook.stats_path), nvml=None, process_metrics=False)
    samples = {s.name: s.value for f in text_string_to_metric_families(exp.render().decode()) for s in f.samples
               if not s.labels}
    assert snap.cache is not None
    assert samples["pinsidecar_cache_slots"] == SLOTS
    assert samples["pinsidecar_cache_hits_total"] == sum(snap.cache["hits"]) > 0
    assert samples["pinsidecar_cache_fills_total"] == sum(snap.cache["fills"]) > 0
    hits, misses = sum(snap.cache["hits"]), snap.total_cold_selections
    assert samples["pinsidecar_cache_hit_ratio"] == pytest.approx(hits / (hits + misses))
