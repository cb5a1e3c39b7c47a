"""Torch reference experts backend: a grouped GEMM in plain torch that leaves the routed rows unfinalized.

What it is for. It is the one backend whose split can be checked *bit for bit against its own unsplit call* on
every machine we have (the CPU here, the H200 through the device tool), and it is the experts stage of the GPU
benchmark. It is not a production path: it loops over experts in Python, and its arithmetic is its own, not the
engine kernel's, so an engine served through it gives slightly different outputs than the same engine unsplit.
That is why the registry never picks it automatically; :class:`TorchRefSplit` exists so that it can be asked
for (``PINSIDECAR_PIN_BACKEND=torch_ref``) as an in-engine reference on any device, for SiLU-and-mul experts with
unquantized activations (weights unquantized or quantized, below). It has run only in the tests here
(tests/test_backends_ref.py, tests/test_backends_quant_ref.py, tests/test_gpu.py), not in an engine.

Why the split is bit-identical to the unsplit call by construction:

- every expert lives wholly in one tier, and for every expert both paths run the *same* GEMMs on the *same* rows
  in the *same* order: the (token, slot) pairs routed to it, gathered in flat ``token * k + slot`` order (a stable
  sort keeps that order), against the same weights (the hot and cold tensors hold byte copies of the originals,
  in the same per-expert layout);
- every (token, slot) row is therefore the same bits in both paths, whichever tier computed it;
- both paths end in the same finalize (:func:`pinsidecar_hook.kernels.finalize`): fp32 FMA of the router weight and
  the row, in slot order ``0..k-1``, one cast to the activation dtype.

Two experts implementations (``impl``): ``"loop"`` (the default, :func:`expert_rows`: one GEMM pair per expert in a
Python loop, with host syncs) and the grouped calls of :mod:`pinsidecar_hook.kernels.grouped` (``"triton"``,
``"grouped_mm"``: static shapes, capturable in a CUDA graph, every touched expert read once). The argument above
holds for each of them; splits and unsplit calls must use the same one.

Two tiers at once. HBM and the host link are independent resources, so on CUDA the cold call runs on a side stream,
forked from and joined to the current stream with events (capturable in a CUDA graph), writing its own rows buffer
that the finalize reads for the cold slots: the step costs about max(hot, cold) rather than their sum, with the
same bits (every row is computed by the same call on the same inputs either way). :data:`OVERLAP_DEFAULT` turns it
on for every split on CUDA (measured on the H200 by bench/placement.py); the CPU runs the two calls in turn.

Layout follows vLLM's unquantized experts: ``w13 [E, 2N, D]`` (gate rows then up rows), ``w2 [E, D, N]``, the
activation is SiLU-and-mul computed in fp32 and rounded once to the activation dtype.

Activation (``activation``, :data:`ACTIVATIONS`). ``"silu"`` (the default) is the SiLU-and-mul above.
``"swigluoai"`` is gpt-oss's (vLLM's ``MoEActivation.SWIGLUOAI``), on ``w13`` rows gate/up *interleaved* (gate =
rows ``0::2``, up = rows ``1::2``, as gpt-oss checkpoints and vLLM's mxfp4 layers keep them): :func:`swigluoai_and_mul`.
Only the ``loop`` implementation runs it (the grouped kernels have a SiLU epilogue only). Either way the
activation is a function of one (token, slot) row, so the bit-identity argument below is unchanged.

Quantized experts. :func:`unsplit` and :func:`split` also take a layer's per-expert tensors as a mapping (vLLM's
parameter names -> tensors; for a split, the ``hot`` and ``cold`` mappings), in any format of
:mod:`pinsidecar_hook.kernels.dequant` (fp8 block / per-tensor / per-channel, int4 GPTQ or AWQ groups, mxfp4,
nvfp4, with or without
biases). Each expert's dense weight is dequantized, in torch, before its GEMMs, from *its own rows* of the
tensors only (elementwise, and gathers within the row), so it is the same bits whichever tier the expert lives
in; the argument above then holds unchanged, and a split is bit-identical to the unsplit call over the original
tensors. A bias is added to its GEMM's output (already rounded to the activation dtype) in fp32, and the sum
rounded once more. A scalar shared by all experts (a static
input scale) is passed unsplit to both tiers. Activation quantization (FP8 w8a8's a1/a2 scales, dynamic or static)
is *not* modelled: the reference is weight-dequantization only, and :class:`TorchRefSplit` refuses a call that
brings quantized activations. With biases only the ``loop`` implementation runs (the grouped kernels have no bias
epilogue); the grouped implementations dequantize a tier's weights whole before their call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

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
)
from pinsidecar_hook.backends.reduce import SlotOrderFinalize
from pinsidecar_hook.backends.streams import fork_join
from pinsidecar_hook.kernels.dequant import (
    FP8_DTYPES,
    PER_EXPERT_TENSORS,
    QuantScheme,
    dequant,
    dequant_expert,
    expert_bias,
    scheme_of,
)
from pinsidecar_hook.kernels.dequant import SHARED_TENSORS as DEQUANT_SHARED_TENSORS
from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.grouped import IMPLS, grouped_experts, silu_and_mul
from pinsidecar_hook.kernels.partition import partition

__all__ = [
    "ACTIVATIONS",
    "IMPLS",
    "OVERLAP_DEFAULT",
    "REQUIRED_TENSORS",
    "SPLIT_TENSORS",
    "TorchRefSplit",
    "expert_rows",
    "split",
    "split_rows",
    "split_tiers",
    "swigluoai_and_mul",
    "tier_rows",
    "unsplit",
    "unsplit_rows",
]

NAME = "torch_ref"
# Every per-expert tensor the dequantization knows (weights, fp8 scales, int4 qweight/scales/qzeros/g_idx, biases).
SPLIT_TENSORS = PER_EXPERT_TENSORS
# None by name: the weights are required in one of two spellings (``w13_weight`` or, for int4, ``w13_qweight``),
# which a list of names cannot say. :class:`TorchRefSplit` refuses (scheme_of) a layer without them, at attach.
REQUIRED_TENSORS: tuple[str, ...] = ()
# Run the cold call on a side stream, concurrently with the hot one, on CUDA (module docstring).
OVERLAP_DEFAULT = True
_UNQUANTIZED = QuantScheme()
# gpt-oss's SwiGLU constants: vLLM's SwigluOAIAndMul defaults (model_executor/layers/activation.py:481) and the
# gemm1_alpha / gemm1_beta (the "+ 1") / swiglu_limit its mxfp4 method passes (quantization/mxfp4.py:430-432).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def swigluoai_and_mul(h: torch.Tensor) -> torch.Tensor:
    """gpt-oss's SwiGLU on ``[M, 2N]`` rows with gate and up *interleaved*: vLLM's ``SwigluOAIAndMul.forward_native``
    (model_executor/layers/activation.py:486-493): ``gate = h[:, ::2]`` clamped to at most the limit, ``up =
    h[:, 1::2]`` clamped to ``[-limit, limit]``, ``(up + 1) * (gate * sigmoid(gate * alpha))``. Computed in fp32
    and rounded once to ``h``'s dtype, as :func:`silu_and_mul` is (forward_native computes in ``h``'s dtype)."""
    x = h.float()
    gate = x[:, ::2].clamp(max=SWIGLUOAI_LIMIT)
    up = x[:, 1::2].clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return ((up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))).to(h.dtype)


# The experts' activations, by vLLM's MoEActivation value (fused_moe/activation.py:26, 34).
_ACTIVATE = {"silu": silu_and_mul, "swigluoai": swigluoai_and_mul}
ACTIVATIONS = tuple(_ACTIVATE)


def _check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"torch_ref activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


@dataclass(frozen=True)
class _Tier:
    """One experts call's per-expert tensors (rows in call order), their scheme and the experts' activation."""

    tensors: Mapping[str, torch.Tensor]
    scheme: QuantScheme
    activation: str = "silu"

    @property
    def num_rows(self) -> int:
        return self.tensors[self.scheme.per_expert[0]].shape[0]

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All rows' dense ``(w13, w2)`` for the grouped implementations (the unquantized tensors as they are)."""
        if self.scheme.bias:
            raise ValueError("torch_ref: biases are supported by impl='loop' only (the grouped kernels have no bias "
                             "epilogue)")
        if self.activation != "silu":
            raise ValueError(f"torch_ref: activation {self.activation!r} is supported by impl='loop' only (the "
                             "grouped kernels have a SiLU-and-mul epilogue)")
        return dequant(self.tensors, self.scheme, "w13", dtype), dequant(self.tensors, self.scheme, "w2", dtype)


