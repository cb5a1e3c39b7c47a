"""The in-place apply in bounded batches: swap pairs of rows under the step lock, a step between two batches.

Part of the in-place apply: :mod:`pinsidecar_hook.swap.apply` serves the request and checks everything that can refuse,
:mod:`pinsidecar_hook.swap.rows` holds what one pair swap is made of (the plan resolved to rows, the copies, the
swap-back). This module carries the plan out on the live tensors without stalling serving: the staging and the
prefetch on a side stream, the batches that each hold the step lock for a bounded time, the :class:`StepClock`
that makes steps and batches alternate, the row-map flips, and the roll-back over every batch on a failure
(:func:`swap_layers`, :class:`SwapStats`, :class:`SwapFailed`).

**Batches, and why a half-applied remap is right.** A pair swap is self-contained: once its copies have landed,
flipping the row-map entries of its two experts (``e_in -> h``, ``e_out -> H + c``) and nothing else leaves every
expert in exactly one row that holds its bytes: a valid placement, and the split is bit-identical to the unsplit
call for *any* placement. So the apply may stop after any pair, and a step between two batches serves a
half-applied remap with the reference bits. One batch: take the lock (saying so: the :class:`StepClock` lets
a batch that asks go before the next step), swap pairs until the next would overrun the budget (at least one per
batch), write the row-map entries of the batch's pairs and run the layer's refreshers, release (how the copies
are ordered against the steps: "Ordering"). Then prefetch the next batch (overlapping the step) and wait until
a step has ended, or :data:`IDLE_S` (an idle engine: no step is coming). Python locks are not fair, hence the
clock: without it a worker could take the lock back batch after batch, or the apply could. The served map's name
(``on_done``: the stats' ``map_hash``) changes after the last batch, under its lock: between batches the stats
still name the old map while some rows already follow the new one, as close as a name can get to a mix that
serves the reference bits. The answer reports the batches, the longest hold, the seconds held in all and in
wall time, and the link bandwidth (bytes moved over the time spent copying them, prefetch included).

**Ordering.** vLLM executes asynchronously: when ``execute_model`` returns, the step's kernels may still run, and the
copies of a batch must come after them (they read the rows being swapped) and before the next step's. Two ways,
``ordering``:

- ``"stream"`` (CUDA, asked for; not yet the default, see below): each step notes the stream it runs on
  (:class:`StepClock`), and a batch queues its copies, its row-map entries (from pinned host memory: a pageable copy
  would sync) and the refreshers on that stream, after the last step's kernels *in stream order*, records an event and
  releases the lock without waiting. Every later step makes its own stream wait for that event on the device (a no-op
  once it is done, the ordering should it run on another stream). The host never waits under the lock, so the next
  step is prepared while the batch runs on the device. After the lock goes, the apply waits for the event and learns
  from the batch's device time what one pair costs; the next batch queues what the budget fits of device time (the
  first batch one pair). So the bound a step sees is the batch's device time (``device_s``).
- ``"host"`` (the default, and what ``"stream"`` falls back to on the CPU, several devices, or before any step was
  seen): under the lock each batch first synchronizes the device, then issues its copies and its row-map entries on
  the current stream, each entry after its pair's copies, and synchronizes again before it releases the lock. The
  first sync is the ``drains``: on the H200 at 16 streams it was 59.1 ms of the longest 60.0 ms hold
  (``bench/results/heal_h200_c16_2026-12-03.json``), the reason for the stream order. The budget bounds the copies
  after the drain, not the drain (:meth:`_Apply._full`), so a hold is one running step plus the budget.

Why the stream order is not the default: on the H200 at 16 streams (2026-12-03, one run each on two machines, not
interleaved: ``bench/results/heal_h200_c16_stream_2026-12-03.json`` against ``heal_h200_c16_2026-12-03.json``) it cut
the longest hold from 60.0 to 9.5 ms and the drain from 59.1 to 0.2 ms, but the longest gap inside one stream in the
remap's applying stage rose from 94 ms to 997 ms, a cause not yet found. Until it is, ``"host"`` serves.

Either way a row map flipped before its copies landed would send tokens to rows that still hold the old
expert (the negative controls, ``tests/test_swap_batched.py`` and the GPU benchmark, show that such an order
diverges). Backends that derive tensors from the row map (``triton_experts``' tier maps) register a refresher on
the layer (``row_map_listeners``), run right after each flip, on the same stream, writing their tensors in place
too. The prefetch stream is made to wait for the engine's stream before it reuses a slot.

**Failure.** An exception anywhere in the swap (a copy, a row-map flip, a refresher, a prefetch or a wait between
batches) swaps every pair already swapped back, over all batches, newest first (a swap is its own inverse),
restores every written row map, synchronizes, and answers ``failed`` with the exception: the old map serves
whole, never a mix. Under a batch's lock the roll-back runs before the lock goes; outside one it takes the lock
first. (Everything that can be refused is checked before, touching nothing: :mod:`pinsidecar_hook.swap.apply`.)

**The GIL.** Every torch call releases the GIL and takes it back, and a batch makes a dozen per pair (the copies,
a sync). Taking it back can wait until the thread holding it is made to let go, which CPython does after
``sys.getswitchinterval()`` (5 ms by default). While a batch holds the step lock every stream waits for such
handoffs, and a busy engine has other threads that want the GIL (the engine core's socket threads serialize
every step's outputs). So an apply lowers the switch interval to :data:`SWITCH_INTERVAL_S` while it runs and puts
the old value back after. The interval belongs to the process, so the other threads switch more often for
those seconds too. It is a cheap guard, not a measured cure. It was added when a 16-stream apply on the H200
held 67.6 ms against its 20 ms budget (``bench/results/heal_h200_c16_2026-12-02.json``). The next run
(``heal_h200_c16_2026-12-03.json``, with the guard) showed where such a hold goes: the drain ("Ordering"),
not the GIL. The guard's own effect has not been measured in isolation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from pinsidecar_hook.contract import APPLY_ORDERINGS, SwapPlan
from pinsidecar_hook.swap.rows import SwapLayer, _LayerWork, _resolve, _roll_back, _row_bytes, _swap_row

__all__ = ["HOLD_BUDGET_S", "IDLE_S", "ORDERING", "ORDERINGS", "STAGING_BYTES", "SWITCH_INTERVAL_S", "StepClock",
           "SwapFailed", "SwapStats", "swap_layers"]

log = logging.getLogger("pinsidecar_hook")

HOLD_BUDGET_S = 0.020  # one batch holds the step lock about this long at most (at least one pair per batch)
STAGING_BYTES = 512 << 20  # prefetch slots in HBM per apply (7 pairs at 70.8 MB/expert); never a tier's copy
IDLE_S = 0.008  # after a batch, wait this long for a step to end before taking the next (the engine may be idle)
SWITCH_INTERVAL_S = 0.0002  # the GIL switch interval while an apply runs (module docstring, "The GIL")
ORDERINGS = APPLY_ORDERINGS  # how a batch is ordered against the steps (module docstring, "Ordering")
ORDERING = "host"  # the default (module docstring, "Ordering": why not "stream"); [remap] apply_ordering picks


@contextlib.contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` for the block, the old value back after (None: leave it alone)."""
    if seconds is None:
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


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
    drains: list[float] = field(default_factory=list)  # per batch, its first sync: the last step's kernels ending
    device_s: list[float] = field(default_factory=list)  # per batch, the device time of its copies and flips
    stream_batches: int = 0  # batches ordered on the engine's stream, not by host syncs ("Ordering")
    hold_budget_s: float = 0.0
    switch_interval_s: float = 0.0  # the GIL switch interval the apply ran under (module docstring, "The GIL")
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
    def device_max_s(self) -> float:
        """The longest batch on the device: what a step enqueued behind a stream-ordered batch waits there."""
        return max(self.device_s, default=0.0)

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
        # CUDA only ("Ordering" in the module docstring): the stream the last step ran on, and the end event of the
        # last stream-ordered batch, which every step makes its own stream wait for on the device.
        self.stream: Any = None
        self.pending: Any = None

    def _on_device(self) -> None:
        """Under the lock, at a step's start: note its stream, and order it after a batch still on the device."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()) or torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream()
        self.stream = current
        pending = self.pending
        if pending is not None:
            current.wait_event(pending)  # a no-op once the event is done; the ordering if the stream is another

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
                if depth == 0:
                    self._on_device()
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
                 fail_after_layers: int | None, switch_interval_s: float | None = SWITCH_INTERVAL_S,
                 ordering: str = ORDERING) -> None:
        if ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
        self.work, self.lock, self.clock = work, lock, clock
        self.budget, self.idle_s, self.switch_interval_s = hold_budget_s, idle_s, switch_interval_s
        self.ordering = ordering
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
        # The last stream-ordered batch still to be awaited (outside the lock): its events, pairs, and what its
        # flips copied from (pinned host tensors, alive until the copies have run).
        self._in_flight: tuple[Any, Any, dict[bool, int]] | None = None
        self._keep: list[torch.Tensor] = []
        self._on_stream = False  # the batch under way is stream-ordered

    # ------------------------------------------------------------------------------------------ helpers

    def _sync(self) -> None:
        for dev in self.devices:
            torch.cuda.synchronize(dev)

    def _drain(self) -> None:
        """A host-ordered batch's first sync: wait for the step still running on the device (its own method so
        that the tests can make it long, as a busy engine's step is)."""
        self._sync()

    def _engine_stream(self) -> Any:
        """The stream to order this batch on ("Ordering"), or None: order by host syncs (the CPU, several devices,
        no step seen yet, or ``ordering="host"``)."""
        if self.ordering != "stream" or self.clock is None or len(self.devices) != 1:
            return None
        stream = self.clock.stream
        return stream if stream is not None and stream.device in self.devices else None

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
            engine = self._engine_stream()
            for dev, stream in self.side.items():
                stream.wait_stream(torch.cuda.current_stream(dev))  # the slots' last readers (the last batch)
                if engine is not None:
                    stream.wait_stream(engine)
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
            rows = torch.tensor(entry.current, dtype=row_map.dtype)
            if self._on_stream:  # pinned, so the copy is queued, not waited for (a pageable one syncs the stream)
                rows = rows.pin_memory()
                self._keep.append(rows)
            row_map.copy_(rows, non_blocking=self._on_stream)
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
        """A layer's last pair is swapped: flip what is pending (so the layer is whole), then the injected faults."""
        self._flip(unflipped)
        unflipped.clear()
        self.stats.layers += 1
        if pair.entry is self.work[0] and self.stall_s:
            self._sync()
            log.warning("pinsidecar pin: stall_s=%s: holding the step lock mid-apply (fault injection)", self.stall_s)
            time.sleep(self.stall_s)
        if self.fail_after_layers is not None and self.stats.layers == self.fail_after_layers:
            raise RuntimeError(f"fail_after_layers={self.fail_after_layers}: failing after {self.stats.layers} "
                               "layer(s) (fault injection)")

    def _batch(self, on_done: Callable[[], None] | None, *, flip_first: bool = False) -> None:
        """Take the lock, swap pairs until the hold budget is spent (at least one), flip their row map entries,
        and (after the last pair) record the candidate as served; roll back before releasing on failure. Ordered
        on the engine's stream when there is one (queued, not waited for: :meth:`_await_batch` does that after the
        lock goes), else by host syncs ("Ordering"). ``flip_first`` (tests only: the negative control) flips each
        pair's entries *before* its copies."""
        asked = time.perf_counter()
        with self._hold():
            locked = time.perf_counter()
            self.stats.lock_wait_s += locked - asked
            self.stats.batch_steps.append(self.clock.steps if self.clock is not None else 0)
            engine = self._engine_stream()
            self._on_stream = engine is not None
            try:
                with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                    self._batch_body(on_done, locked, engine, flip_first)
            finally:
                self.stats.holds.append(time.perf_counter() - locked)
                self.mark = self.clock.steps if self.clock is not None else 0
            self.prefetched = 0

    def _batch_body(self, on_done: Callable[[], None] | None, locked: float, engine: Any, flip_first: bool) -> None:
        """One batch under the lock (on ``engine``, the current stream, when stream-ordered)."""
        try:
            start = None
            if engine is None:
                self._drain()  # the previous step's kernels may still be running (vLLM executes asynchronously)
            else:
                start = torch.cuda.Event(enable_timing=True)
                start.record(engine)  # after the last step's kernels, in stream order: nothing to wait for here
            drained = time.perf_counter()
            self.stats.drains.append(drained - locked)
            if self.fail_after_layers == 0:
                raise RuntimeError("fail_after_layers=0: failing before the first layer (fault injection)")
            unflipped: list[_Pair] = []
            kinds = {True: 0, False: 0}  # pairs of this batch, prefetched or not
            slot, queued, copies = 0, 0.0, 0.0
            while self.next < len(self.pairs):
                prefetched = slot < self.prefetched
                estimate = self._estimate(prefetched)
                if slot and self._full(time.perf_counter() - drained, queued, estimate):
                    break
                pair = self.pairs[self.next]
                t0 = time.perf_counter()
                if flip_first:
                    self._flip([pair])
                self._swap_pair(pair, slot if prefetched else None)
                if engine is None:
                    self._sync()
                    self.pair_s[prefetched] = time.perf_counter() - t0
                    copies += self.pair_s[prefetched]
                else:
                    queued += estimate
                kinds[prefetched] += 1
                self.next += 1
                slot += 1
                unflipped.append(pair)
                if pair.last_of_layer:
                    self._layer_done(pair, unflipped)
            self._flip(unflipped)
            if engine is None:
                self._sync()
                self.stats.copy_s += copies
                self.stats.device_s.append(copies)
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record(engine)
                self.clock.pending = end  # every step from now on waits for it on the device (StepClock._on_device)
                self._in_flight = (start, end, kinds)
                self.stats.stream_batches += 1
            if self.next == len(self.pairs) and on_done is not None:
                on_done()
        except BaseException:
            self.rolled_back = _roll_back(self.done, self.flipped)  # on this stream, then a device sync
            self._in_flight, self._keep = None, []
            raise

    def _full(self, held: float, queued: float, estimate: float) -> bool:
        """Whether one more pair (``estimate``) would overrun the budget, ``held`` seconds of copies into the hold
        (after the drain). Ordered by host syncs the copies under the lock are the bound; stream-ordered it is the
        device time queued (``queued``), and with none measured yet (the first batch) one pair is the batch.

        The drain is not charged to the budget: it waits for a step that is running anyway, and it is as long
        whether the batch then copies one pair or twenty. Charged, it made every batch one pair once a step took
        longer than the budget: on an H100 under 16 streams, steps on a map with most selections cold took up
        to 0.25 s, and a 1024-row apply ran as 997 one-pair batches over 194 s
        (``bench/results/apply_engine_wide_h100_partial_2026-12-05.json``)."""
        if not self._on_stream:
            return held + estimate > self.budget
        if math.isinf(self.budget):
            return False
        return not estimate or max(held, queued) + estimate > self.budget

    def _await_batch(self) -> None:
        """Outside the lock: wait until the last stream-ordered batch ran on the device, and learn from its time
        what one pair costs there (the next batch's budget)."""
        if self._in_flight is None:
            return
        start, end, kinds = self._in_flight
        end.synchronize()
        device_s = start.elapsed_time(end) / 1e3
        self.stats.device_s.append(device_s)
        self.stats.copy_s += device_s
        pairs = kinds[True] + kinds[False]
        if pairs:  # a pair not prefetched costs about twice one that was (both rows cross the link)
            self.pair_s[True] = device_s / (kinds[True] + 2 * kinds[False])
            self.pair_s[False] = 2 * self.pair_s[True]
        self._in_flight, self._keep = None, []

    # ------------------------------------------------------------------------------------------ the whole

    def run(self, on_done: Callable[[], None] | None, *, flip_first: bool = False) -> SwapStats:
        """Every batch, a step between each two; :class:`SwapFailed` after rolling everything back."""
        started = time.perf_counter()
        first_steps = self.clock.steps if self.clock is not None else 0
        try:
            with torch.inference_mode(), _switch_interval(self.switch_interval_s):
                self.stats.switch_interval_s = sys.getswitchinterval()
                # inference_mode: the hook's tensors may be inference tensors (vLLM builds models under it), which
                # may only be written inside it; normal tensors may be written there too.
                self._prefetch()
                while True:
                    self._await_prefetch()
                    self._batch(on_done, flip_first=flip_first)
                    self._await_batch()
                    if self.next == len(self.pairs):
                        break
                    self._prefetch()  # overlaps the step that runs now
                    if self.clock is not None:
                        self.clock.wait_for_step(self.mark, self.idle_s)
        except BaseException as exc:
            if self.rolled_back is None:  # raised outside the lock (a prefetch, a wait): roll back under it
                with self._hold(), torch.inference_mode():
                    self._sync()  # a stream-ordered batch may still run on the device: after it, on any stream
                    self.rolled_back = _roll_back(self.done, self.flipped)
                    self._in_flight, self._keep = None, []
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
        if self.clock is not None and self._in_flight is None and st.stream_batches:
            self.clock.pending = None  # every batch ran on the device: no step needs to wait for one


