"""The rows of an in-place remap: the swap plan resolved to rows, one pair's copies, and the swap-back.

The in-place apply in three modules: :mod:`pinsidecar_hook.swap.apply` serves the request (every check that can
refuse, the answer, fault injection), :mod:`pinsidecar_hook.swap.batches` carries the plan out in bounded batches
between two steps (staging, prefetch, the step lock, the row-map flips), and this module holds what one pair swap
is made of: the plan checked against the row maps and tensors the engine holds (:func:`_resolve`, refusing with
:class:`ApplyRefused` before anything is touched), the copies of one row (:func:`_swap_row`), and the swap-back of
everything swapped so far (:func:`_roll_back`).

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
:data:`~pinsidecar_hook.swap.batches.STAGING_BYTES` (never a copy of a tier). On CUDA the cold tier is written
through its host storage (pinned, a DMA copy), not through the device view the kernels read: the same bytes.

**The swap-back.** A swap is its own inverse, so :func:`_roll_back` swaps back every row already swapped, newest
first, restores every written row map (running the layer's refreshers) and synchronizes the devices; it says
whether all of that worked. When it runs: "Failure" in :mod:`pinsidecar_hook.swap.batches`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pinsidecar_hook.contract import SwapPlan

__all__ = ["ApplyRefused", "SwapLayer"]

log = logging.getLogger("pinsidecar_hook")


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


# ---------------------------------------------------------------------------------------------------- the plan in rows


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


# ---------------------------------------------------------------------------------------------------- the swap-back


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
