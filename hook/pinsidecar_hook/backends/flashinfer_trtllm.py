"""Split invoke for FlashInfer's ``trtllm_fp4_block_scale_routed_moe`` (SM100, MXFP4): two expert windows, one
finalize in slot order.

**Not run on hardware.** No machine here has an SM100 GPU (the lent H200 is SM90) and FlashInfer's TRT-LLM MoE
kernels need one. This adapter is written against the call vLLM 0.33 makes in
``experts/trtllm_mxfp4_moe.py: TrtLlmMxfp4ExpertsModular._invoke_kernel``; the id renumbering, the windows and
the finalize are unit-tested with a *fake* kernel that follows FlashInfer's documented ``do_finalize=False``
contract (tests/test_backends_gpu_adapters.py).

The contract used. Called with ``do_finalize=False``, the kernel returns ``[gemm2_permuted [P, H] (unweighted),
expert_weights [T*k], expanded_idx_to_permuted_idx [T*k] int32]``: for every (token, slot) whose expert id lies
in ``[local_expert_offset, local_expert_offset + local_num_experts)``, the row of ``gemm2_permuted`` holding that
slot's expert output, and ``-1`` for every other slot. ``gemm1_weights`` & co. hold exactly the window's experts.

The split:

1. Renumber each slot's expert to its row: hot experts ``0..H-1``, cold ``H..H+C-1`` (the row map). Slots of
   another rank's experts get an id outside both windows (``num_experts - 1`` when ``H + C < num_experts``).
2. Call the kernel twice with ``do_finalize=False``: the hot window ``(0, H)`` over the hot weights and scales,
   and the cold window ``(H, C)`` over the cold ones. Each call computes only its own slots. ``num_experts``
   stays the unsplit value, so the routing geometry the kernel sees does not depend on the map.
3. Finalize once ourselves (:func:`pinsidecar_hook.kernels.finalize` with ``gather=True``): gather each slot's row
   through the two permute maps and accumulate ``fma(weight, row, acc)`` in fp32 in slot order ``0..k-1``, one
   cast. FlashInfer's own finalize is not used: 0.7.2's small-batch finalize does not sum in slot order for
   top_k > 4, so its result would depend on which slots share a call.

What is *not* established without hardware: that each slot's GEMM rows are the same bits whichever window computes
them (true when both calls pick the same kernel tactic for the tile; the autotuner keys on shapes that include
the local expert count). Placement invariance on SM100 therefore needs a hardware run before it is claimed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = ["TierTensors", "TrtllmFp4Split", "expert_windows", "renumber_for_windows"]


def renumber_for_windows(
    topk_ids: torch.Tensor, row_map: torch.Tensor, hot_rows: int, num_experts: int
) -> torch.Tensor:
    """Each slot's expert id replaced by its row (hot ``0..H-1``, cold ``H..H+C-1``); slots whose expert has no
    row on this rank (row map ``-1``, or an id out of range) get ``num_experts - 1``, which lies outside both
    windows whenever such experts exist (``H + C < num_experts``). int32, as the kernel takes it."""
    ids = topk_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < row_map.shape[0])
    rows = torch.where(in_range, row_map.to(torch.int64)[ids.clamp(min=0, max=row_map.shape[0] - 1)], -1)
    return torch.where(rows >= 0, rows, num_experts - 1).to(torch.int32)


def expert_windows(hot_rows: int, cold_rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(local_expert_offset, local_num_experts)`` of the hot call and of the cold call."""
    return (0, hot_rows), (hot_rows, cold_rows)


@dataclasses.dataclass
class TierTensors:
    """One tier's per-expert tensors in the kernel's layout (rows in tier order). Scales are the MXFP4 block
    scales; biases may be None."""

    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor
    gemm1_bias: torch.Tensor | None = None
    gemm2_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.gemm1_weights.shape[0])


def _flashinfer_kernel() -> Callable[..., Any]:
    from flashinfer import trtllm_fp4_block_scale_routed_moe

    return trtllm_fp4_block_scale_routed_moe


@dataclasses.dataclass
class TrtllmFp4Split:
    """One MoE layer's split invoke over the FlashInfer TRT-LLM MXFP4 kernel.

    ``kernel_args`` holds the arguments the unsplit call passes that do not depend on the tier (``gemm1_alpha``,
    ``gemm1_beta``, ``gemm1_clamp_limit``, ``intermediate_size``, ``routing_method_type``, ``activation_type``,
    ``enable_pdl``, ``tune_max_num_tokens``, ...). ``kernel`` defaults to FlashInfer's and exists for tests."""

    row_map: torch.Tensor
    hot_rows: int
    num_experts: int
    hot: TierTensors
    cold: TierTensors
    kernel_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    expert_counts: torch.Tensor | None = None
    cold_counts: torch.Tensor | None = None
    kernel: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.hot.num_experts != self.hot_rows:
            raise ValueError(f"hot tier holds {self.hot.num_experts} experts, the map says {self.hot_rows}")
        local = self.hot.num_experts + self.cold.num_experts
        if local > self.num_experts:
            raise ValueError(f"{local} local rows exceed num_experts={self.num_experts}")
        if local == self.num_experts and bool((self.row_map < 0).any()):
            raise ValueError("row map has -1 entries but no spare expert id outside both windows (H + C == E)")

    def _call(self, tier: TierTensors, window: tuple[int, int], ids, weights, x, x_scale):
        kernel = self.kernel or _flashinfer_kernel()
        res = kernel(
            topk_ids=(ids, weights),
            routing_bias=None,
            hidden_states=x,
            hidden_states_scale=x_scale,
            gemm1_weights=tier.gemm1_weights,
            gemm1_weights_scale=tier.gemm1_weights_scale,
            gemm1_bias=tier.gemm1_bias,
            gemm2_weights=tier.gemm2_weights,
            gemm2_weights_scale=tier.gemm2_weights_scale,
            gemm2_bias=tier.gemm2_bias,
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
            num_experts=self.num_experts,
            top_k=ids.shape[1],
            n_group=None,
            topk_group=None,
            local_expert_offset=window[0],
            local_num_experts=window[1],
            routed_scaling_factor=None,
            do_finalize=False,
            output=None,
            **self.kernel_args,
        )
        gemm2_permuted, _expert_weights, expanded_idx = res
        return gemm2_permuted, expanded_idx.view(ids.shape)

    def apply(
        self,
        output: torch.Tensor,
        x_quant: torch.Tensor,
        x_scale: torch.Tensor | None,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Both windows and the slot-order finalize; writes ``output [T, H]`` (activation dtype)."""
        partition(topk_ids, self.row_map, self.hot_rows, self.expert_counts, self.cold_counts)  # live counts
        ids = renumber_for_windows(topk_ids, self.row_map, self.hot_rows, self.num_experts)
        hot_window, cold_window = expert_windows(self.hot_rows, self.cold.num_experts)
        rows_hot, idx_hot = self._call(self.hot, hot_window, ids, topk_weights, x_quant, x_scale)
        if self.cold.num_experts > 0:
            rows_cold, idx_cold = self._call(self.cold, cold_window, ids, topk_weights, x_quant, x_scale)
        else:
            rows_cold, idx_cold = rows_hot[:0], torch.full_like(idx_hot, -1)
        return finalize(
            rows_hot, topk_weights, hot_ids=idx_hot, cold_ids=idx_cold, rows_cold=rows_cold, gather=True, out=output
        )
