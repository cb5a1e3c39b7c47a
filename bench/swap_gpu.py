"""Remap in place on the GPU: what a swap of expert rows between HBM and pinned host memory costs, and that it is right.

Layers at the reference geometry (384 experts, top-6, hidden 5120, intermediate 2304, bf16: 70.8 MB per expert;
295 hot rows in HBM, 89 cold rows in pinned host memory read in place through the production device view) are
re-homed by pin mode's production path (:func:`pinsidecar_hook.rehome.rehome_layer`) into pin mode's own state
(:class:`pinsidecar_hook.pin.PinState`), and candidate maps are applied through the production apply
(:meth:`PinState.apply`: map file read and checked, plan, copies and row-map flips under the step lock). The
experts are the torch reference backend's split with the grouped Triton experts call (capturable, UVA-correct).

Measured, in one run:

- **the host link**: pinned host-to-device and device-to-host DMA bandwidth, both directions at once, and HBM copy;
- **swap time**: the step lock's hold time per apply (what serving stands still for) for 2, 20 and 100 swapped rows
  (1, 10 and 50 per layer, two layers), per row and per 100 rows, against the link bound for the bytes moved
  (one row: staging copy in HBM, then host-to-device, then device-to-host, in stream order on one stream);
- **bit identity**: after each apply, every layer's outputs against a fresh re-home with the new map (n/n
  identical), and every expert's rows against its original bytes, in the tier the map says;
- **CUDA graphs**: a forward captured before the apply, replayed after it, against the fresh re-home; and its live
  cold counter, which follows the row map the graph reads at replay;
- **a negative control**: the row map flipped and a forward run on another stream without waiting for the copy
  stream, with the copies of a whole layer in flight, must give other bits (else the ordering checks prove
  nothing); the same with the forward stream waiting for the copies must not.

    python3 bench/swap_gpu.py --out bench/results/swap_h200.json     # the H200, through the device tool
    python3 bench/swap_gpu.py --small --device cpu --out /tmp/s.json  # anywhere (CI runs it: logic only)

On the CPU both tiers are host memory, so the times mean nothing, and there are no streams (no graph, no
negative control); CI checks that the script runs and that the identity checks hold.

The applies here run with nothing serving; the stall they cause while steps run, in bounded batches and in one
hold, is ``bench/apply_gpu.py``'s (which shares this module's helpers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pinsidecar_hook import swap
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.contract import ExpertMap, HookConfig, LayerPlacement, apply_args, plan_swap
from pinsidecar_hook.contract.io import atomic_write_bytes
from pinsidecar_hook.pin import LayerPin, ModelFacts, PinState
from pinsidecar_hook.rehome import MemoryLedger, rehome_layer

if __name__ == "__main__" and not __package__:  # run as a file: the repo root on the path, so that the
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # siblings import as the `bench` package
from bench.gpu_timing import eager_time_us

GEOMETRY = {"experts": 384, "top_k": 6, "hidden": 5120, "intermediate": 2304, "layers": 2, "cold": 89}
SMALL_GEOMETRY = {"experts": 32, "top_k": 6, "hidden": 256, "intermediate": 128, "layers": 2, "cold": 12}
NAMES = ("w13_weight", "w2_weight")
WEIGHT_SCALE = 1 / 64  # keeps activations O(1) at hidden 5120 (a power of two: exact in bf16)
MOVES = (1, 10, 50)  # rows swapped per layer in the timed applies
TOKENS = (1, 6, 16, 64)


def say(*parts: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def expert_bytes(geo: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> int:
    return 3 * geo["hidden"] * geo["intermediate"] * torch.empty((), dtype=dtype).element_size()


def layer_weights(geo: dict[str, int], layer: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s experts, regenerated bit for bit from its seed: ``w13 [E, 2N, D]``, ``w2 [E, D, N]``."""
    e, d, n = geo["experts"], geo["hidden"], geo["intermediate"]
    gen = torch.Generator(device=device).manual_seed(1000 + layer)
    w13 = torch.randn((e, 2 * n, d), generator=gen, device=device, dtype=dtype).mul_(WEIGHT_SCALE)
    w2 = torch.randn((e, d, n), generator=gen, device=device, dtype=dtype).mul_(WEIGHT_SCALE)
    return w13, w2


