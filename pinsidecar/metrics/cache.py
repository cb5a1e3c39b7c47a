"""The cache tier's counters from the hook's stats file: slot hits, fills and evictions, the slots, the hit ratio.

When the served map has cache slots (docs/cache-tier.md), the hook's stats carry ``cache``: ``slots`` and ``policy``
(the map's) and, per layer, ``hits`` (selections served by a slot filled before the step), ``fills`` (cold experts
copied into a slot) and ``evictions`` (fills that replaced another expert), cumulative since the engine booted like
every other counter there. With a cache, ``cold_selections`` are the misses, so the slots' hit ratio is
``hits / (hits + cold_selections)``; hot-row selections are in neither.

:class:`CacheTotals` folds each reading's cache deltas into running totals by the same rules as
:class:`~pinsidecar.metrics.routing.RoutingTotals` (a restart or a reset: the delta is the new snapshot's values; a
counter that goes down anyway is taken as started again, never as negative traffic), so the ``_total`` series stay
monotonic over engine restarts and ``rate()`` sees no false counter reset. The :class:`~pinsidecar.live_stats.
StatsReader` gives no cache deltas of its own, so the totals keep the previous snapshot they folded.

**Without a cache** (a map with no slots, or a hook from before the cache tier): ``pinsidecar_cache_slots`` is 0
and the three lane counters are exported at 0, as ``pinsidecar_remaps_total`` is present at 0 from the start and
the hook's error counters start at 0: a counter at 0 says the truth (no slot served, filled or evicted anything),
a dashboard or rule that reads it works on every lane, and when a lane first boots a map with a cache its counters
already exist, so ``increase()`` does not lose their first increment. Once a lane has counted, its totals stay
(flat) over later boots without a cache. What would lie is a *ratio* of nothing, so the hit-ratio gauge follows
``pinsidecar_cold_selection_ratio``: absent when it is unknown (no cache now, or no slot-or-miss selection since
boot), never 0; the dashboard's PromQL hit rate keeps to lanes whose ``pinsidecar_cache_slots`` is above 0 for the
same reason. The per-layer counters exist only for layers that had a cache (no series of zeros per layer on lanes
that never had one).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pinsidecar_hook.contract import StatsSnapshot
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pinsidecar.live_stats import StatsReading, ratio

__all__: list[str] = []  # nothing here is another package's business

# The per-layer counters in the stats file's ``cache`` (pinsidecar_hook.contract.stats.CACHE_COUNTERS).
COUNTERS = ("hits", "fills", "evictions")

_HELP = {
    "hits": "Routed expert selections served by a cache slot (the expert was copied into HBM before the step).",
    "fills": "Cold experts copied from host memory into a cache slot.",
    "evictions": "Cache fills that replaced another expert in its slot.",
}


def cache_deltas(prev: StatsSnapshot | None, reading: StatsReading) -> dict[str, list[int]] | None:
    """Per counter, per layer (in ``reading.snapshot.layer_ids`` order): what the cache counted since ``prev``.
    None when the snapshot has no cache. Never negative: after a restart or a reset (or with no previous cache)
    the delta is the snapshot's own values, and a counter that went down anyway counts from zero again."""
    cache = reading.snapshot.cache
    if cache is None:
        return None
    before = prev.cache if prev is not None else None
    if reading.restarted or reading.reset or before is None:
        return {key: list(cache[key]) for key in COUNTERS}
    return {key: [now - old if now >= old else now for now, old in zip(cache[key], before[key], strict=True)]
            for key in COUNTERS}


@dataclass
class CacheTotals:
    """Cache counters since the exporter started, per counter and layer id, over engine restarts and resets."""

    hits: dict[int, int] = field(default_factory=dict)
    fills: dict[int, int] = field(default_factory=dict)
    evictions: dict[int, int] = field(default_factory=dict)
    previous: StatsSnapshot | None = field(default=None, repr=False)  # the last snapshot folded in

    def add(self, reading: StatsReading) -> None:
        """Fold one reading in (every reading of one reader, in order: the deltas are against the previous)."""
        deltas = cache_deltas(self.previous, reading)
        self.previous = reading.snapshot
        if deltas is None:
            return
        for key in COUNTERS:
            totals: dict[int, int] = getattr(self, key)
            for lid, d in zip(reading.snapshot.layer_ids, deltas[key], strict=True):
                totals[lid] = totals.get(lid, 0) + d

    def copy(self) -> dict[str, dict[int, int]]:
        return {key: dict(getattr(self, key)) for key in COUNTERS}


def hit_ratio(snap: StatsSnapshot) -> float | None:
    """The slots' hit ratio since the engine booted (or the hook reset): hits / (hits + misses), where the misses
    are the cold selections. None without a cache, or when no selection has gone to a slot or host memory yet."""
    if snap.cache is None:
        return None
    hits = int(sum(snap.cache["hits"]))
    return ratio(hits, hits + snap.total_cold_selections)


def cache_status(snap: StatsSnapshot) -> dict[str, Any] | None:
    """What ``pinsidecar status`` shows of the cache tier, from one snapshot (counts since the engine booted, or
    the hook's last reset), lane totals: None when the engine serves no cache."""
    cache = snap.cache
    if cache is None:
        return None
    hits = int(sum(cache["hits"]))
    misses = snap.total_cold_selections
    return {"slots": int(cache["slots"]), "policy": str(cache.get("policy", "lru")), "hits": hits, "misses": misses,
            "fills": int(sum(cache["fills"])), "evictions": int(sum(cache["evictions"])),
            "hit_ratio": ratio(hits, hits + misses)}


def cache_metrics(totals: dict[str, dict[int, int]], snap: StatsSnapshot) -> Iterator[Metric]:
    """The cache tier's families for one scrape: ``totals`` from :meth:`CacheTotals.copy`, ``snap`` the reading's
    snapshot (slots and the since-boot ratio are the snapshot's own). See the module docstring for what is exported
    without a cache and why."""
    for key in COUNTERS:
        yield CounterMetricFamily(f"pinsidecar_cache_{key}", _HELP[key] + " All MoE layers.",
                                  value=sum(totals[key].values()))
    for key in COUNTERS:
        layer = CounterMetricFamily(f"pinsidecar_layer_cache_{key}", _HELP[key] + " Per MoE layer.",
                                    labels=["layer"])
        for lid in sorted(totals[key]):
            layer.add_metric([str(lid)], totals[key][lid])
        yield layer
    yield GaugeMetricFamily("pinsidecar_cache_slots", "Cache slots per MoE layer in the served map (0: no cache).",
                            value=0 if snap.cache is None else int(snap.cache["slots"]))
    ratio_now = hit_ratio(snap)
    if ratio_now is not None:
        yield GaugeMetricFamily("pinsidecar_cache_hit_ratio",
                                "Cache slot hits / (hits + cold selections) since the engine booted (or the hook "
                                "reset); cold selections are the cache's misses.", value=ratio_now)
