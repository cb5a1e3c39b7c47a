"""Replay a routing trace against an HBM budget split into a static hot set and a small expert cache.

A map keeps the same experts hot for as long as it is deployed; that is right when routing is stationary, and
leaves something on the table when it is not: a token tends to pick experts the previous tokens picked, and a few
HBM rows that follow the traffic (a cache) can catch what a static set misses. Before building that tier, this
says on recorded traffic whether it would pay, and how to split the rows. The model, per MoE layer:

- ``hbm_rows`` N rows = H static hot rows + K cache slots (H = N - K);
- the hot set is the first H experts of a :class:`HotRanking`: the most selected in a counts file or a training
  trace (equal counts: lower id first, as :func:`~pinsidecar.placement.build_usage_map` breaks them), or a map's
  hot set as it is (see :meth:`HotRanking.from_map` for why a map admits only its own split);
- tokens go through in steps of ``batch`` consecutive tokens. A selection is a hit when its expert is hot or in a
  slot at the start of the step, otherwise a miss: the expert is read from host memory. All tokens of a step that
  select one missing expert share one fetch;
- under ``lru`` / ``lfu`` the step's missed experts are filled into slots at the start of the step, before it
  computes (as the engine's tier does), in the order the step first selected them. A fill takes an empty slot, or
  evicts one whose expert the step does not select (a slot the step uses is never overwritten before the step
  computes): the least recently used (``lru``; the step's hits are more recent than the slots it does not touch,
  by their last selection in the step, and its fills more recent still) or the one whose expert has the fewest
  selections seen so far in the run, this step's included, the least recently used among equals (``lfu``). When
  every slot is used by the step, its remaining misses are not admitted: they are read from host memory in place
  (still misses and fetches). A fill counts as a miss and serves hits from the next step on;
- ``static`` fills the K slots once with the next K experts of the ranking: the same as a static set of N rows,
  the baseline a cache has to beat.

Only the cold selections (not in the static set) reach the per-step Python loop; the hot hits are one numpy
lookup per layer, so 100k tokens x 24 layers x top-6 take seconds, not minutes.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pinsidecar_hook.contract import ArtifactError, ExpertMap, RoutingTrace

from pinsidecar.placement._ranking import first_ranked_mask, usage_order

__all__: list[str] = []  # nothing here is another package's business

POLICIES = ("lru", "lfu", "static")
# With --cache-slots auto and no training trace, the split is chosen on this first share of the trace's tokens.
TUNE_FRACTION = 0.25
# Slots must earn their bookkeeping: auto takes a split with slots only when it misses at least this share fewer
# selections than the static split (K = 0) on the tuning tokens. Set on an H200 (bench/cache_tier.py,
# 2026-12-06), when the cache's per-step work cost ~12 us a layer at 15 slots with nothing to fill: on the
# two-domain mixed profile a split with 0.5 % fewer misses than the static one ran 20-26 % slower than it. The
# fused step has since cut that work to ~1 us a layer (H100, 2026-12-07); the margin was not re-tuned for it.
SLOT_MIN_GAIN = 0.10


@dataclass(frozen=True, eq=False)
class HotRanking:
    """Per layer, the experts a placement would keep in HBM, best first: what the hot set and static slots take.

    ``order`` may rank only some experts (a map ranks its hot set and nothing after it); ``fixed_hot_rows`` is set
    when the hot set cannot be cut to another size.
    """

    order: np.ndarray = field(repr=False)  # int [layers, ranked]
    num_experts: int
    source: str  # "counts" | "train" | "map"
    layer_ids: tuple[int, ...] | None = None
    fixed_hot_rows: int | None = None

    @classmethod
    def from_counts(cls, counts: np.ndarray, source: str, layer_ids: Sequence[int] | None = None) -> HotRanking:
        """Every expert of each layer by selection count, ties to the lower id (a counts file or a training
        trace's :meth:`~pinsidecar_hook.contract.RoutingTrace.counts`)."""
        counts = np.asarray(counts)
        return cls(usage_order(counts), int(counts.shape[1]), source,
                   None if layer_ids is None else tuple(layer_ids))

    @classmethod
    def from_map(cls, emap: ExpertMap) -> HotRanking:
        """A map's hot set, which fixes H to the map's hot rows.

        A map stores each layer's hot experts sorted by expert id, not by how often they are selected (one
        placement, one content hash), so its first H hot ids for a smaller H would be the lowest ids, not the
        hottest; and it says nothing about which cold expert comes next. So a map is simulated only with its own
        hot set: ``hbm_rows - cache_slots`` must equal its hot rows. Rank experts with counts or a training trace
        for any other split.
        """
        order = np.asarray([lp.hot for lp in emap.layers], dtype=np.int64).reshape(emap.num_layers, emap.hot_rows)
        return cls(order, emap.num_experts, "map", tuple(emap.layer_ids), fixed_hot_rows=emap.hot_rows)

    @property
    def num_layers(self) -> int:
        return int(self.order.shape[0])

    @property
    def ranked(self) -> int:
        return int(self.order.shape[1])

    def hot_mask(self, rows: int) -> np.ndarray:
        """bool ``[layers, num_experts]``: True for the first ``rows`` experts of each layer's ranking."""
        return first_ranked_mask(self.order, rows, self.num_experts)


@dataclass(frozen=True)
class SimResult:
    """One configuration's figures on one trace."""

    hot_rows: int
    cache_slots: int
    policy: str
    tokens: int
    selections: int
    misses: int
    host_fetches: int

    @property
    def miss_rate(self) -> float:
        return self.misses / self.selections if self.selections else 0.0

    @property
    def host_fetches_per_token(self) -> float:
        return self.host_fetches / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"hot_rows": self.hot_rows, "cache_slots": self.cache_slots, "policy": self.policy,
                "miss_rate": self.miss_rate, "host_fetches_per_token": self.host_fetches_per_token,
                "misses": self.misses, "host_fetches": self.host_fetches}


