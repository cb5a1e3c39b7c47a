"""Split invoke for vLLM's ``TritonExperts`` (SM90+, bf16/fp8): two calls, one ``moe_sum``-exact finalize.

**Not run on hardware.** Neither :class:`TritonExpertsSplit` nor :func:`make_split_apply` has run on a GPU or in
an engine: vLLM's CUDA build is not on the lent H200 and the CPU build has no Triton experts. This adapter is
written against vLLM 0.33's interface (``model_executor/layers/fused_moe/experts/triton_moe.py``) and its id,
config-pinning, reduction and wiring logic is unit-tested against a reference with a fake experts object that
follows the same contract (tests/test_backends_gpu_adapters.py).

How ``TritonExperts.apply`` works, and what the split relies on:

- GEMM2 writes one row per (token, slot), already multiplied by the router weight in fp32 and rounded to the
  activation dtype, into ``intermediate_cache3 [T, k, K]`` (a view of ``workspace2``); then
  ``_finalize_expert_output`` reduces it with ``moe_sum``: an fp32 accumulator from 0, ``acc += float(row)`` in
  slot order, slots of experts ``expert_map`` marks ``-1`` skipped, one cast. :func:`pinsidecar_hook.kernels.finalize`
  with ``weighted_rows=True`` is that arithmetic, bit for bit.
- ``expert_map`` (global id -> local row, ``-1`` elsewhere) is vLLM's expert-parallel seam: slots mapped to ``-1``
  are dropped at alignment and skipped by ``moe_sum``. The split calls ``apply`` twice with the *tier* maps
  (:func:`tier_expert_maps`): the hot call sees hot experts renumbered ``0..H-1`` and ``-1`` elsewhere, the cold
  call cold experts ``0..C-1``. Each call computes only its own slots; a row map that is ``-1`` for another rank's
  experts makes both tier maps ``-1`` there, so expert parallel composes.
- The tile config is looked up from the weight shapes (the expert count among them) and the token count. The split
  pins the config of the *unsplit* shapes for both calls (``override_config``), so every row is computed by the
  same kernel instance with the same tiling as in the unsplit call. The map never enters the config key, so a
  remap with the same geometry changes no compiled kernel.
- Per-expert scales, zero points and biases come from the experts' quant config; each call gets a copy whose
  per-expert tensors are that tier's (:func:`tier_quant_config`).
- Weights in host memory are flagged ``_vllm_is_uva_offloaded`` (:func:`mark_host_resident`), which makes vLLM's
  alignment group each expert's tokens instead of re-reading weights per (token, expert) pair over the bus.

Refused (``UnsupportedSplit``), because the two calls could not reproduce the unsplit rows: LoRA (it aligns the
full ``topk_ids`` itself), a post-GEMM2 hook, and a per-tensor *dynamic* scale for GEMM2's input (its amax would be
taken over one tier's rows only).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = [
    "NAME",
    "REQUIRED_TENSORS",
    "SPLIT_TENSORS",
    "TritonExpertsSplit",
    "UnsupportedSplit",
    "check_supported",
    "make_split_apply",
    "mark_host_resident",
    "moe_sum_reference",
    "tier_expert_maps",
    "tier_quant_config",
]


NAME = "triton_experts"
# Layer parameter -> the FusedMoEQuantConfig field that holds the same per-expert tensor (tier_quant_config keys).
_QUANT_FIELD_OF = {"w13_weight_scale": "w1.scale", "w2_weight_scale": "w2.scale", "w13_bias": "w1.bias",
                   "w2_bias": "w2.bias"}
# The per-expert tensors this backend splits: the weights, and what the quant config's weight descriptors hold per
# expert (scales, biases). Zero points and global scales are not mapped yet, so a layer with them is refused.
SPLIT_TENSORS = ("w13_weight", "w2_weight", *_QUANT_FIELD_OF)
REQUIRED_TENSORS = ("w13_weight", "w2_weight")


class UnsupportedSplit(RuntimeError):
    """The experts object is configured in a way a two-call split cannot reproduce bit for bit."""


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


# Per-expert tensors of FusedMoEQuantConfig's weight descriptors (_w1, _w2) that a tier must replace.
_TIER_FIELDS = ("scale", "alpha_or_gscale", "zp", "bias")


def tier_quant_config(quant_config: Any, tier: dict[str, torch.Tensor | None]) -> Any:
    """A copy of vLLM's ``FusedMoEQuantConfig`` whose per-expert weight tensors are one tier's.

    ``tier`` maps ``"w1.scale"``, ``"w2.bias"``, ... to that tier's tensor (rows in tier order). Fields not named
    keep the original object (per-tensor scales are shared by both tiers). A per-expert field (leading dimension
    = number of experts) left unnamed is an error: the call would read the wrong experts' scales."""
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


