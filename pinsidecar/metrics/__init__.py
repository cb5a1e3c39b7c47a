"""The sidecar's Prometheus metrics: what the engine, its placement and its host look like, read at scrape time.

Why collectors and not gauges set by a loop: every source is read inside ``collect()``, the way
``prometheus_client``'s ``ProcessCollector`` reads ``/proc``. A scrape therefore shows the state *now*, no refresh
thread exists to hang or drift, and each source can be tested alone against a fixture tree, because every input is
a constructor argument (cgroup root, ``/proc`` root, stats path, NVML module, clocks) or a callable asked at scrape
time (the engine's pid, container id and URL, the gate). One collector per module:

- :mod:`~pinsidecar.metrics.engine` — the engine's own ``/metrics``: tokens, tok/s, queue, KV cache;
- :mod:`~pinsidecar.metrics.routing` — the hook's stats file through :class:`pinsidecar.live_stats.StatsReader`:
  selections, cold selections, ratios per layer, tier bytes, hook errors, stats age, the engine's map;
- :mod:`~pinsidecar.metrics.cache` — the cache tier from the same stats file: slots, hits, fills, evictions, the
  slots' hit ratio (and what ``pinsidecar status`` shows of it);
- :mod:`~pinsidecar.metrics.cgroup` — the engine's cgroup memory (v2, v1 fallback) and how to find the cgroup;
- :mod:`~pinsidecar.metrics.host` — host memory (psutil);
- :mod:`~pinsidecar.metrics.gpu` — GPU memory (NVML, where it exists);
- :mod:`~pinsidecar.metrics.daemon_state` — what the daemon reports: engine state, boots, the active map, remaps;
- :mod:`~pinsidecar.metrics.gate` — the drain gate's counters;
- :mod:`~pinsidecar.metrics.drift` — the drift watch: each signal beside its threshold, the detector's state, skew;
- :mod:`~pinsidecar.metrics.remap` — remaps by outcome, their durations, the one running now;
- :mod:`~pinsidecar.metrics.source` — the collector protocols and the per-source status behind
  ``pinsidecar_exporter_source_up`` (failure is local, logged once per change);
- :mod:`~pinsidecar.metrics.exporter` — the facade: one registry, the HTTP server, render.

Names (all ``pinsidecar_``-prefixed, with units; dashboards and alert rules in ``grafana/`` depend on them):

============================================================  ====================================================
``pinsidecar_engine_generation_tokens_total``                 the engine's ``vllm:generation_tokens_total``, raw
``pinsidecar_engine_generation_tokens_per_second``            rate between the last two scrapes (>= 1 s apart)
``pinsidecar_engine_requests_running`` / ``_waiting``         the engine's queue, raw
``pinsidecar_engine_kv_cache_usage_ratio``                    the engine's ``vllm:kv_cache_usage_perc`` (0..1)
``pinsidecar_expert_selections_total``                        routed selections, all layers (monotonic across boots)
``pinsidecar_expert_cold_selections_total``                   ... of which on host-resident (cold) experts
``pinsidecar_layer_expert_selections_total{layer}``           the same per MoE layer
``pinsidecar_layer_expert_cold_selections_total{layer}``
``pinsidecar_cold_selection_ratio``                           cold / selections since the engine booted
``pinsidecar_layer_cold_selection_ratio{layer}``
``pinsidecar_cache_slots``                                    cache slots per MoE layer in the served map; 0: no
                                                              cache (docs/cache-tier.md)
``pinsidecar_cache_hits_total``                               selections served by a cache slot, all layers
                                                              (monotonic across boots; 0 on a lane with no cache)
``pinsidecar_cache_fills_total``                              cold experts copied into a slot
``pinsidecar_cache_evictions_total``                          fills that replaced another expert
``pinsidecar_layer_cache_{hits,fills,evictions}_total``       the same per MoE layer (``{layer}``; only layers that
                                                              had a cache)
``pinsidecar_cache_hit_ratio``                                hits / (hits + cold selections) since the engine
                                                              booted; with a cache the cold selections are the
                                                              misses. Absent without a cache or before traffic
``pinsidecar_expert_bytes{tier="hbm"|"host"}``                expert weight bytes per tier on one rank (tier_bytes)
``pinsidecar_tensor_parallel_ranks``                          the engine's TP ranks (lane bytes: the above x this)
``pinsidecar_hook_errors_total{kind}``                        the hook's own error counters (e.g. stats_write)
``pinsidecar_stats_age_seconds``                              now - the stats file's written_at
``pinsidecar_engine_map_info{map_hash,map_label}``            the map the *engine* reports serving (stats file)
``pinsidecar_engine_cgroup_memory_current_bytes``             the engine cgroup's memory.current
``pinsidecar_engine_cgroup_memory_max_bytes``                 memory.max; **absent when it is "max"** (no limit)
``pinsidecar_engine_cgroup_memory_stat_bytes{type}``          anon, file, shmem from memory.stat (shmem is part of
                                                              file in cgroup v2; pinned host experts land there)
``pinsidecar_host_memory_{total,available,used}_bytes``       psutil.virtual_memory()
``pinsidecar_gpu_memory_{used,total}_bytes{gpu,uuid}``        NVML; absent where NVML is missing
``pinsidecar_engine_state{state}``                            1 for the current state, 0 for the others
``pinsidecar_engine_boots_total{reason}``                     boots by reason
``pinsidecar_engine_boot_cache_misses_total``                 boots flagged as compile-cache misses
``pinsidecar_engine_boot_duration_seconds``                   histogram of start-to-ready seconds
``pinsidecar_engine_last_boot_duration_seconds``              the last boot's start-to-ready seconds
``pinsidecar_engine_last_boot_info{reason,map_hash,cache_miss}``
``pinsidecar_map_info{hash,label}``                           the map the daemon activated
``pinsidecar_map_created_timestamp_seconds`` / ``_age_seconds``
``pinsidecar_map_predicted_cold_selection_ratio``             the map's own prediction (when known)
``pinsidecar_remaps_total{outcome}``                          remaps by outcome (committed, rolled_back, refused,
                                                              aborted, dry_run; all present from the start at 0)
``pinsidecar_remap_duration_seconds``                         histogram of remap start-to-end seconds
``pinsidecar_remap_last_end_timestamp_seconds``               when the last remap ended
``pinsidecar_remap_running``                                  1 while a remap is in a non-terminal state
``pinsidecar_remap_state{state,trigger}``                     the running remap's state
``pinsidecar_remap_running_seconds``                          seconds since the running remap started
``pinsidecar_remap_apply_total{outcome}``                     in-place deploys: applied, rolled_back,
                                                              fell_back_reboot, engine_died
``pinsidecar_remap_apply_requests_total{result}``             apply requests: applied, refused, failed, timeout,
                                                              engine_died
``pinsidecar_remap_apply_seconds``                            histogram of how long an apply held the engine's
                                                              step (+ ``pinsidecar_remap_apply_last_seconds``)
``pinsidecar_remap_apply_rows_swapped_total``                 expert rows swapped in place
``pinsidecar_remap_apply_bytes_moved_total``                  bytes copied between the tiers in place
``pinsidecar_drift_state{state}``                             the detector: steady, rising, drifted
``pinsidecar_drift_exploitable_skew``                         1, or 0 for "no exploitable skew" (never trips)
``pinsidecar_drift_cold_selection_ratio`` (+ ``_threshold``)  signal a: the last window's cold ratio; threshold =
                                                              the map's prediction + drift.cold_rate_alert
``pinsidecar_drift_cold_selection_excess_ratio``             signal a as live - predicted (+ ``_threshold``:
                                                              drift.cold_rate_alert)
``pinsidecar_drift_divergence{stat}``                         signal b over layers (max, mean; + ``_threshold``);
                                                              per layer in
                                                              ``pinsidecar_drift_layer_divergence{layer}``
                                                              (only up to 128 layers)
``pinsidecar_drift_projected_gain_ratio``                     signal c (decides), with ``_trip_threshold`` and
                                                              ``_clear_threshold``
``pinsidecar_drift_{active_map,candidate,uniform}_cold_...``  the cold ratios behind the gain
``pinsidecar_drift_skew_gap_ratio`` (+ ``_threshold``)        uniform minus best reachable cold ratio
``pinsidecar_drift_window_tokens`` (+ ``_threshold``)         the last window's tokens (threshold: min_tokens)
``pinsidecar_drift_consecutive_windows`` (+ ``_threshold``)   windows in a row over the trip level
``pinsidecar_drift_cooldown_remaining_seconds``               before the next remap may start
``pinsidecar_drift_remaps_left_today``                        what the daily cap still allows (rolling 24 h)
``pinsidecar_drift_windows_total``                            windows closed
``pinsidecar_gate_*``                                         the drain gate, when one is given
``pinsidecar_exporter_source_up{source}``                     1 when a configured source was read this scrape
``pinsidecar_process_*``                                      the daemon's own RSS and CPU (prometheus_client)
============================================================  ====================================================
"""