@dataclass(frozen=True)
class AutoSplit:
    """What :func:`auto_split` tried and chose: every split on the trace, and what the choice was made on."""

    results: tuple[SimResult, ...]  # on the trace
    tuning: tuple[SimResult, ...]  # the same splits on the tuning tokens
    chosen: int  # index into both
    tuned_on: str  # "train" | "trace_head"
    tuning_tokens: int
    cross_fitted: bool = False  # tuning figures with the hot set ranked on the other half of the tuning tokens


def check_trace_geometry(trace: RoutingTrace, ranking: HotRanking, trace_name: str, source_name: str) -> None:
    """Refuse a ranking of another model than the trace's, naming both sides' layers and experts."""
    problems = []
    if trace.num_layers != ranking.num_layers:
        problems.append(f"{trace.num_layers} layers in the trace, {ranking.num_layers} in {source_name}")
    if trace.num_experts != ranking.num_experts:
        problems.append(f"{trace.num_experts} experts per layer in the trace, {ranking.num_experts} in {source_name}")
    if not problems and None not in (trace.layer_ids, ranking.layer_ids) and trace.layer_ids != ranking.layer_ids:
        problems.append(f"layer ids {list(trace.layer_ids or ())} in the trace, {list(ranking.layer_ids or ())} in "
                        f"{source_name}")
    if problems:
        raise ArtifactError(None, f"trace {trace_name} and {source_name} describe different models: "
                            + "; ".join(problems), "simulate a trace with the counts, map or trace of the same model")


