"""What the cache tier buys at the kernel level: decode steps of MoE layers at one HBM budget, placed three ways, on
routing with temporal structure.

The simulator (``bench/placement.py --sections sequences``) says how many host fetches a split of the HBM rows
saves; this bench says what that is worth in step time, and whether the cache's own work eats it. Per routing
profile of ``bench/routing_sequences.py`` (``short_reuse``, ``stationary``, ``flat``, ``mixed``), on the same
weights and the same routed tokens, with N HBM rows per layer (23 % of the experts in host memory, as the sequence
table):

- ``static``: the N experts a training trace of the profile selects most, no slots (the map without a cache);
- ``lru_only``: 1 hot row and N-1 LRU slots (a map keeps at least one hot row); every other expert in host memory;
- ``hybrid``: H hot rows and K LRU slots, K chosen on the training trace by what ``pinsidecar map build
  --cache-slots auto --trace`` runs (:func:`pinsidecar.placement.choose_cache_slots`, i.e.
  :func:`pinsidecar.placement.auto_split`). Where it chooses K = 0 the layout is the static one: an A/A control of
  the timing's drift.

Each placement is re-homed by pin mode's production path (:func:`pinsidecar_hook.rehome.rehome_layer` with
``slot_rows=K``: hot rows then slot rows in one HBM tensor, the cold rows in pinned host memory read in place
through the device view), each cached layer gets the engine's :class:`pinsidecar_hook.cache.ExpertCache` over
the same row map layout pin mode builds (hot ``0..H-1``, slots ``H..H+K-1``, cold ``H+K..``). One step is, for
every layer: if the layer has slots, the cache step as pin mode's triton_experts backend runs it
(:meth:`pinsidecar_hook.cache.ExpertCache.step_partition`: one Triton launch that plans, flips the row map, copies
the fills and partitions the ids), then the torch reference backend's split
(:func:`pinsidecar_hook.backends.torch_ref.split`: the partition, unless the cache step made it, a grouped experts
call per tier, the cold one on a side stream, the shared finalize). On CUDA the whole
step is captured in one CUDA graph (the ids, router weights and hidden states are copied into static buffers
before each replay); if the capture fails the JSON says so and the step runs eagerly.

Routing: the held-out trace of the profile (same model seed as the training trace, other token seed). Batch 1 is
one stretch of it; batch 4 is four streams, four stretches far apart, so each keeps its own temporal structure;
a step's ids are one token of each stream. The three placements are interleaved (warm-up of each, then rounds
A-B-C, A-B-C, ... over consecutive stretches of the steps, each placement's cache carrying over), because GPU
figures drift 20-30 % over minutes: the ratios are taken within a round, then summarized over the rounds.

Per case: step time (CUDA events: median, mean, min, max, per round), host fetches and misses counted on the
device (misses: the cache's own counter, or the partition's cold count without a cache; host fetches: the
cache's fills plus the distinct experts the cold tier computed in place, from the partition's live per-expert
counts and the row map after the step), checked EQUAL to the simulator (:func:`pinsidecar.placement.simulate`)
on the same ids at the same batching, and bit identity of every step with the all-HBM reference (every expert in
HBM, the unsplit call). Bookkeeping: on each cached placement, a step whose ids select only hot and slot-resident
experts (nothing to fill), with the cache step (the engine's fused launch, and beside it the unfused launches it
replaced) and without it, interleaved; the difference as a share of the step, and in microseconds per layer.

    python3 bench/cache_tier.py --out bench/results/cache_tier_h200.json   # the H200 (device tool: --out $OUT/...)
    python3 bench/cache_tier.py --small --out /tmp/cache_tier_cpu.json    # anywhere, CPU included (CI runs it)

On the CPU every tier is host memory and nothing is captured, so its times mean nothing and no target is claimed;
CI checks that the script runs, that the counts equal the simulator's and that every step is bit-identical. JSON
and a PNG (mean step time and host fetches per token, per profile, batch and placement) are written side by side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.cache import ExpertCache
from pinsidecar_hook.contract import CountsArtifact
from pinsidecar_hook.contract.io import atomic_write_bytes
from pinsidecar_hook.kernels import grouped
from pinsidecar_hook.rehome import MemoryLedger, RehomedLayer, rehome_layer

from pinsidecar.placement import HotRanking, simulate

if __name__ == "__main__" and not __package__:  # run as a file: the repo root on the path, so that the
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # siblings import as the `bench` package
from bench import routing_sequences
from bench.placement import (
    SEQUENCE_GEOMETRY,
    SEQUENCE_HOST_FRACTION,
    SEQUENCE_SEEDS,
    SEQUENCE_TOKENS,
    TARGET_GAIN,
    Clock,
    Steps,
    layer_weights,
    say,
    simulator_identity,
    summarize,
)

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent

# The geometry (24 MoE layers x 160 experts, top-6: the sequence table's) with the real expert shape of a
# Qwen3-30B-A3B-like layer (hidden 2048, moe intermediate 768, bf16: 9.4 MB an expert). The traces and the split
# choice use all ``model_layers``; the bench instantiates the first ``layers`` of them (time per layer is what
# matters, and three placements of 24 layers would not fit an H100 beside the reference).
GEOMETRY = {"model_layers": SEQUENCE_GEOMETRY["layers"], "layers": 8, "experts": SEQUENCE_GEOMETRY["experts"],
            "top_k": SEQUENCE_GEOMETRY["top_k"], "hidden": 2048, "intermediate": 768}
SMALL_GEOMETRY = {"model_layers": 2, "layers": 2, "experts": 32, "top_k": 4, "hidden": 64, "intermediate": 32}
SMALL_TRACE_TOKENS = 2000
PLACEMENTS = ("static", "lru_only", "hybrid")
BATCHES = (1, 4)
WEIGHT_NAMES = ("w13_weight", "w2_weight")
# The targets.
STEP_TIME_TARGET = 1.02  # hybrid step time <= 1.02 x the better of static and lru_only, every profile
GAIN_PROFILES = ("short_reuse", "mixed")  # where hybrid must be >= TARGET_GAIN better in host fetches and time
BOOKKEEPING_TARGET = 0.01  # the cache step's share of a step with nothing to fill


def hbm_rows_for(experts: int, host_fraction: float) -> int:
    """N HBM rows per layer, as the sequence table computes them (123 of 160 at 23 % host)."""
    return round((1 - host_fraction) * experts)


# ----------------------------------------------------------------------------------------------- routing (CPU)


def prepare_profile(name: str, geo: dict[str, int], host_fraction: float, tokens: int) -> dict[str, Any]:
    """A profile's training and held-out traces (the sequence table's seeds, all ``model_layers``), and the
    split map build would choose on the training trace: the hot set ranked by its counts, K by
    ``--cache-slots auto`` (batch 1, at least one hot row). CPU only, no torch: runs in a worker process."""
    from pinsidecar.placement import choose_cache_slots  # what `map build --cache-slots auto --trace` runs

    t0 = time.monotonic()
    layers, experts, top_k = geo["model_layers"], geo["experts"], geo["top_k"]
    train_ids = routing_sequences.generate(name, tokens, layers, experts, top_k, SEQUENCE_SEEDS["train"],
                                           SEQUENCE_SEEDS["model"])
    test_ids = routing_sequences.generate(name, tokens, layers, experts, top_k, SEQUENCE_SEEDS["test"],
                                          SEQUENCE_SEEDS["model"])
    train = routing_sequences.to_trace(train_ids, experts, {"profile": name, "seed": SEQUENCE_SEEDS["train"]})
    n = hbm_rows_for(experts, host_fraction)
    counts = CountsArtifact(layer_ids=list(range(layers)), num_experts=experts, top_k=top_k,
                            counts=train.counts(), tokens=tokens, workload=f"{name}-train")
    k, choice = choose_cache_slots("auto", "lru", n, counts, train, f"{name}.train.npz")
    return {"name": name, "train_ids": train_ids, "test_ids": test_ids, "train_counts": train.counts(),
            "hbm_rows": n, "hybrid_slots": k, "cache_choice": choice,
            "reuse_heldout": routing_sequences.reuse_stats(test_ids), "seconds": round(time.monotonic() - t0, 1)}


def _prepare_star(job: tuple[str, dict[str, int], float, int]) -> dict[str, Any]:
    return prepare_profile(*job)


def prepare_all(names: list[str], geo: dict[str, int], host_fraction: float, tokens: int,
                jobs: int) -> list[dict[str, Any]]:
    """:func:`prepare_profile` for every profile, in ``jobs`` spawned processes (before any CUDA work: a few tens
    of seconds of Python per profile at the full geometry, device time otherwise), in this one when ``jobs`` is 1
    or the pool fails."""
    work = [(n, geo, host_fraction, tokens) for n in names]
    if jobs > 1 and len(names) > 1:
        try:
            with ProcessPoolExecutor(max_workers=min(jobs, len(names)),
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
                return list(pool.map(_prepare_star, work))
        except Exception as exc:  # a pool that cannot start is no reason to lose the run
            say(f"process pool failed ({exc!r}); preparing the profiles here")
    return [_prepare_star(w) for w in work]


@dataclass
class Spec:
    """One placement of one profile: H static hot rows, K slots (N = H + K), the policy the simulator runs."""

    name: str
    hot_rows: int
    cache_slots: int
    sim_policy: str  # "static" or "lru"
    hot: np.ndarray  # bool [layers, experts]: the static hot set (the first H of the training ranking)


def specs_for(prep: dict[str, Any], ranking: HotRanking, placements: tuple[str, ...]) -> list[Spec]:
    n, k = prep["hbm_rows"], prep["hybrid_slots"]
    split = {"static": (n, 0, "static"), "lru_only": (1, n - 1, "lru"), "hybrid": (n - k, k, "lru")}
    return [Spec(p, split[p][0], split[p][1], split[p][2], ranking.hot_mask(split[p][0])) for p in placements]


def stream_ids(test_ids: np.ndarray, layers: int, streams: int, steps: int, stride: int) -> np.ndarray:
    """int64 ``[steps, streams, layers, k]``: stream j is ``steps`` consecutive tokens of the held-out trace from
    token ``j * stride``; a step is one token of each stream."""
    return np.stack([test_ids[j * stride: j * stride + steps, :layers] for j in range(streams)],
                    axis=1).astype(np.int64)


def step_inputs(ids: np.ndarray, hidden: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The steps' device inputs in :class:`bench.placement.Steps`' layout: ids ``[L, S, T, k]``, router weights
    (softmax of random logits) and hidden states ``[L, S, T, D]`` (each layer its own, as placement.py)."""
    lstk = ids.transpose(2, 0, 1, 3).copy()
    rng = np.random.default_rng(seed)
    weights = torch.softmax(torch.from_numpy(rng.standard_normal(lstk.shape)).float(), dim=-1)
    gen = torch.Generator(device=device).manual_seed(seed)
    layers, steps, tokens, _ = lstk.shape
    x = torch.randn((layers, steps, tokens, hidden), generator=gen, device=device, dtype=torch.bfloat16)
    return {"ids": torch.from_numpy(lstk).to(device), "weights": weights.to(device), "x": x}