# ------------------------------------------------------------------------------------------------------ maps


def random_map(geo: dict[str, int], seed: int, label: str, dtype: torch.dtype = torch.bfloat16) -> ExpertMap:
    rng = random.Random(seed)
    e, hot_rows = geo["experts"], geo["experts"] - geo["cold"]
    layers = []
    for lid in range(geo["layers"]):
        order = list(range(e))
        rng.shuffle(order)
        layers.append(LayerPlacement(lid, tuple(order[:hot_rows]), tuple(order[hot_rows:])))
    return ExpertMap(layer_ids=tuple(range(geo["layers"])), num_experts=e, top_k=geo["top_k"], hot_rows=hot_rows,
                     layers=tuple(layers), label=label, expert_bytes=expert_bytes(geo, dtype))


def moved_map(base: ExpertMap, moves: int, seed: int, label: str) -> ExpertMap:
    """``base`` with ``moves`` hot experts per layer traded for as many cold ones (same geometry)."""
    rng = random.Random(seed)
    layers = []
    for lp in base.layers:
        leaving = set(rng.sample(lp.hot, moves))
        entering = rng.sample(lp.cold, moves)
        hot = [e for e in lp.hot if e not in leaving] + entering
        layers.append(LayerPlacement(lp.layer_id, tuple(hot), tuple(e for e in range(base.num_experts)
                                                                     if e not in set(hot))))
    return ExpertMap(layer_ids=base.layer_ids, num_experts=base.num_experts, top_k=base.top_k,
                     hot_rows=base.hot_rows, layers=tuple(layers), label=label, expert_bytes=base.expert_bytes)


# ------------------------------------------------------------------------------------------------------ state