def check_split(ranking: HotRanking, hbm_rows: int, cache_slots: int, policy: str, batch: int) -> None:
    """Refuse a configuration the model cannot simulate honestly, saying which flag to change."""
    e = ranking.num_experts
    if policy not in POLICIES:
        raise ArtifactError(None, f"policy {policy!r} is not one of {', '.join(POLICIES)}", "pass --policy lru")
    if batch < 1:
        raise ArtifactError(None, f"batch must be at least 1 token per step, got {batch}", "pass --batch 1 or more")
    if not 1 <= hbm_rows < e:
        raise ArtifactError(None, f"--hbm-rows must be in 1..{e - 1} (num_experts - 1), got {hbm_rows}",
                            "with every expert in HBM there is nothing to simulate" if hbm_rows >= e
                            else "pass the HBM rows per layer the budget buys")
    if not 0 <= cache_slots <= hbm_rows:
        raise ArtifactError(None, f"--cache-slots must be in 0..{hbm_rows} (--hbm-rows), got {cache_slots}",
                            "the cache slots are taken out of the HBM rows")
    hot_rows = hbm_rows - cache_slots
    fixed = ranking.fixed_hot_rows
    if fixed is not None and hot_rows != fixed:
        raise ArtifactError(
            None, f"the map keeps {fixed} hot rows per layer, but --hbm-rows {hbm_rows} with --cache-slots "
            f"{cache_slots} leaves {hot_rows}",
            (f"pass --cache-slots {hbm_rows - fixed} to simulate this map plus a cache" if hbm_rows >= fixed
             else f"pass --hbm-rows {fixed} or more") + "; a map lists its hot experts by id, not by rank, so it "
            "cannot be cut to another size: pass --counts or --train to rank experts for any split",
        )
    if policy == "static" and hbm_rows > ranking.ranked:
        raise ArtifactError(
            None, f"static slots take the next {cache_slots} experts after the hot set, but {ranking.source} ranks "
            f"only {ranking.ranked} per layer (a map does not rank its cold experts)",
            "pass --counts or --train for a static baseline with slots, or --cache-slots 0",
        )


def simulate(trace: RoutingTrace, ranking: HotRanking, hbm_rows: int, cache_slots: int, policy: str = "lru",
             batch: int = 1) -> SimResult:
    """Misses and host fetches of one split and policy over ``trace`` (see the module docstring for the model)."""
    check_split(ranking, hbm_rows, cache_slots, policy, batch)
    hot_rows = hbm_rows - cache_slots
    cached = policy != "static" and cache_slots > 0
    hot = ranking.hot_mask(hot_rows if cached else hbm_rows)
    cache = _CACHES.get(policy) if cached else None
    misses = fetches = 0
    for layer in range(trace.num_layers):
        ids = trace.experts[:, layer, :]
        tok, slot = np.nonzero(~hot[layer][ids])  # the cold selections, token by token in router order
        cold = ids[tok, slot]
        steps = tok // batch
        if cache is None:  # a static set: every cold selection misses; one fetch per distinct expert per step
            misses += int(cold.size)
            fetches += int(cold.size) if batch == 1 else int(
                np.unique(steps.astype(np.int64) * trace.num_experts + cold).size)
            continue
        m, f = cache(steps.tolist(), cold.tolist(), cache_slots, trace.num_experts, batch > 1)
        misses += m
        fetches += f
    return SimResult(hot_rows, cache_slots, policy, trace.tokens, trace.selections, misses, fetches)


_STEP = -1  # not an expert id: a marker in the LRU order between the slots this step has not used and those it has


def _lru(steps: list[int], ids: list[int], slots_n: int, num_experts: int, shared: bool) -> tuple[int, int]:
    """LRU slots over one layer's cold stream: (misses, fetches). ``shared``: a step may select an expert twice
    (batch > 1), and its misses of one expert are one fetch.

    The order runs least recent first: the slots the step has not used, the marker ``_STEP`` (moved to the end
    when a step begins), then the step's hits (moved to the end per selection). So the step's fills evict from the
    front up to the marker: reaching it means every slot is used by the step, and the rest are not admitted.
    """
    slots: OrderedDict[int, None] = OrderedDict.fromkeys((_STEP,))
    touch, evict = slots.move_to_end, slots.popitem
    # this step's misses, filled when the next step begins: the same as before the step computes, since the fills
    # take only slots the step does not use
    missed: list[int] = []
    miss = missed.append
    misses = fetches = filled = 0
    current = -1
    for step, e in zip(steps, ids, strict=True):
        if step != current:
            if missed:
                fetch = dict.fromkeys(missed) if shared else missed
                fetches += len(fetch)
                for f in fetch:
                    if filled < slots_n:
                        filled += 1
                    elif evict(last=False)[0] == _STEP:  # every slot is used by this step: read in place
                        slots[_STEP] = None
                        break
                    slots[f] = None
                missed.clear()
            touch(_STEP)
            current = step
        if e in slots:
            touch(e)
        else:
            misses += 1
            miss(e)
    return misses, fetches + len(set(missed))  # the last step's fills change nothing any more