# ----------------------------------------------------------------------------------------------- placements


@dataclass
class TierLayer:
    """One layer as pin mode holds it (:class:`pinsidecar_hook.pin.LayerPin`'s fields the split and cache read)."""

    hot: dict[str, torch.Tensor]
    cold: dict[str, torch.Tensor]
    row_map: torch.Tensor  # int32 [E], a view of the placement's row_maps[layer]
    hot_rows: int  # H + K: the split's tier boundary
    cache: ExpertCache | None
    keep: RehomedLayer  # the pinned host storage behind the cold views


@dataclass
class Built:
    """A placement's layers, plus what the per-step accounting reads in one copy."""

    spec: Spec
    hot: np.ndarray  # bool [layers, experts] (Steps reads the expert count from it)
    row_maps: torch.Tensor  # int32 [layers, E + 2]: each layer's row_map_ext (two junk elements for the cache)
    misses: torch.Tensor  # int64 [layers, 1]: each cache's miss counter
    layers: list[TierLayer] = field(default_factory=list)
    hbm_bytes: int = 0
    host_bytes: int = 0

    def reset(self) -> None:
        """Empty every slot and zero the counters: a run starts from the map's rows, as the simulator does."""
        for layer in self.layers:
            if layer.cache is not None:
                layer.cache.clear()
                layer.cache.reset_counters()
        self.misses.zero_()


