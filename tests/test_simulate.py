"""The cache-tier simulator: hand-computed cases, its agreement with a literal reading of the model, what a cache
buys on stationary and on short-reuse routing, the split search, and ``pinsidecar placement simulate``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
from pinsidecar_hook.contract import ArtifactError, RoutingTrace, save_trace

from bench import routing_sequences as rs
from pinsidecar import placement
from pinsidecar.placement import HotRanking, auto_split, simulate
from pinsidecar.placement.simulate import cache_slot_grid, tuning_tokens
from pinsidecar.testing.artifacts import counts_from, write_counts
from pinsidecar.testing.cli import assert_user_error, run, run_json

# ---------------------------------------------------------------------------------------------------- helpers


def one_layer(tokens: list[list[int]]) -> RoutingTrace:
    """A 1-layer trace of 6 experts: each inner list is one token's top-k."""
    return RoutingTrace(np.asarray(tokens)[:, None, :], 6)


# Expert 0 is the hot one; the rest rank by id (equal counts go to the lower id): 0, 1, 2, 3, 4, 5.
RANK = HotRanking.from_counts(np.array([[10, 0, 0, 0, 0, 0]]), "counts")


def zipf_trace(rng: np.random.Generator, tokens: int, layers: int, experts: int, top_k: int) -> np.ndarray:
    """Stationary routing: every token draws top_k distinct experts from one fixed Zipf popularity per layer."""
    weight = np.log(1.0 / np.arange(1, experts + 1) ** 1.1)
    order = np.stack([np.random.default_rng(99 + i).permutation(experts) for i in range(layers)])
    noise = rng.gumbel(size=(tokens, layers, experts)) + weight[np.argsort(order, axis=1)][None]
    return np.argsort(-noise, axis=2)[:, :, :top_k]


def reuse_trace(rng: np.random.Generator, tokens: int, layers: int, experts: int, top_k: int,
                repeat: float = 0.9) -> np.ndarray:
    """Short reuse: each token repeats the previous token's experts with probability ``repeat``, else draws new
    ones uniformly (so no static set can do better than top_k / experts of the fresh draws)."""
    fresh = np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :top_k]
    keep = rng.random((tokens, layers)) < repeat
    out = fresh.copy()
    for t in range(1, tokens):
        out[t] = np.where(keep[t][:, None], out[t - 1], fresh[t])
    return out


def reference(experts: np.ndarray, hot: np.ndarray, slots_n: int, policy: str, batch: int) -> tuple[int, int]:
    """The model as the docs state it, as plainly as it can be written: (misses, fetches).

    Per layer and step: each cold selection hits if its expert was in a slot at the start of the step, else
    misses; the step's missed experts (once each, in the order first selected) are then filled, each into an empty
    slot, or in place of the least recent / least selected slot whose expert the step does not select; when there
    is no such slot, the rest of the step's misses are not admitted. Recency: the step's hits by their last
    selection in the step, then its fills.
    """
    misses = fetches = 0
    for layer in range(experts.shape[1]):
        slots: dict[int, int] = {}  # expert -> recency (larger: more recent)
        seen: dict[int, int] = {}
        last: dict[int, int] = {}
        clock = pos = 0
        for start in range(0, experts.shape[0], batch):
            in_slot_at_start = set(slots)
            selected: set[int] = set()
            hits: list[int] = []
            missing: list[int] = []
            for row in experts[start:start + batch, layer, :].tolist():
                for e in row:
                    if hot[layer, e]:
                        continue
                    pos += 1
                    seen[e] = seen.get(e, 0) + 1
                    last[e] = pos
                    selected.add(e)
                    if e in in_slot_at_start:
                        hits.append(e)
                    else:
                        misses += 1
                        if e not in missing:
                            missing.append(e)
            fetches += len(missing)
            if policy == "static" or slots_n == 0:
                continue
            for e in hits:
                clock += 1
                slots[e] = clock
            for e in missing:
                if len(slots) >= slots_n:
                    free = [x for x in slots if x not in selected]
                    if not free:
                        break  # every slot is used by this step: the rest are read in place
                    if policy == "lru":
                        victim = min(free, key=lambda x: slots[x])
                    else:
                        victim = min(free, key=lambda x: (seen[x], last[x]))
                    del slots[victim]
                clock += 1
                slots[e] = clock
    return misses, fetches


