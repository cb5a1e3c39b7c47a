"""Split invoke for FlashInfer's ``trtllm_fp4_block_scale_routed_moe`` (SM100, MXFP4): two expert windows, one
finalize in slot order. The FlashInfer family's tier stage.

**Not run on hardware.** :class:`FlashinferTrtllmSplit` has not run on a GPU or in an engine: no machine here has an
SM100 GPU (the lent H200 is SM90) and FlashInfer's TRT-LLM MoE kernels need one. This adapter is written against
the call vLLM 0.33 and 0.34 make in ``experts/trtllm_mxfp4_moe.py: TrtLlmMxfp4ExpertsModular._invoke_kernel``; the
id renumbering, the windows, the finalize and the wiring into the stages are unit-tested with a *fake* kernel that
follows FlashInfer's documented ``do_finalize=False`` contract (tests/test_backends_gpu_adapters.py).

The contract used. Called with ``do_finalize=False``, the kernel returns ``[gemm2_permuted [P, H] (unweighted),
expert_weights [T*k], expanded_idx_to_permuted_idx [T*k] int32]``: for every (token, slot) whose expert id lies
in ``[local_expert_offset, local_expert_offset + local_num_experts)``, the row of ``gemm2_permuted`` holding that
slot's expert output, and ``-1`` for every other slot. ``gemm1_weights`` & co. hold exactly the window's experts.

The split, stage by stage:

1. Partition (the base's, with live counts and the padding mask), then each slot's expert renumbered to its row:
   hot experts ``0..H-1``, cold ``H..H+C-1`` (:meth:`~pinsidecar_hook.backends.base.Partition.row_ids`). Slots of
   another rank's experts get an id outside both windows (``num_experts - 1`` when ``H + C < num_experts``).
2. The kernel twice with ``do_finalize=False``: the hot window ``(0, H)`` over the hot weights and scales, and the
   cold window ``(H, C)`` over the cold ones. Each call computes only its own slots. ``num_experts`` stays the
   unsplit value, so the routing geometry the kernel sees does not depend on the map. Tokens are cut in chunks as
   vLLM cuts them (``_max_supported_tokens``, the batched GEMM's grid limit).
3. Finalize once ourselves (:class:`~pinsidecar_hook.backends.reduce.SlotOrderFinalize` with ``gather=True``): each
   slot's row through the two permute maps, ``fma(weight, row, acc)`` in fp32 in slot order ``0..k-1``, one cast.
   FlashInfer's own finalize is not used: 0.7.2's small-batch finalize does not sum in slot order for top_k > 4, so
   its result would depend on which slots share a call. The split never defers the reduction (vLLM 0.34's
   ``UnfinalizedMoEOutput``): it always writes ``output``.

What is *not* established without hardware: that each slot's GEMM rows are the same bits whichever window computes
them (true when both calls pick the same kernel tactic for the tile; the autotuner keys on shapes that include
the local expert count). Placement invariance on SM100 therefore needs a hardware run before it is claimed.
"""

from __future__ import annotations

import dataclasses
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
)
from pinsidecar_hook.backends.reduce import SlotOrderFinalize
from pinsidecar_hook.kernels.partition import partition_torch

__all__ = ["FlashinferTrtllmSplit", "TierTensors", "expert_windows", "renumber_for_windows"]

# Layer parameter -> TierTensors field: the MXFP4 weights, their block scales and the optional biases.
_TIER_FIELD_OF = {"w13_weight": "gemm1_weights", "w13_weight_scale": "gemm1_weights_scale",
                  "w2_weight": "gemm2_weights", "w2_weight_scale": "gemm2_weights_scale",
                  "w13_bias": "gemm1_bias", "w2_bias": "gemm2_bias"}
# Per-expert activation parameters that vLLM keeps on the experts object (one value per local expert).
_PER_EXPERT_ARGS = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")


def renumber_for_windows(
    topk_ids: torch.Tensor, row_map: torch.Tensor, hot_rows: int, num_experts: int
) -> torch.Tensor:
    """Each slot's expert id replaced by its row (hot ``0..H-1``, cold ``H..H+C-1``); slots whose expert has no
    row on this rank (row map ``-1``, or an id out of range) get ``num_experts - 1``, which lies outside both
    windows whenever such experts exist (``H + C < num_experts``). int32, as the kernel takes it. The split derives
    the same ids from its partition."""
    return Partition(*partition_torch(topk_ids, row_map, hot_rows)).row_ids(hot_rows, absent=num_experts - 1)


