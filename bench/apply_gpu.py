"""Remap in place under serving: how long decode steps stall while an apply moves 800 expert rows, batched vs not.

A stepping thread runs decode steps of 16 tokens (16 streams, one token each per step) through every layer, back
to back, each under pin mode's step guard (:meth:`pinsidecar_hook.pin.PinState.step_guard`, what the worker
holds around ``execute_model``), and records when each step completes. Meanwhile the production apply
(:meth:`PinState.apply`: map file, checks, plan, batches) swaps every hot row of every layer for a cold one.
The gap between two step completions is the gap between two tokens on every stream.

Layers are at the reference row geometry (hidden 5120, intermediate 2304, bf16: 70.8 MB per expert), sized for one
H200: 8 layers of 100 hot rows (56.6 GB of HBM) and 100 cold rows (56.6 GB of pinned host memory), so an apply
between two maps with disjoint hot sets moves 800 rows (113 GB across the host link, both ways). The experts are
the torch reference split with the grouped Triton experts call, as in ``swap_gpu.py`` (whose helpers this uses).
The steps route each token's top-k to experts hot *at that step* (read from the row maps under the guard): the
hot tier serving the traffic, as a good map makes it, so a step's time is HBM time and the stall measured is the
apply's, not cold reads competing for the link.

Two phases, one after the other on the same state: the batched apply (the hook's default hold budget, or
``--hold-ms``) from map A to map B, then the old behaviour (one hold, budget infinite) from B back to A. Each
reports the longest gap between steps during the apply, the median step outside it, the apply's seconds, the
longest hold, batches, bytes moved and link bandwidth against the H200's 55 GB/s. After each, bit identity: the
outputs of fixed steps (random routing over all experts) against those before the first apply (the state was a
fresh re-home with A, and the split is bit-identical for any placement), the first ``--fresh-layers`` layers
against a fresh re-home with B, and every expert's rows against its original bytes.

``--gil-load N`` adds N threads that run pure Python while every phase runs, as an engine's socket threads do
when they serialize each step's outputs, and a third phase to each round: the batched apply again under Python's
own GIL switch interval (5 ms), where the hook lowers it to ``swap.SWITCH_INTERVAL_S`` while an apply runs
(``pinsidecar_hook.swap.batches``, "The GIL"). The two batched phases side by side show what that buys.

``--async-steps`` leaves each step running on the device past its guard, as vLLM's asynchronous scheduling does
(an apply batch that takes the lock then finds the last step's kernels still running), and adds a phase to each
round: the batched apply ordered by host syncs under the lock (``ordering="host"``, the drain the stream order
removes; ``pinsidecar_hook.swap.batches``, "Ordering"). Every phase also recomputes the steps it served during the
apply (half-applied placements) over the final one: ``mid_apply_identity`` must say identical.

    python3 bench/apply_gpu.py --out bench/results/apply_h200.json      # the H200: about 60-90 s
    python3 bench/apply_gpu.py --reps 3 --gil-load 2   # the GIL's share of a batch, interleaved
    python3 bench/apply_gpu.py --reps 3 --async-steps   # stream order vs host syncs, steps left running
    python3 bench/apply_gpu.py --small --device cpu --hold-ms 0 --out /tmp/a.json  # anywhere (CI: logic only)

On the CPU both tiers are host memory and the times mean nothing; CI checks that it runs, that the batched phase
has many batches with steps between them and the other one, and that every identity holds.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pinsidecar_hook import swap
from pinsidecar_hook.contract import ExpertMap, apply_args
from pinsidecar_hook.pin import PinState

if __name__ == "__main__" and not __package__:  # run as a file: the repo root on the path, so that the
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # siblings import as the `bench` package
from bench.gpu_lane import spread
from bench.swap_gpu import (
    Step,
    bench_parser,
    build_state,
    forward,
    make_step,
    moved_map,
    random_map,
    release,
    result_header,
    rows_hold_their_experts,
    run_setup,
    saver,
    say,
)

GEOMETRY = {"experts": 200, "top_k": 6, "hidden": 5120, "intermediate": 2304, "layers": 8, "cold": 100}
SMALL_GEOMETRY = {"experts": 16, "top_k": 4, "hidden": 64, "intermediate": 32, "layers": 2, "cold": 8}
TOKENS = 16  # decode streams: one token each per step
LINK_GBPS = 55.2  # the H200's pinned host link, each way (bench/results/swap_h200.json)
GAP_TARGET_MS = 50.0


# ------------------------------------------------------------------------------------------------------ stepping


def hot_experts(state: PinState) -> list[torch.Tensor]:
    """Per layer, the experts in the hot rows now (row order), on the row map's device: no host sync."""
    out = []
    for p in state.layers:
        inv = torch.empty(p.row_map.numel(), dtype=torch.int64, device=p.row_map.device)
        inv[p.row_map.to(torch.int64)] = torch.arange(p.row_map.numel(), device=p.row_map.device)
        out.append(inv[: p.hot_rows])
    return out


