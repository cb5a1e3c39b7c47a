"""What the routing did, from the hook's live stats file: selections, cold selections, ratios, tier bytes, errors,
and the cache tier's slots, hits, fills and evictions (:mod:`pinsidecar.metrics.cache`).

The file is read through :class:`pinsidecar.live_stats.StatsReader`, the daemon's one reader of it: the same
rules for restarts, resets and the hook's fallback path as the drift watch and the demo. The stats file's
counters start again from zero whenever the engine restarts or the hook serves a ``reset``; this collector folds
each reading's deltas into running totals (:class:`RoutingTotals`), so the exported ``_total`` series stay
monotonic and ``rate()`` never sees a false counter reset. The ratios and the map info are the snapshot's own
(since the engine booted, or the last reset).

When the hook cannot write its configured stats path it writes the fallback and counts ``errors["stats_write"]``;
the reader finds the fallback from the configured path, so the source stays up and that error is exported as
``pinsidecar_hook_errors_total{kind="stats_write"}``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from pinsidecar.live_stats import StatsReader, StatsReading
from pinsidecar.metrics.cache import CacheTotals, cache_metrics
from pinsidecar.metrics.source import SourceStatus

__all__: list[str] = []  # nothing here is another package's business


@dataclass
class RoutingTotals:
    """Totals since the exporter started, over engine restarts and hook resets: the sum of every reading's
    deltas. Per-layer dicts are keyed by layer id, so a geometry change between boots is safe."""

    selections: dict[int, int] = field(default_factory=dict)
    cold_selections: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    restarts: int = 0  # restarts seen after the first reading
    resets: int = 0

    def add(self, reading: StatsReading) -> None:
        """Fold one reading in (its deltas are never negative, so the totals never go down)."""
        lids = reading.snapshot.layer_ids
        for lid, d in zip(lids, reading.delta_selections, strict=True):
            self.selections[lid] = self.selections.get(lid, 0) + d
        for lid, d in zip(lids, reading.delta_cold_selections, strict=True):
            self.cold_selections[lid] = self.cold_selections.get(lid, 0) + d
        for kind, d in reading.delta_errors.items():
            self.errors[kind] = self.errors.get(kind, 0) + d
        self.restarts += int(reading.restarted and not reading.first)
        self.resets += int(reading.reset)


class RoutingCollector:
    """Exports the pin-mode hook's live stats (see the module docstring). ``stats_path`` None turns the source
    off; a missing file (no engine in pin mode yet) or a corrupt one drops these metrics until a readable one
    appears, and the reason is logged once."""

    source = "stats"

    def __init__(self, stats_path: Path | None, *, wall_clock: Callable[[], float] = time.time,
                 use_fallback: bool = True) -> None:
        self.stats_path = None if stats_path is None else Path(stats_path)
        self.reader = None if self.stats_path is None else StatsReader(self.stats_path, use_fallback=use_fallback)
        self.totals = RoutingTotals()
        self.cache_totals = CacheTotals()
        self.status = SourceStatus(self.source)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()  # concurrent scrapes: one read-and-fold at a time

    def _missing(self, reader: StatsReader) -> str:
        others = reader.candidates()[1:]
        also = f" (nor the hook's fallback {others[0]})" if others else ""
        return f"{reader.path}: stats file not found{also}; is the engine running in pin mode yet?"

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            reader = self.reader
            if reader is None:
                self.status.off()
                return
            reading = reader.read()
            if reading is None:
                self.status.fail(reader.last_error or self._missing(reader))
                return
            self.totals.add(reading)
            self.cache_totals.add(reading)
            self.status.ok()
            sel, cold, errors = dict(self.totals.selections), dict(self.totals.cold_selections), \
                dict(self.totals.errors)
            cache = self.cache_totals.copy()
        snap = reading.snapshot
        yield CounterMetricFamily("pinsidecar_expert_selections", "Routed expert selections, all MoE layers.",
                                  value=sum(sel.values()))
        yield CounterMetricFamily("pinsidecar_expert_cold_selections",
                                  "Routed expert selections that fell on host-resident (cold) experts.",
                                  value=sum(cold.values()))
        lsel = CounterMetricFamily("pinsidecar_layer_expert_selections", "Routed expert selections per MoE layer.",
                                   labels=["layer"])
        lcold = CounterMetricFamily("pinsidecar_layer_expert_cold_selections",
                                    "Routed expert selections on cold experts per MoE layer.", labels=["layer"])
        for lid in sorted(sel):
            lsel.add_metric([str(lid)], sel[lid])
            lcold.add_metric([str(lid)], cold.get(lid, 0))
        yield lsel
        yield lcold
        if reading.cold_ratio is not None:
            yield GaugeMetricFamily("pinsidecar_cold_selection_ratio",
                                    "Cold selections / selections since the engine booted (or the hook reset).",
                                    value=reading.cold_ratio)
        per_layer = GaugeMetricFamily("pinsidecar_layer_cold_selection_ratio",
                                      "Cold selections / selections per MoE layer since the engine booted.",
                                      labels=["layer"])
        for lid, layer_ratio in zip(snap.layer_ids, reading.cold_ratio_per_layer, strict=True):
            if layer_ratio is not None:
                per_layer.add_metric([str(lid)], layer_ratio)
        yield per_layer
        yield from cache_metrics(cache, snap)
        if snap.tier_bytes:
            tiers = GaugeMetricFamily("pinsidecar_expert_bytes", "Expert weight bytes by memory tier, on one "
                                      "tensor-parallel rank (every rank holds an equal shard).", labels=["tier"])
            for tier in sorted(snap.tier_bytes):
                tiers.add_metric([tier], snap.tier_bytes[tier])
            yield tiers
        ranks = (snap.meta or {}).get("tp_size")
        if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1:
            yield GaugeMetricFamily("pinsidecar_tensor_parallel_ranks", "Tensor-parallel ranks of the engine: "
                                    "the lane's expert bytes are pinsidecar_expert_bytes times this.", value=ranks)
        errs = CounterMetricFamily("pinsidecar_hook_errors", "Errors the hook counted inside the engine, by kind.",
                                   labels=["kind"])
        for kind in sorted(errors):
            errs.add_metric([kind], errors[kind])
        yield errs
        if snap.written_at > 0:
            yield GaugeMetricFamily("pinsidecar_stats_age_seconds", "Seconds since the hook last wrote its stats.",
                                    value=max(0.0, self._wall_clock() - snap.written_at))
        info = InfoMetricFamily("pinsidecar_engine_map", "The row map the engine reports serving (stats file).",
                                labels=[])
        info.add_metric([], {"map_hash": snap.map_hash, "map_label": snap.map_label})
        yield info
