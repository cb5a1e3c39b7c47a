"""Torch reference experts backend: a grouped GEMM in plain torch that leaves the routed rows unfinalized.

What it is for. It is the one backend whose split can be checked *bit for bit against its own unsplit call* on
every machine we have (the CPU here, the H200 through the device tool), and it is the experts stage of the GPU
benchmark. It is not a production path: it loops over experts in Python, and its arithmetic is its own, not the
engine kernel's, so an engine served through it gives slightly different outputs than the same engine unsplit.
That is why the registry never picks it automatically; :func:`make_split_apply` exists so that it can be asked
for (``PINSIDECAR_PIN_BACKEND=torch_ref``) as an in-engine reference on any device, for unquantized experts with
SiLU-and-mul. It has run only in the tests here (tests/test_backends_ref.py, tests/test_gpu.py), not in an
engine.

Why the split is bit-identical to the unsplit call by construction:

- every expert lives wholly in one tier, and for every expert both paths run the *same* GEMMs on the *same* rows
  in the *same* order: the (token, slot) pairs routed to it, gathered in flat ``token * k + slot`` order (a stable
  sort keeps that order), against the same weights (the hot and cold tensors hold byte copies of the originals,
  in the same per-expert layout);
- every (token, slot) row is therefore the same bits in both paths, whichever tier computed it;
- both paths end in the same finalize (:func:`pinsidecar_hook.kernels.finalize`): fp32 FMA of the router weight and
  the row, in slot order ``0..k-1``, one cast to the activation dtype.

Two experts implementations (``impl``): ``"loop"`` (the default, :func:`expert_rows`: one GEMM pair per expert in a
Python loop, with host syncs) and the grouped calls of :mod:`pinsidecar_hook.kernels.grouped` (``"triton"``,
``"grouped_mm"``: static shapes, capturable in a CUDA graph, every touched expert read once). The argument above
holds for each of them; splits and unsplit calls must use the same one.

Two tiers at once. HBM and the host link are independent resources, so on CUDA the cold call runs on a side stream,
forked from and joined to the current stream with events (capturable in a CUDA graph), writing its own rows buffer
that the finalize reads for the cold slots: the step costs about max(hot, cold) rather than their sum, with the
same bits (every row is computed by the same call on the same inputs either way). :data:`OVERLAP_DEFAULT` turns it
on for every split on CUDA (measured on the H200 by bench/placement.py); the CPU runs the two calls in turn.

Layout follows vLLM's unquantized experts: ``w13 [E, 2N, D]`` (gate rows then up rows), ``w2 [E, D, N]``, the
activation is SiLU-and-mul computed in fp32 and rounded once to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.grouped import IMPLS, grouped_experts, silu_and_mul
from pinsidecar_hook.kernels.partition import partition

__all__ = [
    "IMPLS",
    "NAME",
    "OVERLAP_DEFAULT",
    "REQUIRED_TENSORS",
    "SPLIT_TENSORS",
    "expert_rows",
    "make_split_apply",
    "split",
    "split_rows",
    "split_tiers",
    "unsplit",
    "unsplit_rows",
]

NAME = "torch_ref"
# Unquantized experts only: the two weight tensors, nothing else.
SPLIT_TENSORS = ("w13_weight", "w2_weight")
REQUIRED_TENSORS = ("w13_weight", "w2_weight")
# Run the cold call on a side stream, concurrently with the hot one, on CUDA (module docstring).
OVERLAP_DEFAULT = True
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def expert_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unweighted expert outputs per (token, slot): ``out[t, j] = expert_{row_ids[t, j]}(x[t])`` where
    ``row_ids[t, j] >= 0`` (a row of ``w13``/``w2``); other slots of ``out`` are left as they are (zeros when
    ``out`` is made here). One GEMM pair per row used, over that row's pairs in flat order."""
    num_tokens, top_k = row_ids.shape
    hidden = x.shape[-1]
    if out is None:
        out = x.new_zeros((num_tokens, top_k, hidden))
    flat_out = out.view(num_tokens * top_k, hidden)
    flat = row_ids.reshape(-1).to(torch.int64)
    live = torch.nonzero(flat >= 0).squeeze(1)  # ascending flat indices
    if live.numel() == 0:
        return out
    order = torch.argsort(flat[live], stable=True)  # group by row, flat order kept inside a group
    pairs = live[order]
    rows_used, counts = torch.unique_consecutive(flat[pairs], return_counts=True)
    start = 0
    for row, count in zip(rows_used.tolist(), counts.tolist(), strict=True):
        sel = pairs[start : start + count]
        start += count
        xs = x.index_select(0, torch.div(sel, top_k, rounding_mode="floor"))
        act = silu_and_mul(xs @ w13[row].t())
        flat_out[sel] = act @ w2[row].t()
    return out


