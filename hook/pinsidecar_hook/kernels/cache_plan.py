"""One layer's cache-tier step (:meth:`pinsidecar_hook.cache.ExpertCache.plan`) in one Triton launch.

The torch version is ~30 small ops (scatter_reduce, argsort, index_copy, ...), which torch runs as about a hundred
CUDA kernels (97 for lru, 109 for lfu, counted by torch's profiler on an H100): far above the bookkeeping budget
(at most 1 % of a decode step). :func:`plan_triton` does the same state transitions, bit for bit, in a single
program (``grid=(1,)``) that reads and writes the cache's state tensors in place, so a layer's cache step is this
one launch plus the fill copy (:func:`pinsidecar_hook.kernels.fill.fill_rows_cuda`), which is one launch per
distinct per-expert tensor of the layer (two for bf16 ``w13``/``w2``, more with scales or biases).

The program runs in phases; each phase that reads global memory another thread of the program wrote in an earlier
phase is separated from it by ``tl.debug_barrier()`` (Triton orders shared memory by itself, not global memory):

0. scratch: each expert's last and first selection position (int32, ``[E]``) are set to -1 and ``2**31 - 1``;
1. over the step's ids, in blocks of at most :data:`_BLOCK_P` positions (positions at or past ``num_real * k``
   are padding and select nothing): ``atomic_max``/``atomic_min`` of the position into last/first, ``lfu``:
   ``atomic_add`` of one into ``freq``; hits (the selection's expert is in a slot: ``slot_of >= 0``) and misses (a
   cold expert in no slot) are summed in registers, from the state as it was at the step's start;
2. over the ids again: a selection is its expert's *first* when ``first[id] == position``; the first selections of
   missed experts, in position order, are the missed experts in the order of their first selection (first
   positions of distinct experts are distinct), so a running count (a block ``cumsum`` plus the count carried from
   earlier blocks) is each one's rank, and the first K are scattered into a list (scratch, ``[K]``). The count at
   the end is the number of missed experts;
3. over the slots (one block of K lanes): a slot is *hit* when its expert was selected (``last >= 0``); the others
   are evictable, and each evictable slot's place in the eviction order is the number of evictable slots before
   it, by ``(stamp, slot)`` (``lru``) or ``(freq of its expert, -1 when empty; stamp; slot)`` (``lfu``): K x K
   pairwise comparisons, in column chunks of :data:`_SLOT_CHUNK` slots. A hit slot's stamp is never a key (only
   evictable slots are ranked, and their stamps and frequencies are the step-start ones), so the hit updates wait
   for phase 4. ``n_fill = min(missed experts, evictable slots)``;
4. the flip, per slot: the slot of rank ``i < n_fill`` takes the i-th missed expert; its old expert (if any) goes
   back to its cold row, the new one to the slot's row (and, with ``tier_maps``, both experts' entries of the hot
   and cold maps follow); stamps (hits and fills), the plan, the counters and the clock are written.

Nothing is written to the state tensors' junk elements (the torch version's masked-off writes are masked here), so
the first ``E``/``K`` elements of every state tensor, the counters, the clock and the plan are the torch
version's; tests/test_cache_plan_kernel.py checks that step by step under Triton's interpreter.

Static shapes, no host sync: the step's length ``P = T * k`` and the cache's ``E`` and ``K`` are launch constants,
everything else is read on the device, so the launch can be captured in a CUDA graph. The plan's three tensors and
the scratch are allocated once per cache (:data:`_buffers`) and rewritten by every call: a plan is valid until the
cache's next step, which is how a captured graph uses it anyway.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pinsidecar_hook.kernels.fill import CachePlan
from pinsidecar_hook.kernels.partition import tl, triton, triton_available

__all__ = ["MAX_EXPERTS", "MAX_PAIRS", "MAX_SLOTS", "plan_triton"]

MAX_EXPERTS = 1024  # E: the per-expert phases are one block of lanes
MAX_SLOTS = 256  # K: the eviction order is K x K comparisons
MAX_PAIRS = 65536  # P = T * k: positions are int32, stamps advance by 2P + 2 a step

# Positions one iteration of the phase 1/2 loops handles: a decode step (P of a few hundred) is one iteration.
_BLOCK_P = 1024
# Columns of the K x K slot comparison per iteration: a 256 x 32 tile at most.
_SLOT_CHUNK = 32
_MIN_BLOCK = 16
_NO_POSITION = 2**31 - 1  # "first" of an expert the step does not select

# pinsidecar_hook.cache.ExpertCache, read and written through its attributes (kernels import no other room).
ExpertCache = Any

if triton is not None:

    @triton.jit
    def _cache_plan_kernel(
        ids_ptr, num_real_ptr,
        row_map_ptr, base_rows_ptr, cold_ptr, slot_expert_ptr, slot_of_ptr, stamp_ptr, freq_ptr,
        clock_ptr, hits_ptr, misses_ptr, fills_ptr, evictions_ptr,
        hot_map_ptr, cold_map_ptr,
        last_ptr, first_ptr, miss_list_ptr,
        n_fill_ptr, dst_rows_ptr, src_rows_ptr,
        pairs, top_k, num_experts, num_slots, hot_rows,
        LFU: tl.constexpr, MASK_REAL: tl.constexpr, TIER_MAPS: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SLOT_CHUNK: tl.constexpr,
    ):
        clock = tl.load(clock_ptr)
        real = tl.zeros([], dtype=tl.int64) + pairs  # pairs may arrive as a constexpr (Triton specializes 1)
        if MASK_REAL:
            real = tl.minimum(tl.load(num_real_ptr).to(tl.int64) * top_k, real)

        # 0. scratch: no expert selected yet
        e_offs = tl.arange(0, BLOCK_E)
        e_live = e_offs < num_experts
        tl.store(last_ptr + e_offs, tl.full([BLOCK_E], -1, tl.int32), mask=e_live)
        tl.store(first_ptr + e_offs, tl.full([BLOCK_E], 2147483647, tl.int32), mask=e_live)
        tl.debug_barrier()

        # 1. last and first positions per expert, lfu frequencies, hits and misses as resident at the step's start
        n_hits = tl.zeros([], dtype=tl.int64)
        n_misses = tl.zeros([], dtype=tl.int64)
        for p0 in range(0, pairs, BLOCK_P):
            pos = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(ids_ptr + pos, mask=pos < pairs, other=-1).to(tl.int32)
            valid = (pos < real) & (ids >= 0) & (ids < num_experts)
            tl.atomic_max(last_ptr + ids, pos, mask=valid, sem="relaxed")
            tl.atomic_min(first_ptr + ids, pos, mask=valid, sem="relaxed")
            if LFU:
                tl.atomic_add(freq_ptr + ids, tl.full([BLOCK_P], 1, tl.int64), mask=valid, sem="relaxed")
            in_slot = tl.load(slot_of_ptr + ids, mask=valid, other=-1) >= 0
            is_cold = tl.load(cold_ptr + ids, mask=valid, other=0) != 0
            n_hits += tl.sum((valid & in_slot).to(tl.int64), axis=0)
            n_misses += tl.sum((valid & is_cold & ~in_slot).to(tl.int64), axis=0)
        tl.debug_barrier()

        # 2. the missed experts in the order of their first selection: the first K into the list
        n_missed = tl.zeros([], dtype=tl.int32)
        for p0 in range(0, pairs, BLOCK_P):
            pos = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(ids_ptr + pos, mask=pos < pairs, other=-1).to(tl.int32)
            valid = (pos < real) & (ids >= 0) & (ids < num_experts)
            first = tl.load(first_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
            in_slot = tl.load(slot_of_ptr + ids, mask=valid, other=-1) >= 0
            is_cold = tl.load(cold_ptr + ids, mask=valid, other=0) != 0
            opens = valid & (first == pos) & is_cold & ~in_slot
            rank = n_missed + tl.cumsum(opens.to(tl.int32), axis=0) - 1
            tl.store(miss_list_ptr + rank, ids, mask=opens & (rank < num_slots))
            n_missed += tl.sum(opens.to(tl.int32), axis=0)

        # 3. the eviction order of the slots the step does not use
        s_offs = tl.arange(0, BLOCK_K)
        s_live = s_offs < num_slots
        held = tl.load(slot_expert_ptr + s_offs, mask=s_live, other=num_experts)
        filled = held < num_experts  # the slot holds an expert
        held_last = tl.load(last_ptr + held, mask=s_live & filled, other=-1, cache_modifier=".cg").to(tl.int64)
        hit = s_live & (held_last >= 0)
        evictable = s_live & ~hit
        stamp = tl.load(stamp_ptr + s_offs, mask=s_live, other=0)
        if LFU:
            seen = tl.load(freq_ptr + held, mask=s_live & filled, other=-1, cache_modifier=".cg")
        rank = tl.zeros([BLOCK_K], dtype=tl.int32)
        for c0 in range(0, num_slots, SLOT_CHUNK):
            c_offs = c0 + tl.arange(0, SLOT_CHUNK)
            c_live = c_offs < num_slots
            c_held = tl.load(slot_expert_ptr + c_offs, mask=c_live, other=num_experts)
            c_filled = c_held < num_experts
            c_last = tl.load(last_ptr + c_held, mask=c_live & c_filled, other=-1, cache_modifier=".cg")
            c_evictable = c_live & (c_last < 0)
            c_stamp = tl.load(stamp_ptr + c_offs, mask=c_live, other=0)
            same_stamp = c_stamp[None, :] == stamp[:, None]
            before = (c_stamp[None, :] < stamp[:, None]) | (same_stamp & (c_offs[None, :] < s_offs[:, None]))
            if LFU:
                c_seen = tl.load(freq_ptr + c_held, mask=c_live & c_filled, other=-1, cache_modifier=".cg")
                before = (c_seen[None, :] < seen[:, None]) | ((c_seen[None, :] == seen[:, None]) & before)
            rank += tl.sum((before & c_evictable[None, :]).to(tl.int32), axis=1)
        n_evictable = tl.sum(evictable.to(tl.int32), axis=0)
        n_fill = tl.minimum(n_missed, n_evictable)
        tl.debug_barrier()  # every read of the step-start slot state and of the miss list is done

        # 4. the flip: the slot of rank i < n_fill takes the i-th missed expert
        fill = evictable & (rank < n_fill)
        new = tl.load(miss_list_ptr + rank, mask=fill, other=0, cache_modifier=".cg")
        evict = fill & filled
        hbm_rows = hot_rows + num_slots
        old_row = tl.load(base_rows_ptr + held, mask=evict, other=-1)
        tl.store(row_map_ptr + held, old_row, mask=evict)
        tl.store(slot_of_ptr + held, tl.full([BLOCK_K], -1, tl.int64), mask=evict)
        slot_row = hot_rows + s_offs.to(tl.int64)
        tl.store(slot_expert_ptr + s_offs, new.to(tl.int64), mask=fill)
        tl.store(slot_of_ptr + new, s_offs.to(tl.int64), mask=fill)
        tl.store(row_map_ptr + new, slot_row, mask=fill)
        if TIER_MAPS:
            tl.store(hot_map_ptr + held, tl.where((old_row >= 0) & (old_row < hbm_rows), old_row, -1), mask=evict)
            tl.store(cold_map_ptr + held, tl.where(old_row >= hbm_rows, old_row - hbm_rows, -1), mask=evict)
            tl.store(hot_map_ptr + new, tl.where(slot_row < hbm_rows, slot_row, -1), mask=fill)
            tl.store(cold_map_ptr + new, tl.where(slot_row >= hbm_rows, slot_row - hbm_rows, -1), mask=fill)
        # stamps: a hit gets the step's clock plus its last selection; a fill (lru) the clock plus P plus its first,
        # after every hit of the step, (lfu) the clock plus its last, as a hit
        if LFU:
            new_pos = tl.load(last_ptr + new, mask=fill, other=0, cache_modifier=".cg").to(tl.int64)
        else:
            new_pos = pairs + tl.load(first_ptr + new, mask=fill, other=0, cache_modifier=".cg").to(tl.int64)
        tl.store(stamp_ptr + s_offs, clock + tl.where(fill, new_pos, held_last), mask=fill | hit)
        # the plan: fill i at index i, zeros after the fills
        src_row = tl.load(base_rows_ptr + new, mask=fill, other=0) - hbm_rows
        tl.store(dst_rows_ptr + rank, slot_row, mask=fill)
        tl.store(src_rows_ptr + rank, src_row, mask=fill)
        spare = s_live & (s_offs >= n_fill)
        tl.store(dst_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=spare)
        tl.store(src_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=spare)
        tl.store(n_fill_ptr, n_fill.to(tl.int64))
        # counters and clock (only this program reads or writes them)
        tl.store(hits_ptr, tl.load(hits_ptr) + n_hits)
        tl.store(misses_ptr, tl.load(misses_ptr) + n_misses)
        tl.store(fills_ptr, tl.load(fills_ptr) + n_fill.to(tl.int64))
        tl.store(evictions_ptr, tl.load(evictions_ptr) + tl.sum(evict.to(tl.int64), axis=0))
        tl.store(clock_ptr, clock + 2 * pairs + 2)


@dataclass
class _Buffers:
    """A cache's scratch and plan tensors, allocated at its first :func:`plan_triton` and reused by every call."""

    last: torch.Tensor  # int32 [E]
    first: torch.Tensor  # int32 [E]
    miss_list: torch.Tensor  # int32 [K]
    plan: CachePlan