def build_all(geo: dict[str, int], specs: list[Spec], data: dict[int, dict[str, torch.Tensor]], impl: str,
              device: torch.device) -> tuple[list[Built], dict[int, torch.Tensor]]:
    """Every placement of one profile, layer by layer: the layer's weights are generated once, its all-HBM
    reference outputs computed for every batch's steps (the unsplit call), then it is re-homed once per placement
    by :func:`rehome_layer` with the placement's slot rows, and the original goes."""
    e, nl = geo["experts"], geo["layers"]
    built = [Built(s, s.hot, torch.full((nl, e + 2), -1, dtype=torch.int32, device=device),
                   torch.zeros((nl, 1), dtype=torch.int64, device=device)) for s in specs]
    refs: dict[int, list[torch.Tensor]] = {b: [] for b in data}
    ledger = MemoryLedger()
    for layer in range(nl):
        w13, w2 = layer_weights(geo, layer, device)
        for b, d in data.items():
            refs[b].append(torch.stack([
                torch_ref.unsplit(d["x"][layer, s], w13, w2, d["weights"][layer, s], d["ids"][layer, s], impl=impl)
                for s in range(d["ids"].shape[1])]).cpu())
        for bp in built:
            h, k = bp.spec.hot_rows, bp.spec.cache_slots
            hot_local = np.flatnonzero(bp.spec.hot[layer])
            cold_local = np.flatnonzero(~bp.spec.hot[layer])
            owner = torch.nn.Module()
            owner.w13_weight = torch.nn.Parameter(w13, requires_grad=False)  # shares w13's storage: rehome_layer
            owner.w2_weight = torch.nn.Parameter(w2, requires_grad=False)  # re-points these, w13/w2 stay for the next
            rehomed = rehome_layer(owner, WEIGHT_NAMES, hot_local.tolist(), cold_local.tolist(), ledger, slot_rows=k)
            rows = np.full(e + 2, -1, dtype=np.int32)  # as pin mode: slots after the hot rows, the cold rows moved up
            rows[hot_local] = np.arange(h)
            rows[cold_local] = h + k + np.arange(len(cold_local))
            bp.row_maps[layer].copy_(torch.from_numpy(rows))
            ext = bp.row_maps[layer]
            cache = ExpertCache(ext, h, k, "lru", bp.misses[layer]) if k else None
            bp.layers.append(TierLayer(rehomed.hot, rehomed.cold, ext[:e], h + k, cache, rehomed))
            bp.hbm_bytes += rehomed.hot_bytes
            bp.host_bytes += rehomed.cold_bytes
        del w13, w2
    return built, {b: torch.stack(r) for b, r in refs.items()}  # [L, S, T, D] on the host


def release(*objs: Any) -> None:
    for o in objs:
        if isinstance(o, Built):
            o.layers.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- steps


class CacheSteps(Steps):
    """:class:`bench.placement.Steps` with the cache: per layer the cache step (``cache``, on a layer with slots:
    ``"fused"``, the engine's one launch that plans, copies and partitions; ``"unfused"``, the plan launch, a copy
    launch per tensor and the split's own partition, as before the fused step; ``"off"``: none), then the
    split. The partition's cold counter (``cold_counts``) counts what is still cold after the step's fills (read in
    place); with a cache the misses are the cache's own counter (:attr:`Built.misses`), as in pin mode."""

    def __init__(self, placement: Built, data: dict[str, torch.Tensor], impl: str, overlap: bool, graph: bool,
                 cache: str = "fused") -> None:
        self.cache = cache
        super().__init__(placement, data, impl, overlap, count=True, graph=graph)  # type: ignore[arg-type]

    def _compute(self) -> list[torch.Tensor]:
        outs = []
        for i, layer in enumerate(self.p.layers):
            hot, cold = layer.hot, layer.cold
            partitioned = None
            if self.cache == "unfused" and layer.cache is not None:
                layer.cache.step(self.ids[i], hot, cold)
            elif self.cache == "fused" and layer.cache is not None:  # the engine's step: plan, fills, partition
                partitioned = layer.cache.step_partition(self.ids[i], hot, cold,
                                                         expert_counts=self.expert_counts[i],
                                                         cold_counts=self.cold_counts[i],
                                                         token_counts=self.token_counts[i])
            outs.append(torch_ref.split(
                self.x[i], hot["w13_weight"], hot["w2_weight"], cold["w13_weight"], cold["w2_weight"],
                self.weights[i], self.ids[i], layer.row_map, layer.hot_rows, self.expert_counts[i],
                self.cold_counts[i], token_counts=self.token_counts[i], impl=self.impl, overlap=self.overlap,
                partitioned=partitioned))
        return outs

    def reset(self) -> None:
        self.p.reset()
        for t in (self.expert_counts, self.cold_counts, self.token_counts):
            t.zero_()


def make_steps(bp: Built, data: dict[str, torch.Tensor], impl: str, overlap: bool, graph: bool,
               notes: list[str], cache: str = "fused") -> CacheSteps:
    """Capture the step in a CUDA graph when asked; if the capture fails, say why and run it eagerly."""
    if graph:
        try:
            return CacheSteps(bp, data, impl, overlap, True, cache)
        except Exception as exc:
            torch.cuda.synchronize()
            notes.append(f"{bp.spec.name}: CUDA graph capture failed ({exc!r:.300}); eager")
            say(notes[-1])
    return CacheSteps(bp, data, impl, overlap, False, cache)