# ---------------------------------------------------------------------------------------------------- by hand


# Every token selects hot expert 0 (always a hit) and one cold expert. 2 HBM rows: 1 hot (expert 0) + 1 slot.
TOKENS = [[0, 1], [0, 1], [0, 2], [0, 3], [0, 2], [0, 1]]


def test_lru_by_hand() -> None:
    # slot: 1 miss [1] | 1 hit | 2 miss, evicts 1 [2] | 3 miss [3] | 2 miss [2] | 1 miss [1]
    r = simulate(one_layer(TOKENS), RANK, hbm_rows=2, cache_slots=1, policy="lru")
    assert (r.hot_rows, r.cache_slots, r.misses, r.host_fetches, r.selections) == (1, 1, 5, 5, 12)
    assert r.miss_rate == pytest.approx(5 / 12) and r.host_fetches_per_token == pytest.approx(5 / 6)


def test_lru_keeps_the_recently_used_slot() -> None:
    # 3 HBM rows: hot 0 + 2 slots. 1 m [1] | 2 m [1,2] | 1 h (1 now newest) | 3 m evicts 2 [1,3] | 1 h | 2 m evicts 3
    tokens = [[0, 1], [0, 2], [0, 1], [0, 3], [0, 1], [0, 2]]
    r = simulate(one_layer(tokens), RANK, 3, 2, "lru")
    assert (r.misses, r.host_fetches) == (4, 4)


def test_lfu_by_hand() -> None:
    # 3 rows: hot 0 + 2 slots; seen counts in brackets.
    # 1 m {1:1} | 1 h {1:2} | 1 h {1:3} | 2 m {1:3, 2:1} | 3 m: evict 2 (1 < 3) {1:3, 3:1}
    # | 2 m: evict 3 (1 < 3) {1:3, 2:2} | 3 m: evict 2 (2 < 3) {1:3, 3:2} | 1 h
    tokens = [[0, e] for e in (1, 1, 1, 2, 3, 2, 3, 1)]
    lfu = simulate(one_layer(tokens), RANK, 3, 2, "lfu")
    assert (lfu.misses, lfu.host_fetches) == (5, 5)
    # LRU on the same tokens keeps 2 and 3 and loses 1: 1 m | h | h | 2 m | 3 m evicts 1 | 2 h | 3 h | 1 m
    assert simulate(one_layer(tokens), RANK, 3, 2, "lru").misses == 4
    # static: the 3 rows are experts 0, 1, 2 (the ranking's first three); only the 3s miss
    assert simulate(one_layer(tokens), RANK, 3, 2, "static").misses == 2


def test_lfu_breaks_equal_counts_by_least_recent() -> None:
    # 1 m, 2 m (both seen once); 3 m evicts 1 (older of the two); so 2 is still there: a hit
    r = simulate(one_layer([[0, 1], [0, 2], [0, 3], [0, 2]]), RANK, 3, 2, "lfu")
    assert r.misses == 3


def test_static_slots_are_a_static_set_of_all_the_rows() -> None:
    trace = RoutingTrace(zipf_trace(np.random.default_rng(3), 300, 2, 16, 3), 16)
    rank = HotRanking.from_counts(trace.counts(), "counts")
    whole = simulate(trace, rank, 6, 0, "static")
    for k in (1, 3, 6):
        split = simulate(trace, rank, 6, k, "static")
        assert (split.misses, split.host_fetches) == (whole.misses, whole.host_fetches)
        assert (split.hot_rows, split.cache_slots) == (6 - k, k)
    assert simulate(trace, rank, 6, 0, "lru").misses == whole.misses  # no slots: the policy is moot


