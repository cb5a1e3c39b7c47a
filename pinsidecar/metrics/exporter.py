"""The sidecar's Prometheus exporter: what the engine, its placement and its host look like, read at scrape time.

Why collectors and not gauges set by a loop: every source (the engine's own ``/metrics``, the hook's stats file, the
engine's cgroup, host memory, NVML) is read inside ``collect()``, the way ``prometheus_client``'s
``ProcessCollector`` reads ``/proc``. A scrape therefore shows the state *now*, no refresh thread exists to hang or
drift, and each source can be tested alone against a fixture tree, because every input is a constructor argument
(cgroup root, ``/proc`` root, stats path, NVML module, engine URL, clocks).

Failure is local: a source that cannot be read drops its own metrics and ``pinsidecar_exporter_source_up{source}``
turns 0; the other sources still export and the scrape never fails. The reason is logged once when a source starts
failing (and again only if the reason changes), and once when it recovers, never once per scrape.

What the daemon sets (engine state, boots, the active map, remaps) lives in :class:`Exporter` and is exported by a
collector too, so that the whole output comes from one registry with no ``_created`` clutter.

Names (all ``pinsidecar_``-prefixed, with units):

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
``pinsidecar_expert_bytes{tier="hbm"|"host"}``                expert weight bytes per tier (the hook's tier_bytes)
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
``pinsidecar_remaps_total{outcome}``                          remap attempts by outcome
``pinsidecar_gate_*``                                         the drain gate, when one is attached
``pinsidecar_exporter_source_up{source}``                     1 when a configured source was read this scrape
============================================================  ====================================================

Counters from the stats file restart at zero whenever the engine restarts (``boot_id`` changes or ``seq`` goes
back) or the hook is reset (a per-layer count goes down); :func:`accumulate_stats` folds the previous run's final
values into a base so the exported ``_total`` series stay monotonic and ``rate()`` never sees a false reset.
"""

from __future__ import annotations

import calendar
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil
import structlog
from pinsidecar_hook.contract import ArtifactError, StatsSnapshot, load_stats
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

__all__ = [
    "BOOT_DURATION_BUCKETS_S",
    "ENGINE_SCRAPE_TIMEOUT_S",
    "ENGINE_SERIES",
    "ENGINE_STATES",
    "MEMORY_STAT_KEYS",
    "CgroupMemoryCollector",
    "DaemonStateCollector",
    "EngineMetricsCollector",
    "Exporter",
    "GateCollector",
    "GpuMemoryCollector",
    "HostMemoryCollector",
    "StatsCollector",
    "StatsTotals",
    "accumulate_stats",
    "cgroup_path_for_container",
    "cgroup_path_for_pid",
    "cgroup_v1_memory_path_for_pid",
    "load_nvml",
    "parse_engine_metrics",
]

log = structlog.get_logger(__name__)

