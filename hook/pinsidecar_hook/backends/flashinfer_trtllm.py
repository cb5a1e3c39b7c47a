"""Split invoke for FlashInfer's ``trtllm_fp4_block_scale_routed_moe`` (SM100, MXFP4): two expert windows, one
finalize in slot order.

**Not run on hardware.** Neither :class:`TrtllmFp4Split` nor :class:`FlashinferTrtllmSplit` has run on a GPU or in an
engine: no machine here has an SM100 GPU (the lent H200 is SM90) and FlashInfer's TRT-LLM MoE kernels need one.
This adapter is written against the call vLLM 0.33 makes in
``experts/trtllm_mxfp4_moe.py: TrtLlmMxfp4ExpertsModular._invoke_kernel``; the id renumbering, the windows, the
finalize and the wiring into ``apply`` are unit-tested with a *fake* kernel that follows FlashInfer's documented
``do_finalize=False`` contract (tests/test_backends_gpu_adapters.py).

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

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.base import SplitBackend
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = ["FlashinferTrtllmSplit", "TierTensors", "TrtllmFp4Split", "expert_windows", "renumber_for_windows"]

# Layer parameter -> TierTensors field: the MXFP4 weights, their block scales and the optional biases.
_TIER_FIELD_OF = {"w13_weight": "gemm1_weights", "w13_weight_scale": "gemm1_weights_scale",
                  "w2_weight": "gemm2_weights", "w2_weight_scale": "gemm2_weights_scale",
                  "w13_bias": "gemm1_bias", "w2_bias": "gemm2_bias"}
# Per-expert activation parameters that vLLM keeps on the experts object (one value per local expert).
_PER_EXPERT_ARGS = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")


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
    scales; biases and the per-expert activation parameters (``gemm1_alpha``, ``gemm1_beta``,
    ``gemm1_clamp_limit``, one value per expert of the tier) may be None."""

    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor
    gemm1_bias: torch.Tensor | None = None
    gemm2_bias: torch.Tensor | None = None
    gemm1_alpha: torch.Tensor | None = None
    gemm1_beta: torch.Tensor | None = None
    gemm1_clamp_limit: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.gemm1_weights.shape[0])


def _flashinfer_kernel() -> Callable[..., Any]:
    from flashinfer import trtllm_fp4_block_scale_routed_moe

    return trtllm_fp4_block_scale_routed_moe


@dataclasses.dataclass
class TrtllmFp4Split:
    """One MoE layer's split invoke over the FlashInfer TRT-LLM MXFP4 kernel.

    ``kernel_args`` holds the arguments the unsplit call passes that do not depend on the tier
    (``intermediate_size``, ``routing_method_type``, ``activation_type``, ``enable_pdl``, ``tune_max_num_tokens``,
    ...; the per-expert ones are in :class:`TierTensors`). ``kernel`` defaults to FlashInfer's and exists for
    tests."""

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
            gemm1_alpha=tier.gemm1_alpha,
            gemm1_beta=tier.gemm1_beta,
            gemm1_clamp_limit=tier.gemm1_clamp_limit,
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


def _tier_tensors(experts: Any, tier: dict[str, torch.Tensor], num: int) -> TierTensors:
    fields: dict[str, Any] = {_TIER_FIELD_OF[name]: t for name, t in tier.items() if name in _TIER_FIELD_OF}
    for arg in _PER_EXPERT_ARGS:
        values = getattr(experts, arg, None)
        if values is None:
            continue
        # vLLM builds these from one scalar per layer, so every expert has the same value and a tier takes the first
        # ``num``; a per-expert difference would need the tier's own experts, which the layer state does not name.
        if values.numel() and not bool((values == values.reshape(-1)[0]).all()):
            raise ValueError(f"{arg} differs between experts; the FlashInfer split supports one value per layer")
        fields[arg] = values[:num]
    return TierTensors(**fields)


class FlashinferTrtllmSplit(SplitBackend):
    """The split for vLLM's ``TrtLlmMxfp4ExpertsModular``: a :class:`TrtllmFp4Split` over the layer's hot and
    cold tensors, built once at attach. Never run on hardware (module docstring): ``auto`` does not pick it.

    It always finalizes into ``output`` (it never returns vLLM's deferred ``UnfinalizedMoEOutput``), chunks the
    tokens as vLLM does when the experts object states a maximum (``_max_supported_tokens``), and ignores the
    weights and ``expert_map`` vLLM passes (the layer state holds both tiers; its row map sends other ranks'
    experts to -1). ``kernel`` and ``kernel_args_fn`` (default: vLLM's arguments, through
    :func:`pinsidecar_hook.vllm_seam.trtllm_mxfp4_kernel_args`) exist for tests.
    """

    NAME = "flashinfer_trtllm"
    SPLIT_TENSORS = tuple(_TIER_FIELD_OF)
    REQUIRED_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    VERIFIED = False
    AUTO = False

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not vllm_seam.is_trtllm_mxfp4_experts(experts):
            return "it splits vLLM's TrtLlmMxfp4ExpertsModular (MXFP4 through FlashInfer on SM100) only"
        return None

    def __init__(self, experts: Any, layer: Any, *, kernel: Callable[..., Any] | None = None,
                 kernel_args_fn: Callable[[Any, Any], dict[str, Any]] | None = None) -> None:
        super().__init__(experts, layer)
        self.args_fn = kernel_args_fn or vllm_seam.trtllm_mxfp4_kernel_args
        self.split = TrtllmFp4Split(
            row_map=layer.row_map, hot_rows=layer.hot_rows, num_experts=int(layer.row_map.shape[0]),
            hot=_tier_tensors(experts, layer.hot, layer.hot_rows),
            cold=_tier_tensors(experts, layer.cold, layer.cold_rows),
            expert_counts=layer.expert_counts, cold_counts=layer.cold_counts, kernel=kernel,
        )
        self.args_by_activation: dict[Any, dict[str, Any]] = {}

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        split = self.split
        if activation not in self.args_by_activation:
            self.args_by_activation[activation] = self.args_fn(self.experts, activation)
        split.kernel_args = self.args_by_activation[activation]
        x_scale = None if a1q_scale is None else a1q_scale.view(torch.float8_e4m3fn)
        num_tokens, top_k = topk_ids.shape
        max_tokens = getattr(self.experts, "_max_supported_tokens", None)
        chunk = max_tokens(top_k, split.num_experts) if max_tokens is not None else num_tokens
        self.layer.token_counts.add_(num_tokens)
        for start in range(0, num_tokens, max(chunk, 1)):
            end = min(start + chunk, num_tokens)
            split.apply(output[start:end], hidden_states[start:end], None if x_scale is None else x_scale[start:end],
                        topk_ids[start:end], topk_weights[start:end])