def snapshot(steps: CacheSteps) -> dict[str, np.ndarray]:
    """The counters and row maps after a step, in one device-to-host copy; zeroes the per-expert counts, so each
    snapshot's are that step's."""
    bp = steps.p
    nl, e = steps.expert_counts.shape
    fills = [layer.cache.fills if layer.cache is not None else torch.zeros_like(bp.misses[0])
             for layer in bp.layers]
    flat = torch.cat([steps.expert_counts.reshape(-1), steps.cold_counts.reshape(-1), bp.misses.reshape(-1),
                      torch.cat(fills), bp.row_maps[:, :e].reshape(-1).to(torch.int64)]).cpu().numpy()
    steps.expert_counts.zero_()
    parts = np.split(flat, np.cumsum([nl * e, nl, nl, nl]))
    return {"expert_counts": parts[0].reshape(nl, e), "in_place": parts[1], "cache_misses": parts[2],
            "fills": parts[3], "rows": parts[4].reshape(nl, e)}


class Accounting:
    """Host fetches and misses per step from the device counters: misses are the cache's counter (or the
    partition's cold count without a cache); a host fetch is a fill, or an expert the cold tier computed in place
    (selected this step and still on a cold row after the step's fills): one read of its bytes over the link."""

    def __init__(self, bp: Built) -> None:
        self.cached = np.array([layer.cache is not None for layer in bp.layers])
        self.hot_rows = np.array([layer.hot_rows for layer in bp.layers])[:, None]
        self.last_fills = np.zeros(len(bp.layers), dtype=np.int64)
        self.fetches: list[int] = []
        self.in_place_reads: list[int] = []
        self.misses_total = 0

    def step(self, snap: dict[str, np.ndarray]) -> None:
        fills = snap["fills"] - self.last_fills
        self.last_fills = snap["fills"]
        read_in_place = ((snap["expert_counts"] > 0) & (snap["rows"] >= self.hot_rows)).sum(axis=1)
        self.fetches.append(int((fills + read_in_place).sum()))
        self.in_place_reads.append(int(read_in_place.sum()))
        self.misses_total = int(np.where(self.cached, snap["cache_misses"], snap["in_place"]).sum())


# ----------------------------------------------------------------------------------------------- one profile


