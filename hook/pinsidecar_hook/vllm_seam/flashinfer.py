"""The seam of vLLM's FlashInfer TRT-LLM MXFP4 experts (SM100), for the ``flashinfer_trtllm`` backend.

vLLM 0.34's ``TrtLlmMxfp4ExpertsModular.apply`` (``experts/trtllm_mxfp4_moe.py:426``) may return an
``UnfinalizedMoEOutput`` instead of writing ``output``: when the layer defers its top-k reduction to a fused consumer
(``moe_config.should_defer_moe_finalize``) and one launch covers the batch. The split never defers: it reduces into
``output`` and returns None, which the modular kernel passes on as a finalized tensor (``modular_kernel.py:1471``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_experts", "kernel_args"]


def is_experts(experts: Any) -> bool:
    """vLLM's modular FlashInfer TRT-LLM MXFP4 experts (``fused_moe/experts/trtllm_mxfp4_moe.py``)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.trtllm_mxfp4_moe import TrtLlmMxfp4ExpertsModular
    except ImportError:
        return False
    return isinstance(experts, TrtLlmMxfp4ExpertsModular)


def kernel_args(experts: Any, activation: Any) -> dict[str, Any]:
    """The tier-independent arguments ``TrtLlmMxfp4ExpertsModular._invoke_kernel`` passes to FlashInfer's
    ``trtllm_fp4_block_scale_routed_moe`` (0.33 and 0.34 alike, 0.34 ``trtllm_mxfp4_moe.py:380-413``); the
    per-expert ``gemm1_*`` tensors are left to the caller (one slice per tier)."""
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.utils import fi_moe_largest_bucket

    return {
        "intermediate_size": experts.intermediate_size_per_partition,
        # The modular kernel receives pre-routed ids; vLLM passes Renormalize as the routing method there.
        "routing_method_type": RoutingMethodType.Renormalize,
        "enable_pdl": True,
        "activation_type": experts._flashinfer_activation_type(activation),
        "tune_max_num_tokens": fi_moe_largest_bucket(experts.moe_config),
    }