def _rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, row_ids: torch.Tensor, impl: str) -> torch.Tensor:
    """``[T, k, D]`` rows of one call with the chosen implementation (slots with ``row_ids < 0`` unwritten)."""
    if impl == "loop":
        return expert_rows(x, w13, w2, row_ids)
    if impl not in IMPLS:
        raise ValueError(f"torch_ref impl must be 'loop' or one of {IMPLS}, got {impl!r}")
    num_tokens, top_k = row_ids.shape
    buf = x.new_empty((num_tokens * top_k + 1, x.shape[-1]))  # the last row is the call's scratch
    grouped_experts(x, w13, w2, row_ids, buf, impl)
    return buf[: num_tokens * top_k].view(num_tokens, top_k, x.shape[-1])


def unsplit_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    impl: str = "loop",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the unsplit call, and the local ids used (``None`` without expert parallel)."""
    if expert_map is None:
        return _rows(x, w13, w2, topk_ids, impl), None
    ids = topk_ids.to(torch.int64)
    local = torch.where((ids >= 0) & (ids < expert_map.shape[0]), expert_map.to(torch.int64)[ids.clamp(min=0)], -1)
    local = local.to(torch.int32)
    return _rows(x, w13, w2, local, impl), local


def unsplit(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    impl: str = "loop",
) -> torch.Tensor:
    """The reference: all experts in one tensor, one experts call, the shared finalize. With ``expert_map``
    (expert parallel: global id -> local row, -1 elsewhere) slots of other ranks' experts contribute nothing."""
    rows, local = unsplit_rows(x, w13, w2, topk_ids, expert_map, impl)
    if local is None:
        return finalize(rows, topk_weights)
    return finalize(rows, topk_weights, hot_ids=local, cold_ids=torch.full_like(local, -1))