def test_a_batch_shares_one_fetch_per_expert() -> None:
    tokens = [[0, 1], [0, 1], [0, 1], [0, 2]]
    # static (no slots): every cold selection misses; batch 2 fetches 1 once in step 0, 1 and 2 in step 1
    one, two = (simulate(one_layer(tokens), RANK, 1, 0, "static", batch=b) for b in (1, 2))
    assert (one.misses, one.host_fetches) == (4, 4)
    assert (two.misses, two.host_fetches) == (4, 3)
    # LRU, 1 slot: batch 1: 1 m, 1 h, 1 h, 2 m. Batch 2: step 0 both tokens miss 1 (not in a slot at the start of
    # the step) and share one fetch; step 1: 1 hits, 2 misses.
    one, two = (simulate(one_layer(tokens), RANK, 2, 1, "lru", batch=b) for b in (1, 2))
    assert (one.misses, one.host_fetches) == (2, 2)
    assert (two.misses, two.host_fetches) == (3, 2)
    assert two.host_fetches_per_token == pytest.approx(0.5)


def test_lru_never_evicts_a_slot_the_step_uses() -> None:
    # 3 HBM rows: hot 0 (never selected here) + 2 slots, batch 2 (a step is two tokens of two cold experts each).
    # step 0: 1 m, 2 m, 1 m, 2 m: 4 misses, 2 fetches; fill 1, 2 (empty slots)                       slots [1, 2]
    # step 1: 1 h, 3 m, 2 h, 4 m: 2 misses, 2 fetches; both slots are used by the step: 3, 4 not admitted [1, 2]
    # step 2: 1 h, 2 h, 1 h, 2 h                                                                        [1, 2]
    # step 3: 3 m, 1 h, 3 m, 5 m: 3 misses, 2 fetches; 3 evicts 2 (1 is older but used); 5 not admitted [1, 3]
    # step 4: 5 m, 3 h, 2 m, 1 h: 2 misses, 2 fetches
    # = 11 misses, 8 fetches. Filled after the step (the old model), 3 and 4 evicted 1 and 2 in step 1 and all of
    # step 2 missed: 15 misses, 10 fetches.
    tokens = [[1, 2], [1, 2], [1, 3], [2, 4], [1, 2], [1, 2], [3, 1], [3, 5], [5, 3], [2, 1]]
    r = simulate(one_layer(tokens), RANK, 3, 2, "lru", batch=2)
    assert (r.misses, r.host_fetches, r.selections) == (11, 8, 20)


def test_lfu_never_evicts_a_slot_the_step_uses() -> None:
    # 3 HBM rows: hot 0 + 2 slots, batch 2; each token selects 0 and one cold expert. Seen counts in braces.
    # step 0: 1 m, 2 m: 2 misses, 2 fetches; fill 1, 2 (empty slots)                   {1:1, 2:1}   slots {1, 2}
    # step 1: 1 h, 1 h                                                                  {1:3, 2:1}
    # step 2: 2 h, 3 m: 1 miss, 1 fetch. The fewest selections among the slots is 2 (2 < 3), but the step uses it:
    #         3 evicts 1                                                                {1:3, 2:2, 3:1}  {2, 3}
    # step 3: 2 h, 3 h
    # = 3 misses, 3 fetches. The old model (3 evicting 2, the least selected) missed 2 again in step 3: 4 and 4.
    tokens = [[0, e] for e in (1, 2, 1, 1, 2, 3, 2, 3)]
    r = simulate(one_layer(tokens), RANK, 3, 2, "lfu", batch=2)
    assert (r.misses, r.host_fetches, r.selections) == (3, 3, 16)


def test_a_token_with_more_cold_experts_than_slots_keeps_the_first() -> None:
    # Batch 1 with fewer slots than a token's cold experts: 2 slots, tokens of three cold experts.
    # token 0: 1 m, 2 m, 3 m: fill 1, 2; 3 not admitted (both slots are used by the token)   slots {1, 2}
    # token 1: 1 h, 2 h, 4 m: 4 not admitted                                                  {1, 2}
    # token 2: 1 h, 2 h, 5 m
    # = 5 misses, 5 fetches under both policies. Filled after the token (the old model), 3 evicted 1 in token 0, and
    # in token 1 4 evicted the hit 2 (lru) or the fill 1 (lfu), so token 2 missed again: 7 misses.
    tokens = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    for policy in ("lru", "lfu"):
        r = simulate(one_layer(tokens), RANK, 3, 2, policy)
        assert (r.misses, r.host_fetches) == (5, 5), policy