def check_supported(experts: Any, num_tokens: int, a2_scale: torch.Tensor | None) -> None:
    """Raise :class:`UnsupportedSplit` where the split cannot be bit-identical (module docstring)."""
    if getattr(experts, "_lora_context", None) is not None:
        raise UnsupportedSplit("TritonExperts split: LoRA is active; LoRA aligns the full topk_ids itself")
    uses_hook = getattr(experts, "_uses_post_gemm2_hook", None)
    if uses_hook is not None and uses_hook(num_tokens):
        raise UnsupportedSplit("TritonExperts split: a post-GEMM2 hook consumes the rows instead of moe_sum")
    a2_is_global = (
        getattr(experts, "quant_dtype", None) is not None
        and a2_scale is None
        and getattr(experts, "block_shape", None) is None
        and (not getattr(experts, "per_act_token_quant", False) or getattr(experts, "quantization_emulation", False))
    )
    if a2_is_global:
        raise UnsupportedSplit(
            "TritonExperts split: GEMM2's input uses a per-tensor dynamic scale; each call would take its amax over "
            "one tier's rows. Use a static a2 scale, per-token or block quantization"
        )


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


@contextmanager
def _capture_rows(experts: Any, sink: list[torch.Tensor]):
    """Make ``experts.apply`` hand its unreduced rows (``intermediate_cache3``) to ``sink`` instead of reducing."""

    def capture(expert_output, output, topk_ids=None, expert_map=None):
        sink.append(expert_output)

    experts._finalize_expert_output = capture  # instance attribute shadows the method
    try:
        yield
    finally:
        del experts._finalize_expert_output


