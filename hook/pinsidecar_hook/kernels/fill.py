"""Copy a data-dependent number of expert rows from host memory into cache slots, inside a captured CUDA graph.

The cache tier (:mod:`pinsidecar_hook.cache`) decides each step's fills on the device, so the host never learns
how many there are; a graph cannot launch a copy of that length. This kernel is launched for the most fills a step
can have (the slots, K) and reads the real count from device memory: the spare programs return before touching a
byte, so a step with nothing to fill costs one launch and no bandwidth. Rows are copied as raw 32-bit words (or
bytes, when a row's size is not a multiple of 4), so one kernel serves every dtype: bf16 weights, FP8 weights and
their fp32 scales, packed 4-bit weights.

The source is the cold tier's device view of pinned host memory (UVA), so each fill is one read over the link
and one write to HBM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pinsidecar_hook.kernels.partition import tl, triton, triton_available

__all__ = ["BLOCK", "CachePlan", "copy_row_block", "fill_pairs", "fill_rows_cuda", "fill_rows_reference", "row_words"]

@dataclass
class CachePlan:
    """One step's fills, as device tensors of static length K (:meth:`pinsidecar_hook.cache.ExpertCache.plan`)."""

    n_fill: torch.Tensor  # int64 [1]: how many of the K entries are real fills
    dst_rows: torch.Tensor  # int64 [K]: HBM row (H + slot) of each fill, first n_fill real
    src_rows: torch.Tensor  # int64 [K]: cold row (0-based in the cold tensor) of each fill


# Words one program copies: 4096 32-bit words = 16 KiB in flight per program. A 9 MiB bf16 expert is ~600
# programs, enough to keep the link busy.
BLOCK = 4096

if triton is not None:

    @triton.jit
    def copy_row_block(dst_ptr, src_ptr, dst_row, src_row, row_words, block, BLOCK: tl.constexpr):
        """Block ``block`` of one row: ``BLOCK`` words of ``src[src_row]`` into ``dst[dst_row]`` (also the fused
        cache step's copy, :mod:`pinsidecar_hook.kernels.cache_plan`)."""
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        words = tl.load(src_ptr + src_row * row_words + offs, mask=mask)
        tl.store(dst_ptr + dst_row * row_words + offs, words, mask=mask)

    @triton.jit
    def _fill_kernel(dst_ptr, src_ptr, dst_rows_ptr, src_rows_ptr, n_ptr, row_words, BLOCK: tl.constexpr):
        fill = tl.program_id(0)
        if fill < tl.load(n_ptr):
            dst_row = tl.load(dst_rows_ptr + fill).to(tl.int64)
            src_row = tl.load(src_rows_ptr + fill).to(tl.int64)
            copy_row_block(dst_ptr, src_ptr, dst_row, src_row, row_words, tl.program_id(1), BLOCK)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's rows as flat 32-bit words (bytes when a row is not a whole number of words)."""
    raw = t.reshape(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def row_words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` (slot rows) and ``src`` (cold rows) as flat words, checked to be copyable row for row."""
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"slot rows {tuple(dst.shape[1:])} {dst.dtype} and cold rows {tuple(src.shape[1:])} "
                         f"{src.dtype} differ")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("slot and cold rows must be contiguous tensors (re-homing makes them so)")
    return _as_words(dst), _as_words(src)


def fill_pairs(hot: Mapping[str, torch.Tensor | None],
               cold: Mapping[str, torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-expert tensors a fill copies, as ``(slot rows, cold rows)`` pairs: every tensor both tiers have
    (weights, scales, biases), aliases (two names of one tensor) once."""
    pairs, done = [], set()
    for name, dst in hot.items():
        src = cold.get(name)
        if dst is None or src is None or id(dst) in done:
            continue
        done.add(id(dst))
        pairs.append((dst, src))
    return pairs


def fill_rows_cuda(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor, src_rows: torch.Tensor,
                   n_fill: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for ``i < n_fill[0]``, in one launch of ``len(dst_rows)`` x row
    blocks programs (module docstring). ``dst`` and ``src`` must be contiguous with equal row shapes and dtypes."""
    if not triton_available(dst.device):
        raise RuntimeError("fill_rows_cuda needs Triton on a CUDA device (or TRITON_INTERPRET=1)")
    d, s = row_words(dst, src)
    words = d.shape[1]
    grid = (dst_rows.shape[0], triton.cdiv(words, BLOCK))
    _fill_kernel[grid](d, s, dst_rows, src_rows, n_fill, words, BLOCK=BLOCK)


def fill_rows_reference(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor, src_rows: torch.Tensor,
                        n_fill: torch.Tensor) -> None:
    """The same in torch, with a host sync for the count (the CPU engine, and the tests' reference)."""
    n = int(n_fill.reshape(-1)[0].item())
    if n:
        dst.index_copy_(0, dst_rows[:n], src.index_select(0, src_rows[:n]))
