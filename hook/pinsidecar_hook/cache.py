"""The cache tier: K HBM slots per layer that hold copies of recently used cold experts, inside the step.

A map keeps its hot set for as long as it is deployed; routing with short reuse (a token picks what the last few
tokens picked) leaves that set behind. A layer with a cache has ``H`` static hot rows and ``K`` slot rows in its HBM
tier (rows ``H..H+K-1``), and its cold experts in host memory as before: the host copy stays the master, so a
slot is a *copy* and evicting one costs nothing. Per experts call, before the tiers compute (:meth:`ExpertCache.step`):

1. the step's selections are looked up: a **hit** is a selection of an expert in a slot, a **miss** one of a cold
   expert that is not (one host fetch per expert per step);
2. the step's missed experts are **filled** into slots, in the order the step first selected them. A fill takes
   an empty slot or one whose expert the step does not select (a slot the step uses cannot be overwritten before
   the step computes), the least recently used one first (``lru``) or the one with the fewest selections so far,
   the least recently used among equals (``lfu``); when none is left the remaining misses are read from host
   memory in place, as without a cache;
3. the row map sends each filled expert to its slot and each evicted one back to its cold row; the tiers then
   compute as usual, so the filled experts are computed from HBM in this very step.

This is the model of ``pinsidecar placement simulate`` (pinsidecar/placement/simulate.py), step for step:
tests/test_cache_tier.py replays traces through both and compares hits, misses and fills.

Bit identity: a slot holds the same bytes as the expert's cold row, and the split computes every expert's rows
the same way whichever tier holds it (the backends' placement invariance), so a step's output does not depend on
what the cache holds. A row map flipped before its copy would compute from a stale slot; that negative control is
tested (:func:`plan` without :func:`fill_rows`).

Everything is device ops on tensors of static shape (expert- and slot-sized), so the step can be captured in a
CUDA graph: writes that a step does not need go to a junk element at the end of each state tensor instead of
being skipped. On CUDA the same step is one Triton launch (:mod:`pinsidecar_hook.kernels.cache_plan`, checked
against this torch version step by step; torch's ops are about a hundred kernels, and capturing them in a CUDA
graph failed on an H100). Only the copy's length depends on the data: on the CPU it is a plain ``index_copy_``
of the filled rows; on CUDA the Triton copy (:mod:`pinsidecar_hook.kernels.fill`) reads the fill count on the
device and its spare programs return at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pinsidecar_hook.kernels.cache_plan import (
    MAX_EXPERTS,
    MAX_FILL_TENSORS,
    MAX_PAIRS,
    MAX_SLOTS,
    plan_triton,
    step_triton,
)
from pinsidecar_hook.kernels.fill import CachePlan, fill_pairs, fill_rows_cuda, fill_rows_reference
from pinsidecar_hook.kernels.partition import partition, triton_available

__all__ = ["ExpertCache", "fill_rows"]

_BIG = 2**62  # a sort key after every real one


class ExpertCache:
    """One layer's slots: which expert each holds, its recency or frequency, and the counters.

    ``row_map`` is the layer's row map (global id -> row: hot ``0..H-1``, slot ``H..H+K-1``, cold ``H+K..``, ``-1``
    for an expert of another rank); it must be a view of the first ``E`` elements of ``row_map_ext``, an
    ``E + 2`` tensor whose last two elements absorb writes a step does not need. The cache writes the row map in
    place, so everything that reads it by address (the split, captured graphs) follows.
    """

    def __init__(self, row_map_ext: torch.Tensor, hot_rows: int, slots: int, policy: str,
                 cold_counts: torch.Tensor) -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"cache policy must be lru or lfu, got {policy!r}")
        if slots < 1:
            raise ValueError(f"a cache needs at least one slot, got {slots}")
        device = row_map_ext.device
        self.num_experts = int(row_map_ext.shape[0]) - 2
        # A captured step must take the one-launch kernel, which has bounds (checked once, here).
        self._fused = device.type == "cuda" and triton_available(device)
        if device.type == "cuda" and (self.num_experts > MAX_EXPERTS or slots > MAX_SLOTS):
            raise ValueError(f"the cache tier on CUDA handles at most {MAX_EXPERTS} experts and {MAX_SLOTS} "
                             f"slots per layer; this layer has {self.num_experts} experts and {slots} slots. "
                             "Build the map with fewer --cache-slots, or without a cache")
        self.hot_rows = hot_rows  # H: static hot rows; slots are rows H..H+K-1
        self.slots = slots
        self.policy = policy
        self.row_map_ext = row_map_ext
        e, k = self.num_experts, slots
        self.base_rows = row_map_ext.to(torch.int64).clone()  # each expert's row with no cache (cold: H+K+i)
        # Cold experts of this rank: what may enter a slot. Junk elements never do.
        self.cold = (self.base_rows >= hot_rows + slots)
        self.cold[e:] = False
        self.slot_expert = torch.full((k + 1,), e, dtype=torch.int64, device=device)  # E: empty; [K] junk
        self.slot_of = torch.full((e + 2,), -1, dtype=torch.int64, device=device)  # [E] stays -1, [E+1] junk
        self.stamp = torch.full((k + 1,), -1, dtype=torch.int64, device=device)  # recency; -1: never used
        self.freq = torch.zeros(e + 2, dtype=torch.int64, device=device)  # lfu: selections seen in the run
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.hits = torch.zeros(1, dtype=torch.int64, device=device)
        self.misses = cold_counts  # the layer's cold counter: with a cache, the misses are its cold selections
        self.fills = torch.zeros(1, dtype=torch.int64, device=device)
        self.evictions = torch.zeros(1, dtype=torch.int64, device=device)
        self._slot_index = torch.arange(k, device=device)
        # The split's tier maps (triton_experts: hot_map, cold_map), which the fused CUDA step updates with the row
        # map; ``maps_followed`` says whether the last step did (else the split recomputes them).
        self.tier_maps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.maps_followed = False

    @property
    def row_map(self) -> torch.Tensor:
        return self.row_map_ext[: self.num_experts]

    def reset_counters(self) -> None:
        """Zero the counters (with the layer's others: warm-up is not traffic). The slots keep what they hold."""
        for counter in (self.hits, self.fills, self.evictions):
            counter.zero_()

    def clear(self) -> None:
        """Empty every slot: the row map goes back to the map's rows (before an in-place apply changes them)."""
        self.row_map_ext.copy_(self.base_rows.to(self.row_map_ext.dtype))
        self.slot_expert.fill_(self.num_experts)
        self.slot_of.fill_(-1)
        self.stamp.fill_(-1)
        self.freq.zero_()

    def plan(self, topk_ids: torch.Tensor, num_real: torch.Tensor | None = None,
             misses: torch.Tensor | None = None) -> CachePlan:
        """Count this step's hits and misses, choose its fills and flip the row map for them (module docstring,
        steps 1 to 3). The rows are not copied: :func:`fill_rows` does that, and must run before the tiers
        compute. ``num_real`` (int, ``[1]``) is the number of real tokens when a CUDA graph pads the batch.
        ``misses``: the counter to add the misses to, when not the layer's own cold counter as the cache holds it:
        inside a compiled custom op that declares the counter mutated, the compiler hands the op a stand-in and
        copies it back afterwards, so the op must count into what it was given."""
        # One launch on CUDA (kernels/cache_plan.py), capturable; past its bounds (a prefill of more than
        # MAX_PAIRS selections, never a captured decode step) the torch ops below run, eagerly.
        if self._fused and topk_ids.numel() <= MAX_PAIRS:
            self.maps_followed = self.tier_maps is not None
            return plan_triton(self, topk_ids, num_real, misses, self.tier_maps)
        self.maps_followed = False
        e, k, hot = self.num_experts, self.slots, self.hot_rows
        ids = topk_ids.reshape(-1).to(torch.int64)
        pairs = ids.shape[0]
        pos = torch.arange(pairs, device=ids.device)
        if num_real is not None:  # padding rows select nothing: they go to the neutral element E
            top_k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
            ids = torch.where(pos < num_real.to(torch.int64) * top_k, ids, e)
        last = torch.full((e + 2,), -1, dtype=torch.int64, device=ids.device).scatter_reduce_(0, ids, pos, "amax")
        first = torch.full((e + 2,), _BIG, dtype=torch.int64, device=ids.device).scatter_reduce_(0, ids, pos, "amin")
        selected = last >= 0
        selected[e:] = False
        # 1. hits and misses, as resident at the step's start
        resident = self.slot_of.index_select(0, ids) >= 0
        missed = selected & self.cold & (self.slot_of < 0)
        self.hits.add_(resident.sum())
        (self.misses if misses is None else misses).add_(missed.index_select(0, ids).sum())
        # recency (and frequency) of the slots the step uses
        held = self.slot_expert[:k]
        hit = selected.index_select(0, held)
        clock = self.clock
        self.stamp[:k] = torch.where(hit, clock + last.index_select(0, held), self.stamp[:k])
        if self.policy == "lfu":
            self.freq.index_add_(0, ids, torch.ones_like(ids))
        # 2. the victims: slots the step does not use, in eviction order
        evictable = ~hit
        order = torch.argsort(self.stamp[:k], stable=True)  # least recent first; never used (-1) before all
        if self.policy == "lfu":
            seen = torch.where(held < e, self.freq.index_select(0, held), -1)  # empty slots first
            order = order.index_select(0, torch.argsort(seen.index_select(0, order), stable=True))
        order = order.index_select(0, torch.argsort((~evictable).index_select(0, order).to(torch.int8), stable=True))
        # the misses in the order the step first selected them
        miss_order = torch.argsort(torch.where(missed[:e], first[:e], _BIG), stable=True)[:k]
        n_fill = torch.minimum(missed.sum(), evictable.sum()).reshape(1)
        active = self._slot_index < n_fill
        new = torch.where(active, miss_order, e + 1)
        slot = torch.where(active, order, k)
        old = torch.where(active, self.slot_expert.index_select(0, slot), e + 1)
        self.fills.add_(n_fill)
        self.evictions.add_((active & (old < e)).sum())
        # 3. flip: evicted experts back to their cold rows, filled ones to their slots
        self.row_map_ext.index_copy_(0, old, self.base_rows.index_select(0, old).to(self.row_map_ext.dtype))
        self.slot_of.index_copy_(0, old, torch.full_like(old, -1))
        self.slot_of[e] = -1
        self.slot_expert.index_copy_(0, slot, new)
        self.slot_of.index_copy_(0, new, torch.where(active, slot, -1))
        self.row_map_ext.index_copy_(0, new, (hot + slot).to(self.row_map_ext.dtype))
        # a fill's recency: lru puts the step's fills after its hits, in first-selection order; lfu keys on the
        # expert's last selection, as for a hit
        fill_stamp = clock + (pairs + first.index_select(0, new) if self.policy == "lru" else last.index_select(0, new))
        self.stamp.index_copy_(0, slot, torch.where(active, fill_stamp, -1))
        self.clock.add_(2 * pairs + 2)
        src = torch.where(active, self.base_rows.index_select(0, new) - (hot + k), 0)
        return CachePlan(n_fill, torch.where(active, hot + slot, 0), src)

    def step(self, topk_ids: torch.Tensor, hot: Mapping[str, torch.Tensor | None],
             cold: Mapping[str, torch.Tensor | None], num_real: torch.Tensor | None = None,
             misses: torch.Tensor | None = None) -> None:
        """The whole step before the tiers compute: :meth:`plan`, then :func:`fill_rows`."""
        fill_rows(self.plan(topk_ids, num_real, misses), hot, cold)

    def step_partition(self, topk_ids: torch.Tensor, hot: Mapping[str, torch.Tensor | None],
                       cold: Mapping[str, torch.Tensor | None], *, expert_counts: torch.Tensor | None = None,
                       cold_counts: torch.Tensor | None = None, num_real: torch.Tensor | None = None,
                       token_counts: torch.Tensor | None = None,
                       misses: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step`, then the split's partition of the ids by the new row map (``hot_rows = H + K``; the
        counters as :func:`pinsidecar_hook.kernels.partition.partition` takes them; ``cold_counts`` then counts
        what is still cold after the fills). On CUDA it is one launch that plans, copies the fills and
        partitions (:func:`pinsidecar_hook.kernels.cache_plan.step_triton`): a step with nothing to fill costs
        little more than the partition the split launches anyway."""
        fused = self._fused and topk_ids.numel() <= MAX_PAIRS and (expert_counts is None) == (cold_counts is None)
        pairs = fill_pairs(hot, cold)
        if fused and len(pairs) <= MAX_FILL_TENSORS:
            self.maps_followed = self.tier_maps is not None
            _, out = step_triton(self, topk_ids, num_real, misses, self.tier_maps, fills=pairs, partition=True,
                                 expert_counts=expert_counts, cold_counts=cold_counts, token_counts=token_counts)
            assert out is not None
            return out.hot_ids, out.cold_ids
        self.step(topk_ids, hot, cold, num_real, misses)
        return partition(topk_ids, self.row_map, self.hot_rows + self.slots, expert_counts, cold_counts,
                         num_real=num_real, token_counts=token_counts)

    def counters(self) -> dict[str, int]:
        """Hits, fills and evictions since the last reset (a small device-to-host copy)."""
        return {"hits": int(self.hits.item()), "fills": int(self.fills.item()),
                "evictions": int(self.evictions.item())}


def fill_rows(plan: CachePlan, hot: Mapping[str, torch.Tensor | None], cold: Mapping[str, torch.Tensor | None]) -> None:
    """Copy each fill's cold row into its slot row, for every per-expert tensor of the layer (weights, scales,
    biases). Must run after :meth:`ExpertCache.plan` and before the tiers compute. Aliases (two names of one
    tensor) are copied once."""
    copy = fill_rows_cuda if plan.dst_rows.is_cuda else fill_rows_reference
    for dst, src in fill_pairs(hot, cold):
        copy(dst, src, plan.dst_rows, plan.src_rows, plan.n_fill)