ENGINE_STATES = ("starting", "ready", "draining", "restarting", "failed", "stopped")
# memory.stat keys exported. Pinned host memory (cold experts) is charged as shmem, which cgroup v2 also counts
# inside "file"; anon is ordinary process memory (DESIGN.md section 1).
MEMORY_STAT_KEYS = ("anon", "file", "shmem")
# Start-to-ready seconds: CPU demo boots take 7-25 s, a cache-hit GPU reboot of a large MoE model a minute or two,
# a cold compile many minutes.
BOOT_DURATION_BUCKETS_S = (5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0)
# The engine's /metrics is read inside our scrape; Prometheus' default scrape timeout is 10 s, so stay well below.
ENGINE_SCRAPE_TIMEOUT_S = 1.0
# Two engine scrapes closer than this reuse the previous rate instead of dividing by a tiny interval.
MIN_RATE_INTERVAL_S = 1.0


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class _FailureLog:
    """Logs a source's failure once per distinct reason, and its recovery once. ``up`` is None when unused."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.reason: str | None = None
        self.up: bool | None = None

    def fail(self, reason: str) -> None:
        self.up = False
        if reason != self.reason:
            log.warning("metrics source unavailable; its metrics are left out", source=self.source, reason=reason)
            self.reason = reason

    def ok(self) -> None:
        self.up = True
        if self.reason is not None:
            log.info("metrics source recovered", source=self.source)
            self.reason = None

    def off(self) -> None:
        self.up = None


# ---------------------------------------------------------------------------------------------------- engine


class EngineMetricsCollector:
    """Reads the engine's ``/metrics`` (vLLM's ``vllm:*``) at scrape time and re-exports what the sidecar needs.

    ``url`` is the engine's base URL or its full ``/metrics`` URL; ``None`` (or :meth:`set_url` with None) turns
    the source off. Generation tokens per second is the counter's increase over the interval since an earlier
    scrape, so it needs two scrapes at least :data:`MIN_RATE_INTERVAL_S` apart; an engine restart (counter went
    down) counts the new value as the increase.
    """

    source = "engine"

    def __init__(self, url: str | None, *, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = ENGINE_SCRAPE_TIMEOUT_S, client: httpx.Client | None = None) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._client = client
        self._lock = threading.Lock()
        self._prev: tuple[float, float] | None = None  # (time, tokens) of the rate's base
        self._rate: float | None = None
        self.status = _FailureLog(self.source)
        self.url: str | None = None
        self.set_url(url)

    def set_url(self, url: str | None) -> None:
        with self._lock:
            if url is not None:
                url = url.rstrip("/")
                if not url.endswith("/metrics"):
                    url += "/metrics"
            if url != self.url:
                self._prev, self._rate = None, None
            self.url = url

    def _fetch(self, url: str) -> str:
        if self._client is None:
            # one client for the exporter's life: a fresh one per scrape would build an SSL context each time
            # (~10 ms of CPU) and a new connection; trust_env=False so a proxy setting never captures loopback
            self._client = httpx.Client(timeout=self._timeout_s, trust_env=False)
        resp = self._client.get(url, timeout=self._timeout_s)
        resp.raise_for_status()
        return resp.text

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            url = self.url
            if url is None:
                self.status.off()
                return
            try:
                values = parse_engine_metrics(self._fetch(url))
            except httpx.HTTPError as exc:
                self.status.fail(f"GET {url}: {type(exc).__name__}: {exc}")
                return
            except ValueError as exc:
                self.status.fail(f"GET {url}: unparsable metrics text: {exc}")
                return
            tokens = values.get("vllm:generation_tokens_total")
            if tokens is None:
                self.status.fail(f"GET {url}: no vllm:generation_tokens_total in the engine's metrics")
                return
            self.status.ok()
            now = self._clock()
            if self._prev is None:
                self._prev = (now, tokens)
            elif now - self._prev[0] >= MIN_RATE_INTERVAL_S:
                t0, v0 = self._prev
                delta = tokens - v0 if tokens >= v0 else tokens  # counter reset: the engine restarted
                self._rate = delta / (now - t0)
                self._prev = (now, tokens)
            rate = self._rate
        yield CounterMetricFamily("pinsidecar_engine_generation_tokens",
                                  "Generation tokens the engine has produced (its vllm:generation_tokens_total; "
                                  "resets when the engine restarts).", value=tokens)
        if rate is not None:
            yield GaugeMetricFamily("pinsidecar_engine_generation_tokens_per_second",
                                    "Generation tokens per second between the last two scrapes of the engine.",
                                    value=rate)
        for src, name, doc in (
            ("vllm:num_requests_running", "pinsidecar_engine_requests_running", "Requests the engine is running."),
            ("vllm:num_requests_waiting", "pinsidecar_engine_requests_waiting", "Requests waiting in the engine."),
            ("vllm:kv_cache_usage_perc", "pinsidecar_engine_kv_cache_usage_ratio",
             "Fraction of the engine's KV cache in use (0..1)."),
        ):
            if src in values:
                yield GaugeMetricFamily(name, doc, value=values[src])


# The engine series the exporter reads; everything else in the engine's (large) /metrics is skipped unparsed.
ENGINE_SERIES = ("vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")


def parse_engine_metrics(text: str, names: tuple[str, ...] = ENGINE_SERIES) -> dict[str, float]:
    """Sum every sample of each series in ``names`` over its labels (an engine may export one series per engine
    index). Only lines starting with one of the names are parsed: vLLM's /metrics runs to hundreds of histogram
    lines, and this runs inside every scrape."""
    wanted = [line for line in text.splitlines() if line.startswith(names)]
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            if sample.name in names and not math.isnan(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


# ---------------------------------------------------------------------------------------------------- stats


@dataclass
class StatsTotals:
    """Monotonic totals over engine restarts: ``base_*`` holds what finished runs counted, ``last`` the current
    run's latest snapshot. Per-layer dicts are keyed by layer id, so a geometry change between boots is safe."""

    base_selections: dict[int, int] = field(default_factory=dict)
    base_cold: dict[int, int] = field(default_factory=dict)
    base_errors: dict[str, int] = field(default_factory=dict)
    last: StatsSnapshot | None = None
    restarts: int = 0

    def selections(self) -> dict[int, int]:
        return _add(self.base_selections, _per_layer(self.last, "selections"))

    def cold_selections(self) -> dict[int, int]:
        return _add(self.base_cold, _per_layer(self.last, "cold_selections"))

    def errors(self) -> dict[str, int]:
        return _add(self.base_errors, dict(self.last.errors) if self.last else {})