KEEP_STEPS = 256  # steps whose outputs a phase keeps, to recompute after the apply (the mid-apply identity)


@dataclass
class Stepper:
    """Decode steps back to back under the state's step guard, each routed to the experts hot at that step; the
    completion time of each step. ``async_steps=False``: after its kernels, a device sync inside the guard (as
    vLLM's sampled tokens without asynchronous scheduling). True: the guard is released as soon as the step is
    queued, and the step is waited for after the next one is queued (as vLLM's asynchronous scheduling does), so
    an apply batch that takes the lock finds the last step still running on the device. ``keep``: the ids and
    outputs of the steps since it was set (at most :data:`KEEP_STEPS`), for :meth:`mid_apply_identity`."""

    state: PinState
    geo: dict[str, int]
    device: torch.device
    dtype: torch.dtype
    impl: str
    async_steps: bool = False
    keep: bool = False
    kept: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        hot = self.geo["experts"] - self.geo["cold"]
        base = make_step(self.geo, TOKENS, 5, self.device, self.dtype, focus=[list(range(hot))] * self.geo["layers"])
        self.slots, self.template = base.ids, base  # slot ranks in 0..H-1, k distinct per token
        self.thread = threading.Thread(target=self._run, name="stepper", daemon=True)

    def _step(self, previous: Any) -> Any:
        """One step; returns its end event when it is left running (``async_steps``), after waiting for
        ``previous``."""
        cuda = self.device.type == "cuda"
        with self.state.step_guard():
            ids = torch.stack([hot[ranks] for hot, ranks in zip(hot_experts(self.state), self.slots, strict=True)])
            outs = forward(self.state, Step(self.template.x, ids, self.template.weights), self.impl, counters=False)
            if self.keep and len(self.kept) < KEEP_STEPS:
                self.kept.append((ids, outs))
            end = None
            if cuda and self.async_steps:
                end = torch.cuda.Event()
                end.record()
            elif cuda:
                torch.cuda.synchronize(self.device)
        if end is None:
            self.done_at.append(time.perf_counter())
            return None
        if previous is not None:
            previous.synchronize()
            self.done_at.append(time.perf_counter())
        return end

    def mid_apply_identity(self) -> str:
        """The kept steps (routed by the row maps *during* the apply, so over half-applied placements, their copies
        ordered by the apply's "Ordering") recomputed now, over the final placement: the same bits, or what
        differs. A batch's copies landing after a step that read its rows would show here."""
        if not self.kept:
            return "no step kept"
        for n, (ids, outs) in enumerate(self.kept):
            again = forward(self.state, Step(self.template.x, ids, self.template.weights), self.impl, counters=False)
            for layer, (a, b) in enumerate(zip(outs, again, strict=True)):
                if not torch.equal(a, b):
                    return f"step {n} of {len(self.kept)} kept, layer {layer}: outputs differ"
        return f"identical ({len(self.kept)} steps)"

    def _run(self) -> None:
        try:
            previous = None
            while not self.stop.is_set():
                previous = self._step(previous)
            if previous is not None:
                previous.synchronize()
                self.done_at.append(time.perf_counter())
        except BaseException as exc:  # reported, not swallowed: the phase's numbers would be meaningless
            self.error.append(exc)

    def __enter__(self) -> Stepper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        if self.error:
            raise RuntimeError(f"the stepping thread failed: {self.error[0]!r}") from self.error[0]