def _tier(w13: torch.Tensor, w2: torch.Tensor) -> _Tier:
    return _Tier({"w13_weight": w13, "w2_weight": w2}, _UNQUANTIZED)


def _gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ w.T`` in ``a``'s dtype; a bias is added to that in fp32 and the sum rounded to ``a``'s dtype."""
    out = a @ w.t()
    if bias is None:
        return out
    return (out.to(torch.float32) + bias.to(torch.float32)).to(a.dtype)


def _expert_rows(x: torch.Tensor, tier: _Tier, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens, top_k = row_ids.shape
    hidden = x.shape[-1]
    if out is None:
        out = x.new_zeros((num_tokens, top_k, hidden))
    flat_out = out.view(num_tokens * top_k, hidden)
    flat = row_ids.reshape(-1).to(torch.int64)
    live = torch.nonzero(flat >= 0).squeeze(1)  # ascending flat indices
    if live.numel() == 0:
        return out
    order = torch.argsort(flat[live], stable=True)  # group by row, flat order kept inside a group
    pairs = live[order]
    rows_used, counts = torch.unique_consecutive(flat[pairs], return_counts=True)
    t, scheme = tier.tensors, tier.scheme
    activate = _ACTIVATE[tier.activation]
    plain = scheme == _UNQUANTIZED and t["w13_weight"].dtype == x.dtype  # the weights as they are (no copy)
    start = 0
    for row, count in zip(rows_used.tolist(), counts.tolist(), strict=True):
        sel = pairs[start : start + count]
        start += count
        xs = x.index_select(0, torch.div(sel, top_k, rounding_mode="floor"))
        if plain:
            act = activate(xs @ t["w13_weight"][row].t())
            flat_out[sel] = act @ t["w2_weight"][row].t()
            continue
        w13 = dequant_expert(t, scheme, row, "w13", x.dtype)
        act = activate(_gemm(xs, w13, expert_bias(t, scheme, row, "w13")))
        w2 = dequant_expert(t, scheme, row, "w2", x.dtype)
        flat_out[sel] = _gemm(act, w2, expert_bias(t, scheme, row, "w2"))
    return out


def expert_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unweighted expert outputs per (token, slot): ``out[t, j] = expert_{row_ids[t, j]}(x[t])`` where
    ``row_ids[t, j] >= 0`` (a row of ``w13``/``w2``); other slots of ``out`` are left as they are (zeros when
    ``out`` is made here). One GEMM pair per row used, over that row's pairs in flat order."""
    return _expert_rows(x, _tier(w13, w2), row_ids, out)


