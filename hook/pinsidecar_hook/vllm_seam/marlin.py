"""The seam of vLLM's ``MarlinExperts`` (weight-only int4/int8/FP8 through the Marlin MoE GEMM), for the
``marlin_experts`` backend.

The split runs ``_fused_marlin_moe`` (the body of ``fused_marlin_moe`` without its reduction) once per tier. Its
signature changed between the two GPU versions read, so :func:`rows` calls it the way the installed version's
``MarlinExperts.apply`` does, told apart by the function's own parameters (:func:`call_form`):

- vLLM 0.26 (``experts/marlin_moe.py``): act-order indices (``g_idx1``, ``sort_indices1``), ``input_dtype``,
  ``is_k_full``, the clamp and gated-activation scalars as arguments;
- vLLM 0.34 (``experts/marlin_moe.py:59``): no act order, no activation quantization, an ``activation_config``
  and ``mul_topk_weights_in_gemm2``; ``MarlinExperts.apply`` (``:670``, its call at ``:711-739``) passes
  ``activation_func=self.activation``, ``activation_config=self.activation_config`` and
  ``mul_topk_weights_in_gemm2=not hooked``.

Any other form is refused at attach with the version's name. On SM90, 0.34 serves GPTQ/AWQ int4 with
``HummingIndexedExperts`` (``prioritize_humming``), not ``MarlinExperts``, so this path is what a FP8 W8A16 or a
forced ``--moe-backend marlin`` layer takes there.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

__all__ = ["block_size", "call_form", "is_experts", "rows"]


def is_experts(experts: Any) -> bool:
    """vLLM's ``MarlinExperts`` (``fused_moe/experts/marlin_moe.py``) with its own ``apply``."""
    from pinsidecar_hook.vllm_seam._common import vllm_class

    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    except ImportError:
        return False
    return isinstance(experts, MarlinExperts) and vllm_class(experts).apply is MarlinExperts.apply


def call_form() -> str | None:
    """``"0.26"`` or ``"0.34"``: which ``_fused_marlin_moe`` signature this vLLM has (module docstring); None for
    one the split was not written against (or no Marlin at all)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import _fused_marlin_moe
    except ImportError:
        return None
    params = set(inspect.signature(_fused_marlin_moe).parameters)
    if {"g_idx1", "sort_indices1", "input_dtype", "is_k_full"} <= params:
        return "0.26"
    if {"activation_config", "mul_topk_weights_in_gemm2"} <= params and "g_idx1" not in params:
        return "0.34"
    return None


def block_size(experts: Any, num_tokens: int, top_k: int, local_experts: int, global_num_experts: int) -> int:
    """The M block size ``fused_marlin_moe`` picks for the *unsplit* call (it depends on the expert count of the
    weights it is given, so a tier's call would pick its own; the split pins the unsplit one). The same rule in 0.26
    and 0.34, but for 0.26's floor of 16 with 8-bit activations (0.34 has no activation quantization in Marlin)."""
    m = num_tokens if global_num_experts == -1 else math.ceil(num_tokens * local_experts / global_num_experts)
    block = 64
    for block in (8, 16, 32, 48, 64):
        if m * top_k / local_experts / block < 0.9:
            break
    input_dtype = getattr(experts, "input_dtype", None)
    if input_dtype is not None and input_dtype.itemsize == 1:
        block = max(block, 16)
    return block


def rows(experts: Any, tier: dict[str, Any], hidden_states: Any, topk_weights: Any, topk_ids: Any,
         expert_map: Any, activation: Any, global_num_experts: int, block_size_m: int,
         apply_router_weight_on_input: bool, workspace13: Any, workspace2: Any) -> Any:
    """One tier's weighted GEMM2 rows ``[T, k, K]`` from vLLM's ``_fused_marlin_moe``, with that tier's weights,
    scales, zero points (and, on 0.26, act-order indices), the unsplit call's block size, and ``expert_map``
    sending the other tier's experts to -1."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import _fused_marlin_moe
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.scalar_type import ScalarType

    sorted_token_ids, expert_ids, padded = moe_align_block_size(
        topk_ids, block_size_m, global_num_experts, expert_map, ignore_invalid_experts=True)
    top_k = topk_ids.shape[1]
    common = dict(
        hidden_states=hidden_states, w1=tier["w13_weight"], w2=tier["w2_weight"], bias1=tier.get("w13_bias"),
        bias2=tier.get("w2_bias"), w1_scale=tier["w13_scales"], w2_scale=tier["w2_scales"],
        topk_weights=topk_weights, num_topk=top_k, quant_type=ScalarType.from_id(experts.quant_type_id),
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        block_size_m=block_size_m, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
        num_tokens_post_padded=padded, activation=activation, activation_func=experts.activation, topk_ids=topk_ids,
        global_scale1=experts.g1_alphas, global_scale2=experts.g2_alphas,
        w1_zeros=tier.get("w13_qzeros") if experts.w1_zp is not None else None,
        w2_zeros=tier.get("w2_qzeros") if experts.w2_zp is not None else None,
        intermediate_cache13=workspace2, intermediate_cache2=workspace13, output=None,
    )
    form = call_form()
    if form == "0.26":
        out = _fused_marlin_moe(
            **common, input_global_scale1=experts.a1_gscale, input_global_scale2=experts.a2_gscale,
            g_idx1=tier.get("w13_g_idx"), g_idx2=tier.get("w2_g_idx"),
            sort_indices1=tier.get("w13_g_idx_sort_indices"), sort_indices2=tier.get("w2_g_idx_sort_indices"),
            input_dtype=experts.input_dtype, is_k_full=experts.is_k_full, clamp_limit=experts.gemm1_clamp_limit,
            gemm1_alpha=experts.gemm1_alpha, gemm1_beta=experts.gemm1_beta)
    elif form == "0.34":
        out = _fused_marlin_moe(**common, activation_config=experts.activation_config,
                                mul_topk_weights_in_gemm2=True)
    else:
        raise RuntimeError("this vLLM's _fused_marlin_moe has a signature the Marlin split was not written against")
    return out.view(-1, top_k, hidden_states.shape[-1])