@pytest.mark.parametrize("policy", placement.POLICIES)
def test_the_simulator_agrees_with_the_model_read_literally(policy: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(120):
        e = int(rng.integers(4, 16))
        k = int(rng.integers(1, min(4, e) + 1))
        layers, tokens = int(rng.integers(1, 3)), int(rng.integers(1, 50))
        popularity = rng.dirichlet(np.ones(e) * 0.5)
        ex = np.stack([[rng.choice(e, k, replace=False, p=popularity) for _ in range(layers)]
                       for _ in range(tokens)])
        rank = HotRanking.from_counts(rng.integers(0, 5, size=(layers, e)), "counts")
        n = int(rng.integers(1, e))
        slots, batch = int(rng.integers(0, n + 1)), int(rng.integers(1, 5))
        r = simulate(RoutingTrace(ex, e), rank, n, slots, policy, batch)
        hot = rank.hot_mask(n - slots if policy != "static" and slots else n)
        assert (r.misses, r.host_fetches) == reference(ex, hot, slots, policy, batch), (e, k, tokens, n, slots, batch)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_simulator_agrees_with_the_reference_on_every_slot_count(policy: str, batch: int) -> None:
    # Short-reuse routing over few experts, so the slots are contended and steps often use all of them.
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        e, k = 12, int(rng.integers(2, 5))
        ex = reuse_trace(rng, 160, 2, e, k, repeat=0.6)
        rank = HotRanking.from_counts(rng.integers(0, 5, size=(2, e)), "counts")
        for slots in range(1, 9):
            for hot_rows in (0, 2):
                r = simulate(RoutingTrace(ex, e), rank, hot_rows + slots, slots, policy, batch)
                expected = reference(ex, rank.hot_mask(hot_rows), slots, policy, batch)
                assert (r.misses, r.host_fetches) == expected, (seed, k, slots, hot_rows)


# ---------------------------------------------------------------------------------------------------- synthetic


def test_on_stationary_routing_a_cache_buys_nothing_over_the_static_set() -> None:
    rng = np.random.default_rng(5)
    train = RoutingTrace(zipf_trace(rng, 3000, 2, 32, 4), 32)
    test = RoutingTrace(zipf_trace(rng, 3000, 2, 32, 4), 32)
    rank = HotRanking.from_counts(train.counts(), "train")
    static = simulate(test, rank, 12, 0, "lru").miss_rate
    lru = simulate(test, rank, 12, 2, "lru").miss_rate
    lfu = simulate(test, rank, 12, 2, "lfu").miss_rate
    assert static <= lru < static + 0.03  # the slots churn on traffic the static set already covers
    # LFU settles on the most selected: the static set again, less closely with fewer slots than a token's cold
    # experts (2 < top-4), where a token's fills cannot evict each other and two rare ones can take both slots
    assert abs(lfu - static) < 0.02


def test_a_map_as_the_hot_set_is_the_map() -> None:
    rng = np.random.default_rng(6)
    train = RoutingTrace(zipf_trace(rng, 2000, 2, 32, 4), 32)
    test = RoutingTrace(zipf_trace(rng, 2000, 2, 32, 4), 32)
    emap = placement.build_usage_map([counts_from(train.counts(), top_k=4)], 12)
    by_map = simulate(test, HotRanking.from_map(emap), 12, 0, "static")
    by_counts = simulate(test, HotRanking.from_counts(train.counts(), "train"), 12, 0, "static")
    assert by_map.misses == by_counts.misses
    assert by_map.miss_rate == pytest.approx(placement.evaluate(emap, counts_from(test.counts(), top_k=4))["cold_rate"])
    plus_cache = simulate(test, HotRanking.from_map(emap), 16, 4, "lru")
    assert plus_cache.hot_rows == 12 and plus_cache.misses < by_map.misses


def test_on_short_reuse_a_cache_beats_the_static_set_clearly() -> None:
    rng = np.random.default_rng(7)
    train = RoutingTrace(reuse_trace(rng, 3000, 2, 32, 4), 32)
    test = RoutingTrace(reuse_trace(rng, 3000, 2, 32, 4), 32)
    rank = HotRanking.from_counts(train.counts(), "train")
    static = simulate(test, rank, 12, 8, "static")
    lru = simulate(test, rank, 12, 8, "lru")
    assert lru.miss_rate < 0.25 * static.miss_rate
    assert lru.host_fetches_per_token < 0.25 * static.host_fetches_per_token


# ---------------------------------------------------------------------------------------------------- the split


def test_the_grid_is_eighths_of_the_rows() -> None:
    assert cache_slot_grid(16) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert cache_slot_grid(3) == [0, 1, 2, 3]
    assert cache_slot_grid(1) == [0, 1]
    assert tuning_tokens(1000, 1) == 250 and tuning_tokens(1000, 16) == 240 and tuning_tokens(3, 8) == 3


def test_auto_chooses_one_split_on_the_trace_head_or_on_train() -> None:
    rng = np.random.default_rng(8)
    test = RoutingTrace(reuse_trace(rng, 2000, 2, 32, 4), 32)
    train = RoutingTrace(reuse_trace(rng, 1000, 2, 32, 4), 32)
    rank = HotRanking.from_counts(train.counts(), "train")
    head = auto_split(test, rank, 16, "lru")
    assert head.tuned_on == "trace_head" and head.tuning_tokens == 500
    assert [r.cache_slots for r in head.results] == cache_slot_grid(16)
    assert all(t.tokens == 500 for t in head.tuning) and all(r.tokens == 2000 for r in head.results)
    assert head.tuning[head.chosen].miss_rate == min(t.miss_rate for t in head.tuning)
    assert head.results[head.chosen].cache_slots > 0  # reuse traffic: the cache wins
    on_train = auto_split(test, rank, 16, "lru", train=train)
    assert on_train.tuned_on == "train" and on_train.tuning_tokens == 1000



def test_auto_takes_slots_only_when_they_cut_misses_by_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache costs work every step (measured on an H200), so a split with slots must miss SLOT_MIN_GAIN fewer
    than the static split on the tuning tokens; ``max_slots`` bounds what may be chosen, not what is tried."""
    sim = importlib.import_module("pinsidecar.placement.simulate")  # the module: the package exports a function

    rng = np.random.default_rng(8)
    test = RoutingTrace(reuse_trace(rng, 2000, 2, 32, 4), 32)
    rank = HotRanking.from_counts(test.counts(), "test")
    best = auto_split(test, rank, 16, "lru")
    k = best.tuning[best.chosen]
    static = next(t for t in best.tuning if t.cache_slots == 0)
    gain = 1 - k.miss_rate / static.miss_rate
    assert k.cache_slots > 0 and gain > sim.SLOT_MIN_GAIN, gain
    monkeypatch.setattr(sim, "SLOT_MIN_GAIN", gain + 0.01)  # the same gain now falls short of the margin
    short = auto_split(test, rank, 16, "lru")
    assert short.tuning[short.chosen].cache_slots == 0 and len(short.results) == len(best.results)
    monkeypatch.setattr(sim, "SLOT_MIN_GAIN", gain - 0.01)
    assert auto_split(test, rank, 16, "lru").chosen == best.chosen
    capped = auto_split(test, rank, 16, "lru", max_slots=k.cache_slots - 1)
    assert capped.tuning[capped.chosen].cache_slots < k.cache_slots
    assert [r.cache_slots for r in capped.results] == cache_slot_grid(16)

def test_auto_grades_the_splits_on_train_with_the_hot_set_ranked_on_the_other_half() -> None:
    """The case that made auto cross-fit: six domains in long segments. Ranked and graded on the same tokens,
    the static set holds their heads, so no split with slots misses SLOT_MIN_GAIN fewer there and an in-sample
    auto kept K = 0; held out the slots miss far fewer. Cross-fitted, auto takes them."""
    sim = importlib.import_module("pinsidecar.placement.simulate")
    params = rs.Params(zipf=1.0, domains=6, segment=512.0)
    for seed in (1, 3):
        train = rs.to_trace(rs.generate_with(params, 6000, 2, 160, 6, seed=seed), 160)
        test = rs.to_trace(rs.generate_with(params, 6000, 2, 160, 6, seed=seed + 1), 160)
        rank = HotRanking.from_counts(train.counts(), "train")
        in_sample = [simulate(train, rank, 123, k, "lru").miss_rate for k in cache_slot_grid(123)]
        assert min(in_sample) > (1 - sim.SLOT_MIN_GAIN) * in_sample[0], (seed, in_sample)
        auto = auto_split(test, rank, 123, "lru", train=train)
        assert auto.cross_fitted and auto.tuned_on == "train" and auto.tuning_tokens == 6000
        assert all(t.tokens == 6000 for t in auto.tuning)
        held_out = auto.results[auto.chosen]
        assert held_out.cache_slots > 0, seed
        assert held_out.miss_rate < (1 - sim.SLOT_MIN_GAIN) * auto.results[0].miss_rate, seed
        # the folds by hand: rank on one half, replay the other, both ways
        halves = RoutingTrace(train.experts[:3000], 160), RoutingTrace(train.experts[3000:], 160)
        folds = [simulate(replay, HotRanking.from_counts(ranked.counts(), "train"), 123, held_out.cache_slots, "lru")
                 for ranked, replay in (halves, halves[::-1])]
        assert auto.tuning[auto.chosen].misses == sum(f.misses for f in folds)
        assert auto.tuning[auto.chosen].host_fetches == sum(f.host_fetches for f in folds)


def test_a_train_trace_too_short_to_halve_is_graded_as_it_is() -> None:
    rng = np.random.default_rng(8)
    test = RoutingTrace(reuse_trace(rng, 200, 2, 32, 4), 32)
    train = RoutingTrace(reuse_trace(rng, 3, 2, 32, 4), 32)
    rank = HotRanking.from_counts(train.counts(), "train")
    auto = auto_split(test, rank, 16, "lru", batch=2, train=train)  # 3 tokens: one whole step, no two halves
    assert not auto.cross_fitted and auto.tuning_tokens == 3
    assert [t.misses for t in auto.tuning] == [simulate(train, rank, 16, k, "lru", 2).misses
                                              for k in cache_slot_grid(16)]


def test_configurations_that_cannot_be_simulated_are_refused() -> None:
    trace = one_layer(TOKENS)
    with pytest.raises(ArtifactError, match=r"--hbm-rows must be in 1\.\.5"):
        simulate(trace, RANK, 6, 0)
    with pytest.raises(ArtifactError, match=r"--cache-slots must be in 0\.\.2"):
        simulate(trace, RANK, 2, 3)
    with pytest.raises(ArtifactError, match="batch must be at least 1"):
        simulate(trace, RANK, 2, 1, batch=0)
    with pytest.raises(ArtifactError, match="policy 'fifo'"):
        simulate(trace, RANK, 2, 1, "fifo")


def test_a_map_fixes_its_hot_rows() -> None:
    counts = counts_from([[9, 8, 7, 1, 1, 0]])
    ranking = HotRanking.from_map(placement.build_usage_map([counts], 3))
    trace = one_layer(TOKENS)
    assert simulate(trace, ranking, 5, 2, "lru").hot_rows == 3
    with pytest.raises(ArtifactError, match="the map keeps 3 hot rows per layer") as err:
        simulate(trace, ranking, 4, 2, "lru")
    assert "--cache-slots 1" in str(err.value) and "--counts or --train" in str(err.value)
    with pytest.raises(ArtifactError, match="pass --hbm-rows 3 or more"):
        simulate(trace, ranking, 2, 0, "lru")
    with pytest.raises(ArtifactError, match="a map does not rank its cold experts"):
        simulate(trace, ranking, 5, 2, "static")
    with pytest.raises(ArtifactError, match="the map fixes its hot rows at 3"):
        auto_split(trace, ranking, 5)


# ---------------------------------------------------------------------------------------------------- CLI


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    rng = np.random.default_rng(9)
    save_trace(tmp_path / "test.npz", RoutingTrace(reuse_trace(rng, 800, 4, 32, 4), 32))
    save_trace(tmp_path / "train.npz", RoutingTrace(reuse_trace(rng, 800, 4, 32, 4), 32))
    counts = write_counts(tmp_path / "c.json", num_layers=4, num_experts=32, top_k=4, tokens=200)
    other = write_counts(tmp_path / "c6.json", num_layers=6, num_experts=32, top_k=4, tokens=200)
    emap = placement.build_usage_map([counts_from(np.ones((4, 32), dtype=np.int64), top_k=4)], 8)
    placement.save_map(emap, tmp_path / "m.json")
    return {"test": str(tmp_path / "test.npz"), "train": str(tmp_path / "train.npz"), "counts": str(counts),
            "counts6": str(other), "map": str(tmp_path / "m.json")}


def test_cli_json_is_one_document_with_the_configuration(files: dict[str, str]) -> None:
    r = run_json("placement", "simulate", files["test"], "--counts", files["counts"], "--hbm-rows", "12",
                 "--cache-slots", "4", "--policy", "lfu", "--batch", "2")
    assert {k: r[k] for k in ("trace", "tokens", "layers", "num_experts", "top_k", "hbm_rows", "batch", "hot_from")
            } == {"trace": files["test"], "tokens": 800, "layers": 4, "num_experts": 32, "top_k": 4, "hbm_rows": 12,
                  "batch": 2, "hot_from": "counts"}
    [only] = r["results"]
    assert (only["hot_rows"], only["cache_slots"], only["policy"]) == (8, 4, "lfu") and "chosen" not in only
    assert 0 <= only["miss_rate"] <= 1 and only["host_fetches_per_token"] >= 0


def test_cli_auto_marks_exactly_one_chosen(files: dict[str, str]) -> None:
    r = run_json("placement", "simulate", files["test"], "--train", files["train"], "--hbm-rows", "8",
                 "--cache-slots", "auto")
    assert r["hot_from"] == "train" and r["auto"]["chosen_on"] == "train" and r["auto"]["cross_fitted"] is True
    assert [x["cache_slots"] for x in r["results"]] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert sum(x["chosen"] for x in r["results"]) == 1
    assert all(isinstance(x["chosen"], bool) for x in r["results"])
    head = run_json("placement", "simulate", files["test"], "--counts", files["counts"], "--hbm-rows", "8",
                    "--cache-slots", "auto")
    assert head["auto"]["chosen_on"] == "trace_head" and head["auto"]["tuning_tokens"] == 200
    assert head["auto"]["tuning_fraction"] == placement.TUNE_FRACTION and head["auto"]["cross_fitted"] is False
    human = run("placement", "simulate", files["test"], "--train", files["train"], "--hbm-rows", "8",
                "--cache-slots", "auto")
    assert human.exit_code == 0 and "ranked on the other half" in human.stdout, human.stdout


def test_cli_human_output_is_a_table(files: dict[str, str]) -> None:
    result = run("placement", "simulate", files["test"], "--map", files["map"], "--hbm-rows", "10",
                 "--cache-slots", "2")
    assert result.exit_code == 0, result.stderr
    for text in ("hot set from map", "miss rate", "host fetches/token"):
        assert text in result.stdout, result.stdout


def test_cli_geometry_mismatch_exits_2_naming_both(files: dict[str, str]) -> None:
    assert_user_error(run("placement", "simulate", files["test"], "--counts", files["counts6"], "--hbm-rows", "8"),
                      "describe different models", "4 layers in the trace, 6 in counts")


@pytest.mark.parametrize(("args", "fragments"), [
    ((), ("give exactly one source for the hot set",)),
    (("--counts", "C", "--train", "T"), ("give exactly one source",)),
    (("--counts", "C", "--cache-slots", "lots"), ("--cache-slots must be a number of slots or 'auto'", "'lots'")),
    (("--counts", "C", "--cache-slots", "-1"), ("--cache-slots must be at least 0",)),
    (("--map", "M", "--cache-slots", "1"), ("the map keeps 8 hot rows", "--cache-slots 4")),
    (("--map", "M", "--cache-slots", "auto"), ("the map fixes its hot rows at 8",)),
    (("--train", "missing.npz"), ("missing.npz: file not found",)),
])
def test_cli_user_errors_exit_2(files: dict[str, str], args: tuple[str, ...], fragments: tuple[str, ...]) -> None:
    named = {"C": files["counts"], "T": files["train"], "M": files["map"]}
    argv = [named.get(a, a) for a in args]
    assert_user_error(run("placement", "simulate", files["test"], *argv, "--hbm-rows", "12"), *fragments)
