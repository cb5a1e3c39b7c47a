"""Split invoke for vLLM's ``MarlinExperts``: weight-only 4/8-bit experts (GPTQ and AWQ int4, int8, FP8 W8A16)
through the Marlin MoE GEMM, as vLLM 0.26 serves GPTQ/AWQ checkpoints on SM90.

How ``MarlinExperts.apply`` works in vLLM 0.26 (``fused_moe/experts/marlin_moe.py``), and what the split relies on:

- ``fused_marlin_moe`` picks an M block size from the token count, top-k and the expert count of the weights it is
  given, aligns the ids per expert (``moe_align_block_size`` with ``expert_map``; experts mapped to -1 get no
  blocks), runs GEMM1 (``moe_wna16_marlin_gemm``), the activation, GEMM2 with the router weights multiplied in
  (fp32 reduction inside the GEMM, no atomics), and ends with ``moe_sum`` over the ``[T, k, K]`` rows.
- A row of GEMM2 depends on its token, its expert's weights, scales, zero points and act-order indices, and on
  the block size (the tile). So each tier runs ``_fused_marlin_moe`` (the body without the reduction,
  :func:`pinsidecar_hook.vllm_seam.marlin_rows`) with that tier's tensors, an ``expert_map`` sending the other
  tier's experts to -1, and the block size of the *unsplit* call (:func:`pinsidecar_hook.vllm_seam.marlin_block_size`;
  a tier's own would follow its own expert count). The two tiers' rows are then reduced once, by the hook's
  finalize when it equals the class's ``moe_sum`` on this device (checked at attach), else merged slot by slot and
  reduced by the class's own ``moe_sum``, as :mod:`pinsidecar_hook.backends.triton_experts` does.
- Per-expert tensors, all split in mirror by re-homing: the packed weights (``w13_qweight`` and its alias
  ``w13_weight``), group scales (``w13_scales``), zero points (``w13_qzeros``, used only when the quant config
  has them), act-order indices (``w13_g_idx``, ``w13_g_idx_sort_indices``; ``[E, 0]`` without act order), biases.

Not run on hardware yet (``VERIFIED = False``): ``auto`` does not pick it until it has been checked against vLLM's
unsplit Marlin call on the H200; ``PINSIDECAR_PIN_BACKEND=marlin`` runs it, with a warning at boot. Refused at
attach: FP4 weights (MXFP4/NVFP4 carry per-expert global scales this backend does not map yet), activation
quantization (W8A8 through Marlin), and LoRA at the call.
"""

from __future__ import annotations

from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.base import SplitBackend, UnsupportedSplit
from pinsidecar_hook.backends.triton_experts import (
    activation_dtype,
    finalize_matches_reduction,
    reduce_like_unsplit,
    tier_expert_maps,
)
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = ["MarlinExpertsSplit"]

_WEIGHT_ONLY = ("use_int4_w4a16", "use_int8_w8a16", "use_fp8_w8a16")


class MarlinExpertsSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's ``MarlinExperts`` (module docstring). ``rows_fn`` (default
    :func:`pinsidecar_hook.vllm_seam.marlin_rows`) and ``fused_finalize`` exist for tests."""

    NAME = "marlin_experts"
    SPLIT_TENSORS = ("w13_weight", "w2_weight", "w13_qweight", "w2_qweight", "w13_scales", "w2_scales",
                     "w13_qzeros", "w2_qzeros", "w13_g_idx", "w2_g_idx", "w13_g_idx_sort_indices",
                     "w2_g_idx_sort_indices", "w13_bias", "w2_bias")
    REQUIRED_TENSORS = ("w13_weight", "w2_weight", "w13_scales", "w2_scales")
    VERIFIED = False
    AUTO = False

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not vllm_seam.is_marlin_experts(experts):
            return "it splits vLLM's MarlinExperts only"
        qc = getattr(experts, "quant_config", None)
        if not any(bool(getattr(qc, flag, False)) for flag in _WEIGHT_ONLY):
            return ("only weight-only int4, int8 and FP8 (W4A16/W8A16) Marlin layers are split; FP4 weights carry "
                    "per-expert global scales this backend does not map yet")
        input_dtype = getattr(experts, "input_dtype", None)
        if input_dtype is not None:
            return f"Marlin with {input_dtype} activations (W8A8) is not split by this backend"
        if not vllm_seam.vllm_version().startswith("0.26."):
            return (f"the Marlin split calls vLLM 0.26's _fused_marlin_moe; this is vLLM "
                    f"{vllm_seam.vllm_version() or 'unknown'}")
        return None

    def __init__(self, experts: Any, layer: Any, *, rows_fn: Any = None, fused_finalize: bool | None = None) -> None:
        super().__init__(experts, layer)
        self.row_map = layer.row_map
        self.hot_rows = layer.hot_rows
        self.local_experts = layer.hot_rows + layer.cold_rows
        self.has_cold = layer.cold_rows > 0
        self.global_num_experts = int(layer.row_map.shape[0])
        self.hot_map, self.cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.num_real = vllm_seam.real_token_count(layer.row_map.device)
        self.rows_fn = rows_fn or vllm_seam.marlin_rows
        if fused_finalize is None:
            top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
            w13 = layer.hot["w13_weight"]
            hidden = int(layer.hot["w2_scales"].shape[-1])
            fused_finalize = isinstance(top_k, int) and finalize_matches_reduction(
                experts, top_k, hidden, activation_dtype(experts, w13), w13.device)
        self.fused_finalize = fused_finalize

    def refresh(self) -> None:
        hot_map, cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.hot_map.copy_(hot_map)
        self.cold_map.copy_(cold_map)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("Marlin split: LoRA is active; LoRA wraps the activation and moe_sum itself")
        layer = self.layer
        num_tokens, top_k = topk_ids.shape
        hot_ids, cold_ids = partition(topk_ids, self.row_map, self.hot_rows, layer.expert_counts, layer.cold_counts,
                                      num_real=self.num_real, token_counts=layer.token_counts)
        block = vllm_seam.marlin_block_size(self.experts, num_tokens, top_k, self.local_experts,
                                            self.global_num_experts)
        common = dict(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids,
                      activation=activation, global_num_experts=self.global_num_experts, block_size_m=block,
                      apply_router_weight_on_input=apply_router_weight_on_input, workspace13=workspace13)
        rows_hot = self.rows_fn(self.experts, layer.hot, expert_map=self.hot_map, workspace2=workspace2, **common)
        rows_cold = None
        if self.has_cold:  # its own GEMM workspace: the hot rows live in workspace2
            rows_cold = self.rows_fn(self.experts, layer.cold, expert_map=self.cold_map,
                                     workspace2=torch.empty_like(workspace2), **common)
        if self.fused_finalize and expert_map is None:
            finalize(rows_hot, None, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold, weighted_rows=True,
                     out=output)
            return
        rows = rows_hot if rows_cold is None else torch.where((cold_ids >= 0).unsqueeze(-1), rows_cold, rows_hot)
        reduce_like_unsplit(self.experts, rows, output, topk_ids, expert_map)