def split_rows(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    hot_ids: torch.Tensor,
    cold_ids: torch.Tensor,
) -> torch.Tensor:
    """Rows of a split call: the hot call fills the hot slots, the cold call the cold slots, of one buffer."""
    rows = expert_rows(x, w13_hot, w2_hot, hot_ids)
    if w13_cold.shape[0] > 0:
        expert_rows(x, w13_cold, w2_cold, cold_ids, out=rows)
    return rows


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def split_tiers(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    hot_ids: torch.Tensor,
    cold_ids: torch.Tensor,
    *,
    impl: str = "loop",
    overlap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of a split call as ``(hot rows, cold rows or None)``, each ``[T, k, D]``: the cold call writes its own
    buffer, so with ``overlap`` (CUDA only) it can run on the side stream while the hot call runs here. The fork
    and the join are stream waits (events), so a CUDA graph captures both branches. Buffers the side stream writes
    are allocated here, on the current stream, before the fork, so the allocator never hands them out early."""
    if w13_cold.shape[0] == 0:
        return _rows(x, w13_hot, w2_hot, hot_ids, impl), None
    if not (overlap and x.is_cuda):
        return _rows(x, w13_hot, w2_hot, hot_ids, impl), _rows(x, w13_cold, w2_cold, cold_ids, impl)
    num_tokens, top_k = cold_ids.shape
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    if impl == "loop":
        cold_rows = x.new_zeros((num_tokens, top_k, x.shape[-1]))
        cold_out = cold_rows
    else:
        cold_out = x.new_empty((num_tokens * top_k + 1, x.shape[-1]))
        cold_rows = cold_out[: num_tokens * top_k].view(num_tokens, top_k, x.shape[-1])
    side.wait_stream(main)  # fork: the cold call sees x and the ids
    with torch.cuda.stream(side):
        if impl == "loop":
            expert_rows(x, w13_cold, w2_cold, cold_ids, out=cold_out)
        else:
            grouped_experts(x, w13_cold, w2_cold, cold_ids, cold_out, impl)
    hot_rows = _rows(x, w13_hot, w2_hot, hot_ids, impl)
    main.wait_stream(side)  # join: the finalize reads the cold rows after the cold call
    return hot_rows, cold_rows


def split(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
    *,
    num_real: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
    impl: str = "loop",
    overlap: bool | None = None,
) -> torch.Tensor:
    """The split invoke: partition (with live counts when counters are given, CUDA-graph padding masked by
    ``num_real``), the hot call, the cold call (on a side stream, concurrently, when ``overlap``; default
    :data:`OVERLAP_DEFAULT` on CUDA), the shared finalize. Bit-identical to :func:`unsplit` over the original
    weights with the same ``impl`` (module docstring)."""
    hot_ids, cold_ids = partition(topk_ids, row_map, hot_rows, expert_counts, cold_counts, num_real=num_real,
                                  token_counts=token_counts)
    if overlap is None:
        overlap = OVERLAP_DEFAULT
    if impl == "loop" and not (overlap and x.is_cuda):  # the original path: one rows buffer, the calls in turn
        rows = split_rows(x, w13_hot, w2_hot, w13_cold, w2_cold, hot_ids, cold_ids)
        return finalize(rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids)
    rows, rows_cold = split_tiers(x, w13_hot, w2_hot, w13_cold, w2_cold, hot_ids, cold_ids, impl=impl,
                                  overlap=overlap)
    return finalize(rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold)


def make_split_apply(experts: Any, layer: Any) -> Callable[..., Any]:
    """A replacement for ``experts.apply`` (vLLM's ``FusedMoEExpertsModular.apply`` signature) that runs
    :func:`split` over the layer's hot and cold tensors (``layer`` is a :class:`pinsidecar_hook.backends.SplitLayer`).

    The weights vLLM passes (the layer's parameters, which now hold only the hot rows) and its ``expert_map`` are
    ignored: the row map already sends other ranks' experts to -1. Only SiLU-and-mul with the router weight
    applied after the experts is supported; anything else raises at the first call.
    """
    hot_w13, hot_w2 = layer.hot["w13_weight"], layer.hot["w2_weight"]
    cold_w13, cold_w2 = layer.cold["w13_weight"], layer.cold["w2_weight"]
    num_real = vllm_seam.real_token_count(layer.row_map.device)

    def split_apply(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                    expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                    workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
                    apply_router_weight_on_input: bool) -> None:
        act = str(getattr(activation, "value", activation)).lower()
        if act != "silu" or apply_router_weight_on_input:
            raise RuntimeError(f"the torch_ref split supports SiLU-and-mul with the router weight applied after the "
                               f"experts only (activation {act!r}, apply_router_weight_on_input "
                               f"{apply_router_weight_on_input})")
        output.copy_(split(hidden_states, hot_w13, hot_w2, cold_w13, cold_w2, topk_weights, topk_ids, layer.row_map,
                           layer.hot_rows, layer.expert_counts, layer.cold_counts, num_real=num_real,
                           token_counts=layer.token_counts))

    split_apply._pinsidecar_split = True  # type: ignore[attr-defined]
    return split_apply