@dataclasses.dataclass
class TritonExpertsSplit:
    """One MoE layer's split invoke over a ``TritonExperts`` object.

    Built once per layer at attach time (:func:`make_split_apply`); both calls go to the experts *class's*
    ``apply`` (the instance's is replaced by the split). ``full_w1_shape``/``full_w2_shape`` are the unsplit
    weight shapes (``[E_local, ...]``) whose tile config both calls use. ``config_fn`` and ``override_fn`` default
    to vLLM's (through :mod:`pinsidecar_hook.vllm_seam`) and exist for tests."""

    experts: Any
    row_map: torch.Tensor
    hot_rows: int
    global_num_experts: int
    full_w1_shape: tuple[int, ...]
    full_w2_shape: tuple[int, ...]
    hot_quant_config: Any
    cold_quant_config: Any
    expert_counts: torch.Tensor | None = None
    cold_counts: torch.Tensor | None = None
    config_fn: Any = None
    override_fn: Any = None

    def __post_init__(self) -> None:
        self.hot_map, self.cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.config_fn = self.config_fn or vllm_seam.triton_moe_config
        self.override_fn = self.override_fn or vllm_seam.triton_override_config

    def _call(self, quant_config, sink, **kwargs) -> None:
        original = self.experts.quant_config
        self.experts.quant_config = quant_config
        try:
            with _capture_rows(self.experts, sink):
                type(self.experts).apply(self.experts, **kwargs)  # the class's: the instance's is the split
        finally:
            self.experts.quant_config = original

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1_hot: torch.Tensor,
        w2_hot: torch.Tensor,
        w1_cold: torch.Tensor,
        w2_cold: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Any,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Any,
        apply_router_weight_on_input: bool,
    ) -> None:
        """The two calls and the finalize; writes ``output [T, K]`` as the unsplit ``apply`` would."""
        num_tokens, top_k = topk_ids.shape
        check_supported(self.experts, num_tokens, a2_scale)
        hot_ids, cold_ids = partition(topk_ids, self.row_map, self.hot_rows, self.expert_counts, self.cold_counts)
        config = self.config_fn(
            self.experts, self.full_w1_shape, self.full_w2_shape, top_k, hidden_states.dtype, num_tokens
        )
        common = dict(
            hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation,
            global_num_experts=self.global_num_experts, a1q_scale=a1q_scale, a2_scale=a2_scale,
            workspace13=workspace13, expert_tokens_meta=expert_tokens_meta,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        hot_rows_out: list[torch.Tensor] = []
        cold_rows_out: list[torch.Tensor] = []
        with self.override_fn(config):
            # The hot call's rows must survive the cold call: give the cold call its own workspace2.
            self._call(self.hot_quant_config, hot_rows_out, output=output, w1=w1_hot, w2=w2_hot,
                       expert_map=self.hot_map, workspace2=workspace2, **common)
            if w1_cold.shape[0] > 0:
                self._call(self.cold_quant_config, cold_rows_out, output=output, w1=w1_cold, w2=w2_cold,
                           expert_map=self.cold_map, workspace2=torch.empty_like(workspace2), **common)
        rows_hot = hot_rows_out[0]
        rows_cold = cold_rows_out[0] if cold_rows_out else rows_hot
        finalize(rows_hot, None, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold, weighted_rows=True,
                 out=output)


def _tier_quant_tensors(tier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_QUANT_FIELD_OF[name]: t for name, t in tier.items() if name in _QUANT_FIELD_OF}


def make_split_apply(experts: Any, layer: Any, *, config_fn: Any = None, override_fn: Any = None) -> Any:
    """A replacement for ``experts.apply`` (vLLM's ``FusedMoEExpertsModular.apply`` signature) that runs a
    :class:`TritonExpertsSplit` over the layer's hot and cold tensors (``layer`` is a
    :class:`pinsidecar_hook.backends.SplitLayer`). Not run on hardware (module docstring).

    The weights vLLM passes (the layer's parameters, which now hold the hot rows) and its ``expert_map`` are
    ignored: the layer state holds both tiers, and its row map already sends other ranks' experts to -1.
    ``config_fn``/``override_fn`` are for tests (see :class:`TritonExpertsSplit`).
    """
    hot, cold = layer.hot, layer.cold
    local = layer.hot_rows + layer.cold_rows
    split = TritonExpertsSplit(
        experts=experts, row_map=layer.row_map, hot_rows=layer.hot_rows,
        global_num_experts=int(layer.row_map.shape[0]),
        full_w1_shape=(local, *hot["w13_weight"].shape[1:]), full_w2_shape=(local, *hot["w2_weight"].shape[1:]),
        hot_quant_config=tier_quant_config(experts.quant_config, _tier_quant_tensors(hot)),
        cold_quant_config=tier_quant_config(experts.quant_config, _tier_quant_tensors(cold)),
        expert_counts=layer.expert_counts, cold_counts=layer.cold_counts, config_fn=config_fn,
        override_fn=override_fn,
    )

    def split_apply(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                    expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                    workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
                    apply_router_weight_on_input: bool) -> None:
        layer.token_counts.add_(topk_ids.shape[0])
        split.apply(output, hidden_states, hot["w13_weight"], hot["w2_weight"], cold["w13_weight"],
                    cold["w2_weight"], topk_weights, topk_ids, activation, a1q_scale, a2_scale, workspace13,
                    workspace2, expert_tokens_meta, apply_router_weight_on_input)

    split_apply._pinsidecar_split = True  # type: ignore[attr-defined]
    split_apply.split = split  # type: ignore[attr-defined]
    return split_apply