def _lfu(steps: list[int], ids: list[int], slots_n: int, num_experts: int, shared: bool) -> tuple[int, int]:
    """LFU slots over one layer's cold stream: (misses, fetches), ``shared`` as for :func:`_lru`.

    A heap of (selections seen, last selection, expert), one entry per slot, updated lazily: a hit only bumps the
    expert's figures, which never decrease, so an entry's key is at most its expert's true key. An eviction pops
    the smallest entry; if it is stale it goes back with its true key; a current one whose expert the step selected
    (last selection in the step) is set aside and goes back after; the first current one the step did not select
    is the one to evict. If there is none, the step's remaining misses are not admitted.
    """
    seen = [0] * num_experts
    last = [0] * num_experts
    held = [False] * num_experts
    heap: list[tuple[int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    missed: list[int] = []
    miss = missed.append
    misses = fetches = filled = 0
    current = -1
    start = 0  # the step's first tick
    for tick, (step, e) in enumerate(zip(steps, ids, strict=True)):
        if step != current:
            if missed:
                fetch = dict.fromkeys(missed) if shared else missed
                fetches += len(fetch)
                for f in fetch:
                    if filled < slots_n:
                        filled += 1
                    else:
                        aside: list[tuple[int, int, int]] = []  # current entries of slots the step selected
                        while heap:
                            c, t, x = entry = pop(heap)
                            if c != seen[x] or t != last[x]:
                                push(heap, (seen[x], last[x], x))
                            elif t < start:  # not selected in this step: the one to evict
                                held[x] = False
                                break
                            else:
                                aside.append(entry)
                        else:  # every slot is used by this step: the rest are read in place
                            for entry in aside:
                                push(heap, entry)
                            break
                        for entry in aside:
                            push(heap, entry)
                    held[f] = True
                    push(heap, (seen[f], last[f], f))
                missed.clear()
            current = step
            start = tick
        seen[e] += 1
        last[e] = tick
        if not held[e]:
            misses += 1
            miss(e)
    return misses, fetches + len(set(missed))


_CACHES: dict[str, Callable[[list[int], list[int], int, int, bool], tuple[int, int]]] = {"lru": _lru, "lfu": _lfu}


def cache_slot_grid(hbm_rows: int) -> list[int]:
    """The splits ``--cache-slots auto`` tries: K = 0, N/8, N/4, ... N (floored, without repeats)."""
    return sorted({hbm_rows * i // 8 for i in range(9)})


def tuning_tokens(tokens: int, batch: int) -> int:
    """How many of the trace's first tokens choose the split when there is no training trace: a quarter, in
    whole steps, at least one step (all of a trace shorter than that)."""
    return min(tokens, max(batch, int(tokens * TUNE_FRACTION) // batch * batch))


def cross_fitted(tune: RoutingTrace, hbm_rows: int, grid: Sequence[int], policy: str = "lru",
                 batch: int = 1) -> tuple[SimResult, ...] | None:
    """Each split of ``grid`` on ``tune`` with the hot set ranked out of sample: rank on the first half, replay
    the second; rank on the second, replay the first; the two summed. None when ``tune`` has under two steps.

    Why: a hot set ranked on the tokens it is graded on holds exactly their heads, so the static split looks
    better there than it will on new traffic, and a margin against it (:data:`SLOT_MIN_GAIN`) then turns down
    slots that pay held out. Each half is ranked on half the tokens, which makes both sides a little worse than
    a ranking on all of them; the split with slots depends on its ranking less, so if anything this leans to
    slots, by less than the in-sample figures lean against them.
    """
    half = tune.tokens // 2 // batch * batch
    if half < batch:
        return None
    first = dataclasses.replace(tune, experts=tune.experts[:half])
    second = dataclasses.replace(tune, experts=tune.experts[half:])
    folds = [(replay, HotRanking.from_counts(ranked.counts(), "train", ranked.layer_ids))
             for ranked, replay in ((first, second), (second, first))]
    out = []
    for k in grid:
        a, b = (simulate(replay, ranking, hbm_rows, k, policy, batch) for replay, ranking in folds)
        out.append(dataclasses.replace(a, tokens=a.tokens + b.tokens, selections=a.selections + b.selections,
                                       misses=a.misses + b.misses, host_fetches=a.host_fetches + b.host_fetches))
    return tuple(out)


def auto_split(trace: RoutingTrace, ranking: HotRanking, hbm_rows: int, policy: str = "lru", batch: int = 1,
               train: RoutingTrace | None = None, max_slots: int | None = None) -> AutoSplit:
    """Try every split of :func:`cache_slot_grid`, choose the one with the fewest misses on ``train`` (or, without
    one, on the trace's first :func:`tuning_tokens`), and report all of them on the whole trace.

    ``ranking`` is taken to be ranked on ``train`` when one is given (the CLI's ``--train``, or a map built from a
    trace's own counts), so on ``train`` the splits are graded :func:`cross_fitted`, each hot set ranked on the
    half it is not graded on; ``ranking`` itself is what the reported figures on the trace use. On the trace's
    head (no ``train``) the ranking comes from elsewhere and is used as it is.

    Equal miss rates go to fewer host fetches, then to fewer cache slots (the simpler tier). A split with slots
    must also miss :data:`SLOT_MIN_GAIN` fewer than the static split on the tuning tokens, or the static split
    (K = 0) is chosen: a cache that barely changes the misses only adds its per-step work. A map fixes its split
    (:meth:`HotRanking.from_map`), so there is nothing to choose with one. ``max_slots``: the largest K that may
    be chosen (a map keeps at least one hot row); every split of the grid is still tried and reported.
    """
    if ranking.fixed_hot_rows is not None:
        raise ArtifactError(None, f"--cache-slots auto chooses the split of --hbm-rows, but the map fixes its hot "
                            f"rows at {ranking.fixed_hot_rows}",
                            f"pass --cache-slots {max(0, hbm_rows - ranking.fixed_hot_rows)}, or rank experts with "
                            "--counts or --train to search the split")
    grid = cache_slot_grid(hbm_rows)
    for k in grid:
        check_split(ranking, hbm_rows, k, policy, batch)
    if train is not None:
        tune, tuned_on = train, "train"
        crossed = cross_fitted(train, hbm_rows, grid, policy, batch)
    else:
        n = tuning_tokens(trace.tokens, batch)
        tune, tuned_on, crossed = dataclasses.replace(trace, experts=trace.experts[:n]), "trace_head", None
    tuning = crossed or tuple(simulate(tune, ranking, hbm_rows, k, policy, batch) for k in grid)
    allowed = [i for i, k in enumerate(grid) if max_slots is None or k <= max_slots]
    chosen = min(allowed, key=lambda i: (tuning[i].miss_rate, tuning[i].host_fetches_per_token, grid[i]))
    static = grid.index(0)
    if tuning[chosen].miss_rate > (1.0 - SLOT_MIN_GAIN) * tuning[static].miss_rate:
        chosen = static
    results = tuple(simulate(trace, ranking, hbm_rows, k, policy, batch) for k in grid)
    return AutoSplit(results, tuning, chosen, tuned_on, tune.tokens, crossed is not None)