def swap_layers(layers: Sequence[SwapLayer], plan: SwapPlan, lock: AbstractContextManager[Any], *,
                stall_s: float | None = None, fail_after_layers: int | None = None,
                on_done: Callable[[], None] | None = None, clock: StepClock | None = None,
                hold_budget_s: float = HOLD_BUDGET_S, staging_bytes: int = STAGING_BYTES,
                idle_s: float = IDLE_S, switch_interval_s: float | None = SWITCH_INTERVAL_S,
                ordering: str = ORDERING) -> SwapStats:
    """Carry out ``plan`` on ``layers`` in batches, each under ``lock`` (the step lock) for at most about
    ``hold_budget_s`` (at least one pair; ``math.inf``: one batch, the old behaviour), with a step between two
    batches when ``clock`` (the steps' :class:`StepClock`) is given, waiting at most ``idle_s`` for one. Each
    batch: the copies, then its pairs' row-map entries, in stream order ("Ordering"); after the last,
    ``on_done()`` (the bookkeeping: which map is served), before the lock goes. Raises :class:`ApplyRefused`
    (before any lock, nothing touched) or :class:`SwapFailed` (after rolling every batch back; ``on_done`` not
    called). ``switch_interval_s``: the GIL switch interval while the apply runs (None: Python's, untouched; the
    module docstring, "The GIL"). ``ordering``: ``"stream"`` queues each batch on the engine's stream where there is
    one, ``"host"`` orders it by device syncs under the lock (module docstring, "Ordering"). ``stall_s`` /
    ``fail_after_layers`` inject faults (tests only: "Fault injection" in :mod:`pinsidecar_hook.swap`)."""
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
                  stall_s=stall_s, fail_after_layers=fail_after_layers,
                  switch_interval_s=switch_interval_s, ordering=ordering).run(on_done)

