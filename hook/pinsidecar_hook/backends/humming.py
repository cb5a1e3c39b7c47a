"""Split invoke for vLLM's Humming MoE experts (``HummingIndexedExperts``): what vLLM 0.34 serves GPTQ/AWQ int4
and NVFP4 with on SM90. The Humming family's tier stage.

How the unsplit call computes is in :mod:`pinsidecar_hook.vllm_seam.humming`; in short, one row per (token, slot)
from GEMM1, the activation over all rows, GEMM2, then ``moe_fused_mul_sum`` (fp32, slot order, the router weight
applied in the sum). The split keeps that call's buffers and runs each GEMM once per tier into them:

- **tiers** (:meth:`HummingSplit.run_tiers`, the two tiers share buffers, so the family schedules them itself):
  the input processed once; GEMM1 of the hot tier, then of the cold tier, into the one ``gate_up_output`` (each
  call writes only its own slots' rows: vLLM's alignment with the tier's ``expert_map`` leaves the other tier's
  slots out); the activation once over every row, as vLLM runs it; GEMM2 of each tier into the one
  ``down_output``. Each tier call has the tier's per-expert tensors and row count and the *unsplit* call's
  ``valid_shape_m`` and tuning list, so it gets the tile config the unsplit call gets;
- **reduce** (:class:`HummingMulSum`): vLLM's ``moe_fused_mul_sum`` over ``down_output`` with the call's own ids
  and weights: the unsplit call's very reduction on the same rows.

The rows are the unsplit call's only where the config computes each tile in one piece. Humming's default tuning
uses **stream-K** for some batch sizes (on a Qwen3-30B-sized layer: decode at 1-2 tokens and large prefills, read
from humming's SM90 heuristics), where a tile's K loop is cut by the whole call's schedule and the slices are
summed in bf16 (vLLM's own call is then not deterministic past 3 slices). A layer whose tuning uses stream-K in any
range is refused at attach, naming ``VLLM_BATCH_INVARIANT=1`` (vLLM's batch-invariant mode: stream-K off for every
range) or ``--moe-backend marlin``.

Per-expert tensors, split in mirror: ``w13_weight``/``w2_weight`` (packed int32), the block scales, the zero points
(AWQ), the biases and NVFP4's per-expert global scale (``weight_scale_2``). Written from the source; ``VERIFIED``
and ``AUTO`` stay off until a GPU run shows the self-check bitwise. Refused: expert parallel (vLLM picks the
grouped class there), LoRA, a CPU device, and a map with a cache tier.
"""

from __future__ import annotations

from typing import Any

import torch

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
from pinsidecar_hook.vllm_seam import humming

__all__ = ["HummingMulSum", "HummingSplit"]

SUBLAYERS = ("w13", "w2")


class HummingMulSum(Reducer):
    """vLLM's ``moe_fused_mul_sum`` over the rows both tiers wrote into the one ``down_output``."""

    def __init__(self, mul_sum: Any = None) -> None:
        self.mul_sum = mul_sum or humming.mul_sum

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        self.mul_sum(rows.hot.values, call.topk_weights, call.topk_ids, call.expert_map, call.output)