def gap_stats(done_at: list[float], start: float, end: float) -> dict[str, Any]:
    """Gaps between step completions: the longest one overlapping [start, end] (the apply), the median of those
    wholly before it."""
    gaps = list(itertools.pairwise(done_at))
    during = [b - a for a, b in gaps if b >= start and a <= end]
    before = [b - a for a, b in gaps if b < start]
    return {"steps_during": sum(1 for t in done_at if start <= t <= end),
            "longest_gap_ms": max(during, default=end - start) * 1e3,
            "gaps_over_target": sum(1 for g in during if g * 1e3 > GAP_TARGET_MS),
            "median_step_ms_outside": statistics.median(before) * 1e3 if before else None,
            "steps_before": len(before)}


GIL_BUSY_S, GIL_IDLE_S = 0.001, 0.002  # each load thread: 1 ms of pure Python, then 2 ms asleep


class GilLoad:
    """``threads`` threads that each run pure Python for :data:`GIL_BUSY_S` (no torch call: nothing that lets the
    GIL go on its own), then sleep :data:`GIL_IDLE_S`, until the block ends: the stand-in for an engine's socket
    threads serializing each step's outputs, which the apply's thread shares the GIL with. Not busy all the time:
    on 2026-12-03 two threads that never slept made every step of this benchmark's stepper (hundreds of torch
    calls, each a GIL handoff) take 6.3 s, which no engine does (``apply_h200_gil_load_2026-12-03.log``)."""

    def __init__(self, threads: int) -> None:
        self.stop = threading.Event()
        self.loops = 0
        self.threads = [threading.Thread(target=self._spin, name=f"gil-load-{i}", daemon=True)
                        for i in range(threads)]

    def _spin(self) -> None:
        payload = [{"id": i, "text": "x" * 16, "logprobs": [0.5] * 8} for i in range(64)]
        while not self.stop.is_set():
            until = time.perf_counter() + GIL_BUSY_S
            while time.perf_counter() < until:
                total = 0
                for item in payload:  # bytecode, not one C call: the interpreter may be asked to switch here
                    total += len(item["text"]) + sum(item["logprobs"])
                self.loops += 1
            time.sleep(GIL_IDLE_S)

    def __enter__(self) -> GilLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


# ------------------------------------------------------------------------------------------------------ checks


def fixed_steps(geo: dict[str, int], device: torch.device, dtype: torch.dtype) -> list[Step]:
    """Routing over all experts (hot and cold), the same before and after: the identity checks' inputs."""
    return [make_step(geo, t, 300 + t, device, dtype) for t in (1, TOKENS)]


