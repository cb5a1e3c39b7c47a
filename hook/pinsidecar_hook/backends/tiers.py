"""What every split backend derives from a layer's row map and tier tensors, in one place.

- :func:`tier_expert_maps`: vLLM ``expert_map``-style maps for the two calls (the families that tell a vLLM call
  which slots are its own through ``expert_map``: Triton, Marlin);
- :func:`mark_host_resident`: the flag vLLM reads to treat a weight as read from host memory in place;
- :func:`activation_dtype`: the dtype of the rows an experts call writes, for checks made at attach.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["activation_dtype", "mark_host_resident", "tier_expert_maps"]


def tier_expert_maps(row_map: torch.Tensor, hot_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``expert_map``-style maps for the two calls: ``hot_map[e]`` is ``e``'s hot row or -1, ``cold_map[e]``
    its cold row (0-based within the cold tensor) or -1. ``hot_map[topk_ids]`` is the partition's ``hot_ids``; an
    expert on another rank (row map -1) is -1 in both, so expert parallel composes."""
    rows = row_map.to(torch.int32)
    minus_one = torch.full_like(rows, -1)
    hot_map = torch.where((rows >= 0) & (rows < hot_rows), rows, minus_one)
    cold_map = torch.where(rows >= hot_rows, rows - hot_rows, minus_one)
    return hot_map, cold_map


def mark_host_resident(*tensors: torch.Tensor | None) -> None:
    """Flag tensors that live in pinned host memory (read in place through a device view) the way vLLM's UVA
    offloading does (``_vllm_is_uva_offloaded``), so vLLM's Triton path treats them as host-resident. Re-homing
    sets it on the cold tier's views (:mod:`pinsidecar_hook.rehome`)."""
    for t in tensors:
        if t is not None:
            t._vllm_is_uva_offloaded = True


def activation_dtype(experts: Any, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the rows the experts call writes: the weights' for 16/32-bit weights, else the model's
    activation dtype (quantized weights: fp8, packed int32)."""
    if weight.dtype.is_floating_point and weight.element_size() >= 2:
        return weight.dtype
    dtype = getattr(getattr(experts, "moe_config", None), "in_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
