"""One layer's cache-tier step (:meth:`pinsidecar_hook.cache.ExpertCache.plan`, the fill copy and the split's
partition) in one Triton launch.

The torch version is ~30 small ops (scatter_reduce, argsort, index_copy, ...), which torch runs as about a hundred
CUDA kernels (97 for lru, 109 for lfu, counted by torch's profiler on an H100): far above the bookkeeping budget
(at most 1 % of a decode step). A first Triton version did the plan in one program, then one copy launch per
tensor, then the split's partition launch: with nothing to fill that added 9.7 us a layer at 15 slots and 46 us at
122 slots to an H100's step, against about 2 us for the fused launch below (bench/cache_tier.py's bookkeeping,
bench/results/cache_tier_h100_fused_2026-12-06*). :func:`step_triton` does the same state
transitions, bit for bit, in one launch of ``1 + F`` programs that read and write the cache's state in place:

Program 0, the plan and the partition:

1. one pass over the step's selections (positions at or past ``num_real * k`` are padding and select nothing), by
   the row map at the step's start: a row among the slots (``H <= row < H + K``) is a **hit**, and its slot's
   stamp becomes the clock plus the last position selecting it (an ``atomic_max``: every stamp is below the
   clock); a row past them is a **miss** (a cold expert in no slot); ``lfu``: ``atomic_add`` of one into
   ``freq``. The pass also writes the partition (``hot_ids``/``cold_ids`` with ``hot_rows = H + K``) and the
   per-expert counts. When nothing missed, that is the whole step: the plan says no fills, the counters and the
   clock advance, and the fill programs are told to return (a step with nothing to fill costs little more than
   the partition the split needs anyway);
2. otherwise, scratch: each expert's last and first selection position (int32 ``[E]``), by ``atomic_max`` and
   ``atomic_min`` over the ids;
3. over the ids again: a selection is its expert's *first* when ``first[id] == position``; the first selections of
   missed experts, in position order, are the missed experts in the order of their first selection, so a running
   count (a block ``cumsum`` plus the count carried from earlier blocks) is each one's rank, and the first K are
   scattered into a list (scratch, ``[K]``). The count at the end is the number of missed experts;
4. over the slots (one block of K lanes): a slot is *hit* when its expert was selected (``last >= 0``); the others
   are evictable, and each evictable slot's place in the eviction order is the number of evictable slots before
   it, by ``(stamp, slot)`` (``lru``) or ``(freq of its expert, -1 when empty; stamp; slot)`` (``lfu``): K x K
   pairwise comparisons, in column chunks of :data:`_SLOT_CHUNK` slots. Only evictable slots are ranked, and their
   stamps are the step-start ones. ``n_fill = min(missed experts, evictable slots)``;
5. the flip, per slot: the slot of rank ``i < n_fill`` takes the i-th missed expert; its old expert (if any) goes
   back to its cold row, the new one to the slot's row (and, with ``tier_maps``, both experts' entries of the hot
   and cold maps follow); the fills' stamps, the plan and the counters are written;
6. the partition again, by the flipped row map (the filled experts are computed from their slots this very step),
   and then the word that lets the fill programs read the plan.

Each phase that reads global memory another thread of the program wrote in an earlier phase is separated from it
by ``tl.debug_barrier()`` (Triton orders shared memory by itself, not global memory).

Programs 1..F, the copy: program ``i`` waits for its own word, ``sync[i - 1]`` (1: nothing to fill, 2: the plan is
written), which program 0 writes for all of them at once (one lane each; with a release when there is a plan, and
an acquire in the program that reads it), then copies its share of the fills' row blocks of every per-expert
tensor (at most :data:`MAX_FILL_TENSORS`; :func:`pinsidecar_hook.kernels.fill.copy_row_block`) from pinned host
memory into the slots, and sets its word back to 0: the next step's launch cannot begin before this one ends. A
word per program, polled by plain volatile loads, replaced one word that every program polled with atomics and a
counter that every program incremented: with F = 132 on an H100 those were hundreds of atomics on two addresses a
step, where a step with nothing to fill should cost little more than the partition. F is at most the number of
SMs, so all programs can be resident at once; only program 0 is ever waited on, and the hardware dispatches it
first.

Nothing is written to the state tensors' junk elements (the torch version's masked-off writes are masked here), so
the first ``E``/``K`` elements of every state tensor, the counters, the clock and the plan are the torch
version's; tests/test_cache_plan_kernel.py checks that step by step under Triton's interpreter, with the copies
and the partition against fill_rows and the torch partition.

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

from pinsidecar_hook.kernels.fill import BLOCK as FILL_BLOCK
from pinsidecar_hook.kernels.fill import CachePlan, row_words
from pinsidecar_hook.kernels.partition import tl, triton, triton_available

__all__ = ["MAX_EXPERTS", "MAX_FILL_TENSORS", "MAX_PAIRS", "MAX_SLOTS", "Partitioned", "plan_triton", "step_triton"]

MAX_EXPERTS = 1024  # E: the per-expert phases are one block of lanes
MAX_SLOTS = 256  # K: the eviction order is K x K comparisons
MAX_PAIRS = 65536  # P = T * k: positions are int32, stamps advance by 2P + 2 a step
MAX_FILL_TENSORS = 4  # per-expert tensors one launch copies (bf16: 2; FP8 with scales: 4)

# Positions one iteration of the phase 1/2 loops handles: a decode step (P of a few hundred) is one iteration.
_BLOCK_P = 1024
# Columns of the K x K slot comparison per iteration: a 256 x 32 tile at most.
_SLOT_CHUNK = 32
_MIN_BLOCK = 16
_NO_POSITION = 2**31 - 1  # "first" of an expert the step does not select

# pinsidecar_hook.cache.ExpertCache, read and written through its attributes (kernels import no other room).
ExpertCache = Any

if triton is not None:
    from pinsidecar_hook.kernels.fill import copy_row_block

    @triton.jit
    def _cache_step_kernel(
        ids_ptr, num_real_ptr,
        row_map_ptr, base_rows_ptr, slot_expert_ptr, slot_of_ptr, stamp_ptr, freq_ptr,
        clock_ptr, hits_ptr, misses_ptr, fills_ptr, evictions_ptr,
        hot_map_ptr, cold_map_ptr,
        last_ptr, first_ptr, miss_list_ptr,
        n_fill_ptr, dst_rows_ptr, src_rows_ptr,
        hot_ids_ptr, cold_ids_ptr, expert_counts_ptr, part_cold_ptr, token_counts_ptr,
        sync_ptr, fill_programs,
        d0, s0, w0, d1, s1, w1, d2, s2, w2, d3, s3, w3,
        pairs, top_k, num_tokens, num_experts, num_slots, hot_rows,
        LFU: tl.constexpr, MASK_REAL: tl.constexpr, TIER_MAPS: tl.constexpr,
        PARTITION: tl.constexpr, COUNT: tl.constexpr, COUNT_TOKENS: tl.constexpr,
        NT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
        FILL_BLOCK: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SLOT_CHUNK: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        if tl.program_id(0) == 0:
            clock = tl.load(clock_ptr)
            real_tokens = tl.zeros([], dtype=tl.int64) + num_tokens  # may arrive as a constexpr (Triton specializes 1)
            if MASK_REAL:
                real_tokens = tl.minimum(tl.load(num_real_ptr).to(tl.int64), real_tokens)
            real = tl.minimum(real_tokens * top_k, tl.zeros([], dtype=tl.int64) + pairs)
            hbm_rows = hot_rows + num_slots

            # 1. one pass over the step's selections, by the row map at the step's start: a row among the slots is a
            # hit (its slot's stamp: the clock plus the last position selecting it, by atomic max: every stamp is
            # below the clock), a row past them a miss; lfu frequencies; the partition by these rows
            n_hits = tl.zeros([], dtype=tl.int64)
            n_misses = tl.zeros([], dtype=tl.int64)
            n_cold = tl.zeros([], dtype=tl.int64)
            for p0 in range(0, pairs, BLOCK_P):
                pos = p0 + tl.arange(0, BLOCK_P)
                live = pos < pairs
                ids = tl.load(ids_ptr + pos, mask=live, other=-1).to(tl.int32)
                in_range = live & (ids >= 0) & (ids < num_experts)
                valid = in_range & (pos < real)
                rows = tl.load(row_map_ptr + ids, mask=in_range, other=-1)
                in_slot = (rows >= hot_rows) & (rows < hbm_rows)
                missed = rows >= hbm_rows
                tl.atomic_max(stamp_ptr + (rows - hot_rows), clock + pos, mask=valid & in_slot, sem="relaxed")
                if LFU:
                    tl.atomic_add(freq_ptr + ids, tl.full([BLOCK_P], 1, tl.int64), mask=valid, sem="relaxed")
                n_hits += tl.sum((valid & in_slot).to(tl.int64), axis=0)
                n_misses += tl.sum((valid & missed).to(tl.int64), axis=0)
                if PARTITION:
                    tl.store(hot_ids_ptr + pos, tl.where((rows >= 0) & (rows < hbm_rows), rows, -1), mask=live)
                    tl.store(cold_ids_ptr + pos, tl.where(missed, rows - hbm_rows, -1), mask=live)
                    if COUNT:
                        tl.atomic_add(expert_counts_ptr + ids, tl.full([BLOCK_P], 1, tl.int64), mask=valid,
                                      sem="relaxed")
            n_cold = n_misses  # the partition's cold count: nothing flipped yet

            s_offs = tl.arange(0, BLOCK_K)
            s_live = s_offs < num_slots
            if n_misses > 0:  # the rest of the plan only when something missed (module docstring)
                # 2. scratch: each expert's last and first selection position
                e_offs = tl.arange(0, BLOCK_E)
                e_live = e_offs < num_experts
                tl.store(last_ptr + e_offs, tl.full([BLOCK_E], -1, tl.int32), mask=e_live)
                tl.store(first_ptr + e_offs, tl.full([BLOCK_E], 2147483647, tl.int32), mask=e_live)
                tl.debug_barrier()
                for p0 in range(0, pairs, BLOCK_P):
                    pos = p0 + tl.arange(0, BLOCK_P)
                    ids = tl.load(ids_ptr + pos, mask=pos < pairs, other=-1).to(tl.int32)
                    valid = (pos < real) & (ids >= 0) & (ids < num_experts)
                    tl.atomic_max(last_ptr + ids, pos, mask=valid, sem="relaxed")
                    tl.atomic_min(first_ptr + ids, pos, mask=valid, sem="relaxed")
                tl.debug_barrier()

                # 3. the missed experts in the order of their first selection: the first K into the list
                n_missed = tl.zeros([], dtype=tl.int32)
                for p0 in range(0, pairs, BLOCK_P):
                    pos = p0 + tl.arange(0, BLOCK_P)
                    ids = tl.load(ids_ptr + pos, mask=pos < pairs, other=-1).to(tl.int32)
                    valid = (pos < real) & (ids >= 0) & (ids < num_experts)
                    first = tl.load(first_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
                    rows = tl.load(row_map_ptr + ids, mask=valid, other=-1)
                    opens = valid & (first == pos) & (rows >= hbm_rows)
                    rank = n_missed + tl.cumsum(opens.to(tl.int32), axis=0) - 1
                    tl.store(miss_list_ptr + rank, ids, mask=opens & (rank < num_slots))
                    n_missed += tl.sum(opens.to(tl.int32), axis=0)

                # 4. the eviction order of the slots the step does not use
                held = tl.load(slot_expert_ptr + s_offs, mask=s_live, other=num_experts)
                filled = held < num_experts  # the slot holds an expert
                held_last = tl.load(last_ptr + held, mask=s_live & filled, other=-1, cache_modifier=".cg")
                evictable = s_live & (held_last < 0)
                stamp = tl.load(stamp_ptr + s_offs, mask=s_live, other=0, cache_modifier=".cg")
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
                    c_stamp = tl.load(stamp_ptr + c_offs, mask=c_live, other=0, cache_modifier=".cg")
                    same_stamp = c_stamp[None, :] == stamp[:, None]
                    before = (c_stamp[None, :] < stamp[:, None]) | (same_stamp & (c_offs[None, :] < s_offs[:, None]))
                    if LFU:
                        c_seen = tl.load(freq_ptr + c_held, mask=c_live & c_filled, other=-1, cache_modifier=".cg")
                        before = (c_seen[None, :] < seen[:, None]) | ((c_seen[None, :] == seen[:, None]) & before)
                    rank += tl.sum((before & c_evictable[None, :]).to(tl.int32), axis=1)
                n_evictable = tl.sum(evictable.to(tl.int32), axis=0)
                n_fill = tl.minimum(n_missed, n_evictable)
                tl.debug_barrier()  # every read of the step-start slot state and of the miss list is done

                # 5. the flip: the slot of rank i < n_fill takes the i-th missed expert
                fill = evictable & (rank < n_fill)
                new = tl.load(miss_list_ptr + rank, mask=fill, other=0, cache_modifier=".cg")
                evict = fill & filled
                old_row = tl.load(base_rows_ptr + held, mask=evict, other=-1)
                tl.store(row_map_ptr + held, old_row, mask=evict)
                tl.store(slot_of_ptr + held, tl.full([BLOCK_K], -1, tl.int64), mask=evict)
                slot_row = hot_rows + s_offs.to(tl.int64)
                tl.store(slot_expert_ptr + s_offs, new.to(tl.int64), mask=fill)
                tl.store(slot_of_ptr + new, s_offs.to(tl.int64), mask=fill)
                tl.store(row_map_ptr + new, slot_row, mask=fill)
                if TIER_MAPS:
                    tl.store(hot_map_ptr + held, tl.where((old_row >= 0) & (old_row < hbm_rows), old_row, -1),
                             mask=evict)
                    tl.store(cold_map_ptr + held, tl.where(old_row >= hbm_rows, old_row - hbm_rows, -1), mask=evict)
                    tl.store(hot_map_ptr + new, tl.where(slot_row < hbm_rows, slot_row, -1), mask=fill)
                    tl.store(cold_map_ptr + new, tl.where(slot_row >= hbm_rows, slot_row - hbm_rows, -1), mask=fill)
                # a fill's stamp: (lru) the clock plus P plus its first position, after every hit of the step,
                # (lfu) the clock plus its last, as a hit
                if LFU:
                    new_pos = tl.load(last_ptr + new, mask=fill, other=0, cache_modifier=".cg").to(tl.int64)
                else:
                    new_pos = pairs + tl.load(first_ptr + new, mask=fill, other=0, cache_modifier=".cg").to(tl.int64)
                tl.store(stamp_ptr + s_offs, clock + new_pos, mask=fill)
                # the plan: fill i at index i, zeros after the fills
                src_row = tl.load(base_rows_ptr + new, mask=fill, other=0) - hbm_rows
                tl.store(dst_rows_ptr + rank, slot_row, mask=fill)
                tl.store(src_rows_ptr + rank, src_row, mask=fill)
                spare = s_live & (s_offs >= n_fill)
                tl.store(dst_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=spare)
                tl.store(src_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=spare)
                tl.store(n_fill_ptr, n_fill.to(tl.int64))
                tl.atomic_add(fills_ptr, n_fill.to(tl.int64), sem="relaxed")
                tl.atomic_add(evictions_ptr, tl.sum(evict.to(tl.int64), axis=0), sem="relaxed")
                tl.debug_barrier()  # the flip and the plan are written

                # 6. the partition again, by the flipped row map: the filled experts are computed from their slots
                if PARTITION:
                    n_cold = tl.zeros([], dtype=tl.int64)
                    for p0 in range(0, pairs, BLOCK_P):
                        pos = p0 + tl.arange(0, BLOCK_P)
                        live = pos < pairs
                        ids = tl.load(ids_ptr + pos, mask=live, other=-1).to(tl.int32)
                        in_range = live & (ids >= 0) & (ids < num_experts)
                        rows = tl.load(row_map_ptr + ids, mask=in_range, other=-1, cache_modifier=".cg")
                        tl.store(hot_ids_ptr + pos, tl.where((rows >= 0) & (rows < hbm_rows), rows, -1), mask=live)
                        tl.store(cold_ids_ptr + pos, tl.where(rows >= hbm_rows, rows - hbm_rows, -1), mask=live)
                        n_cold += tl.sum((in_range & (pos < real) & (rows >= hbm_rows)).to(tl.int64), axis=0)
                if NT > 0:
                    tl.debug_barrier()
                    # each fill program's own word: it may read the plan (one lane a program, release)
                    f_offs = tl.arange(0, BLOCK_F)
                    tl.atomic_xchg(sync_ptr + f_offs, tl.full([BLOCK_F], 2, tl.int32), mask=f_offs < fill_programs,
                                   sem="release")
            else:
                if NT > 0:  # nothing to fill: the fill programs return (nothing for them to read, so relaxed)
                    f_offs = tl.arange(0, BLOCK_F)
                    tl.atomic_xchg(sync_ptr + f_offs, tl.full([BLOCK_F], 1, tl.int32), mask=f_offs < fill_programs,
                                   sem="relaxed")
                tl.store(n_fill_ptr, tl.zeros([], dtype=tl.int64))
                tl.store(dst_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=s_live)
                tl.store(src_rows_ptr + s_offs, tl.zeros([BLOCK_K], dtype=tl.int64), mask=s_live)

            # counters and clock (only this program writes them)
            tl.atomic_add(hits_ptr, n_hits, sem="relaxed")
            tl.atomic_add(misses_ptr, n_misses, sem="relaxed")
            tl.store(clock_ptr, clock + 2 * pairs + 2)
            if PARTITION:
                if COUNT:
                    tl.atomic_add(part_cold_ptr, n_cold, sem="relaxed")
                if COUNT_TOKENS:
                    tl.atomic_add(token_counts_ptr, real_tokens, sem="relaxed")
        else:
            if NT > 0:
                # 7. the fill programs: each waits for its own word from program 0 (a plain volatile load: no two
                # programs poll one address), copies its share of the fills' rows of every tensor, and sets its word
                # back to 0 for the next step, which cannot start before this launch ends
                mine = sync_ptr + tl.program_id(0) - 1
                ready = tl.load(mine, volatile=True)
                while ready == 0:
                    ready = tl.load(mine, volatile=True)
                if ready == 2:
                    tl.atomic_add(mine, 0, sem="acquire")  # pairs with program 0's release: the plan is visible
                    items = tl.load(n_fill_ptr, cache_modifier=".cg") * (B0 + B1 + B2 + B3)
                    for item in range((tl.program_id(0) - 1).to(tl.int64), items, fill_programs):
                        f = item // (B0 + B1 + B2 + B3)
                        b = item % (B0 + B1 + B2 + B3)
                        dst_row = tl.load(dst_rows_ptr + f, cache_modifier=".cg")
                        src_row = tl.load(src_rows_ptr + f, cache_modifier=".cg")
                        if b < B0:
                            copy_row_block(d0, s0, dst_row, src_row, w0, b, FILL_BLOCK)
                        elif b < B0 + B1:
                            copy_row_block(d1, s1, dst_row, src_row, w1, b - B0, FILL_BLOCK)
                        elif b < B0 + B1 + B2:
                            copy_row_block(d2, s2, dst_row, src_row, w2, b - B0 - B1, FILL_BLOCK)
                        else:
                            copy_row_block(d3, s3, dst_row, src_row, w3, b - B0 - B1 - B2, FILL_BLOCK)
                tl.store(mine, 0)


@dataclass
class _Buffers:
    """A cache's scratch and plan tensors, allocated at its first step and reused by every call."""

    last: torch.Tensor  # int32 [E]
    first: torch.Tensor  # int32 [E]
    miss_list: torch.Tensor  # int32 [K]
    sync: torch.Tensor  # int32 [the most fill programs]: program 0's word to each fill program (0: wait, 1:
    # nothing to fill, 2: the plan is written); each program sets its own back to 0 before the launch ends
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
            sync=torch.zeros(_fill_programs(device, 1 << 30), dtype=torch.int32, device=device),
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