def expert_windows(hot_rows: int, cold_rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(local_expert_offset, local_num_experts)`` of the hot call and of the cold call."""
    return (0, hot_rows), (hot_rows, cold_rows)


@dataclasses.dataclass
class TierTensors:
    """One tier's per-expert tensors in the kernel's layout (rows in tier order). Scales are the MXFP4 block
    scales; biases and the per-expert activation parameters (``gemm1_alpha``, ``gemm1_beta``,
    ``gemm1_clamp_limit``, one value per expert of the tier) may be None."""

    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor
    gemm1_bias: torch.Tensor | None = None
    gemm2_bias: torch.Tensor | None = None
    gemm1_alpha: torch.Tensor | None = None
    gemm1_beta: torch.Tensor | None = None
    gemm1_clamp_limit: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.gemm1_weights.shape[0])


def _flashinfer_kernel() -> Callable[..., Any]:
    from flashinfer import trtllm_fp4_block_scale_routed_moe

    return trtllm_fp4_block_scale_routed_moe


def _tier_tensors(experts: Any, tier: dict[str, torch.Tensor], num: int) -> TierTensors:
    fields: dict[str, Any] = {_TIER_FIELD_OF[name]: t for name, t in tier.items() if name in _TIER_FIELD_OF}
    for arg in _PER_EXPERT_ARGS:
        values = getattr(experts, arg, None)
        if values is None:
            continue
        # vLLM builds these from one scalar per layer, so every expert has the same value and a tier takes the first
        # ``num``; a per-expert difference would need the tier's own experts, which the layer state does not name.
        if values.numel() and not bool((values == values.reshape(-1)[0]).all()):
            raise ValueError(f"{arg} differs between experts; the FlashInfer split supports one value per layer")
        fields[arg] = values[:num]
    return TierTensors(**fields)


class FlashinferTrtllmSplit(SplitBackend):
    """The split for vLLM's ``TrtLlmMxfp4ExpertsModular`` (module docstring), built once at attach. Never run on
    hardware: ``auto`` does not pick it.

    It ignores the weights and ``expert_map`` vLLM passes (the layer state holds both tiers; its row map sends other
    ranks' experts to -1). ``kernel`` and ``kernel_args_fn`` (default: vLLM's arguments, through
    :func:`pinsidecar_hook.vllm_seam.flashinfer.kernel_args`) exist for tests.
    """

    NAME = "flashinfer_trtllm"
    SPLIT_TENSORS = tuple(_TIER_FIELD_OF)
    REQUIRED_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    VERIFIED = False
    AUTO = False

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if not vllm_seam.flashinfer.is_experts(experts):
            return "it splits vLLM's TrtLlmMxfp4ExpertsModular (MXFP4 through FlashInfer on SM100) only"
        return None

    def __init__(self, experts: Any, layer: Any, *, kernel: Callable[..., Any] | None = None,
                 kernel_args_fn: Callable[[Any, Any], dict[str, Any]] | None = None,
                 num_real: Any = REAL_TOKENS) -> None:
        super().__init__(experts, layer, num_real=num_real)
        num_experts = self.global_num_experts
        local = layer.hot_rows + layer.cold_rows
        if local > num_experts:
            raise ValueError(f"{local} local rows exceed num_experts={num_experts}")
        if local == num_experts and bool((layer.row_map < 0).any()):
            raise ValueError("row map has -1 entries but no spare expert id outside both windows (H + C == E)")
        self.tensors = {"hot": _tier_tensors(experts, layer.hot, layer.hot_rows),
                        "cold": _tier_tensors(experts, layer.cold, layer.cold_rows)}
        if self.tensors["hot"].num_experts != layer.hot_rows:
            raise ValueError(f"hot tier holds {self.tensors['hot'].num_experts} experts, the map says "
                             f"{layer.hot_rows}")
        self.kernel = kernel
        self.args_fn = kernel_args_fn or vllm_seam.flashinfer.kernel_args
        self.args_by_activation: dict[Any, dict[str, Any]] = {}

    def choose_reducer(self) -> Reducer:
        return SlotOrderFinalize(weighted_rows=False, gather=True)

    def chunk_tokens(self, call: ExpertsCall) -> int:
        max_tokens = getattr(self.experts, "_max_supported_tokens", None)
        if max_tokens is None:
            return call.num_tokens
        return max_tokens(call.topk_ids.shape[1], self.global_num_experts)

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        if call.activation not in self.args_by_activation:
            self.args_by_activation[call.activation] = self.args_fn(self.experts, call.activation)
        tensors = self.tensors[tier.name]
        ids = part.row_ids(self.layer.hot_rows, absent=self.global_num_experts - 1)
        x_scale = None if call.a1q_scale is None else call.a1q_scale.view(torch.float8_e4m3fn)
        kernel = self.kernel or _flashinfer_kernel()
        gemm2_permuted, _expert_weights, expanded_idx = kernel(
            topk_ids=(ids, call.topk_weights),
            routing_bias=None,
            hidden_states=call.hidden_states,
            hidden_states_scale=x_scale,
            gemm1_weights=tensors.gemm1_weights,
            gemm1_weights_scale=tensors.gemm1_weights_scale,
            gemm1_bias=tensors.gemm1_bias,
            gemm1_alpha=tensors.gemm1_alpha,
            gemm1_beta=tensors.gemm1_beta,
            gemm1_clamp_limit=tensors.gemm1_clamp_limit,
            gemm2_weights=tensors.gemm2_weights,
            gemm2_weights_scale=tensors.gemm2_weights_scale,
            gemm2_bias=tensors.gemm2_bias,
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
            num_experts=self.global_num_experts,
            top_k=ids.shape[1],
            n_group=None,
            topk_group=None,
            local_expert_offset=tier.offset,
            local_num_experts=tier.rows,
            routed_scaling_factor=None,
            do_finalize=False,
            output=None,
            **self.args_by_activation[call.activation],
        )
        return Rows(gemm2_permuted, expanded_idx.view(ids.shape))
