"""Torch reference experts backend: a grouped GEMM in plain torch that leaves the routed rows unfinalized.

What it is for. It is the one backend whose split can be checked *bit for bit against its own unsplit call* on
every machine we have (the CPU here, the H200 through the device tool), and it is the experts stage of the GPU
benchmark. It is not a production path: it loops over experts in Python.

Why the split is bit-identical to the unsplit call by construction:

- every expert lives wholly in one tier, and for every expert both paths run the *same* GEMMs on the *same* rows
  in the *same* order: the (token, slot) pairs routed to it, gathered in flat ``token * k + slot`` order (a stable
  sort keeps that order), against the same weights (the hot and cold tensors hold byte copies of the originals,
  in the same per-expert layout);
- every (token, slot) row is therefore the same bits in both paths, whichever tier computed it;
- both paths end in the same finalize (:func:`pinsidecar_hook.kernels.finalize`): fp32 FMA of the router weight and
  the row, in slot order ``0..k-1``, one cast to the activation dtype.

Layout follows vLLM's unquantized experts: ``w13 [E, 2N, D]`` (gate rows then up rows), ``w2 [E, D, N]``, the
activation is SiLU-and-mul computed in fp32 and rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pinsidecar_hook.kernels.finalize import finalize
from pinsidecar_hook.kernels.partition import partition

__all__ = [
    "device_view_of_pinned",
    "expert_rows",
    "rehome_weights",
    "routing_case",
    "row_map_for",
    "split",
    "split_rows",
    "unsplit",
    "unsplit_rows",
]


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[-1] // 2
    return (F.silu(h[:, :n].float()) * h[:, n:].float()).to(h.dtype)


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
    start = 0
    for row, count in zip(rows_used.tolist(), counts.tolist(), strict=True):
        sel = pairs[start : start + count]
        start += count
        xs = x.index_select(0, torch.div(sel, top_k, rounding_mode="floor"))
        act = _silu_and_mul(xs @ w13[row].t())
        flat_out[sel] = act @ w2[row].t()
    return out


def unsplit_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the unsplit call, and the local ids used (``None`` without expert parallel)."""
    if expert_map is None:
        return expert_rows(x, w13, w2, topk_ids), None
    ids = topk_ids.to(torch.int64)
    local = torch.where((ids >= 0) & (ids < expert_map.shape[0]), expert_map.to(torch.int64)[ids.clamp(min=0)], -1)
    local = local.to(torch.int32)
    return expert_rows(x, w13, w2, local), local