# Per cache, without touching the cache object; an entry goes when its cache does.
_buffers: weakref.WeakKeyDictionary[ExpertCache, _Buffers] = weakref.WeakKeyDictionary()


def _buffers_of(cache: ExpertCache) -> _Buffers:
    device = cache.slot_expert.device
    buf = _buffers.get(cache)
    if buf is None or buf.last.device != device:
        e, k = cache.num_experts, cache.slots
        buf = _Buffers(
            last=torch.empty(e, dtype=torch.int32, device=device),
            first=torch.empty(e, dtype=torch.int32, device=device),
            miss_list=torch.zeros(k, dtype=torch.int32, device=device),
            plan=CachePlan(torch.zeros(1, dtype=torch.int64, device=device),
                           torch.zeros(k, dtype=torch.int64, device=device),
                           torch.zeros(k, dtype=torch.int64, device=device)),
        )
        _buffers[cache] = buf
    return buf


def _check_int64_state(cache: ExpertCache) -> None:
    for name in ("base_rows", "slot_expert", "slot_of", "stamp", "freq", "clock", "hits", "fills", "evictions"):
        t = getattr(cache, name)
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"cache.{name} must be a contiguous int64 tensor, got {t.dtype}")


def plan_triton(cache: ExpertCache, topk_ids: torch.Tensor, num_real: torch.Tensor | None = None,
                misses: torch.Tensor | None = None,
                tier_maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> CachePlan:
    """:meth:`ExpertCache.plan` in one launch of one program (module docstring): same arguments, same state
    transitions, same plan. ``tier_maps=(hot_map, cold_map)`` (int32 ``[E]``, as
    :func:`pinsidecar_hook.backends.triton_experts.tier_expert_maps` makes them for ``hbm_rows = H + K``) are
    updated in place for the experts whose row the step changes, so they stay equal to the maps of the new row
    map. The returned plan's tensors belong to the cache and are rewritten by its next call."""
    e, k = cache.num_experts, cache.slots
    pairs = topk_ids.numel()
    if e > MAX_EXPERTS:
        raise ValueError(f"plan_triton handles at most {MAX_EXPERTS} experts per layer, this cache has {e}")
    if k > MAX_SLOTS:
        raise ValueError(f"plan_triton handles at most {MAX_SLOTS} cache slots per layer, this cache has {k}")
    if pairs > MAX_PAIRS:
        raise ValueError(f"plan_triton handles at most {MAX_PAIRS} selections (tokens x top-k) per step, "
                         f"got {pairs} ({tuple(topk_ids.shape)})")
    if triton is None or not triton_available(topk_ids.device):
        raise RuntimeError("plan_triton needs Triton on a CUDA device (or TRITON_INTERPRET=1); use "
                           "ExpertCache.plan elsewhere")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_real is not None and num_real.numel() != 1:
        raise ValueError("num_real must be a tensor of one element")
    _check_int64_state(cache)
    misses = cache.misses if misses is None else misses
    if misses.dtype != torch.int64 or misses.numel() != 1:
        raise ValueError("the misses counter must be an int64 tensor of one element")
    if not cache.row_map_ext.is_contiguous():
        raise ValueError("cache.row_map_ext must be contiguous")
    if tier_maps is not None:
        for name, t in zip(("hot_map", "cold_map"), tier_maps, strict=True):
            if t.dtype != torch.int32 or tuple(t.shape) != (e,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor of shape ({e},), got {t.dtype} "
                                 f"{tuple(t.shape)}")
    buf = _buffers_of(cache)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    hot_map, cold_map = tier_maps if tier_maps is not None else (buf.last, buf.last)
    _cache_plan_kernel[(1,)](
        ids, num_real if num_real is not None else cache.clock,
        cache.row_map_ext, cache.base_rows, cache.cold.view(torch.uint8), cache.slot_expert, cache.slot_of,
        cache.stamp, cache.freq,
        cache.clock, cache.hits, misses, cache.fills, cache.evictions,
        hot_map, cold_map,
        buf.last, buf.first, buf.miss_list,
        buf.plan.n_fill, buf.plan.dst_rows, buf.plan.src_rows,
        pairs, topk_ids.shape[-1] if topk_ids.dim() > 1 else 1, e, k, cache.hot_rows,
        LFU=cache.policy == "lfu",
        MASK_REAL=num_real is not None,
        TIER_MAPS=tier_maps is not None,
        BLOCK_P=min(_BLOCK_P, max(_MIN_BLOCK, triton.next_power_of_2(max(pairs, 1)))),
        BLOCK_E=max(_MIN_BLOCK, triton.next_power_of_2(e)),
        BLOCK_K=max(_MIN_BLOCK, triton.next_power_of_2(k)),
        SLOT_CHUNK=min(_SLOT_CHUNK, max(_MIN_BLOCK, triton.next_power_of_2(k))),
    )
    return buf.plan