def _check_counter(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int64 or t.numel() != 1:
        raise ValueError(f"{name} must be an int64 tensor of one element")


def _fill_programs(device: torch.device, work: int) -> int:
    """How many programs copy a step's fills: one per SM (all resident at once, so program 0 is never waited on
    by programs that hold every SM), at most one per block of work; a few under the interpreter."""
    if device.type != "cuda":
        return max(1, min(3, work))
    return max(1, min(torch.cuda.get_device_properties(device).multi_processor_count, work))


@dataclass
class Partitioned:
    """The split's partition of the step's ids, by the row map after the step's fills (the contract of
    :mod:`pinsidecar_hook.kernels.partition`, with ``hot_rows = H + K``)."""

    hot_ids: torch.Tensor
    cold_ids: torch.Tensor


def step_triton(cache: ExpertCache, topk_ids: torch.Tensor, num_real: torch.Tensor | None = None,
                misses: torch.Tensor | None = None,
                tier_maps: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                fills: list[tuple[torch.Tensor, torch.Tensor]] | None = None, partition: bool = False,
                expert_counts: torch.Tensor | None = None, cold_counts: torch.Tensor | None = None,
                token_counts: torch.Tensor | None = None) -> tuple[CachePlan, Partitioned | None]:
    """:meth:`ExpertCache.plan` in one launch (module docstring): same arguments, same state transitions, same
    plan. ``tier_maps=(hot_map, cold_map)`` (int32 ``[E]``, as
    :func:`pinsidecar_hook.backends.tiers.tier_expert_maps` makes them for ``hbm_rows = H + K``) are
    updated in place for the experts whose row the step changes, so they stay equal to the maps of the new row
    map. ``fills``: the ``(slot rows, cold rows)`` tensors to copy the fills into (at most
    :data:`MAX_FILL_TENSORS`, see :func:`pinsidecar_hook.kernels.fill.fill_pairs`), in the same launch.
    ``partition``: also partition the ids by the new row map, counting into ``expert_counts``/``cold_counts``
    (both or neither) and ``token_counts`` as :func:`pinsidecar_hook.kernels.partition.partition` does. The
    returned plan's tensors belong to the cache and are rewritten by its next call."""
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
    _check_counter("the misses counter", misses)
    if cache.row_map_ext.dtype != torch.int32 or not cache.row_map_ext.is_contiguous():
        raise ValueError("cache.row_map_ext must be a contiguous int32 tensor")
    if tier_maps is not None:
        for name, t in zip(("hot_map", "cold_map"), tier_maps, strict=True):
            if t.dtype != torch.int32 or tuple(t.shape) != (e,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor of shape ({e},), got {t.dtype} "
                                 f"{tuple(t.shape)}")
    if (expert_counts is None) != (cold_counts is None):
        raise ValueError("the step counts both or neither: pass expert_counts and cold_counts together")
    for name, t in (("expert_counts", expert_counts), ("cold_counts", cold_counts),
                    ("token_counts", token_counts)):
        if t is not None and (not partition or t.dtype != torch.int64):
            raise ValueError(f"{name} counts the partition: pass partition=True and an int64 tensor")
    if cold_counts is not None:
        _check_counter("cold_counts", cold_counts)
    if token_counts is not None:
        _check_counter("token_counts", token_counts)
    words = [row_words(dst, src) for dst, src in (fills or [])]
    if len(words) > MAX_FILL_TENSORS:
        raise ValueError(f"the fused step copies at most {MAX_FILL_TENSORS} tensors per fill, got {len(words)}; "
                         "copy with fill_rows after the step instead")
    buf = _buffers_of(cache)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    hot_map, cold_map = tier_maps if tier_maps is not None else (buf.last, buf.last)
    out = None
    if partition:
        out = Partitioned(torch.empty(ids.shape, dtype=torch.int32, device=ids.device),
                          torch.empty(ids.shape, dtype=torch.int32, device=ids.device))
    blocks = [triton.cdiv(d.shape[1], FILL_BLOCK) for d, _ in words]
    fill_programs = _fill_programs(ids.device, k * sum(blocks)) if words else 0
    tensors = [(d, s, d.shape[1]) for d, s in words]
    tensors += [tensors[0] if tensors else (buf.last, buf.last, 0)] * (MAX_FILL_TENSORS - len(tensors))
    blocks += [0] * (MAX_FILL_TENSORS - len(blocks))
    scratch = buf.last  # a stand-in for pointers a launch does not use
    _cache_step_kernel[(1 + fill_programs,)](
        ids, num_real if num_real is not None else scratch,
        cache.row_map_ext, cache.base_rows, cache.slot_expert, cache.slot_of, cache.stamp, cache.freq,
        cache.clock, cache.hits, misses, cache.fills, cache.evictions,
        hot_map, cold_map,
        buf.last, buf.first, buf.miss_list,
        buf.plan.n_fill, buf.plan.dst_rows, buf.plan.src_rows,
        out.hot_ids if out else scratch, out.cold_ids if out else scratch,
        expert_counts if expert_counts is not None else scratch,
        cold_counts if cold_counts is not None else scratch,
        token_counts if token_counts is not None else scratch,
        buf.sync, fill_programs,
        *[x for triple in tensors for x in triple],
        pairs, topk_ids.shape[-1] if topk_ids.dim() > 1 else 1, ids.shape[0] if ids.dim() > 1 else pairs,
        e, k, cache.hot_rows,
        LFU=cache.policy == "lfu",
        MASK_REAL=num_real is not None,
        TIER_MAPS=tier_maps is not None,
        PARTITION=partition, COUNT=expert_counts is not None, COUNT_TOKENS=token_counts is not None,
        NT=len(words), B0=blocks[0], B1=blocks[1], B2=blocks[2], B3=blocks[3], FILL_BLOCK=FILL_BLOCK,
        BLOCK_P=min(_BLOCK_P, max(_MIN_BLOCK, triton.next_power_of_2(max(pairs, 1)))),
        BLOCK_E=max(_MIN_BLOCK, triton.next_power_of_2(e)),
        BLOCK_K=max(_MIN_BLOCK, triton.next_power_of_2(k)),
        SLOT_CHUNK=min(_SLOT_CHUNK, max(_MIN_BLOCK, triton.next_power_of_2(k))),
        BLOCK_F=max(_MIN_BLOCK, triton.next_power_of_2(max(fill_programs, 1))),
    )
    return buf.plan, out


def plan_triton(cache: ExpertCache, topk_ids: torch.Tensor, num_real: torch.Tensor | None = None,
                misses: torch.Tensor | None = None,
                tier_maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> CachePlan:
    """The plan alone (:func:`step_triton` without the copy or the partition): the rows are not copied, which is
    what the negative control of bit identity needs."""
    return step_triton(cache, topk_ids, num_real, misses, tier_maps)[0]