class HummingSplit(SplitBackend):
    """One MoE layer's split invoke over vLLM's ``HummingIndexedExperts`` (module docstring). ``gemm`` (default
    :func:`pinsidecar_hook.vllm_seam.humming.gemm`) and ``reducer`` exist for tests."""

    NAME = "humming"
    SPLIT_TENSORS = tuple(f"{sub}_{name}" for sub in SUBLAYERS
                          for name in ("weight", "weight_scale", "weight_scale_2", "zero_point", "bias"))
    # static activation scales, one for the layer (a per-expert one is refused by the re-homing plan)
    SHARED_TENSORS = tuple(f"{sub}_{name}" for sub in SUBLAYERS for name in ("input_scale", "input_scale_2"))
    VERIFIED = False  # written from 0.34's source; VERIFIED once the in-engine self-check ran on the GPU
    AUTO = False  # auto picks verified backends only
    TIER_MAPS = True  # each tier's GEMMs align the call's ids through the tier's expert_map

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not humming.is_indexed(experts):
            return f"it splits vLLM's {humming.CLASS} (no expert parallel)"
        if device.type != "cuda":
            return "the Humming kernels run on CUDA only"
        problem = humming.api_problem(experts)
        if problem is not None:
            return problem
        stream_k = humming.stream_k_ranges(experts)
        if stream_k:
            return (f"Humming's tuning uses stream-K for valid_shape_m (tokens x top-k) in {', '.join(stream_k)}: "
                    "there a tile's K loop is cut by the whole call's schedule and its slices summed in bf16, so no "
                    "per-tier call gives vLLM's bits. Boot vLLM with VLLM_BATCH_INVARIANT=1 (stream-K off in "
                    "every range; it also makes vLLM's other kernels batch-invariant, and slower), or with "
                    "--moe-backend marlin (MarlinExperts, split but not bit-identical)")
        return None

    def __init__(self, experts: Any, layer: Any, *, gemm: Any = None, reducer: Reducer | None = None,
                 num_real: Any = REAL_TOKENS) -> None:
        self._reducer = reducer
        self.gemm = gemm or humming.gemm
        super().__init__(experts, layer, num_real=num_real)
        for tier in (self.hot, self.cold):
            for sub in SUBLAYERS:
                missing = humming.missing_tensor(experts, sub, tier.tensors) if tier.rows else None
                if missing is not None:
                    raise UnsupportedSplit(f"Humming split: {missing}")
        self.configs = {tier.name: {sub: humming.tier_config(experts.humming_configs[sub], tier.rows)
                                    for sub in SUBLAYERS} for tier in (self.hot, self.cold)}

    def choose_reducer(self) -> Reducer:
        return self._reducer or HummingMulSum()

    def check_call(self, call: ExpertsCall) -> None:
        if getattr(self.experts, "_lora_context", None) is not None:
            raise UnsupportedSplit("Humming split: LoRA is active; it hooks the activation and the rows")
        if call.expert_map is not None or call.expert_tokens_meta is not None:
            raise UnsupportedSplit("Humming split: expert parallel is not split (vLLM picks the grouped class there)")
        if call.apply_router_weight_on_input:
            raise UnsupportedSplit("Humming split: vLLM's Humming class refuses router weights on the input too")

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        raise NotImplementedError("the Humming tiers share one call's buffers: run_tiers runs them")

    def _buffers(self, call: ExpertsCall) -> dict[str, torch.Tensor]:
        """The unsplit call's buffers, in its workspaces (the ones vLLM passed, or fresh where it passed none)."""
        experts, (m, k) = self.experts, call.topk_ids.shape
        if call.workspace13 is not None and call.workspace2 is not None:
            return experts.prepare_buffers(call.workspace13, call.workspace2, m, k, call.activation)
        metas, required = experts.get_buffer_metas(m, k, call.activation)
        return {name: torch.empty(metas[name]["shape"], dtype=metas[name]["dtype"], device=call.output.device)
                for name in required}

    def run_tiers(self, call: ExpertsCall, part: Partition) -> TierRows:
        experts = self.experts
        tiers = [tier for tier in (self.hot, self.cold) if tier.rows > 0]
        hidden = call.hidden_states.view(-1, call.hidden_states.size(-1))
        buffers = self._buffers(call)
        # each tier's alignment: the unsplit valid_shape_m and tile configs, the tier's own slots as local rows
        kwargs = {tier.name: experts.prepare_humming_moe_kwargs(call.topk_ids, tier.expert_map, None)[:2]
                  for tier in tiers}
        inputs, scale, scale_2 = experts.process_input(
            "w13", inputs=hidden, input_scale=call.a1q_scale, quanted_input=buffers.get("quanted_gate_up_input"))
        for tier in tiers:
            self.gemm(experts, "w13", self.configs[tier.name]["w13"], tier.tensors, inputs=inputs, input_scale=scale,
                      input_scale_2=scale_2, outputs=buffers["gate_up_output"], **kwargs[tier.name][0])
        inputs, scale, scale_2 = experts.process_input(
            "w2", inputs=buffers["gate_up_output"], quanted_input=buffers["quanted_down_input"],
            activation=call.activation, scatter_idx=None)
        down = buffers["down_output"].view(-1, hidden.size(-1))
        for tier in tiers:
            self.gemm(experts, "w2", self.configs[tier.name]["w2"], tier.tensors, inputs=inputs, input_scale=scale,
                      input_scale_2=scale_2, outputs=down, **kwargs[tier.name][1])
        return TierRows(Rows(buffers["down_output"].view(*call.topk_ids.shape, -1)))
