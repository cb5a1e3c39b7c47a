"""Split invoke for vLLM's ``MarlinExperts``: weight-only 4/8-bit experts (GPTQ and AWQ int4, int8, FP8 W8A16)
through the Marlin MoE GEMM, as vLLM 0.26 serves GPTQ/AWQ checkpoints on SM90. The Marlin family's tier stage.

How ``MarlinExperts.apply`` works (0.26 and 0.34 ``fused_moe/experts/marlin_moe.py``), and what the split relies on:

- ``fused_marlin_moe`` picks an M block size from the token count, top-k and the expert count of the weights it is
  given, aligns the ids per expert (``moe_align_block_size`` with ``expert_map``; experts mapped to -1 get no
  blocks), runs GEMM1 (``moe_wna16_marlin_gemm``), the activation, GEMM2 with the router weights multiplied in
  (fp32 reduction inside the GEMM, no atomics), and ends with ``moe_sum`` over the ``[T, k, K]`` rows.
- A row of GEMM2 depends on its token, its expert's weights, scales, zero points (and, on 0.26, act-order indices),
  and on the block size (the tile). So each tier runs ``_fused_marlin_moe`` (the body without the reduction,
  :func:`pinsidecar_hook.vllm_seam.marlin.rows`, which calls it with the installed version's signature) with that
  tier's tensors, the tier map as ``expert_map`` (the base's ``TIER_MAPS``), and the block size of the *unsplit*
  call (:func:`pinsidecar_hook.vllm_seam.marlin.block_size`; a tier's own would follow its own expert count). The
  reduce stage is the same as Triton's: the hook's finalize where it equals the class's ``moe_sum`` on this device
  (checked at attach), else the merged rows through the class's own ``moe_sum``.
- Per-expert tensors, all split in mirror by re-homing: the packed weights (``w13_qweight`` and its alias
  ``w13_weight``), group scales (``w13_scales``), zero points (``w13_qzeros``, used only when the quant config
  has them), act-order indices (``w13_g_idx``, ``w13_g_idx_sort_indices``; ``[E, 0]`` without act order), biases.

Not bit-identical on hardware (``VERIFIED = False``): on the H200 with 0.26 the unsplit Marlin call was not even
deterministic against itself (``docs/backends.md``); ``auto`` does not pick it, ``PINSIDECAR_PIN_BACKEND=marlin``
runs it, with a warning at boot. Refused at attach: FP4 weights (MXFP4/NVFP4 carry per-expert global scales this
backend does not map yet), activation quantization (W8A8 through Marlin), a ``_fused_marlin_moe`` of another
signature than 0.26's or 0.34's. Refused at the call: LoRA and a post-GEMM2 hook. On SM90, 0.34 serves GPTQ/AWQ int4
with ``HummingIndexedExperts`` rather than Marlin, which no backend splits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.base import (
    REAL_TOKENS,
    ExpertsCall,
    Partition,
    Reducer,
    Rows,
    SplitBackend,
    Tier,
    UnsupportedSplit,
)
from pinsidecar_hook.backends.reduce import WeightedRowsReduction, finalize_matches_reduction
from pinsidecar_hook.backends.tiers import activation_dtype

__all__ = ["MarlinExpertsSplit"]

_WEIGHT_ONLY = ("use_int4_w4a16", "use_int8_w8a16", "use_fp8_w8a16")


class MarlinExpertsSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's ``MarlinExperts`` (module docstring). ``rows_fn`` (default
    :func:`pinsidecar_hook.vllm_seam.marlin.rows`) and ``fused_finalize`` exist for tests."""

    NAME = "marlin_experts"
    TIER_MAPS = True
    SPLIT_TENSORS = ("w13_weight", "w2_weight", "w13_qweight", "w2_qweight", "w13_scales", "w2_scales",
                     "w13_qzeros", "w2_qzeros", "w13_g_idx", "w2_g_idx", "w13_g_idx_sort_indices",
                     "w2_g_idx_sort_indices", "w13_bias", "w2_bias")
    REQUIRED_TENSORS = ("w13_weight", "w2_weight", "w13_scales", "w2_scales")
    VERIFIED = False
    AUTO = False
    GUARANTEE = "none"  # measured on the H200 with 0.26: 35/144 bitwise, the unsplit call itself not deterministic

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not vllm_seam.marlin.is_experts(experts):
            return "it splits vLLM's MarlinExperts only"
        qc = getattr(experts, "quant_config", None)
        if not any(bool(getattr(qc, flag, False)) for flag in _WEIGHT_ONLY):
            return ("only weight-only int4, int8 and FP8 (W4A16/W8A16) Marlin layers are split; FP4 weights carry "
                    "per-expert global scales this backend does not map yet")
        input_dtype = getattr(experts, "input_dtype", None)
        if input_dtype is not None:
            return f"Marlin with {input_dtype} activations (W8A8) is not split by this backend"
        if vllm_seam.marlin.call_form() is None:
            return (f"the Marlin split calls _fused_marlin_moe as vLLM 0.26 and 0.34 define it; this vLLM "
                    f"({vllm_seam.vllm_version() or 'unknown'}) has another signature")
        return None

    def __init__(self, experts: Any, layer: Any, *, rows_fn: Callable[..., torch.Tensor] | None = None,
                 fused_finalize: bool | None = None, num_real: Any = REAL_TOKENS) -> None:
        self.fused_finalize = fused_finalize
        super().__init__(experts, layer, num_real=num_real)
        self.local_experts = layer.hot_rows + layer.cold_rows
        self.rows_fn = rows_fn or vllm_seam.marlin.rows

    def choose_reducer(self) -> Reducer:
        fused = self.fused_finalize
        if fused is None:
            experts, w13 = self.experts, self.layer.hot["w13_weight"]
            top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
            hidden = int(self.layer.hot["w2_scales"].shape[-1])
            fused = isinstance(top_k, int) and finalize_matches_reduction(
                experts, top_k, hidden, activation_dtype(experts, w13), w13.device)
        self.fused_finalize = fused
        return WeightedRowsReduction(self.experts, fused)

    def check_call(self, call: ExpertsCall) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("Marlin split: LoRA is active; LoRA wraps the activation and moe_sum itself")
        uses_hook = getattr(self.experts, "_uses_post_gemm2_hook", None)
        if uses_hook is not None and uses_hook(call.num_tokens):
            raise UnsupportedSplit("Marlin split: a post-GEMM2 hook consumes the rows instead of moe_sum")

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        num_tokens, top_k = call.topk_ids.shape
        block = vllm_seam.marlin.block_size(self.experts, num_tokens, top_k, self.local_experts,
                                            self.global_num_experts)
        # The cold call gets its own GEMM workspace: the hot rows live in workspace2.
        workspace2 = call.workspace2 if tier.name == "hot" else torch.empty_like(call.workspace2)
        return Rows(self.rows_fn(
            self.experts, tier.tensors, hidden_states=call.hidden_states, topk_weights=call.topk_weights,
            topk_ids=call.topk_ids, expert_map=tier.expert_map, activation=call.activation,
            global_num_experts=self.global_num_experts, block_size_m=block,
            apply_router_weight_on_input=call.apply_router_weight_on_input, workspace13=call.workspace13,
            workspace2=workspace2))