def unsplit(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: all experts in one tensor, one experts call, the shared finalize. With ``expert_map``
    (expert parallel: global id -> local row, -1 elsewhere) slots of other ranks' experts contribute nothing."""
    rows, local = unsplit_rows(x, w13, w2, topk_ids, expert_map)
    if local is None:
        return finalize(rows, topk_weights)
    return finalize(rows, topk_weights, hot_ids=local, cold_ids=torch.full_like(local, -1))


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
    rows = expert_rows(x, w13_hot, w2_hot, hot_ids)
    if w13_cold.shape[0] > 0:
        expert_rows(x, w13_cold, w2_cold, cold_ids, out=rows)
    return rows


def split(
    x: torch.Tensor,
    w13_hot: torch.Tensor,
    w2_hot: torch.Tensor,
    w13_cold: torch.Tensor,
    w2_cold: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The split invoke: partition (with live counts when counters are given), the hot call, the cold call, the
    shared finalize. Bit-identical to :func:`unsplit` over the original weights (module docstring)."""
    hot_ids, cold_ids = partition(topk_ids, row_map, hot_rows, expert_counts, cold_counts)
    rows = split_rows(x, w13_hot, w2_hot, w13_cold, w2_cold, hot_ids, cold_ids)
    return finalize(rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids)


def row_map_for(num_experts: int, hot_experts: list[int], cold_experts: list[int]) -> torch.Tensor:
    """The int32 row map that puts ``hot_experts`` in hot rows ``0..H-1`` and ``cold_experts`` in cold rows
    ``H..H+C-1``, in the order given; experts in neither list are ``-1`` (another rank's, under expert parallel)."""
    row_map = torch.full((num_experts,), -1, dtype=torch.int32)
    order = list(hot_experts) + list(cold_experts)
    if len(set(order)) != len(order):
        raise ValueError("an expert is listed twice across hot_experts and cold_experts")
    row_map[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order), dtype=torch.int32)
    return row_map


def rehome_weights(
    weights: torch.Tensor, row_map: torch.Tensor, hot_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte copies of one per-expert tensor ``[E, ...]`` split by the row map: (hot ``[H, ...]``, cold
    ``[C, ...]``), row ``r`` holding the expert whose ``row_map`` entry is ``r``. A stand-in for pin mode's
    re-homing where the test or benchmark needs the two tiers without an engine."""
    rows = row_map.to(torch.int64).cpu()
    local = torch.nonzero(rows >= 0).squeeze(1)
    experts_by_row = local[torch.argsort(rows[local])].to(weights.device)
    ordered = weights.index_select(0, experts_by_row)
    return ordered[:hot_rows].clone(), ordered[hot_rows:].clone()


def routing_case(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    cold_fraction: float,
    adversarial: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A routing step and a map for placement tests: ``(topk_ids [T, k] int64, topk_weights [T, k] fp32,
    row_map [E] int32, hot_rows)``. ``cold_fraction`` of the experts are cold, chosen at random. A random case
    routes each token to k distinct random experts; an adversarial one alternates each token's slots between the
    tiers (hot, cold, hot, ...) wherever both tiers are non-empty, so every token's k ids straddle the split."""
    num_cold = round(num_experts * cold_fraction)
    hot_rows = num_experts - num_cold
    perm = torch.randperm(num_experts, generator=generator)
    hot, cold = perm[:hot_rows], perm[hot_rows:]
    row_map = row_map_for(num_experts, hot.tolist(), cold.tolist())
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64)
    for t in range(num_tokens):
        if adversarial and hot.numel() and cold.numel():
            h = hot[torch.randperm(hot.numel(), generator=generator)]
            c = cold[torch.randperm(cold.numel(), generator=generator)]
            picked, hi, ci = [], 0, 0
            for j in range(top_k):
                if (j % 2 == 0 and hi < h.numel()) or ci >= c.numel():
                    picked.append(int(h[hi]))
                    hi += 1
                else:
                    picked.append(int(c[ci]))
                    ci += 1
            ids[t] = torch.tensor(picked)
        else:
            ids[t] = torch.randperm(num_experts, generator=generator)[:top_k]
    weights = torch.rand((num_tokens, top_k), generator=generator, dtype=torch.float32)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids, weights, row_map, hot_rows


def device_view_of_pinned(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor that reads ``host`` (pinned CPU memory) in place over the bus (UVA zero-copy), for
    standalone tests and the benchmark where vLLM's ``get_accelerator_view_from_cpu_tensor`` is absent.

    It goes through CuPy's ``__cuda_array_interface__``: under UVA a pinned host pointer is also a valid device
    pointer. The returned tensor does not own the memory; keep ``host`` alive as long as the view is used (the
    view holds a reference to it)."""
    if not host.is_pinned():
        raise ValueError("device_view_of_pinned needs pinned host memory (torch.empty(..., pin_memory=True))")
    import cupy  # only on GPU machines

    nbytes = host.numel() * host.element_size()
    mem = cupy.cuda.UnownedMemory(host.data_ptr(), nbytes, host, device_id=torch.cuda.current_device())
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    view = torch.as_tensor(raw, device="cuda").view(host.dtype).view(host.shape)
    view._pinsidecar_host = host  # keep the pinned pages alive with the view
    return view