def build_state(geo: dict[str, int], emap: ExpertMap, map_path: Path, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> PinState:
    """Pin mode's state for ``emap``, every layer re-homed by the production path (cold rows into pinned host
    memory behind the production device view on CUDA; the originals freed)."""
    layers = []
    for lid in emap.layer_ids:
        owner = torch.nn.Module()
        w13, w2 = layer_weights(geo, lid, device, dtype)
        owner.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        owner.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        del w13, w2
        rows, hot_local, cold_local = emap.layer(lid).row_map(emap.num_experts)
        rehomed = rehome_layer(owner, list(NAMES), hot_local, cold_local, MemoryLedger())
        layers.append(LayerPin(
            layer_id=lid, name=f"layers.{lid}.experts", row_map=torch.tensor(rows, dtype=torch.int32, device=device),
            hot_rows=len(hot_local), cold_rows=len(cold_local), hot=rehomed.hot, cold=rehomed.cold,
            expert_counts=torch.zeros(emap.num_experts, dtype=torch.int64, device=device),
            cold_counts=torch.zeros(1, dtype=torch.int64, device=device),
            token_counts=torch.zeros(1, dtype=torch.int64, device=device), hot_bytes=rehomed.hot_bytes,
            cold_bytes=rehomed.cold_bytes, keepalive=list(rehomed.cold_host.values()),
            cold_host=dict(rehomed.cold_host)))
        del owner
    facts = ModelFacts(layer_ids=emap.layer_ids, num_experts=emap.num_experts, top_k=emap.top_k, first_tensors=NAMES,
                       expert_bytes=emap.expert_bytes, names_by_layer={p.name: list(NAMES) for p in layers},
                       problems=())
    summary = {"tier_bytes": {"hbm": sum(p.hot_bytes for p in layers), "host": sum(p.cold_bytes for p in layers)},
               "peak_extra_total_bytes": 0}
    return PinState(emap=emap, layers=layers, backend="torch_ref", rank=0, tp_size=1, summary=summary,
                    cfg=HookConfig(mode="pin", map_path=map_path), facts=facts)


def release(*objs: Any) -> None:
    for obj in objs:
        if isinstance(obj, PinState):
            obj.layers.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class Step:
    """One routed step for every layer: hidden states, top-k ids and router weights."""

    x: torch.Tensor  # [L, T, D]
    ids: torch.Tensor  # [L, T, k] int64
    weights: torch.Tensor  # [L, T, k] fp32


def make_step(geo: dict[str, int], tokens: int, seed: int, device: torch.device, dtype: torch.dtype,
              focus: list[list[int]] | None = None) -> Step:
    """Random routing (k distinct experts per token); with ``focus`` (per layer, a list of experts) every slot
    picks from it instead, so a step can route exactly to the rows a swap moves."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e, k = geo["experts"], geo["top_k"]
    ids = torch.empty((geo["layers"], tokens, k), dtype=torch.int64)
    for layer in range(geo["layers"]):
        pool = torch.tensor(focus[layer]) if focus else torch.arange(e)
        for t in range(tokens):
            ids[layer, t] = pool[torch.randperm(pool.numel(), generator=g)[:k]]
    weights = torch.rand((geo["layers"], tokens, k), generator=g)
    x = torch.randn((geo["layers"], tokens, geo["hidden"]), generator=g)
    return Step(x.to(device, dtype), ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device))


def forward(state: PinState, step: Step, impl: str, counters: bool = True) -> list[torch.Tensor]:
    """Every layer's split invoke on ``step`` (live counters as in the engine)."""
    outs = []
    for i, p in enumerate(state.layers):
        outs.append(torch_ref.split(step.x[i], p.hot["w13_weight"], p.hot["w2_weight"], p.cold["w13_weight"],
                                    p.cold["w2_weight"], step.weights[i], step.ids[i], p.row_map, p.hot_rows,
                                    p.expert_counts if counters else None, p.cold_counts if counters else None,
                                    token_counts=p.token_counts if counters else None, impl=impl, overlap=False))
    return outs


def rows_hold_their_experts(state: PinState, geo: dict[str, int], device: torch.device,
                            dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(experts whose rows are their original bytes, in the tier the map says; experts checked). One expert at a
    time: no second copy of a layer is ever made."""
    good = total = 0
    for p in state.layers:
        originals = dict(zip(NAMES, layer_weights(geo, p.layer_id, device, dtype), strict=True))
        rows = p.row_map.tolist()
        hot_set = set(state.emap.layer(p.layer_id).hot)
        for e, r in enumerate(rows):
            in_hot = r < p.hot_rows
            ok = in_hot == (e in hot_set)
            for name in NAMES:
                got = p.hot[name][r] if in_hot else p.cold[name][r - p.hot_rows]
                ok = ok and bool(torch.equal(got, originals[name][e]))
            good += ok
            total += 1
        del originals
    return good, total


# ------------------------------------------------------------------------------------------------------ probes


def _events_ms(fn: Any, reps: int = 5) -> float:
    """Median of ``reps`` eager calls, in ms (the shared CUDA-event timer)."""
    return eager_time_us(fn, reps) / 1000


def bandwidth_probes(device: torch.device, nbytes: int) -> dict[str, Any]:
    """Pinned H2D and D2H DMA, both at once on two streams, and an HBM copy (GB/s; CUDA events, median of 5)."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(2)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _events_ms(lambda: dev_b.copy_(host_a, non_blocking=True))
    d2h = _events_ms(lambda: host_b.copy_(dev_a, non_blocking=True))
    d2d = _events_ms(lambda: dev_b.copy_(dev_a))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def duplex() -> None:
        main = torch.cuda.current_stream()
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            dev_b.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_a, non_blocking=True)
        main.wait_stream(s1)
        main.wait_stream(s2)

    both = _events_ms(duplex)
    out = {"h2d_GBps": nbytes / h2d / 1e6, "d2h_GBps": nbytes / d2h / 1e6,
           "duplex_GBps": 2 * nbytes / both / 1e6, "hbm_copy_GBps": 2 * nbytes / d2d / 1e6,
           "method": f"{nbytes >> 20} MiB pinned host buffer (torch pin_memory) <-> HBM, non_blocking copies timed "
                     "with CUDA events, median of 5; duplex: one copy each way on two streams at once (bytes of "
                     "both); HBM copy counts bytes read + written"}
    return out


# ------------------------------------------------------------------------------------------------------ sections


def timed_applies(state: PinState, geo: dict[str, int], maps_dir: Path, base: ExpertMap, reps: int,
                  bw: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Apply ``base`` -> moved -> ``base`` ``reps`` times per size; the step lock's hold time per apply."""
    rows_out = []
    base_path = maps_dir / "base.json"
    for moves in MOVES:
        moves = min(moves, geo["cold"], geo["experts"] - geo["cold"])
        target = moved_map(base, moves, seed=10 + moves, label=f"moved{moves}")
        target_path = maps_dir / f"{target.label}.json"
        target.save(target_path)
        seconds, results = [], []
        for i in range(reps):
            for emap, path in ((target, target_path), (base, base_path)):
                result = state.apply(apply_args(path, emap.content_hash), f"apply-{moves}-{i}-{emap.label}")
                if result.outcome != "applied":
                    raise RuntimeError(f"apply {emap.label}: {result.outcome}: {result.reason}")
                seconds.append(result.seconds)
                results.append(result)
        rows, moved = results[0].rows, results[0].bytes_moved
        median = statistics.median(seconds)
        row_bytes = base.expert_bytes
        entry: dict[str, Any] = {
            "rows": rows, "rows_per_layer": moves, "bytes_moved": moved, "applies": len(seconds),
            "lock_held_s": {"median": median, "min": min(seconds), "max": max(seconds)},
            "per_row_ms": median / rows * 1e3, "per_100_rows_ms": median / rows * 100 * 1e3,
            "effective_GBps": moved / median / 1e9,
        }
        if bw:
            one_row = row_bytes / (bw["h2d_GBps"] * 1e9) + row_bytes / (bw["d2h_GBps"] * 1e9) \
                + 2 * row_bytes / (bw["hbm_copy_GBps"] * 1e9)
            entry["link_bound_per_row_ms"] = one_row * 1e3
            entry["duplex_bound_per_row_ms"] = 2 * row_bytes / (bw["duplex_GBps"] * 1e9) * 1e3
            entry["of_link_bound"] = one_row * rows / median
        say("swap", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()
                     if not isinstance(v, dict)})
        rows_out.append(entry)
    return rows_out


def identity_section(state: PinState, geo: dict[str, int], device: torch.device, dtype: torch.dtype, impl: str,
                     maps_dir: Path, base: ExpertMap, target: ExpertMap) -> dict[str, Any]:
    """Apply ``target``; every layer's outputs against a fresh re-home with ``target``, for several steps; every
    expert's rows against its original bytes; then back to ``base``, the same."""
    plan = plan_swap(base, target)
    focus = [list(s.entering) + list(s.leaving) for s in plan.layers]
    steps = [(t, kind, make_step(geo, t, 100 + t + (kind == "moved"), device, dtype,
                                 focus if kind == "moved" else None))
             for t in TOKENS for kind in ("random", "moved")]
    before = [forward(state, s, impl, counters=False) for _, _, s in steps]
    target_path = maps_dir / "identity_target.json"
    target.save(target_path)
    result = state.apply(apply_args(target_path, target.content_hash), "apply-identity")
    assert result.outcome == "applied", result.reason
    after = [forward(state, s, impl, counters=False) for _, _, s in steps]
    rows_good, rows_total = rows_hold_their_experts(state, geo, device, dtype)
    fresh = build_state(geo, target, target_path, device, dtype)
    expected = [forward(fresh, s, impl, counters=False) for _, _, s in steps]
    release(fresh)
    del fresh
    same = [bool(torch.equal(a, b)) for outs_a, outs_b in zip(after, expected, strict=True)
            for a, b in zip(outs_a, outs_b, strict=True)]
    invariant = [bool(torch.equal(a, b)) for outs_a, outs_b in zip(after, before, strict=True)
                 for a, b in zip(outs_a, outs_b, strict=True)]
    back = state.apply(apply_args(maps_dir / "base.json", base.content_hash), "apply-identity-back")
    assert back.outcome == "applied", back.reason
    again = [forward(state, s, impl, counters=False) for _, _, s in steps]
    back_same = [bool(torch.equal(a, b)) for outs_a, outs_b in zip(again, before, strict=True)
                 for a, b in zip(outs_a, outs_b, strict=True)]
    back_good, back_total = rows_hold_their_experts(state, geo, device, dtype)
    out = {
        "rows_swapped": result.rows, "steps": [{"tokens": t, "routing": kind} for t, kind, _ in steps],
        "after_apply_vs_fresh_rehome": f"{sum(same)}/{len(same)}",
        "after_apply_vs_before": f"{sum(invariant)}/{len(invariant)}",
        "after_swap_back_vs_before": f"{sum(back_same)}/{len(back_same)}",
        "experts_rows_hold_original_bytes": f"{rows_good}/{rows_total}",
        "after_swap_back_rows_hold_original_bytes": f"{back_good}/{back_total}",
        "note": "'moved' steps route every slot to an expert the swap moved; every (layer, step) output compared "
                "bitwise (torch.equal)",
    }
    say("identity", out)
    return out


def graph_section(state: PinState, geo: dict[str, int], device: torch.device, dtype: torch.dtype, impl: str,
                  maps_dir: Path, base: ExpertMap, target: ExpertMap) -> dict[str, Any]:
    """A forward captured in a CUDA graph at ``base``, replayed after applying ``target``: same bits as the fresh
    re-home with ``target``, and the graph's live cold counter follows the new row map."""
    plan = plan_swap(base, target)
    focus = [list(s.entering) + list(s.leaving) for s in plan.layers]
    step = make_step(geo, 16, 7, device, dtype, focus)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(state, step, impl)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(state, step, impl)

    def replay_cold() -> tuple[list[torch.Tensor], list[int]]:
        for p in state.layers:
            p.cold_counts.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in captured], [int(p.cold_counts) for p in state.layers]

    before, cold_before = replay_cold()
    target_path = maps_dir / "graph_target.json"
    target.save(target_path)
    result = state.apply(apply_args(target_path, target.content_hash), "apply-graph")
    assert result.outcome == "applied", result.reason
    after, cold_after = replay_cold()
    fresh = build_state(geo, target, target_path, device, dtype)
    expected = forward(fresh, step, impl, counters=False)
    release(fresh)
    del fresh

    def cold_selections(emap: ExpertMap) -> list[int]:
        out = []
        for i, lp in enumerate(emap.layers):
            cold = set(lp.cold)
            out.append(sum(1 for e in step.ids[i].reshape(-1).tolist() if e in cold))
        return out

    same = [bool(torch.equal(a, b)) for a, b in zip(after, expected, strict=True)]
    back = state.apply(apply_args(maps_dir / "base.json", base.content_hash), "apply-graph-back")
    assert back.outcome == "applied", back.reason
    out = {
        "replay_after_apply_vs_fresh_rehome": f"{sum(same)}/{len(same)}",
        "replay_after_apply_vs_before": f"{sum(bool(torch.equal(a, b)) for a, b in zip(after, before, strict=True))}"
                                        f"/{len(after)}",
        "cold_selections_before": cold_before, "expected_before": cold_selections(base),
        "cold_selections_after": cold_after, "expected_after": cold_selections(target),
        "cold_counter_follows_row_map": cold_before == cold_selections(base) and cold_after == cold_selections(target),
    }
    say("graph", out)
    return out


