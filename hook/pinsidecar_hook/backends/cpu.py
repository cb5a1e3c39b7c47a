"""Split experts invoke for the vLLM CPU engine (``cpu_fused_moe``): the backend CI runs.

Why it looks the way it does. ``cpu_fused_moe`` reduces the top-k rows of a token *inside* the kernel, so a split
over two weight tensors cannot reproduce the unsplit kernel's bits. The guarantee on this backend is therefore
**placement invariance**: every row map (all-hot, all-cold, random, a token's k ids split across the tiers) gives
the same bits. It holds by construction:

1. Each (token, slot) pair becomes one *row* of a top-1 call: the kernel computes ``bf16(w * expert(x))`` for it,
   with the router weight ``w`` applied to the fp32 expert output exactly as the kernel's own top-1 path does.
   The pairs of one tier are gathered in flat ``token * k + slot`` order, so for every expert the kernel sees the
   same rows in the same order whichever tier the expert lives in, and whatever else is in the call: the kernel
   groups rows per expert and tiles within that group only, and its N-tiling depends on the thread count and
   ``topk`` (always 1 here), never on the data. Each expert lives in exactly one tier, so each row is computed
   once (no slot is computed twice) and its bits do not depend on the map.
2. One finalize sums the k rows of each token in fp32, in the original k order, over a ``[T, k, H]`` tensor whose
   contents, by (1), do not depend on the map, and casts to the activation dtype once (``Tensor.copy_``).

Slots whose expert is not on this rank (expert parallel: row map ``-1``) contribute zero rows, as the unsplit
kernel's expert-parallel contract does; the cross-rank reduction is vLLM's.

Compared with the unsplit kernel (count mode, hook off) the result differs in the last bits: the unsplit kernel
keeps the k weighted rows in fp32 until its final cast, this backend rounds each weighted row to the activation
dtype first (as vLLM's GPU ``TritonExperts`` + ``moe_sum`` path does).

In eager mode the split runs as plain Python every step. Under ``torch.compile`` it is the registered custom op
``pinsidecar::cpu_split_moe`` (opaque to Dynamo; data-dependent shapes stay inside it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pinsidecar_hook.kernels.partition import partition_torch

__all__ = ["SPLIT_TENSORS", "cpu_split_moe", "finalize_rows", "make_split_apply", "split_rows"]

# The per-expert tensors this backend knows how to split and use. A layer with any other per-expert tensor (block
# scales of a quantized model, say) is refused at boot: ignoring a tensor would silently compute something else.
SPLIT_TENSORS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
REQUIRED_TENSORS = ("w13_weight", "w2_weight")


def _fused_moe_op() -> Callable[..., None]:
    from vllm._custom_ops import cpu_fused_moe

    return cpu_fused_moe


def split_rows(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    hot_ids: torch.Tensor,
    cold_ids: torch.Tensor,
    hot: dict[str, torch.Tensor | None],
    cold: dict[str, torch.Tensor | None],
    activation: str,
    isa: str,
    skip_weighted: bool,
    kernel: Callable[..., None] | None = None,
) -> torch.Tensor:
    """The weighted, unreduced per-(token, slot) rows ``[T * k, H]``: each tier's pairs as one top-1 call.

    ``hot_ids`` / ``cold_ids`` are the partition's outputs (row in that tier, or -1). Rows of pairs that are in
    neither tier (experts of another rank) are zero.
    """
    kernel = kernel or _fused_moe_op()
    num_tokens, top_k = hot_ids.shape
    hidden = x.shape[-1]
    rows = x.new_zeros((num_tokens * top_k, hidden))
    flat_weights = topk_weights.reshape(-1).to(torch.float32)
    for tier_ids, weights in ((hot_ids, hot), (cold_ids, cold)):
        flat_ids = tier_ids.reshape(-1)
        pairs = torch.nonzero(flat_ids >= 0).squeeze(1)  # flat (token * k + slot) indices, ascending
        count = pairs.numel()
        if count == 0:
            continue
        tier_x = x.index_select(0, torch.div(pairs, top_k, rounding_mode="floor"))
        tier_topk_ids = flat_ids.index_select(0, pairs).view(count, 1).to(torch.int32)
        tier_topk_weights = flat_weights.index_select(0, pairs).view(count, 1)
        tier_out = torch.empty_like(tier_x)
        kernel(tier_out, tier_x, weights["w13_weight"], weights["w2_weight"], weights.get("w13_bias"),
               weights.get("w2_bias"), tier_topk_weights, tier_topk_ids, activation, isa, skip_weighted)
        rows.index_copy_(0, pairs, tier_out)
    return rows


def finalize_rows(rows: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """Sum each token's k rows in fp32 in the original k order and cast once into ``out`` ``[T, H]``."""
    num_tokens = out.shape[0]
    per_token = rows.view(num_tokens, top_k, -1)
    acc = per_token[:, 0].to(torch.float32)
    for slot in range(1, top_k):
        acc.add_(per_token[:, slot])  # fp32 accumulate; the bf16 operand is widened exactly
    out.copy_(acc)
    return out


