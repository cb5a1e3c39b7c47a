"""The seam of vLLM's Humming MoE experts (``HummingIndexedExperts``: GPTQ/AWQ int4 and NVFP4 on SM90), for the
``humming`` backend.

Read in vLLM 0.34.0 (``fused_moe/experts/fused_humming_moe.py``) and humming-kernels 0.1.20 (vLLM 0.34.0's wheel
pins 0.1.19). ``HummingIndexedExperts`` is modular (the router runs before it) and its ``apply`` (``:780``) is:

1. ``prepare_humming_moe_kwargs`` (``:679``): ``valid_shape_m`` from the *shape* of ``topk_ids`` (tokens x k), the
   tile config of the tuning list entry whose range holds it, and vLLM's ``moe_align_block_size`` with
   ``expert_map`` and ``ignore_invalid_experts=True``: ids the map sends to -1 are left out, the others become
   local rows;
2. ``process_input("w13")``: the input's quantization, if any (bf16 activations: nothing), once for the call;
3. GEMM1 (``humming_forward``) into ``gate_up_output [T * k, 2I]``: one row per (token, slot), written only for
   the slots the alignment kept;
4. ``process_input("w2", activation=...)``: the activation (and any quantization) over every row;
5. GEMM2 into ``down_output [T * k, H]`` (bf16, the router weight not applied);
6. ``moe_fused_mul_sum`` (``fused_moe/moe_fused_mul_sum.py``): per token, fp32 from 0, slots in order, ``acc +=
   row * weight``, ids < 0 (or sent to -1 by ``expert_map``) skipped, one cast.

Every per-expert tensor has the expert first and nothing crosses experts (the launcher addresses expert ``e`` at
``e * N * K``; NVFP4's global scale is read as ``gs[e]``). The weights come from ``w1``/``w2``, everything else
(block scales, zero points, biases, NVFP4's ``weight_scale_2``) from ``experts.quant_config``, whose tensors are the
layer's parameters (``get_live_param``): re-homing re-points them, so vLLM keeps no second copy.

What a row depends on besides its token and expert: the kernel's tile config, chosen from the tuning list by
``valid_shape_m`` (the call's shape, not its valid slots), and, where that config uses **stream-K**, on the whole
call's tile count (a tile's K range is cut into slices by position in the schedule, and the slices are added in
bf16, in order for 2-3 slices and by atomics for more, so vLLM's own call is then not deterministic). A tier call
made with the unsplit call's tuning list and ``valid_shape_m`` gets the unsplit config; without stream-K each tile
is one CTA's fp32 loop over K, stored once, so its rows are the unsplit call's. With stream-K no tier call can
reproduce them: :func:`stream_k_ranges` says where the tuning uses it, and ``VLLM_BATCH_INVARIANT=1`` switches it
off everywhere (``use_batch_invariant`` in the compute config).

The kernel's expert count is a compile-time constant (``LayerConfig.num_experts``, also in the launcher's shape
checks), so a tier's GEMMs run under the layer's config with the tier's row count (:func:`tier_config`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

__all__ = ["CLASS", "api_problem", "gemm", "is_indexed", "missing_tensor", "mul_sum", "stream_k_ranges",
           "tier_config"]

CLASS = "HummingIndexedExperts"
_MODULE = "vllm.model_executor.layers.fused_moe.experts.fused_humming_moe"
# humming's names for the per-expert tensors of a sublayer, and the quant config's for each
_QC_NAMES = {"weight_scale": "w{i}_scale", "zero_point": "w{i}_zp", "bias": "w{i}_bias",
             "weight_scale_2": "g{i}_alphas"}


def is_indexed(experts: Any) -> bool:
    """Whether ``experts`` is vLLM's ``HummingIndexedExperts`` with its own ``apply``."""
    from pinsidecar_hook.vllm_seam._common import vllm_class

    try:
        known = getattr(importlib.import_module(_MODULE), CLASS)
    except (ImportError, AttributeError):
        return False
    return isinstance(experts, known) and vllm_class(experts).apply is known.apply


def api_problem(experts: Any) -> str | None:
    """Why this experts object's Humming API is not the one the split is written against, or None."""
    for name in ("prepare_humming_moe_kwargs", "process_input", "prepare_buffers", "humming_configs", "locks",
                 "w13_tuning_config", "w2_tuning_config", "compute_config"):
        if not hasattr(experts, name):
            return f"this vLLM's {CLASS} has no {name} (the split is written against vLLM 0.34's)"
    return None


def stream_k_ranges(experts: Any) -> list[str]:
    """The tuning ranges (``sublayer (lo, hi]`` of ``valid_shape_m`` = tokens x k) whose config uses stream-K."""
    found = []
    for sub in ("w13", "w2"):
        for lo, hi, config in getattr(experts, f"{sub}_tuning_config"):
            if config.get("use_stream_k", False):
                found.append(f"{sub} ({lo}, {hi}]")
    return found


def tier_config(config: Any, rows: int) -> Any:
    """The sublayer's ``LayerConfig`` for a tier of ``rows`` experts: the same in everything but the count."""
    return dataclasses.replace(config, num_experts=rows)


def missing_tensor(experts: Any, sub: str, tensors: dict[str, Any]) -> str | None:
    """A per-expert tensor vLLM passes to ``sub``'s GEMM (its quant config holds it) that ``tensors`` (a tier's,
    by layer parameter name) lacks, or None: a tier call without it would run the kernel without the zero points or
    global scales the unsplit call uses. Asked once per tier, at attach."""
    index = 1 if sub == "w13" else 2
    for arg, qc_name in _QC_NAMES.items():
        passed = qc_name.format(i=index)
        if tensors.get(f"{sub}_{arg}") is None and getattr(experts.quant_config, passed, None) is not None:
            return f"vLLM passes {passed} but the tier has no {sub}_{arg}"
    return None


def gemm(experts: Any, sub: str, config: Any, tensors: dict[str, Any], *, inputs: Any, input_scale: Any,
         input_scale_2: Any, outputs: Any, **kwargs: Any) -> Any:
    """``HummingExpertsBase.humming_forward`` for one tier: the same call with the tier's config and per-expert
    tensors (``tensors``: the layer's parameter names, ``w13_weight``, ``w13_weight_scale``, ...; checked against
    vLLM's by :func:`missing_tensor` at attach)."""
    from vllm.utils.humming import humming_forward

    per_expert = {arg: tensors.get(f"{sub}_{arg}") for arg in _QC_NAMES}
    return humming_forward(config, inputs=inputs, weight=tensors[f"{sub}_weight"], input_scale=input_scale,
                           input_scale_2=input_scale_2, outputs=outputs, locks=experts.locks, **per_expert, **kwargs)


def mul_sum(rows: Any, topk_weights: Any, topk_ids: Any, expert_map: Any, output: Any) -> None:
    """vLLM's ``moe_fused_mul_sum`` over ``rows [T, k, H]``, as ``HummingIndexedExperts.apply`` calls it."""
    from vllm.model_executor.layers.fused_moe.moe_fused_mul_sum import moe_fused_mul_sum

    moe_fused_mul_sum(inputs=rows, topk_weights=topk_weights, topk_ids=topk_ids, expert_map=expert_map,
                      outputs=output)