def ordering_control(state: PinState, geo: dict[str, int], device: torch.device, dtype: torch.dtype, impl: str,
                     target: ExpertMap, wait: bool) -> dict[str, Any]:
    """Layer 0's swaps to ``target`` issued on a copy stream, then its row map flipped and a forward run on another
    stream, waiting for the copy stream first only when ``wait``. Without the wait the forward reads rows whose
    copies are still queued: its bits must differ from the right answer. Afterwards the copies are complete, the
    state is put back to the map it had (swaps again, in stream order), and checked."""
    active = state.emap
    plan = plan_swap(active, target)
    layer = state.layers[0]
    swap0 = plan.layers[0]
    work = swap._resolve([layer], type(plan)(plan.from_hash, plan.to_hash, (swap0,), plan.expert_bytes))[0]
    # route to the experts entering last: after the flip they point at hot rows (HBM: the forward is quick) whose
    # copies are surely still queued behind the others
    tail = list(swap0.entering[-2 * geo["top_k"]:])
    step = make_step(geo, 8, 11, device, dtype, [tail] * geo["layers"])
    staging = {name: torch.empty((1, *hot.shape[1:]), dtype=hot.dtype, device=device)
               for name, hot, _ in work.tensors}
    # the right answer, and a warm-up so that no kernel compiles while the copies run
    right = forward(state, step, impl, counters=False)[0]
    torch.cuda.synchronize()
    copy_stream, fwd_stream = torch.cuda.Stream(), torch.cuda.Stream()
    t0 = time.perf_counter()
    with torch.cuda.stream(copy_stream):
        for h, c in work.pairs:
            for name, hot, cold in work.tensors:
                swap._swap_row(hot, cold, staging[name], h, c)
        copies_done = torch.cuda.Event(enable_timing=True)
        copies_done.record()
    issued_s = time.perf_counter() - t0
    with torch.cuda.stream(fwd_stream):
        if wait:
            fwd_stream.wait_stream(copy_stream)
        flip = torch.cuda.Event(enable_timing=True)
        flip.record()
        layer.row_map.copy_(work.new_rows)
        out = forward(state, step, impl, counters=False)[0]
        fwd_done = torch.cuda.Event(enable_timing=True)
        fwd_done.record()
    torch.cuda.synchronize()
    forward_before_copies_done = flip.elapsed_time(copies_done) > 0 and fwd_done.elapsed_time(copies_done) > 0
    diverged = not torch.equal(out, right)
    settled = forward(state, step, impl, counters=False)[0]  # copies done now: the new placement, whole
    settled_right = bool(torch.equal(settled, right))
    # put layer 0 back (the swaps are their own inverse), in stream order this time
    for h, c in work.pairs:
        for name, hot, cold in work.tensors:
            swap._swap_row(hot, cold, staging[name], h, c)
    layer.row_map.copy_(work.old_rows)
    torch.cuda.synchronize()
    restored = bool(torch.equal(forward(state, step, impl, counters=False)[0], right))
    out_doc = {"waited_for_copies": wait, "rows_in_flight": len(work.pairs),
               "bytes_in_flight": 2 * len(work.pairs) * target.expert_bytes, "copies_issued_in_s": issued_s,
               "forward_finished_before_copies": forward_before_copies_done, "diverged": diverged,
               "after_copies_settled_right": settled_right, "restored_right": restored}
    say("ordering control", out_doc)
    return out_doc


