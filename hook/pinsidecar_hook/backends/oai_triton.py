"""Split invoke for vLLM's OAI Triton MoE experts: gpt-oss MXFP4 through triton_kernels' ``matmul_ogs``, the modular
classes ``UnfusedOAITritonExperts`` (``--moe-backend triton_unfused``) and ``OAITritonExperts`` (the modular form of
the default Triton MXFP4 backend), and the default monolithic ``OAITritonMxfp4ExpertsMonolithic``. The OAI family's
tier stage.

How the unsplit call computes, and what the split relies on (:mod:`pinsidecar_hook.vllm_seam.oai_triton` has the
line numbers): each slot's row is GEMM1, the activation, GEMM2 with the router weight, written in the activation
dtype (``split_k`` is pinned to 1 on SM90); each token's k rows are then summed in fp32 in slot order with one cast
(``masked_moe_sum`` for the unfused class, ``reduce_grouped`` inside ``matmul_ogs`` for the fused one: the same
arithmetic). So:

- **tiers**: one call per tier of vLLM's own routing and ``matmul_ogs`` (:func:`~pinsidecar_hook.vllm_seam.
  oai_triton.tier_rows`) with the tier's swizzled MXFP4 weights, ue8m0 block scales and fp32 biases, the other
  tier's slots ``-1``, GEMM2 told to scatter rows rather than sum them, and every GEMM under the *unsplit* call's
  tiling (a tier's own would follow its own expert count);
- **reduce**: the two tiers' rows merged slot by slot and summed by vLLM's ``masked_moe_sum`` (:class:`OAIRows`).

Per-expert tensors, split in mirror by re-homing, which keeps their swizzled memory order: ``w13_weight``,
``w2_weight`` (packed FP4, swizzled for Hopper's MMA), ``w13_weight_scale``, ``w2_weight_scale`` (swizzled ue8m0),
``w13_bias``, ``w2_bias`` (fp32). vLLM keeps second references to the weights and scales (triton_kernels tensors
over the same storage); :meth:`OAITritonSplit.before_rehome` drops them so the originals are freed, and keeps their
layout, dtype and shape as the templates of the tier tensors.

The default MXFP4 kernel on SM90 is ``OAITritonMxfp4ExpertsMonolithic``, which takes the router's logits and routes
inside itself. Its arithmetic after routing is ``OAITritonExperts``'s, so the split stands in for it (``ROUTES``):
it routes the logits with the kernel's own ``topk`` call (count mode's probe, which also hands back the router
weights), then runs the fused form. Its fused swiglu rounds differently from the unfused class's activation op, so
the two classes' outputs differ from each other; each split aims at its own class. Both are bitwise, shown on an
H100 with vLLM 0.34.0 (its vendored triton_kernels 3.5.1; the 3.6 branches were read, not run): kernel by kernel
(``scripts/gpu_lane/oai_split_check.py``: each form against vLLM's own call, 1 to 4096 tokens, 0 to 100 % cold,
24/24 each) and in the engine (the self-check on every layer, 480/480 for each class, greedy tokens equal to the
hook-off engine's; ``bench/results/gpu_lane_h100_vllm0.34_mxfp4_*_2026-12-07.json``). So ``VERIFIED`` and ``AUTO``
are on. Refused: LoRA (it hooks the activation and the rows), triton_kernels 3.8, a CPU device, a layer without
MXFP4 weight scales, and a map with a cache tier (``CACHE`` is off: slots would need MXFP4 fills).
"""

from __future__ import annotations

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
    TierRows,
    UnsupportedSplit,
)
from pinsidecar_hook.backends.reduce import merged_rows
from pinsidecar_hook.vllm_seam import oai_triton

__all__ = ["OAIRows", "OAITritonSplit"]


class OAIRows(Reducer):
    """The tiers' rows merged slot by slot, summed by vLLM's ``masked_moe_sum`` (fp32, slot order, one cast),
    skipping the slots of experts on another rank."""

    def __init__(self, hot_rows: int) -> None:
        self.hot_rows = hot_rows

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        oai_triton.module().masked_moe_sum(merged_rows(part, rows), part.row_ids(self.hot_rows), call.output)


class OAITritonSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's modular OAI Triton experts (module docstring). ``rows_fn``
    (default :func:`pinsidecar_hook.vllm_seam.oai_triton.tier_rows`) and ``reducer`` exist for tests."""

    NAME = "oai_triton"
    SPLIT_TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
    REQUIRED_TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    VERIFIED = True  # H100, vLLM 0.34.0, 2026-12-07: kernel check 24/24 per form, self-check 480/480 per class
    ROUTES = True  # it stands in for the monolithic class too (module docstring)

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        form = oai_triton.kind(experts)
        if form is None:
            return ("it splits vLLM's OAI Triton MXFP4 experts (UnfusedOAITritonExperts, OAITritonExperts, "
                    "OAITritonMxfp4ExpertsMonolithic)")
        if form == "monolithic" and not hasattr(experts, "renormalize"):
            return "this OAITritonMxfp4ExpertsMonolithic has no routing rule (renormalize) the split can follow"
        if device.type != "cuda":
            return "the OAI Triton kernels run on CUDA only"
        problem = oai_triton.api_problem()
        if problem is not None:
            return problem
        qc = getattr(experts, "quant_config", None)
        if getattr(getattr(qc, "w1_precision", None), "weight_scale", None) is None:
            return "only MXFP4 weights (with block scales in the precision config) are split"
        return None

    @classmethod
    def before_rehome(cls, experts: Any, owner: Any) -> None:
        experts._pinsidecar_oai_templates = oai_triton.release_views(owner, experts)

    def __init__(self, experts: Any, layer: Any, *, rows_fn: Any = None, reducer: Reducer | None = None,
                 form: str | None = None, num_real: Any = REAL_TOKENS) -> None:
        """``form``: "unfused", "fused" or "monolithic", for an experts object that is not vLLM's class (the
        kernel-level check and the tests); otherwise the class says (:func:`oai_triton.kind`)."""
        self._reducer = reducer
        self.rows_fn = rows_fn or oai_triton.tier_rows
        found = form or oai_triton.kind(experts)
        if found not in ("unfused", "fused", "monolithic"):
            raise UnsupportedSplit(f"not an OAI Triton experts object: {type(experts).__name__}")
        self.form = "fused" if found == "monolithic" else found  # the monolithic kernel's arithmetic is the fused one
        super().__init__(experts, layer, num_real=num_real)
        self.local_experts = layer.hot_rows + layer.cold_rows
        templates = getattr(experts, "_pinsidecar_oai_templates", None)
        if templates is None:
            raise UnsupportedSplit("OAI Triton split: built before before_rehome kept vLLM's weight tensors, whose "
                                   "layout the tier tensors need")
        qc = experts.quant_config
        self.tier_args = {tier.name: self._tier_args(tier, templates, qc) for tier in (self.hot, self.cold)}

    @staticmethod
    def _tier_args(tier: Tier, templates: dict[str, Any], qc: Any) -> dict[str, Any]:
        """A tier's weights as the kernel takes them: triton_kernels tensors over the tier's rows (layout, dtype
        and logical shape of vLLM's own), its precision configs with the tier's block scales, its biases."""
        t = tier.tensors
        args: dict[str, Any] = {"w1_bias": t.get("w13_bias"), "w2_bias": t.get("w2_bias")}
        for w, name, precision in (("w1", "w13", qc.w1_precision), ("w2", "w2", qc.w2_precision)):
            args[w] = oai_triton.tier_tensor(templates[f"{name}_weight"], t[f"{name}_weight"].data)
            scale = oai_triton.tier_tensor(precision.weight_scale, t[f"{name}_weight_scale"].data)
            args[f"{w}_precision"] = oai_triton.precision_with_scale(precision, scale)
        return args

    def choose_reducer(self) -> Reducer:
        return self._reducer or OAIRows(self.layer.hot_rows)

    def route(self, router_logits: torch.Tensor, **routing: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The monolithic kernel's routing: top-k of the logits (renormalized or softmax-first). Its ``apply``
        takes grouped top-k, a correction bias, the routed scaling factor and a replay buffer and uses none of them
        (vLLM 0.34 ``gpt_oss_triton_kernels_moe.py:1579-1608``; its oracle admits only renormalizing routing), so
        neither does the split."""
        return vllm_seam.monolithic.oai_triton_routing(self.experts, router_logits)

    def check_call(self, call: ExpertsCall) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("OAI Triton split: LoRA is active; it hooks the activation and the rows")

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        if tier.rows == 0:  # an all-cold layer's hot tier: no rows to compute
            return Rows(torch.zeros((*call.topk_ids.shape, call.hidden_states.shape[-1]),
                                    dtype=call.output.dtype, device=call.output.device))
        return Rows(self.rows_fn(
            self.form, hidden_states=call.hidden_states, **self.tier_args[tier.name],
            topk_weights=call.topk_weights, tier_ids=part.ids(tier), num_experts=self.local_experts,
            activation=call.activation, activation_fn=getattr(self.experts, "activation", None),
            apply_router_weight_on_input=call.apply_router_weight_on_input))