def run_profile(prep: dict[str, Any], geo: dict[str, int], placements: tuple[str, ...], batches: tuple[int, ...],
                steps: int, rounds: int, warmup: int, impl: str, device: torch.device, graph: bool,
                deadline: float) -> dict[str, Any]:
    """Build the placements of one profile, run every batch (placements interleaved by round), the bookkeeping
    steps, and the simulator on the same ids."""
    name, nl = prep["name"], geo["layers"]
    ranking = HotRanking.from_counts(prep["train_counts"][:nl], "train")
    specs = specs_for(prep, ranking, placements)
    total = warmup + steps
    stride = prep["test_ids"].shape[0] // max(batches)
    if total > stride:
        raise SystemExit(f"error: {total} steps per stream do not fit {prep['test_ids'].shape[0]} held-out tokens in "
                         f"{max(batches)} streams; pass fewer --steps or more --trace-tokens")
    ids = {b: stream_ids(prep["test_ids"], nl, b, total, stride) for b in batches}
    data = {b: step_inputs(ids[b], geo["hidden"], 300 + b, device) for b in batches}
    clock = Clock(device)
    overlap = device.type == "cuda" and torch_ref.OVERLAP_DEFAULT
    t0 = time.monotonic()
    built, refs = build_all(geo, specs, data, impl, device)
    build_s = round(time.monotonic() - t0, 1)
    say(f"{name}: built {', '.join(f'{s.name} H={s.hot_rows} K={s.cache_slots}' for s in specs)} in {build_s}s")
    out: dict[str, Any] = {
        "name": name, "hbm_rows": prep["hbm_rows"], "cache_choice": prep["cache_choice"],
        "reuse_heldout": prep["reuse_heldout"], "prepare_seconds": prep["seconds"], "build_seconds": build_s,
        "placements": {bp.spec.name: {"hot_rows": bp.spec.hot_rows, "cache_slots": bp.spec.cache_slots,
                                      "policy": "lru" if bp.spec.cache_slots else "static",
                                      "hbm_bytes": bp.hbm_bytes, "host_bytes": bp.host_bytes} for bp in built},
        "streams": {str(b): {"stride_tokens": stride, "tokens_per_stream": total} for b in batches},
        "cases": [], "rounds": [], "bookkeeping": [], "notes": [],
    }
    slices = [range(warmup + r * (steps // rounds), warmup + (r + 1) * (steps // rounds)) for r in range(rounds)]
    sim_steps = warmup + rounds * (steps // rounds)
    for b in batches:
        if time.monotonic() > deadline:
            out["notes"].append(f"deadline: batch {b} skipped")
            continue
        cases, notes = run_batch(built, data[b], refs[b], ids[b][:sim_steps], b, prep, ranking, warmup, slices, impl,
                                 overlap, graph, clock)
        out["cases"] += cases
        out["rounds"].append({"batch": b, "rounds": round_ratios(out["cases"], name, b, len(slices))})
        out["notes"] += notes
        out["bookkeeping"] += bookkeeping(built, data[b], b, impl, overlap, graph, clock, device, out["notes"])
    release(*built)
    return out


def run_batch(built: list[Built], data: dict[str, torch.Tensor], ref: torch.Tensor, ids: np.ndarray, batch: int,
              prep: dict[str, Any], ranking: HotRanking, warmup: int, slices: list[range], impl: str, overlap: bool,
              graph: bool, clock: Clock) -> tuple[list[dict[str, Any]], list[str]]:
    """One batch of one profile: capture each placement's step, empty the caches, run the warm-up steps of each,
    then the rounds (A-B-C, A-B-C, ...: every placement the same steps in a round, its cache carried over), each
    step timed, checked against the reference ``ref [L, S, T, D]`` and counted; then the simulator on the same
    ids ``[S, T, L, k]``, at the same batching."""
    name = prep["name"]
    nl, k = ids.shape[2], ids.shape[3]
    notes: list[str] = []
    runners = [make_steps(bp, data, impl, overlap, graph, notes) for bp in built]
    for r in runners:  # the captures' warm-up calls ran the caches: start from the map's rows
        r.reset()
    acct = [Accounting(bp) for bp in built]
    times: list[list[float]] = [[] for _ in built]
    round_of: list[list[int]] = [[] for _ in built]
    same = [0] * len(built)
    for i in range(len(built)):  # warm-up: run, checked and counted, not timed
        for s in range(warmup):
            same[i] += run_step(runners[i], s, clock, ref, acct[i])[1]
    for rnd, span in enumerate(slices):
        for i in range(len(built)):
            for s in span:
                ms, ok = run_step(runners[i], s, clock, ref, acct[i])
                same[i] += ok
                times[i].append(ms)
                round_of[i].append(rnd)
    sim_trace = routing_sequences.to_trace(ids.reshape(-1, nl, k), ranking.num_experts)
    cases = []
    for i, bp in enumerate(built):
        spec = bp.spec
        sim = simulate(sim_trace, ranking, prep["hbm_rows"], spec.cache_slots, spec.sim_policy, batch)
        cache_counts = {"hits": 0, "fills": 0, "evictions": 0}
        for layer in bp.layers:
            if layer.cache is not None:
                for key, v in layer.cache.counters().items():
                    cache_counts[key] += v
        checked = len(acct[i].fetches)
        fetches = sum(acct[i].fetches)
        tokens = checked * batch
        measured = acct[i].fetches[warmup:]
        case = {
            "profile": name, "placement": spec.name, "batch": batch, "hot_rows": spec.hot_rows,
            "cache_slots": spec.cache_slots, "execution": "cuda_graph" if runners[i].graph is not None else "eager",
            **summarize(times[i]), "per_layer_mean_ms": statistics.fmean(times[i]) / nl,
            "per_round": [summarize([t for t, rr in zip(times[i], round_of[i], strict=True) if rr == rnd])
                          for rnd in range(len(slices))],
            "steps_checked": checked, "bit_identical_steps": same[i],
            "tokens": tokens, "misses": acct[i].misses_total, "host_fetches": fetches,
            "host_fetches_per_token": fetches / tokens, "miss_rate": acct[i].misses_total / (tokens * k * nl),
            "measured_host_fetches_per_token": sum(measured) / (len(measured) * batch) if measured else None,
            "in_place_reads": sum(acct[i].in_place_reads), **cache_counts,
            "simulator": {"misses": sim.misses, "host_fetches": sim.host_fetches, "tokens": sim.tokens,
                          "miss_rate": sim.miss_rate, "host_fetches_per_token": sim.host_fetches_per_token},
            "matches_simulator": sim.misses == acct[i].misses_total and sim.host_fetches == fetches
            and sim.tokens == tokens,
            "step_ms": [round(t, 4) for t in times[i]], "step_host_fetches": acct[i].fetches,
        }
        cases.append(case)
        say(f"{name:11s} b{batch} {spec.name:8s} H={spec.hot_rows:3d} K={spec.cache_slots:3d} "
            f"mean {case['mean_ms']:.3f} ms median {case['median_ms']:.3f} ms  fetches/token "
            f"{case['host_fetches_per_token']:.3f} (sim {sim.host_fetches_per_token:.3f}"
            f"{'' if case['matches_simulator'] else ' MISMATCH'})  identical {same[i]}/{checked}")
    return cases, notes


def run_step(runner: CacheSteps, step: int, clock: Clock, ref: torch.Tensor, acct: Accounting) -> tuple[float, bool]:
    """One step: its inputs into the static buffers, the timed run, its outputs against the reference, its
    counters into the accounting."""
    runner.load(step)
    ms = clock.time_ms(runner.run)
    same = bool(torch.equal(torch.stack(runner.outputs).cpu(), ref[:, step]))
    acct.step(snapshot(runner))
    return ms, same


def round_ratios(cases: list[dict[str, Any]], profile: str, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Within each round (the same steps for every placement): hybrid's mean and median step time over static's,
    lru_only's and the better of the two's."""
    by = {c["placement"]: c for c in cases if c["profile"] == profile and c["batch"] == batch}
    if not all(p in by for p in PLACEMENTS):
        return []
    rows = []
    for rnd in range(rounds):
        row: dict[str, Any] = {"round": rnd}
        for stat in ("mean_ms", "median_ms"):
            h, s, lo = (by[p]["per_round"][rnd][stat] for p in ("hybrid", "static", "lru_only"))
            better = min(s, lo)
            row[stat] = {"hybrid_over_static": h / s, "hybrid_over_lru_only": h / lo, "hybrid_over_better": h / better,
                         "better": "static" if s <= lo else "lru_only", "gain": better / h}
        rows.append(row)
    return rows


def resident_ids(bp: Built, tokens: int, top_k: int) -> np.ndarray:
    """``[L, 1, T, k]`` ids that select only experts in HBM now (slot-resident first, then hot), distinct per token:
    a step with nothing to fill."""
    out = np.empty((len(bp.layers), 1, tokens, top_k), dtype=np.int64)
    for li, layer in enumerate(bp.layers):
        assert layer.cache is not None
        e = layer.row_map.shape[0]
        held = [int(x) for x in layer.cache.slot_expert[: layer.cache.slots].cpu().tolist() if x < e]
        pool = held + np.flatnonzero(bp.spec.hot[li]).tolist()
        for t in range(tokens):
            out[li, 0, t] = [pool[(t * top_k + j) % len(pool)] for j in range(top_k)]
    return out


def _share(with_ms: list[float], without_ms: list[float], layers: int) -> dict[str, Any]:
    """A cache step's extra time per round: as a share of the step with it, and in microseconds per layer."""
    per = [(a - b) / a for a, b in zip(with_ms, without_ms, strict=True)]
    extra_us = [(a - b) * 1000 / layers for a, b in zip(with_ms, without_ms, strict=True)]
    return {"median": statistics.median(per), "min": min(per), "max": max(per), "per_round": per,
            "extra_us_per_layer": _spread(extra_us)}


def bookkeeping(built: list[Built], data: dict[str, torch.Tensor], batch: int, impl: str, overlap: bool,
                graph: bool, clock: Clock, device: torch.device, notes: list[str]) -> list[dict[str, Any]]:
    """Per cached placement: the step with its cache step (the fused launch, and the unfused launches it replaced)
    and without, on ids that fill nothing, interleaved (the order rotates each round); each cache step's extra time
    as a share of the step with it. The slots hold what the run left in them."""
    cuda = device.type == "cuda"
    rounds, inner = (9, 20) if cuda else (3, 1)
    rows = []
    for bp in built:
        if not bp.spec.cache_slots:
            continue
        k = data["ids"].shape[-1]
        d = {"ids": torch.from_numpy(resident_ids(bp, batch, k)).to(device), "weights": data["weights"][:, :1],
             "x": data["x"][:, :1]}
        before = {key: sum(layer.cache.counters()[key] for layer in bp.layers if layer.cache is not None)
                  for key in ("fills", "hits")}
        misses_before = int(bp.misses.sum().item())
        variants = {mode: make_steps(bp, d, impl, overlap, graph, notes, cache=mode)
                    for mode in ("fused", "unfused", "off")}
        times: dict[str, list[float]] = {mode: [] for mode in variants}

        def reps(s: CacheSteps) -> Callable[[], None]:
            return lambda: [s.run() for _ in range(inner)]

        order = list(variants)
        for rnd in range(rounds):
            for mode in order[rnd % 3:] + order[:rnd % 3]:
                times[mode].append(clock.time_ms(reps(variants[mode])) / inner)
        outputs = {mode: torch.stack(v.outputs).cpu() for mode, v in variants.items()}
        identical = all(torch.equal(outputs[m], outputs["off"]) for m in ("fused", "unfused"))
        fills = sum(layer.cache.counters()["fills"] for layer in bp.layers if layer.cache is not None)
        layers = len(bp.layers)
        rows.append({
            "placement": bp.spec.name, "batch": batch, "cache_slots": bp.spec.cache_slots, "layers": layers,
            "execution": "cuda_graph" if variants["fused"].graph is not None else "eager",
            "replays_per_timing": inner, "rounds": rounds,
            "with_cache_ms": summarize(times["fused"]), "unfused_ms": summarize(times["unfused"]),
            "without_cache_ms": summarize(times["off"]),
            "share_of_step": _share(times["fused"], times["off"], layers),
            "unfused_share_of_step": _share(times["unfused"], times["off"], layers),
            "nothing_filled": fills == before["fills"] and int(bp.misses.sum().item()) == misses_before,
            "outputs_identical_with_and_without": identical,
        })
        say(f"bookkeeping {bp.spec.name} b{batch}: fused {statistics.median(times['fused']):.4f} ms, unfused "
            f"{statistics.median(times['unfused']):.4f} ms, without {statistics.median(times['off']):.4f} ms; "
            f"share fused {rows[-1]['share_of_step']['median']:.2%}, unfused "
            f"{rows[-1]['unfused_share_of_step']['median']:.2%}")
        del variants
    return rows


# ----------------------------------------------------------------------------------------------- figures


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures per profile and batch, against its targets. ``met`` is None where nothing may be claimed
    (the CPU, where every tier is host memory; or the small geometry)."""
    claimable = result["device_type"] == "cuda" and not result["small"]
    why = None if claimable else ("CPU: every tier is host memory and nothing is captured, so step times mean "
                                  "nothing" if result["device_type"] != "cuda" else "--small geometry")

    def met(ok: bool) -> bool | None:
        return bool(ok) if claimable else None

    fig: dict[str, Any] = {"claimable": claimable, "why_not_claimable": why, "targets": {
        "hybrid_over_better_step_time_max": STEP_TIME_TARGET, "gain_min": TARGET_GAIN,
        "gain_profiles": list(GAIN_PROFILES), "bit_identical_fraction": 1.0,
        "bookkeeping_share_max": BOOKKEEPING_TARGET,
        "rule": "step-time ratios are the mean step time of each placement within a round (the same steps), the "
        "median over rounds against the target; host fetches are counts over every step"}, "profiles": {}}
    verdicts: list[bool | None] = []
    all_cases = [c for p in result["profiles"] for c in p.get("cases", [])]
    for prof in result["profiles"]:
        name = prof["name"]
        entry: dict[str, Any] = {}
        for rr in prof.get("rounds", []):
            b, rows = rr["batch"], rr["rounds"]
            cases = {c["placement"]: c for c in prof["cases"] if c["batch"] == b}
            row: dict[str, Any] = {"identical_steps": f"{sum(c['bit_identical_steps'] for c in cases.values())}/"
                                   f"{sum(c['steps_checked'] for c in cases.values())}",
                                   "host_fetches_per_token": {p: c["host_fetches_per_token"] for p, c in cases.items()},
                                   "host_fetches_equal_simulator": all(c["matches_simulator"]
                                                                       for c in cases.values())}
            if rows:
                over = _spread([r["mean_ms"]["hybrid_over_better"] for r in rows])
                gain = _spread([r["mean_ms"]["gain"] for r in rows])
                row["hybrid_over_better_step_time"] = {**over, "target": STEP_TIME_TARGET,
                                                       "met": met(over["median"] <= STEP_TIME_TARGET)}
                row["hybrid_over_static_step_time"] = _spread([r["mean_ms"]["hybrid_over_static"] for r in rows])
                row["hybrid_over_lru_only_step_time"] = _spread([r["mean_ms"]["hybrid_over_lru_only"] for r in rows])
                row["hybrid_over_better_median_step_time"] = _spread([r["median_ms"]["hybrid_over_better"]
                                                                      for r in rows])
                f = row["host_fetches_per_token"]
                better = min(f["static"], f["lru_only"])
                fetch_gain = better / f["hybrid"] if f["hybrid"] else math.inf
                row["host_fetch_ratios"] = {f"hybrid_over_{p}": f["hybrid"] / f[p] if f[p] else None
                                            for p in ("static", "lru_only")}
                row["host_fetch_ratios"]["hybrid_over_better"] = f["hybrid"] / better if better else None
                gated = name in GAIN_PROFILES
                row["step_time_gain"] = {**gain, "target": TARGET_GAIN if gated else None,
                                         "met": met(gain["median"] >= TARGET_GAIN) if gated else None}
                row["host_fetch_gain"] = {"value": fetch_gain, "target": TARGET_GAIN if gated else None,
                                          "met": met(fetch_gain >= TARGET_GAIN) if gated else None}
                verdicts += [row["hybrid_over_better_step_time"]["met"], row["step_time_gain"]["met"],
                             row["host_fetch_gain"]["met"]]
            books = [x for x in prof.get("bookkeeping", []) if x["batch"] == b and x["placement"] == "hybrid"]
            if books:
                share = books[0]["share_of_step"]["median"]
                row["bookkeeping_share"] = {"median": share, "target": BOOKKEEPING_TARGET,
                                            "met": met(share <= BOOKKEEPING_TARGET)}
                verdicts.append(row["bookkeeping_share"]["met"])
            entry[f"b{b}"] = row
        fig["profiles"][name] = entry
    checked = sum(c["steps_checked"] for c in all_cases)
    same = sum(c["bit_identical_steps"] for c in all_cases)
    fig["bit_identical_steps"] = f"{same}/{checked}"
    fig["bit_identical_fraction"] = same / checked if checked else None
    fig["host_fetches_equal_simulator"] = all(c["matches_simulator"] for c in all_cases)
    fig["bookkeeping_outputs_identical"] = all(x["outputs_identical_with_and_without"] and x["nothing_filled"]
                                               for p in result["profiles"] for x in p.get("bookkeeping", []))
    verdicts.append(met(fig["bit_identical_fraction"] == 1.0))
    # None where a target does not apply (the gain off its profiles) or nothing may be claimed
    fig["all_targets_met"] = all(v for v in verdicts if v is not None) if claimable else None
    return fig


def table_markdown(result: dict[str, Any]) -> str:
    """The cases as a Markdown table, then the ratios within rounds."""
    lines = ["| profile | batch | placement | H+K | mean ms | median ms | ms/layer | fetch/tok (sim) | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for prof in result["profiles"]:
        for c in prof.get("cases", []):
            lines.append(
                f"| {c['profile']} | {c['batch']} | {c['placement']} | {c['hot_rows']}+{c['cache_slots']} | "
                f"{c['mean_ms']:.3f} | {c['median_ms']:.3f} | {c['per_layer_mean_ms']:.3f} | "
                f"{c['host_fetches_per_token']:.3f} ({c['simulator']['host_fetches_per_token']:.3f}"
                f"{'' if c['matches_simulator'] else ' !'}) | {c['bit_identical_steps']}/{c['steps_checked']} |")
    lines += ["", "| profile | batch | hybrid / better (mean, median [min..max] over rounds) | time gain | fetch gain |"
              " bookkeeping |", "|---|---|---|---|---|---|"]
    for name, entry in result.get("figures", {}).get("profiles", {}).items():
        for b, row in entry.items():
            if "hybrid_over_better_step_time" not in row:
                continue
            o, g = row["hybrid_over_better_step_time"], row["step_time_gain"]
            book = row.get("bookkeeping_share")
            lines.append(f"| {name} | {b} | {o['median']:.3f} [{o['min']:.3f}..{o['max']:.3f}] | {g['median']:.2f}x | "
                         f"{row['host_fetch_gain']['value']:.2f}x | "
                         f"{'-' if book is None else format(book['median'], '.2%')} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Mean step time (whiskers: the rounds' min and max) and host fetches per token, per profile and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = [p for p in result["profiles"] if p.get("cases")]
    batches = sorted({c["batch"] for p in profiles for c in p["cases"]})
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 7), squeeze=False)
    width = 0.8 / len(PLACEMENTS)
    for col, b in enumerate(batches):
        for i, pl in enumerate(PLACEMENTS):
            xs, ms, lo, hi, fetch = [], [], [], [], []
            for j, prof in enumerate(profiles):
                c = next((c for c in prof["cases"] if c["batch"] == b and c["placement"] == pl), None)
                if c is None:
                    continue
                rounds = [r["mean_ms"] for r in c["per_round"]]
                xs.append(j + (i - 1) * width)
                ms.append(c["mean_ms"])
                lo.append(c["mean_ms"] - min(rounds))
                hi.append(max(rounds) - c["mean_ms"])
                fetch.append(c["host_fetches_per_token"])
            axes[0][col].bar(xs, ms, width, yerr=[lo, hi], label=pl, capsize=2)
            axes[1][col].bar(xs, fetch, width, label=pl)
        for row, label in ((0, "mean step time, ms"), (1, "host fetches per token")):
            ax = axes[row][col]
            ax.set_xticks(range(len(profiles)), [p["name"] for p in profiles])
            ax.set_ylabel(label)
            ax.set_title(f"batch {b}")
            ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    g = result["geometry"]
    fig.suptitle(f"{result['device']}: {g['layers']} of {g['model_layers']} MoE layers, {g['experts']} experts top-"
                 f"{g['top_k']}, hidden {g['hidden']}, intermediate {g['intermediate']}, bf16, N = "
                 f"{result['hbm_rows']} HBM rows ({result['impl']}, {result['execution']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether it had changes (None where there is no git)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            return {"commit": head.stdout.strip(), "modified": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": os.environ.get("PINSIDECAR_GIT_COMMIT"), "modified": None}


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cache_tier.json"),
                        help="JSON report; the PNG goes beside it with the same stem")
    parser.add_argument("--small", action="store_true", help="tiny geometry (CPU, CI: well under a minute)")
    parser.add_argument("--profiles", default=",".join(routing_sequences.PROFILES),
                        help=f"routing profiles, of {','.join(routing_sequences.PROFILES)}")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help=f"subset of {','.join(PLACEMENTS)}")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="streams per step (tokens per step)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"MoE layers instantiated (default {GEOMETRY['layers']} of {GEOMETRY['model_layers']})")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per case (default 300; small 12)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds the steps are split into (>= 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the rounds (default 10; small 2)")
    parser.add_argument("--trace-tokens", type=int, default=None,
                        help=f"tokens of the training and the held-out trace (default {SEQUENCE_TOKENS}; small "
                        f"{SMALL_TRACE_TOKENS})")
    parser.add_argument("--host-fraction", type=float, default=SEQUENCE_HOST_FRACTION,
                        help="share of each layer's experts in host memory (N = round((1 - f) x experts))")
    parser.add_argument("--impl", default="auto", choices=("auto", "loop", *grouped.IMPLS),
                        help="experts implementation (auto: triton on CUDA, the fastest accurate one in "
                        "bench/results/placement_h200.json; grouped_mm on the CPU)")
    parser.add_argument("--no-graph", action="store_true", help="run the steps eagerly on CUDA too")
    parser.add_argument("--jobs", type=int, default=None, help="processes preparing the traces (default 4; small 1)")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="start no profile or batch after this")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.deadline_s
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    geo = dict(SMALL_GEOMETRY if args.small else GEOMETRY)
    if args.layers:
        geo["layers"] = args.layers
        geo["model_layers"] = max(geo["model_layers"], args.layers)
    steps = args.steps or (12 if args.small else 300)
    warmup = args.warmup if args.warmup is not None else (2 if args.small else 10)
    tokens = args.trace_tokens or (SMALL_TRACE_TOKENS if args.small else SEQUENCE_TOKENS)
    jobs = args.jobs or (1 if args.small else 4)
    profiles = args.profiles.split(",")
    placements = tuple(p for p in PLACEMENTS if p in args.placements.split(","))
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        parser.error("--batches is a list of integers, e.g. 1,4")
    for flag, chosen, known in (("--profiles", profiles, routing_sequences.PROFILES),
                                ("--placements", args.placements.split(","), PLACEMENTS)):
        unknown = set(chosen) - set(known)
        if unknown:
            parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {','.join(known)}")
    if args.rounds < 3 or steps < args.rounds:
        parser.error("--rounds must be at least 3 and at most --steps")
    if not 0 < args.host_fraction < 1 or min(batches) < 1:
        parser.error("--host-fraction must be in (0, 1) and every batch at least 1")
    impl = args.impl
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else ("grouped_mm" if grouped.grouped_mm_available() else "loop")
    graph = device.type == "cuda" and not args.no_graph and impl != "loop"
    n = hbm_rows_for(geo["experts"], args.host_fraction)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    result: dict[str, Any] = {
        "benchmark": "bench/cache_tier.py",
        "command": os.environ.get("PINSIDECAR_BENCH_COMMAND", " ".join(["python3", "bench/cache_tier.py", *(
            argv if argv is not None else sys.argv[1:])])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()})",
        "device_type": device.type, "small": args.small, "git": git_commit(), "simulator": simulator_identity(),
        "environment": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                        "numpy": np.__version__, "triton": getattr(grouped.triton, "__version__", None)},
        "geometry": {**geo, "dtype": "bfloat16", "expert_bytes": 3 * geo["hidden"] * geo["intermediate"] * 2},
        "host_fraction": args.host_fraction, "hbm_rows": n, "trace_tokens": tokens, "seeds": SEQUENCE_SEEDS,
        "steps": steps, "rounds": args.rounds, "warmup": warmup, "batches": list(batches),
        "placements": list(placements), "impl": impl, "overlap": cuda and torch_ref.OVERLAP_DEFAULT,
        "execution": "cuda_graph" if graph else "eager",
        "execution_note": None if graph else ("CPU: no CUDA graph; every tier is host memory, the timings mean "
                                              "nothing" if not cuda else "eager on CUDA (--no-graph or impl loop)"),
        "profiles": [],
    }

    def save() -> None:
        atomic_write_bytes(out, (json.dumps(result, indent=1, default=float) + "\n").encode())

    say(f"preparing {profiles} ({tokens} tokens x {geo['model_layers']} layers, {jobs} processes)")
    preps = prepare_all(profiles, geo, args.host_fraction, tokens, jobs)
    torch.manual_seed(0)
    for prep in preps:
        if time.monotonic() > deadline:
            say(f"deadline: skipping {prep['name']}")
            result["profiles"].append({"name": prep["name"], "skipped": "deadline"})
            continue
        try:
            result["profiles"].append(run_profile(prep, geo, placements, batches, steps, args.rounds, warmup, impl,
                                                  device, graph, deadline))
        except Exception as exc:  # keep what ran (a CUDA error is usually sticky: stop here, say where and why)
            import traceback

            say(f"{prep['name']}: failed: {exc!r}")
            result["profiles"].append({"name": prep["name"], "error": repr(exc)[:2000],
                                       "traceback": traceback.format_exc()[-6000:]})
            save()
            break
        if any(c["execution"] == "eager" for c in result["profiles"][-1]["cases"]) and graph:
            result["execution"] = "mixed: see each case's execution and the profile notes"
        save()
    result["figures"] = figures(result)
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:
        say("matplotlib is missing: no PNG")
    print(table_markdown(result))
    print(json.dumps({k: v for k, v in result["figures"].items() if k != "profiles"}, indent=1, default=float))
    fig = result["figures"]
    ok = fig["bit_identical_fraction"] in (None, 1.0) and fig["host_fetches_equal_simulator"] \
        and fig["bookkeeping_outputs_identical"] and not any("error" in p for p in result["profiles"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