def tier_rows(
    x: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    row_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    scheme: QuantScheme | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """:func:`expert_rows` over one call's per-expert tensors by name, in any format of
    :mod:`pinsidecar_hook.kernels.dequant` (``scheme``: :func:`scheme_of` of ``tensors`` unless given). Each used
    row's weights are dequantized to ``x``'s dtype before its GEMMs; ``activation``: one of :data:`ACTIVATIONS`."""
    return _expert_rows(x, _Tier(tensors, scheme or scheme_of(tensors), _check_activation(activation)), row_ids, out)


def _rows(x: torch.Tensor, tier: _Tier, row_ids: torch.Tensor, impl: str) -> torch.Tensor:
    """``[T, k, D]`` rows of one call with the chosen implementation (slots with ``row_ids < 0`` unwritten)."""
    if impl == "loop":
        return _expert_rows(x, tier, row_ids)
    if impl not in IMPLS:
        raise ValueError(f"torch_ref impl must be 'loop' or one of {IMPLS}, got {impl!r}")
    num_tokens, top_k = row_ids.shape
    buf = x.new_empty((num_tokens * top_k + 1, x.shape[-1]))  # the last row is the call's scratch
    grouped_experts(x, *tier.dense(x.dtype), row_ids, buf, impl)
    return buf[: num_tokens * top_k].view(num_tokens, top_k, x.shape[-1])


def _local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    ids = topk_ids.to(torch.int64)
    local = torch.where((ids >= 0) & (ids < expert_map.shape[0]), expert_map.to(torch.int64)[ids.clamp(min=0)], -1)
    return local.to(torch.int32)


def _unsplit_rows(x: torch.Tensor, tier: _Tier, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                  impl: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if expert_map is None:
        return _rows(x, tier, topk_ids, impl), None
    local = _local_ids(topk_ids, expert_map)
    return _rows(x, tier, local, impl), local


def unsplit_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    impl: str = "loop",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the unsplit call, and the local ids used (``None`` without expert parallel)."""
    return _unsplit_rows(x, _tier(w13, w2), topk_ids, expert_map, impl)


def _unsplit(
    x: torch.Tensor,
    tensors: Mapping[str, torch.Tensor] | _Tier,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    impl: str = "loop",
    scheme: QuantScheme | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    _check_activation(activation)
    if isinstance(tensors, _Tier):
        tier = dataclasses.replace(tensors, activation=activation)
    else:
        tier = _Tier(tensors, scheme or scheme_of(tensors), activation)
    rows, local = _unsplit_rows(x, tier, topk_ids, expert_map, impl)
    if local is None:
        return finalize(rows, topk_weights)
    return finalize(rows, topk_weights, hot_ids=local, cold_ids=torch.full_like(local, -1))


@overload
def unsplit(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, /, expert_map: torch.Tensor | None = None, *, impl: str = "loop",
            scheme: QuantScheme | None = None, activation: str = "silu") -> torch.Tensor: ...


@overload
def unsplit(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, /, expert_map: torch.Tensor | None = None, *,
            impl: str = "loop", activation: str = "silu") -> torch.Tensor: ...


def unsplit(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The reference: all experts in one call, the shared finalize. With ``expert_map`` (expert parallel: global
    id -> local row, -1 elsewhere) slots of other ranks' experts contribute nothing.

    Two forms, told apart by the second argument: ``unsplit(x, tensors, topk_weights, topk_ids)`` with the layer's
    per-expert tensors by name, in any format of :mod:`pinsidecar_hook.kernels.dequant` (``scheme``:
    :func:`scheme_of` of ``tensors`` unless given), or ``unsplit(x, w13, w2, topk_weights, topk_ids)`` for
    unquantized weights. ``activation``: one of :data:`ACTIVATIONS` (module docstring)."""
    if args and isinstance(args[0], Mapping):
        return _unsplit(x, *args, **kwargs)
    w13, w2, *rest = args
    return _unsplit(x, _tier(w13, w2), *rest, **kwargs)


def _split_rows(x: torch.Tensor, hot: _Tier, cold: _Tier, hot_ids: torch.Tensor,
                cold_ids: torch.Tensor) -> torch.Tensor:
    rows = _expert_rows(x, hot, hot_ids)
    if cold.num_rows > 0:
        _expert_rows(x, cold, cold_ids, out=rows)
    return rows


def split_rows(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    hot_ids: torch.Tensor,
    cold_ids: torch.Tensor,
) -> torch.Tensor:
    """Rows of a split call: the hot call fills the hot slots, the cold call the cold slots, of one buffer."""
    return _split_rows(x, _tier(w13_hot, w2_hot), _tier(w13_cold, w2_cold), hot_ids, cold_ids)


def _split_tiers(x: torch.Tensor, hot: _Tier, cold: _Tier, hot_ids: torch.Tensor, cold_ids: torch.Tensor, *,
                 impl: str, overlap: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if cold.num_rows == 0:
        return _rows(x, hot, hot_ids, impl), None
    if not (overlap and x.is_cuda):
        return _rows(x, hot, hot_ids, impl), _rows(x, cold, cold_ids, impl)
    num_tokens, top_k = cold_ids.shape
    if impl == "loop":
        cold_rows = x.new_zeros((num_tokens, top_k, x.shape[-1]))
        cold_out = cold_rows
    else:
        cold_out = x.new_empty((num_tokens * top_k + 1, x.shape[-1]))
        cold_rows = cold_out[: num_tokens * top_k].view(num_tokens, top_k, x.shape[-1])

    def cold_call() -> None:  # dequantized cold weights, if any, are made and used on the side stream only
        if impl == "loop":
            _expert_rows(x, cold, cold_ids, out=cold_out)
        else:
            grouped_experts(x, *cold.dense(x.dtype), cold_ids, cold_out, impl)

    hot_rows, _ = fork_join(lambda: _rows(x, hot, hot_ids, impl), cold_call, x.device)
    return hot_rows, cold_rows


def split_tiers(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    hot_ids: torch.Tensor,
    cold_ids: torch.Tensor,
    *,
    impl: str = "loop",
    overlap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of a split call as ``(hot rows, cold rows or None)``, each ``[T, k, D]``: the cold call writes its own
    buffer, so with ``overlap`` (CUDA only) it can run on the side stream while the hot call runs here. The fork
    and the join are stream waits (events), so a CUDA graph captures both branches. Buffers the side stream writes
    are allocated here, on the current stream, before the fork, so the allocator never hands them out early."""
    return _split_tiers(x, _tier(w13_hot, w2_hot), _tier(w13_cold, w2_cold), hot_ids, cold_ids, impl=impl,
                        overlap=overlap)


def _tiers(hot: Mapping[str, torch.Tensor] | _Tier, cold: Mapping[str, torch.Tensor] | _Tier,
           scheme: QuantScheme | None, activation: str = "silu") -> tuple[_Tier, _Tier]:
    """The two calls' tiers; their schemes must be equal (a tier's tensors in another format than the other's
    would mean the split did not mirror every per-expert tensor)."""
    _check_activation(activation)
    if isinstance(hot, _Tier) and isinstance(cold, _Tier):
        return dataclasses.replace(hot, activation=activation), dataclasses.replace(cold, activation=activation)
    assert not isinstance(hot, _Tier) and not isinstance(cold, _Tier)
    if scheme is not None:
        return _Tier(hot, scheme, activation), _Tier(cold, scheme, activation)
    hot_scheme, cold_scheme = scheme_of(hot), scheme_of(cold)
    if hot_scheme != cold_scheme:
        raise ValueError(f"hot and cold tensors differ in format: {hot_scheme} vs {cold_scheme}")
    return _Tier(hot, hot_scheme, activation), _Tier(cold, cold_scheme, activation)


def _split(
    x: torch.Tensor,
    hot: Mapping[str, torch.Tensor] | _Tier,
    cold: Mapping[str, torch.Tensor] | _Tier,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
    *,
    num_real: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
    impl: str = "loop",
    overlap: bool | None = None,
    scheme: QuantScheme | None = None,
    partitioned: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    hot_tier, cold_tier = _tiers(hot, cold, scheme, activation)
    if partitioned is not None:  # the cache's step partitioned the ids (and counted) in its own launch
        hot_ids, cold_ids = partitioned
    else:
        hot_ids, cold_ids = partition(topk_ids, row_map, hot_rows, expert_counts, cold_counts, num_real=num_real,
                                      token_counts=token_counts)
    rows, rows_cold = _compute_tiers(x, hot_tier, cold_tier, hot_ids, cold_ids, impl=impl, overlap=overlap)
    return finalize(rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold)


def _compute_tiers(x: torch.Tensor, hot: _Tier, cold: _Tier, hot_ids: torch.Tensor, cold_ids: torch.Tensor, *,
                   impl: str, overlap: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both calls' rows as ``(rows, rows_cold or None)``: with ``impl="loop"`` and no overlap, one buffer that the
    hot call and then the cold call write (the original path); otherwise :func:`split_tiers`'s two buffers."""
    if overlap is None:
        overlap = OVERLAP_DEFAULT
    if impl == "loop" and not (overlap and x.is_cuda):
        return _split_rows(x, hot, cold, hot_ids, cold_ids), None
    return _split_tiers(x, hot, cold, hot_ids, cold_ids, impl=impl, overlap=overlap)


@overload
def split(x: torch.Tensor, hot: Mapping[str, torch.Tensor], cold: Mapping[str, torch.Tensor],
          topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_map: torch.Tensor, hot_rows: int, /,
          expert_counts: torch.Tensor | None = None, cold_counts: torch.Tensor | None = None, *,
          num_real: torch.Tensor | None = None, token_counts: torch.Tensor | None = None, impl: str = "loop",
          overlap: bool | None = None, scheme: QuantScheme | None = None,
          partitioned: tuple[torch.Tensor, torch.Tensor] | None = None, activation: str = "silu") -> torch.Tensor: ...


@overload
def split(x: torch.Tensor, w13_hot: torch.Tensor, w2_hot: torch.Tensor, w13_cold: torch.Tensor,
          w2_cold: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_map: torch.Tensor,
          hot_rows: int, /, expert_counts: torch.Tensor | None = None, cold_counts: torch.Tensor | None = None, *,
          num_real: torch.Tensor | None = None, token_counts: torch.Tensor | None = None, impl: str = "loop",
          overlap: bool | None = None,
          partitioned: tuple[torch.Tensor, torch.Tensor] | None = None, activation: str = "silu") -> torch.Tensor: ...


def split(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The split invoke: partition (with live counts when counters are given, CUDA-graph padding masked by
    ``num_real``), the hot call, the cold call (on a side stream, concurrently, when ``overlap``; default
    :data:`OVERLAP_DEFAULT` on CUDA), the shared finalize. Bit-identical to :func:`unsplit` over the original
    tensors with the same ``impl`` (module docstring).

    Two forms, told apart by the second argument: ``split(x, hot, cold, topk_weights, topk_ids, row_map,
    hot_rows, ...)`` with each tier's per-expert tensors by name (every per-expert tensor split in mirror; shared
    scalars in both; ``scheme``: :func:`scheme_of` of each tier, which must agree, unless given), or
    ``split(x, w13_hot, w2_hot, w13_cold, w2_cold, topk_weights, ...)`` for unquantized weights. ``partitioned``:
    the ``(hot_ids, cold_ids)`` a cache's step already made (:meth:`pinsidecar_hook.cache.ExpertCache.step_partition`,
    which counted too), instead of partitioning here. ``activation``: one of :data:`ACTIVATIONS`, the same as the
    unsplit call's."""
    if args and isinstance(args[0], Mapping):
        return _split(x, *args, **kwargs)
    w13_hot, w2_hot, w13_cold, w2_cold, *rest = args
    return _split(x, _tier(w13_hot, w2_hot), _tier(w13_cold, w2_cold), *rest, **kwargs)


class TorchRefSplit(SplitBackend):
    """The reference split as a backend, through the stages: the torch experts over the layer's hot and cold
    tensors as the tier stage (:func:`_compute_tiers`, the side stream included on CUDA), the hook's FMA finalize in
    slot order as the reducer. ``layer`` is a :class:`pinsidecar_hook.backends.base.SplitLayer`: every per-expert
    tensor of its ``hot`` / ``cold`` dicts, in any format :func:`scheme_of` knows (fp8 scales with 128 x 128
    blocks). A layer whose tensors it does not know, or whose two tiers differ in format, is refused at attach (the
    constructor). ``auto`` never picks it.

    The weights vLLM passes (the layer's parameters, which now hold only the hot rows) and its ``expert_map`` are
    ignored: the row map already sends other ranks' experts to -1. Only SiLU-and-mul with the router weight
    applied after the experts, on unquantized activations, is supported; anything else is refused at the call.
    It is bit-identical to *its own* unsplit call, not to vLLM's kernel (``GUARANTEE = "placement-invariant"``)."""

    NAME = "torch_ref"
    SPLIT_TENSORS = SPLIT_TENSORS
    REQUIRED_TENSORS = REQUIRED_TENSORS
    SHARED_TENSORS = tuple(DEQUANT_SHARED_TENSORS)
    AUTO = False
    GUARANTEE = "placement-invariant"

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        return None  # any layer whose tensors scheme_of knows: checked on the tensors, at construction

    def __init__(self, experts: Any, layer: Any, *, num_real: Any = REAL_TOKENS) -> None:
        scheme = scheme_of(dict(layer.hot))
        if scheme_of(dict(layer.cold)) != scheme:
            raise ValueError(f"torch_ref: the hot and cold tensors of a layer differ in format: {scheme} vs "
                             f"{scheme_of(dict(layer.cold))}")
        self.tier_tensors = _Tier(dict(layer.hot), scheme), _Tier(dict(layer.cold), scheme)
        super().__init__(experts, layer, num_real=num_real)

    def choose_reducer(self) -> Reducer:
        return SlotOrderFinalize(weighted_rows=False)

    def check_call(self, call: ExpertsCall) -> None:
        act = str(getattr(call.activation, "value", call.activation)).lower()
        if act != "silu" or call.apply_router_weight_on_input:
            raise RuntimeError(f"the torch_ref split supports SiLU-and-mul with the router weight applied after the "
                               f"experts only (activation {act!r}, apply_router_weight_on_input "
                               f"{call.apply_router_weight_on_input})")
        if call.a1q_scale is not None or call.a2_scale is not None or call.hidden_states.dtype in FP8_DTYPES:
            raise RuntimeError("the torch_ref split dequantizes weights only; it does not model activation "
                               f"quantization (hidden states {call.hidden_states.dtype}, a1q_scale "
                               f"{'set' if call.a1q_scale is not None else None}, a2_scale "
                               f"{'set' if call.a2_scale is not None else None})")

    def run_tiers(self, call: ExpertsCall, part: Partition) -> TierRows:
        rows, rows_cold = _compute_tiers(call.hidden_states, *self.tier_tensors, part.hot_ids, part.cold_ids,
                                         impl="loop", overlap=None)
        return TierRows(Rows(rows), None if rows_cold is None else Rows(rows_cold))

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        hot, cold = self.tier_tensors
        return Rows(_rows(call.hidden_states, hot if tier.name == "hot" else cold, part.ids(tier), "loop"))