def _per_layer(snap: StatsSnapshot | None, attr: str) -> dict[int, int]:
    if snap is None:
        return {}
    return dict(zip(snap.layer_ids, getattr(snap, attr), strict=True))


def _add(a: dict[Any, int], b: dict[Any, int]) -> dict[Any, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _is_restart(prev: StatsSnapshot, snap: StatsSnapshot) -> bool:
    if snap.boot_id != prev.boot_id or snap.seq < prev.seq:
        return True
    before, now = _per_layer(prev, "selections"), _per_layer(snap, "selections")
    # a hook "reset" zeroes the counters within one boot: any layer going down is a new run
    return any(now.get(lid, 0) < v for lid, v in before.items()) or any(
        snap.errors.get(k, 0) < v for k, v in prev.errors.items())


def accumulate_stats(totals: StatsTotals, snap: StatsSnapshot) -> StatsTotals:
    """Fold one new snapshot into the totals. Pure: returns a new :class:`StatsTotals`."""
    prev = totals.last
    if prev is None or not _is_restart(prev, snap):
        return dataclasses.replace(totals, last=snap)
    return StatsTotals(
        base_selections=_add(totals.base_selections, _per_layer(prev, "selections")),
        base_cold=_add(totals.base_cold, _per_layer(prev, "cold_selections")),
        base_errors=_add(totals.base_errors, dict(prev.errors)),
        last=snap,
        restarts=totals.restarts + 1,
    )


class StatsCollector:
    """Exports the pin-mode hook's live stats file: selections, cold selections and their ratio (total and per
    layer), expert bytes by tier, and the hook's error counters. A missing file (no engine in pin mode yet) or a
    corrupt one drops these metrics until a valid file appears; the file is re-parsed only when it changes."""

    source = "stats"

    def __init__(self, stats_path: Path | None, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.stats_path = None if stats_path is None else Path(stats_path)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._sig: tuple[int, int, int] | None = None
        self.totals = StatsTotals()
        self.status = _FailureLog(self.source)

    def _refresh(self, path: Path) -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            self.status.fail(f"{path}: stats file not found (the engine is not in pin mode yet?)")
            return False
        except OSError as exc:
            self.status.fail(f"{path}: {exc.strerror}")
            return False
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig != self._sig:
            try:
                snap = load_stats(path)
            except ArtifactError as exc:
                self.status.fail(str(exc))
                return False
            self.totals = accumulate_stats(self.totals, snap)
            self._sig = sig
        self.status.ok()
        return True

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if self.stats_path is None:
                self.status.off()
                return
            if not self._refresh(self.stats_path):
                return
            totals = self.totals
        snap = totals.last
        assert snap is not None
        sel, cold = totals.selections(), totals.cold_selections()
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
        if snap.total_selections > 0:
            yield GaugeMetricFamily("pinsidecar_cold_selection_ratio",
                                    "Cold selections / selections since the engine booted (or the hook reset).",
                                    value=snap.total_cold_selections / snap.total_selections)
        ratio = GaugeMetricFamily("pinsidecar_layer_cold_selection_ratio",
                                  "Cold selections / selections per MoE layer since the engine booted.",
                                  labels=["layer"])
        for lid, s, c in zip(snap.layer_ids, snap.selections, snap.cold_selections, strict=True):
            if s > 0:
                ratio.add_metric([str(lid)], c / s)
        yield ratio
        if snap.tier_bytes:
            tiers = GaugeMetricFamily("pinsidecar_expert_bytes", "Expert weight bytes by memory tier.",
                                      labels=["tier"])
            for tier in sorted(snap.tier_bytes):
                tiers.add_metric([tier], snap.tier_bytes[tier])
            yield tiers
        errors = totals.errors()
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


# ---------------------------------------------------------------------------------------------------- cgroup


def cgroup_path_for_pid(pid: int, *, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
                        ) -> Path:
    """The cgroup v2 directory of ``pid``: the ``0::<path>`` line of ``/proc/<pid>/cgroup`` under the cgroup root.

    Raises ``FileNotFoundError`` when the process is gone, ``ValueError`` when it has no cgroup v2 entry (a
    cgroup v1 host, which this exporter does not read).
    """
    text = (proc_root / str(pid) / "cgroup").read_text()
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            return cgroup_root / path.lstrip("/")
    raise ValueError(f"{proc_root / str(pid) / 'cgroup'}: no cgroup v2 ('0::') entry; is this a cgroup v1 host?")


# Where docker and podman put a container's cgroup (systemd and cgroupfs drivers, rootful and rootless).
_CONTAINER_CGROUP_GLOBS = ("system.slice/docker-{id}*.scope", "docker/{id}*", "machine.slice/libpod-{id}*.scope",
                           "machine.slice/libpod-{id}*.scope/container", "user.slice/*/*/*/libpod-{id}*.scope",
                           "user.slice/*/*/*/*/libpod-{id}*.scope", "libpod_parent/libpod-{id}*")


def cgroup_path_for_container(container_id: str, *, cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path:
    """Find a docker or podman container's cgroup by its id (full or a prefix of at least 12 hex digits)."""
    for pattern in _CONTAINER_CGROUP_GLOBS:
        hits = sorted(p for p in cgroup_root.glob(pattern.format(id=container_id)) if p.is_dir())
        if hits:
            return hits[0]
    raise FileNotFoundError(f"no cgroup for container {container_id} under {cgroup_root}; pass the engine pid "
                            "(the container's init pid) instead")


# cgroup v1 has no "max": an unlimited memory.limit_in_bytes is PAGE_COUNTER_MAX rounded to pages (~2**63).
_V1_UNLIMITED = 2**62
# cgroup v1 file names for the same quantities (hierarchical totals, like v2's memory.current).
_V1_FILES = {"current": "memory.usage_in_bytes", "max": "memory.limit_in_bytes"}
_V1_STAT_KEYS = {"anon": "total_rss", "file": "total_cache", "shmem": "total_shmem"}


def cgroup_v1_memory_path_for_pid(pid: int, *, proc_root: Path = Path("/proc"),
                                  cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The cgroup v1 *memory* controller directory of ``pid`` (``<root>/memory/<path>``), or None without one."""
    for line in (proc_root / str(pid) / "cgroup").read_text().splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return cgroup_root / "memory" / path.lstrip("/")
    return None


class CgroupMemoryCollector:
    """Exports the engine's cgroup memory: current, max and ``anon``/``file``/``shmem`` from ``memory.stat``.

    Read the engine's cgroup, not ``/proc/meminfo``, which inside a container shows the whole host. The cgroup is
    looked up from the engine pid on every scrape (a restarted engine is a new pid), or from the container id when
    no pid is known. cgroup v2 is the target (``memory.current``, ``memory.max``, ``memory.stat``); on a hybrid or
    v1 host whose memory controller is mounted v1 the same metrics come from ``memory.usage_in_bytes``,
    ``memory.limit_in_bytes`` and ``total_rss``/``total_cache``/``total_shmem``. An unlimited max (``max`` in v2,
    ~2**63 in v1) is left out rather than exported as +Inf, so ratios against it give no result instead of 0."""

    source = "cgroup"

    def __init__(self, *, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_root: Path = Path("/proc")) -> None:
        self.cgroup_root = Path(cgroup_root)
        self.proc_root = Path(proc_root)
        self.pid: int | None = None
        self.container_id: str | None = None
        self.status = _FailureLog(self.source)
        self._file_status = _FailureLog("cgroup files")

    def _cgroup(self) -> tuple[int, Path] | None:
        """(cgroup version, directory) of the engine, or None when no engine is set."""
        if self.pid is not None:
            try:
                v2: Path | None = cgroup_path_for_pid(self.pid, proc_root=self.proc_root, cgroup_root=self.cgroup_root)
            except ValueError:
                v2 = None
            if v2 is not None and (v2 / "memory.current").exists():
                return 2, v2
            v1 = cgroup_v1_memory_path_for_pid(self.pid, proc_root=self.proc_root, cgroup_root=self.cgroup_root)
            if v1 is not None and (v1 / _V1_FILES["current"]).exists():
                return 1, v1
            if v2 is None:
                raise ValueError(f"{self.proc_root / str(self.pid) / 'cgroup'}: no cgroup v2 entry and no v1 memory "
                                 "controller")
            return 2, v2  # reading memory.current fails below, with the path in the message
        if self.container_id:
            return 2, cgroup_path_for_container(self.container_id, cgroup_root=self.cgroup_root)
        return None

    def collect(self) -> Iterator[Metric]:
        try:
            found = self._cgroup()
        except (OSError, ValueError) as exc:
            self.status.fail(f"engine cgroup not found: {exc}")
            return
        if found is None:
            self.status.off()
            return
        version, cg = found
        current_file = "memory.current" if version == 2 else _V1_FILES["current"]
        try:
            current = int((cg / current_file).read_text())
        except (OSError, ValueError) as exc:
            self.status.fail(f"{cg / current_file}: {exc} (is the memory controller enabled for this cgroup?)")
            return
        self.status.ok()
        yield GaugeMetricFamily("pinsidecar_engine_cgroup_memory_current_bytes",
                                "Memory charged to the engine's cgroup (memory.current).", value=current)
        missing: list[str] = []
        max_file = "memory.max" if version == 2 else _V1_FILES["max"]
        try:
            raw = (cg / max_file).read_text().strip()
            if raw != "max" and int(raw) < _V1_UNLIMITED:
                yield GaugeMetricFamily("pinsidecar_engine_cgroup_memory_max_bytes",
                                        "The engine cgroup's memory limit (memory.max); absent when unlimited.",
                                        value=int(raw))
        except (OSError, ValueError) as exc:
            missing.append(f"{max_file}: {exc}")
        try:
            stat = _parse_memory_stat((cg / "memory.stat").read_text())
            fam = GaugeMetricFamily("pinsidecar_engine_cgroup_memory_stat_bytes",
                                    "The engine cgroup's memory.stat by type (shmem, where pinned host memory is "
                                    "charged, is also counted in file).", labels=["type"])
            for key in MEMORY_STAT_KEYS:
                src = key if version == 2 else _V1_STAT_KEYS[key]
                if src in stat:
                    fam.add_metric([key], stat[src])
            yield fam
        except (OSError, ValueError) as exc:
            missing.append(f"memory.stat: {exc}")
        if missing:
            self._file_status.fail(f"{cg}: " + "; ".join(missing))
        else:
            self._file_status.ok()


def _parse_memory_stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key and value:
            out[key] = int(value)
    return out


# ---------------------------------------------------------------------------------------------------- host, GPU


class HostMemoryCollector:
    """Host memory from psutil. Inside a container this is the whole host; the engine's share is the cgroup."""

    source = "host"

    def __init__(self, virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> None:
        self._virtual_memory = virtual_memory
        self.status = _FailureLog(self.source)

    def collect(self) -> Iterator[Metric]:
        try:
            vm = self._virtual_memory()
        except (OSError, RuntimeError) as exc:
            self.status.fail(f"psutil.virtual_memory(): {exc}")
            return
        self.status.ok()
        for attr in ("total", "available", "used"):
            yield GaugeMetricFamily(f"pinsidecar_host_memory_{attr}_bytes", f"Host memory {attr} (psutil).",
                                    value=getattr(vm, attr))


class _RealNvml:
    """Marker for "import pynvml on first scrape"."""


REAL_NVML: Any = _RealNvml()


def load_nvml() -> Any:
    """Import and initialise NVML (nvidia-ml-py's ``pynvml``); raises with the reason where it is missing."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


class GpuMemoryCollector:
    """GPU memory used and total per GPU from NVML. ``nvml`` is the ``pynvml`` module or an object with the same
    functions (tests pass a fake); ``None`` turns the source off. Where NVML cannot be loaded (no driver, no GPU,
    no library) the metrics are absent and one log line says why; it is not retried every scrape."""

    source = "gpu"

    def __init__(self, nvml: Any = REAL_NVML, loader: Callable[[], Any] = load_nvml) -> None:
        self._nvml: Any = nvml
        self._loader = loader
        self._pending = nvml is not None
        self.status = _FailureLog(self.source)

    def _handle(self) -> Any:
        if self._pending:
            self._pending = False
            try:
                if isinstance(self._nvml, _RealNvml):
                    self._nvml = self._loader()
                else:
                    self._nvml.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors: all mean "no NVML"
                self._nvml = None
                log.info("NVML not available; GPU memory metrics are left out", reason=f"{type(exc).__name__}: {exc}")
        return self._nvml

    def collect(self) -> Iterator[Metric]:
        nvml = self._handle()
        if nvml is None:
            self.status.off()
            return
        used = GaugeMetricFamily("pinsidecar_gpu_memory_used_bytes", "GPU memory in use (NVML), per GPU.",
                                 labels=["gpu", "uuid"])
        total = GaugeMetricFamily("pinsidecar_gpu_memory_total_bytes", "GPU memory installed (NVML), per GPU.",
                                  labels=["gpu", "uuid"])
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                labels = [str(i), uuid.decode() if isinstance(uuid, bytes) else str(uuid)]
                used.add_metric(labels, mem.used)
                total.add_metric(labels, mem.total)
        except Exception as exc:  # NVMLError subclasses (GPU lost, driver reloaded) carry no common base we import
            self.status.fail(f"NVML query failed: {type(exc).__name__}: {exc}")
            return
        self.status.ok()
        yield used
        yield total


# ---------------------------------------------------------------------------------------------------- daemon


@dataclass
class _MapState:
    hash: str
    label: str
    created_at: str
    created_ts: float | None
    predicted_cold_ratio: float | None


def _parse_utc(stamp: str) -> float | None:
    """The artifacts' ``YYYY-MM-DDTHH:MM:SSZ`` as epoch seconds (None when empty or not in that form)."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, TypeError):
        return None


class DaemonStateCollector:
    """What the daemon knows and tells the exporter: engine state, boots, the active map, remaps. Thread-safe:
    the daemon's loop writes, the metrics server's thread reads."""

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self.state = "stopped"
        self.boots: dict[str, int] = {}
        self.cache_misses = 0
        self.boot_buckets = [0] * len(BOOT_DURATION_BUCKETS_S)
        self.boot_count = 0
        self.boot_sum = 0.0
        self.last_boot: tuple[str, float, str, bool] | None = None
        self.map: _MapState | None = None
        self.remaps: dict[str, int] = {}

    def set_state(self, state: str) -> None:
        if state not in ENGINE_STATES:
            raise ValueError(f"unknown engine state {state!r}; expected one of {ENGINE_STATES}")
        with self._lock:
            self.state = state

    def record_boot(self, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
        if not reason:
            raise ValueError("boot reason must be a non-empty string")
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"boot seconds must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            self.boots[reason] = self.boots.get(reason, 0) + 1
            self.cache_misses += int(bool(cache_miss))
            for i, bound in enumerate(BOOT_DURATION_BUCKETS_S):
                if seconds <= bound:
                    self.boot_buckets[i] += 1
            self.boot_count += 1
            self.boot_sum += seconds
            self.last_boot = (reason, float(seconds), map_hash, bool(cache_miss))

    def set_map(self, hash: str, label: str, created_at: str, predicted_cold_ratio: float | None = None) -> None:
        with self._lock:
            self.map = _MapState(hash, label, created_at, _parse_utc(created_at), predicted_cold_ratio)

    def record_remap(self, outcome: str) -> None:
        if not outcome:
            raise ValueError("remap outcome must be a non-empty string")
        with self._lock:
            self.remaps[outcome] = self.remaps.get(outcome, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            state, boots, misses = self.state, dict(self.boots), self.cache_misses
            buckets, count, total = list(self.boot_buckets), self.boot_count, self.boot_sum
            last, emap, remaps = self.last_boot, self.map, dict(self.remaps)
        fam = GaugeMetricFamily("pinsidecar_engine_state", "1 for the engine's current state, 0 for the others.",
                                labels=["state"])
        for s in ENGINE_STATES:
            fam.add_metric([s], 1.0 if s == state else 0.0)
        yield fam
        fam = CounterMetricFamily("pinsidecar_engine_boots", "Engine boots by reason.", labels=["reason"])
        for reason in sorted(boots):
            fam.add_metric([reason], boots[reason])
        yield fam
        yield CounterMetricFamily("pinsidecar_engine_boot_cache_misses",
                                  "Boots much slower than the last one with the same geometry (compile cache miss).",
                                  value=misses)
        yield HistogramMetricFamily(
            "pinsidecar_engine_boot_duration_seconds", "Seconds from engine start to ready.",
            buckets=[*((_fmt_bound(b), c) for b, c in zip(BOOT_DURATION_BUCKETS_S, buckets, strict=True)),
                     ("+Inf", count)],
            sum_value=total)
        if last is not None:
            yield GaugeMetricFamily("pinsidecar_engine_last_boot_duration_seconds",
                                    "Seconds from start to ready of the last engine boot.", value=last[1])
            info = InfoMetricFamily("pinsidecar_engine_last_boot", "The last engine boot.", labels=[])
            info.add_metric([], {"reason": last[0], "map_hash": last[2], "cache_miss": str(last[3]).lower()})
            yield info
        if emap is not None:
            info = InfoMetricFamily("pinsidecar_map", "The row map the daemon activated.", labels=[])
            info.add_metric([], {"hash": emap.hash, "label": emap.label})
            yield info
            if emap.created_ts is not None:
                yield GaugeMetricFamily("pinsidecar_map_created_timestamp_seconds",
                                        "When the active map was built (Unix time).", value=emap.created_ts)
                yield GaugeMetricFamily("pinsidecar_map_age_seconds", "Seconds since the active map was built.",
                                        value=max(0.0, self._wall_clock() - emap.created_ts))
            if emap.predicted_cold_ratio is not None:
                yield GaugeMetricFamily("pinsidecar_map_predicted_cold_selection_ratio",
                                        "The cold-selection ratio the active map predicted on its source counts.",
                                        value=emap.predicted_cold_ratio)
        fam = CounterMetricFamily("pinsidecar_remaps", "Remap attempts by outcome.", labels=["outcome"])
        for outcome in sorted(remaps):
            fam.add_metric([outcome], remaps[outcome])
        yield fam


def _fmt_bound(b: float) -> str:
    return repr(float(b))


class GateCollector:
    """The drain gate's counters: requests by outcome, requests in flight and held, whether it is holding."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self.gate
        counts = dict(gate.counters)
        fam = CounterMetricFamily("pinsidecar_gate_requests", "Requests the gate answered, by outcome.",
                                  labels=["outcome"])
        for outcome in sorted(counts):
            fam.add_metric([outcome], counts[outcome])
        yield fam
        yield GaugeMetricFamily("pinsidecar_gate_in_flight_requests", "Requests passed to the engine and not done.",
                                value=gate.in_flight)
        yield GaugeMetricFamily("pinsidecar_gate_held_requests", "Requests waiting at the gate during a hold.",
                                value=gate.held)
        yield GaugeMetricFamily("pinsidecar_gate_holding", "1 while the gate holds new requests (drain-reboot).",
                                value=1.0 if gate.holding else 0.0)


# ---------------------------------------------------------------------------------------------------- exporter


class _ExporterCollector:
    """Chains the sources and adds ``pinsidecar_exporter_source_up``. A source that raises anyway (a bug) is
    logged once and left out, so one source can never fail the scrape."""

    def __init__(self, sources: list[Any], extra: list[Any]) -> None:
        self.sources = sources
        self.extra = extra
        self._broken: set[str] = set()

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time: that would scrape the engine

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pinsidecar_exporter_source_up",
                               "1 when a configured metrics source was read this scrape, 0 when it failed.",
                               labels=["source"])
        for src in [*self.sources, *self.extra]:
            name = getattr(src, "source", type(src).__name__)
            try:
                families = list(src.collect())
            except Exception as exc:
                if name not in self._broken:
                    log.exception("metrics collector raised; its metrics are left out", source=name, error=str(exc))
                    self._broken.add(name)
                if hasattr(src, "status"):
                    up.add_metric([name], 0.0)
                continue
            yield from families
            status = getattr(src, "status", None)
            if status is not None and status.up is not None:
                up.add_metric([name], 1.0 if status.up else 0.0)
        yield up


class Exporter:
    """The sidecar's metrics: all collectors in one registry, plus the setters the daemon calls.

    Usage: build it with the sources' locations, call the setters as the daemon's state changes, and
    :meth:`start_http` once. Everything else is read at scrape time. ``registry`` defaults to a fresh
    :class:`CollectorRegistry` (not the global one), so several exporters can live in one process (tests).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, stats_path: Path | None,
                 engine_metrics_url: str | None, cgroup_root: Path = Path("/sys/fs/cgroup"),
                 proc_root: Path = Path("/proc"), nvml: object | None = REAL_NVML,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 process_metrics: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.daemon = DaemonStateCollector(wall_clock=wall_clock)
        self.engine = EngineMetricsCollector(engine_metrics_url, clock=clock)
        self.stats = StatsCollector(stats_path, wall_clock=wall_clock)
        self.cgroup = CgroupMemoryCollector(cgroup_root=cgroup_root, proc_root=proc_root)
        self.host = HostMemoryCollector()
        self.gpu = GpuMemoryCollector(nvml)
        self._collector = _ExporterCollector([self.daemon, self.engine, self.stats, self.cgroup, self.host,
                                              self.gpu], [])
        self.registry.register(self._collector)
        if process_metrics:
            # the daemon's own RSS and CPU (pinsidecar_process_*), for the idle-daemon budget
            ProcessCollector(namespace="pinsidecar", registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- setters the daemon calls
    def set_engine_state(self, state: str) -> None:
        self.daemon.set_state(state)

    def record_boot(self, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
        self.daemon.record_boot(reason, seconds, map_hash, cache_miss)

    def set_map(self, hash: str, label: str, created_at: str, predicted_cold_ratio: float | None = None) -> None:
        self.daemon.set_map(hash, label, created_at, predicted_cold_ratio)

    def record_remap(self, outcome: str) -> None:
        self.daemon.record_remap(outcome)

    def set_engine_pid(self, pid: int | None) -> None:
        self.cgroup.pid = pid

    def set_container(self, id: str | None) -> None:
        self.cgroup.container_id = id

    def set_engine_metrics_url(self, url: str | None) -> None:
        self.engine.set_url(url)

    def attach_gate(self, gate: Any) -> None:
        """Export the drain gate's counters (``pinsidecar_gate_*``)."""
        self._collector.extra = [GateCollector(gate)]

    # -- serving
    def start_http(self, addr: str, port: int) -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (prometheus_client's WSGI server)."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError("metrics HTTP server already started")
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics server listening", addr=addr, port=self.port)

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def stop(self) -> None:
        self.engine.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server, self._thread = None, None

    def render(self) -> bytes:
        """The exposition text a scrape would get now (Prometheus text format 0.0.4)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