def same_outputs(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> str:
    same = [bool(torch.equal(x, y)) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return f"{sum(same)}/{len(same)}"


def one_layer(emap: ExpertMap, layer_id: int) -> ExpertMap:
    """``emap`` restricted to one layer: a fresh re-home of one layer at a time, never a second copy of a tier."""
    return ExpertMap(layer_ids=(layer_id,), num_experts=emap.num_experts, top_k=emap.top_k, hot_rows=emap.hot_rows,
                     layers=(emap.layer(layer_id),), label=f"{emap.label}-{layer_id}", expert_bytes=emap.expert_bytes)


def vs_fresh_rehome(state: PinState, target: ExpertMap, path: Path, steps: list[Step], layers: int,
                    device: torch.device, dtype: torch.dtype, impl: str, geo: dict[str, int]) -> str:
    """The first ``layers`` layers' outputs against a fresh re-home of that layer alone with ``target``."""
    same = []
    got = [forward(state, s, impl, counters=False) for s in steps]
    for i, p in enumerate(state.layers[:layers]):
        fresh = build_state({**geo, "layers": 1}, one_layer(target, p.layer_id), path, device, dtype)
        for s, outs in zip(steps, got, strict=True):
            want = forward(fresh, Step(s.x[i : i + 1], s.ids[i : i + 1], s.weights[i : i + 1]), impl,
                           counters=False)[0]
            same.append(bool(torch.equal(outs[i], want)))
        release(fresh)
        del fresh
    return f"{sum(same)}/{len(same)}"


# ------------------------------------------------------------------------------------------------------ phases


def phase(state: PinState, stepper_args: dict[str, Any], target: ExpertMap, path: Path, hold_budget_s: float,
          warm_s: float, gil_load: int = 0, switch_interval_s: float | None = swap.SWITCH_INTERVAL_S,
          ordering: str = "stream") -> dict[str, Any]:
    """Serve with the stepping thread (and ``gil_load`` busy threads), apply ``target`` in the middle under
    ``switch_interval_s`` (None: Python's) and ``ordering``, keep serving a little; the figures, and the identity
    of the steps served during the apply."""
    with GilLoad(gil_load), Stepper(state, **stepper_args) as stepper:
        time.sleep(warm_s)
        deadline = time.monotonic() + 60
        while len(stepper.done_at) < 4 and time.monotonic() < deadline:  # steps before, to compare (slow under load)
            time.sleep(0.01)
        start = time.perf_counter()
        stepper.keep = True
        result = state.apply(apply_args(path, target.content_hash), f"apply-{target.label}",
                             hold_budget_s=hold_budget_s, switch_interval_s=switch_interval_s, ordering=ordering)
        stepper.keep = False
        end = time.perf_counter()
        time.sleep(warm_s / 2)
    if result.outcome != "applied":
        raise RuntimeError(f"apply {target.label}: {result.outcome}: {result.reason}")
    out = {"hold_budget_ms": None if math.isinf(hold_budget_s) else hold_budget_s * 1e3,
           "switch_interval_ms": None if switch_interval_s is None else switch_interval_s * 1e3,
           "ordering": ordering, "stream_batches": result.stream_batches, "async_steps": stepper.async_steps,
           "gil_load_threads": gil_load, "rows": result.rows,
           "bytes_moved": result.bytes_moved, "batches": result.batches, "hold_max_ms": result.hold_max_s * 1e3,
           "drain_max_ms": result.drain_max_s * 1e3, "device_max_ms": result.device_max_s * 1e3,
           "mid_apply_identity": stepper.mid_apply_identity(),
           "held_s": result.seconds, "apply_s": result.wall_s, "link_GBps": result.link_GBps,
           "of_link": result.link_GBps / LINK_GBPS, **gap_stats(stepper.done_at, start, end)}
    say("phase", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()})
    return out


SPREAD = ("longest_gap_ms", "hold_max_ms", "drain_max_ms", "device_max_ms", "apply_s", "held_s", "link_GBps",
          "median_step_ms_outside")


def _spread(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's figures over the interleaved rounds: median, min and max (GPU figures move 20-30 % between
    runs; one round is a sample, not a figure)."""
    return {name: {k: spread([r[name][k] for r in rounds]) for k in SPREAD} for name in rounds[0]}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "apply_gpu.json")
    parser.add_argument("--hold-ms", type=float, default=swap.HOLD_BUDGET_S * 1e3,
                        help="the batched phase's hold budget (default: the hook's)")
    parser.add_argument("--fresh-layers", type=int, default=2, help="layers checked against a fresh re-home")
    parser.add_argument("--reps", type=int, default=1,
                        help="rounds of (batched, one hold), interleaved; the figures' median, min and max")
    parser.add_argument("--gil-load", type=int, default=0,
                        help="busy Python threads during every phase, and a batched phase under Python's own GIL "
                             "switch interval in each round")
    parser.add_argument("--async-steps", action="store_true",
                        help="leave each step running past its guard, as vLLM's asynchronous scheduling does, and "
                             "add a batched phase ordered by host syncs to each round (the stream order's baseline)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    run = run_setup(args.device, GEOMETRY, SMALL_GEOMETRY if args.small else None)
    device, cuda, geo, dtype, impl = run.device, run.cuda, run.geo, run.dtype, run.impl
    warm_s = 1.0 if cuda else 0.2
    result = result_header("bench/apply_gpu.py", argv, run)
    result["geometry"]["tokens_per_step"] = TOKENS
    result.update(staging_bytes=swap.STAGING_BYTES, gap_target_ms=GAP_TARGET_MS, link_GBps=LINK_GBPS,
                  gil_load_threads=args.gil_load, python_switch_interval_ms=sys.getswitchinterval() * 1e3)
    save = saver(Path(args.out), result)

    with tempfile.TemporaryDirectory() as tmp:
        maps_dir = Path(tmp)
        base = random_map(geo, 1, "a", dtype)
        target = moved_map(base, min(geo["cold"], geo["experts"] - geo["cold"]), seed=2, label="b")
        paths = {m.label: maps_dir / f"{m.label}.json" for m in (base, target)}
        for m in (base, target):
            m.save(paths[m.label])
        say("building", geo)
        t0 = time.monotonic()
        state = build_state(geo, base, paths["a"], device, dtype)
        result["build_s"] = round(time.monotonic() - t0, 1)
        result["tier_bytes"] = state.summary["tier_bytes"]
        say("built in", result["build_s"], "s", state.summary["tier_bytes"])
        steps = fixed_steps(geo, device, dtype)
        before = [forward(state, s, impl, counters=False) for s in steps]  # also compiles the kernels
        stepper_args = {"geo": geo, "device": device, "dtype": dtype, "impl": impl, "async_steps": args.async_steps}

        rounds: list[dict[str, Any]] = []
        for i in range(max(1, args.reps)):  # interleaved: batched a -> b, then one hold b -> a, then again
            batched = phase(state, stepper_args, target, paths["b"], args.hold_ms / 1e3, warm_s, args.gil_load)
            batched["identity"] = {"vs_before": same_outputs([forward(state, s, impl, counters=False) for s in steps],
                                                             before)}
            if i == 0:  # the costly checks once: a fresh re-home pins its own copy of the layers
                batched["identity"].update(
                    vs_fresh_rehome=vs_fresh_rehome(state, target, paths["b"], steps, args.fresh_layers, device,
                                                    dtype, impl, geo),
                    rows_hold_original_bytes="{}/{}".format(*rows_hold_their_experts(state, geo, device, dtype)))
            say("identity", batched["identity"])
            unbatched = phase(state, stepper_args, base, paths["a"], math.inf, warm_s, args.gil_load)
            unbatched["identity"] = {
                "vs_before": same_outputs([forward(state, s, impl, counters=False) for s in steps], before),
                "rows_hold_original_bytes": "{}/{}".format(*rows_hold_their_experts(state, geo, device, dtype))}
            say("identity", unbatched["identity"])
            this = {"batched": batched, "unbatched": unbatched}
            if args.gil_load:  # the same batched apply under Python's switch interval, then back in one hold
                this["batched_python_switch"] = phase(state, stepper_args, target, paths["b"], args.hold_ms / 1e3,
                                                      warm_s, args.gil_load, switch_interval_s=None)
                phase(state, stepper_args, base, paths["a"], math.inf, warm_s, args.gil_load)
                this["batched_python_switch"]["identity"] = {"vs_before": same_outputs(
                    [forward(state, s, impl, counters=False) for s in steps], before)}
            if args.async_steps:  # the same batched apply ordered by host syncs under the lock, then back
                this["batched_host_order"] = phase(state, stepper_args, target, paths["b"], args.hold_ms / 1e3,
                                                   warm_s, args.gil_load, ordering="host")
                phase(state, stepper_args, base, paths["a"], math.inf, warm_s, args.gil_load)
                this["batched_host_order"]["identity"] = {"vs_before": same_outputs(
                    [forward(state, s, impl, counters=False) for s in steps], before)}
            rounds.append(this)
            result.update(batched=rounds[0]["batched"], unbatched=rounds[0]["unbatched"], rounds=rounds,
                          spread=_spread(rounds))
            save()
        release(state)
    worst_gap = max(r["batched"]["longest_gap_ms"] for r in result["rounds"])
    result["target_met"] = result["batched"]["rows"] >= 800 and worst_gap <= GAP_TARGET_MS
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    print(json.dumps({k: result[k] for k in ("spread", "target_met", "seconds")}, indent=1,
                     default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