# ------------------------------------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class RunSetup:
    """Where and how a benchmark runs: bf16 and the grouped Triton experts call on CUDA; fp32 and the loop on the
    CPU (bf16 GEMMs on this CPU are slow; the checks are the same)."""

    device: torch.device
    geo: dict[str, int]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def impl(self) -> str:
        return "triton" if self.cuda else "loop"


def run_setup(device: str | None, geometry: dict[str, int], small: dict[str, int] | None) -> RunSetup:
    """``device`` (default: cuda when available) and the geometry (``small`` when given)."""
    return RunSetup(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")),
                    dict(small if small is not None else geometry))


def result_header(script: str, argv: list[str] | None, run: RunSetup) -> dict[str, Any]:
    """The head of a benchmark's JSON: what ran, where, when, on which geometry."""
    device, geo, dtype = run.device, run.geo, run.dtype
    return {
        "benchmark": script,
        "command": os.environ.get("PINSIDECAR_BENCH_COMMAND", " ".join(["python3", script, *(
            argv if argv is not None else sys.argv[1:])])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if run.cuda else f"CPU ({platform.machine()})",
        "environment": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "geometry": {**geo, "hot": geo["experts"] - geo["cold"], "dtype": str(dtype).replace("torch.", ""),
                     "expert_bytes": expert_bytes(geo, dtype)},
        "impl": run.impl,
    }


def saver(out: Path, result: dict[str, Any]) -> Callable[[], None]:
    """A function that writes ``result`` (as it stands then) to ``out``, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        atomic_write_bytes(out, (json.dumps(result, indent=1, default=float) + "\n").encode())

    return save


def bench_parser(doc: str, out_name: str) -> argparse.ArgumentParser:
    """The options every benchmark here takes: ``--out`` (default under ``$OUT``), ``--small``, ``--device``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
    parser.add_argument("--small", action="store_true", help="small geometry (quick runs, CPU, CI)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "swap_gpu.json")
    parser.add_argument("--reps", type=int, default=None, help="applies per size and direction")
    parser.add_argument("--probe-mib", type=int, default=2048, help="bytes per bandwidth probe copy, MiB")
    args = parser.parse_args(argv)
    started = time.monotonic()
    run = run_setup(args.device, GEOMETRY, SMALL_GEOMETRY if args.small else None)
    device, cuda, geo, dtype, impl = run.device, run.cuda, run.geo, run.dtype, run.impl
    reps = args.reps or (3 if cuda else 1)
    result = result_header("bench/swap_gpu.py", argv, run)
    result["reps"] = reps
    save = saver(Path(args.out), result)

    if cuda:
        result["bandwidth"] = bandwidth_probes(device, args.probe_mib << 20)
        release()  # the probe buffers go back before the layers are built
        say("bandwidth", {k: round(v, 2) for k, v in result["bandwidth"].items() if k != "method"})
        save()
    with tempfile.TemporaryDirectory() as tmp:
        maps_dir = Path(tmp)
        base = random_map(geo, 1, "base", dtype)
        base.save(maps_dir / "base.json")
        say("building", geo)
        t0 = time.monotonic()
        state = build_state(geo, base, maps_dir / "base.json", device, dtype)
        result["build_s"] = round(time.monotonic() - t0, 1)
        result["tier_bytes"] = state.summary["tier_bytes"]
        say("built in", result["build_s"], "s", state.summary["tier_bytes"])
        addresses = [t.data_ptr() for p in state.layers for t in (*p.hot.values(), *p.cold.values(), p.row_map)]
        warm = make_step(geo, 4, 1, device, dtype)
        forward(state, warm, impl)  # compile the kernels before anything is timed
        full = moved_map(base, min(geo["cold"], geo["experts"] - geo["cold"]), seed=99, label="every-cold")

        def section(key: str, fn: Any) -> None:
            """Run one section; a failure is recorded (with its traceback) and the next section still runs."""
            try:
                result[key] = fn()
            except Exception as exc:
                import traceback

                result.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                say("section", key, "failed:", exc)
                release()
            save()

        section("swaps", lambda: timed_applies(state, geo, maps_dir, base, reps, result.get("bandwidth")))
        if cuda:
            section("ordering", lambda: {
                "unordered": ordering_control(state, geo, device, dtype, impl, full, wait=False),
                "ordered": ordering_control(state, geo, device, dtype, impl, full, wait=True)})
        section("identity", lambda: identity_section(state, geo, device, dtype, impl, maps_dir, base, full))
        if cuda:
            section("graph", lambda: graph_section(state, geo, device, dtype, impl, maps_dir, base, full))
        result["addresses_kept"] = addresses == [t.data_ptr() for p in state.layers
                                                 for t in (*p.hot.values(), *p.cold.values(), p.row_map)]
        release(state)
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    summary = {"swaps": [{k: s.get(k) for k in ("rows", "per_row_ms", "per_100_rows_ms", "effective_GBps",
                                                 "link_bound_per_row_ms", "of_link_bound")}
                         for s in result.get("swaps", [])],
               "identity": result.get("identity"), "graph": result.get("graph"), "ordering": result.get("ordering"),
               "addresses_kept": result["addresses_kept"], "bandwidth": result.get("bandwidth"),
               "errors": sorted(result.get("errors", {}))}
    print(json.dumps(summary, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