from pinsidecar.metrics.cache import CacheTotals, cache_status
from pinsidecar.metrics.cgroup import (
    MEMORY_STAT_KEYS,
    CgroupMemoryCollector,
    cgroup_path_for_container,
    cgroup_path_for_pid,
    cgroup_v1_memory_path_for_pid,
)
from pinsidecar.metrics.daemon_state import BOOT_DURATION_BUCKETS_S, ENGINE_STATES, DaemonStateCollector
from pinsidecar.metrics.drift import MAX_LAYER_SERIES, DriftCollector, DriftView
from pinsidecar.metrics.engine import (
    ENGINE_SCRAPE_TIMEOUT_S,
    ENGINE_SERIES,
    EngineMetricsCollector,
    parse_engine_metrics,
)
from pinsidecar.metrics.exporter import Exporter, Live
from pinsidecar.metrics.gate import GateCollector, GateView
from pinsidecar.metrics.gpu import GpuMemoryCollector, load_nvml
from pinsidecar.metrics.host import HostMemoryCollector
from pinsidecar.metrics.remap import REMAP_OUTCOMES, RemapCollector
from pinsidecar.metrics.routing import RoutingCollector, RoutingTotals
from pinsidecar.metrics.source import Collector, Source, SourceStatus

__all__ = ["Exporter"]