def _split_impl(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_map: torch.Tensor,
    expert_counts: torch.Tensor, cold_counts: torch.Tensor, token_counts: torch.Tensor,
    hot_w13: torch.Tensor, hot_w2: torch.Tensor, hot_b13: torch.Tensor | None, hot_b2: torch.Tensor | None,
    cold_w13: torch.Tensor, cold_w2: torch.Tensor, cold_b13: torch.Tensor | None, cold_b2: torch.Tensor | None,
    hot_rows: int, activation: str, isa: str, skip_weighted: bool,
) -> torch.Tensor:
    hot_ids, cold_ids = partition_torch(topk_ids, row_map, hot_rows, expert_counts, cold_counts)
    token_counts.add_(topk_ids.shape[0])
    rows = split_rows(
        x, topk_weights, hot_ids, cold_ids,
        {"w13_weight": hot_w13, "w2_weight": hot_w2, "w13_bias": hot_b13, "w2_bias": hot_b2},
        {"w13_weight": cold_w13, "w2_weight": cold_w2, "w13_bias": cold_b13, "w2_bias": cold_b2},
        activation, isa, skip_weighted,
    )
    return finalize_rows(rows, topk_ids.shape[1], torch.empty_like(x))


@torch.library.custom_op("pinsidecar::cpu_split_moe", mutates_args=("expert_counts", "cold_counts", "token_counts"),
                         device_types="cpu")
def cpu_split_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_map: torch.Tensor,
    expert_counts: torch.Tensor, cold_counts: torch.Tensor, token_counts: torch.Tensor,
    hot_w13: torch.Tensor, hot_w2: torch.Tensor, hot_b13: torch.Tensor | None, hot_b2: torch.Tensor | None,
    cold_w13: torch.Tensor, cold_w2: torch.Tensor, cold_b13: torch.Tensor | None, cold_b2: torch.Tensor | None,
    hot_rows: int, activation: str, isa: str, skip_weighted: bool,
) -> torch.Tensor:
    """Partition + count + split + finalize as one op that ``torch.compile`` treats as opaque."""
    return _split_impl(x, topk_weights, topk_ids, row_map, expert_counts, cold_counts, token_counts,
                       hot_w13, hot_w2, hot_b13, hot_b2, cold_w13, cold_w2, cold_b13, cold_b2,
                       hot_rows, activation, isa, skip_weighted)


@cpu_split_moe.register_fake
def _(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(x)


def make_split_apply(experts: Any, layer: Any) -> Callable[..., Any]:
    """A replacement for ``experts.apply`` (vLLM's ``FusedMoEExpertsModular.apply`` signature) that runs the split.

    ``layer`` is the pin-mode layer state (:class:`pinsidecar_hook.pin.LayerPin`): row map, counters, and the
    hot and cold tensors. The weights vLLM passes in (``w1``/``w2``, the layer's parameters, which now hold only
    the hot rows) are ignored in favour of the layer state, which holds both tiers.
    """
    isa = str(getattr(experts, "isa", "vec"))
    if getattr(experts, "_use_zentorch", False):
        raise RuntimeError("pin mode does not support the zentorch CPU MoE path (it has no per-expert kernel call)")
    hot, cold = layer.hot, layer.cold

    def split_apply(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                    expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                    workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
                    apply_router_weight_on_input: bool) -> None:
        act = str(getattr(activation, "value", activation))
        args = (hidden_states, topk_weights, topk_ids, layer.row_map, layer.expert_counts, layer.cold_counts,
                layer.token_counts, hot["w13_weight"], hot["w2_weight"], hot.get("w13_bias"), hot.get("w2_bias"),
                cold["w13_weight"], cold["w2_weight"], cold.get("w13_bias"), cold.get("w2_bias"),
                layer.hot_rows, act, isa, bool(apply_router_weight_on_input))
        if torch.compiler.is_compiling():
            output.copy_(torch.ops.pinsidecar.cpu_split_moe(*args))
            return
        # Eager: skip the op dispatcher (a few microseconds per layer per step) and finalize straight into output.
        hot_ids, cold_ids = partition_torch(topk_ids, layer.row_map, layer.hot_rows, layer.expert_counts,
                                            layer.cold_counts)
        layer.token_counts.add_(topk_ids.shape[0])
        rows = split_rows(hidden_states, topk_weights, hot_ids, cold_ids, hot, cold, act, isa,
                          bool(apply_router_weight_on_input))
        finalize_rows(rows, topk_ids.shape[1], output)

    split_apply._pinsidecar_split = True  # type: ignore[attr-defined]
    return split_apply
