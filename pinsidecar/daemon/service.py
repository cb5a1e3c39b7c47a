"""The sidecar daemon: one asyncio process that fronts, supervises and reports on one engine.

``pinsidecar run`` calls :func:`run_daemon`. The start order is chosen so that nothing is half-up:

1. the config is already validated; the control token is read (mode 0600 or the daemon refuses to start);
2. what a previous run left behind is cleaned up: an engine process group still running from a SIGKILLed daemon
   (recorded in ``<state_dir>/engine.pid`` and ``count-engine.pid``; stopped only when its start time matches, see
   :func:`~pinsidecar.engine.process.stop_recorded_engine`), and remap records left open (closed by
   :mod:`pinsidecar.remap.recovery`: the engine boots from ``active-map.json``, which a remap changes only at
   commit, so the old map serves);
3. the Prometheus exporter, the gate (clients' entry point), the control API and the maps library start;
4. the supervisor boots the engine and keeps it alive (:mod:`pinsidecar.daemon.supervisor`); in pin mode the
   drift watch (:class:`~pinsidecar.drift.DriftWatch`) starts on the served map and reads the engine's live stats
   every ``remap.watch_interval_s``; a trip asks for a remap;
5. ``READY=1`` goes to systemd when the engine is first ready (or has failed for good: the daemon stays up to
   report that, and systemd must not kill it for a slow start); the main loop sends ``WATCHDOG=1`` at half of
   ``WATCHDOG_USEC`` and ``STATUS=`` on every state change.

**Drain-reboot** (:meth:`Daemon.drain_reboot` from the control API, and every remap's reboot: one
implementation): the gate holds new requests, in-flight ones get up to ``timeout_s`` to finish, the engine is
stopped and started again (with the new map if one is given, validated first), and once it serves, the gate
releases what it held. A map of a different geometry (``hash_hit`` false: another hot-row count) is allowed and
logged; vLLM keeps the expert tensors out of its compiled graph (the fused-MoE call is one custom op that finds
the layer's weights by name), so its compile cache hits anyway: on the H200 (vLLM 0.26, 2026-12-02) a drain-reboot
from 99 to 92 hot rows loaded the compiled graph from the cache and booted in 87 s against 150 s cold. The boot
record's ``cache_miss`` says whether a boot hit. If the engine does not come up with the new map, or a remap's
check on the new engine fails before the gate releases, the daemon boots the old one again and says so
(``rolled_back``).

**Remaps** (:meth:`Daemon.request_remap`, every trigger's one entry): one at a time, through the drift config's
cooldown and daily cap, run by :class:`~pinsidecar.remap.pipeline.RemapPipeline` in the background. A remap
deploys in place first (the hook swaps the candidate into the serving engine, the gate never holds; see
:mod:`pinsidecar.remap.apply`) and drain-reboots when it cannot.

**SIGTERM / SIGINT**: ``STOPPING=1``, the gate holds, in-flight requests drain (bounded), the engine stops, exit 0.

The active map survives daemon restarts: after a successful switch it is recorded in
``<state_dir>/active-map.json`` and preferred over ``engine.map`` at the next start while it still validates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from pinsidecar_hook.contract import ArtifactError, ExpertMap, atomic_write_json, load_map, utc_now

from pinsidecar import __version__
from pinsidecar.daemon.config import Config
from pinsidecar.daemon.control import ControlError, ControlServer, read_token
from pinsidecar.daemon.map_library import MapLibrary, MapNotFound
from pinsidecar.daemon.sdnotify import Notifier
from pinsidecar.daemon.supervisor import EngineState, Supervisor
from pinsidecar.drift import NO_SKEW, DriftWatch, WindowRecord
from pinsidecar.engine import EngineError, EngineProcess, EngineSpec, Launcher
from pinsidecar.engine.ports import check_ports_free
from pinsidecar.engine.process import stop_recorded_engine
from pinsidecar.live_stats import StatsReader, load_newest_stats
from pinsidecar.remap import admission
from pinsidecar.remap.apply import ApplyAnswer, withdraw_apply_request
from pinsidecar.remap.candidates import reference_counts
from pinsidecar.remap.pipeline import COUNT_ENGINE_PID_FILE, KEEP_RECORDS, RemapPipeline, RemapTools
from pinsidecar.remap.recovery import close_open_records

if TYPE_CHECKING:
    from pinsidecar.metrics import Exporter

__all__ = ["run_daemon"]

log = structlog.get_logger(__name__)

ACTIVE_MAP_FILE = "active-map.json"
ENGINE_PID_FILE = "engine.pid"

# A hook (BeforeStop / AfterBoot) run inside a drain-reboot while the gate holds: returns None to go on, or why not.
RebootHook = Callable[[dict[str, Any]], Awaitable[str | None]]


def make_launcher_factory(cfg: Config) -> Any:
    """The launcher for ``engine.launcher``: a local process (default; it records itself in
    ``<state_dir>/engine.pid`` so the next daemon can stop it if this one is killed) or a container."""
    if cfg.engine.launcher == "container":
        from pinsidecar.engine.container import ContainerEngine

        return lambda spec: ContainerEngine(spec, cfg.container, cfg.daemon.state_dir)
    pid_file = cfg.daemon.state_dir / ENGINE_PID_FILE
    return lambda spec: EngineProcess(spec, pid_file=pid_file)


class Daemon:
    """The running daemon. Build with a validated :class:`Config`; ``await run()`` until a stop signal."""

    def __init__(self, cfg: Config, notifier: Notifier | None = None, launcher_factory: Any = None,
                 remap_tools: RemapTools | None = None) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier.from_env()
        self.state_dir = cfg.daemon.state_dir
        self.launcher_factory = launcher_factory or make_launcher_factory(cfg)
        self.started_at = time.monotonic()  # for uptime: an interval, so never the wall clock
        self.exporter: Exporter | None = None
        self.gate: Any = None
        self.control: ControlServer | None = None
        self.maps = MapLibrary(cfg.maps_dir, watch=cfg.maps.watch)
        self.supervisor: Supervisor | None = None
        self.last_drain_reboot: dict[str, Any] | None = None
        self.capture_store: Any = None
        self.watch: DriftWatch | None = None
        self._stats_reader: StatsReader | None = None
        self.remaps = RemapPipeline(self, remap_tools)
        self._stop = asyncio.Event()
        self._ready_sent = False
        self._drain_busy = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._token = ""

    # ------------------------------------------------------------------------------------------------ helpers

    def _spec_for(self, map_path: Path | None) -> EngineSpec:
        return self.cfg.engine_spec(map_path)

    def _initial_map(self) -> Path | None:
        configured = self.cfg.engine.map
        if self.cfg.engine.hook_mode != "pin":
            return None
        record = self.state_dir / ACTIVE_MAP_FILE
        try:
            doc = json.loads(record.read_text())
            path, want = Path(doc["path"]), doc["hash"]
        except (OSError, ValueError, KeyError, TypeError):
            return configured
        try:
            emap = load_map(path)
        except (ArtifactError, OSError) as exc:
            log.warning("active_map_unusable", path=str(path), reason=str(exc), using=str(configured))
            return configured
        if emap.content_hash != want:
            log.warning("active_map_changed", path=str(path), recorded=want, now=emap.content_hash,
                        using=str(configured))
            return configured
        if path != configured:
            log.info("active_map_from_state", path=str(path), hash=want, configured=str(configured))
        return path

    # What the exporter reads at every scrape: the engine the supervisor runs now, so a restarted engine (a new
    # pid, container or URL) is followed without telling the exporter anything.

    def _launcher(self) -> Launcher | None:
        return self.supervisor.launcher if self.supervisor is not None else None

    def _engine_pid(self) -> int | None:
        launcher = self._launcher()
        return launcher.pid if launcher is not None else None

    def _engine_container_id(self) -> str | None:
        return getattr(self._launcher(), "container_id", None)  # only the container launcher has one

    def _on_state(self, state: str, detail: str) -> None:
        text = f"engine {state}" + (f": {detail}" if detail else "")
        if not self._ready_sent and state in (EngineState.READY, EngineState.FAILED):
            self._ready_sent = True
            self.notifier.ready(text)
            log.info("daemon_ready", engine=state)
        else:
            self.notifier.status(text)

    # ------------------------------------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        cfg = self.cfg
        token = self._token or read_token(cfg.control.token_file, create=cfg.control.create_token)  # type: ignore[arg-type]
        self.state_dir.mkdir(parents=True, exist_ok=True)
        await self._clean_up_after_a_crash()
        check_ports_free(self._listen_ports())  # after the clean-up: a leftover engine of ours held its port
        spec = self._spec_for(None)
        if cfg.metrics.enabled:
            from pinsidecar.metrics import Exporter

            stats_path = Path(spec.env["PINSIDECAR_STATS_PATH"]) if "PINSIDECAR_STATS_PATH" in spec.env else None
            configured_url = spec.base_url

            def engine_url() -> str:  # the running engine's, else the configured one (reported down, not off)
                launcher = self._launcher()
                return launcher.base_url if launcher is not None else configured_url

            kwargs: dict[str, Any] = {} if cfg.metrics.nvml else {"nvml": None}
            self.exporter = Exporter(stats_path=stats_path, engine_url=engine_url, engine_pid=self._engine_pid,
                                     engine_container_id=self._engine_container_id, gate=lambda: self.gate,
                                     drift=lambda: self.watch, remap=self.remaps.current_json,
                                     cgroup_root=cfg.metrics.cgroup_root, **kwargs)
            self.exporter.start_http(cfg.metrics.host, cfg.metrics.port)
        if cfg.gate.enabled:
            from pinsidecar.daemon.gate import Gate

            capture = None
            if cfg.gate.capture_dir is not None:
                capture = self.capture_store = self._capture_store()
            self.gate = Gate(cfg.gate.host, cfg.gate.port, spec.base_url, max_queue=cfg.gate.max_queue,
                             max_hold_s=cfg.gate.max_hold_s, max_body_bytes=cfg.gate.max_body_bytes,
                             capture=capture, upstream_idle_timeout_s=cfg.gate.upstream_idle_timeout_s)
            self.gate.hold()  # until the engine first serves: the supervisor releases it then
            await self.gate.start()
        self.control = ControlServer(self, token, host=cfg.control.host, port=cfg.control.port,
                                     unix_socket=cfg.control.unix_socket, max_body_bytes=cfg.control.max_body_bytes,
                                     remap_alerts=cfg.control.remap_alerts)
        await self.control.start()
        await self.maps.start()
        self.supervisor = Supervisor(
            self._spec_for, self.launcher_factory, cfg.supervisor, ready_timeout_s=cfg.engine.ready_timeout_s,
            stop_timeout_s=cfg.engine.stop_timeout_s, map_path=self._initial_map(), observer=self.exporter,
            on_state=self._on_state, gate=self.gate)
        self._tasks.append(asyncio.create_task(self.supervisor.run(), name="supervisor"))
        self._start_drift_watch(spec)
        log.info("daemon_started", version=__version__, config=str(cfg.path), control=self.control.address,
                 gate=f"{cfg.gate.host}:{cfg.gate.port}" if self.gate else None,
                 metrics=f"{cfg.metrics.host}:{cfg.metrics.port}" if self.exporter else None)

    def _listen_ports(self) -> dict[str, tuple[str, int]]:
        """Every TCP port the daemon and its engine listen on, by config key (checked before anything starts)."""
        c = self.cfg
        wanted = {"engine.port": (c.engine.host, c.engine.port)}
        if c.gate.enabled:
            wanted["gate.port"] = (c.gate.host, c.gate.port)
        if c.control.unix_socket is None:
            wanted["control.port"] = (c.control.host, c.control.port)
        if c.metrics.enabled:
            wanted["metrics.port"] = (c.metrics.host, c.metrics.port)
        return wanted

    async def _clean_up_after_a_crash(self) -> None:
        """Stop engines a killed predecessor left running (they hold the ports), close its open remap records."""
        for name in (ENGINE_PID_FILE, COUNT_ENGINE_PID_FILE):
            found = await asyncio.to_thread(stop_recorded_engine, self.state_dir / name)
            if found is not None and found.get("stopped"):
                log.warning("engine_leftover_stopped", file=name, pid=found["pid"], port=found.get("port"))
        if self.cfg.engine.launcher == "container":  # a leftover engine container holds the name and the port
            from pinsidecar.engine.container import remove_leftover_containers

            try:
                await asyncio.to_thread(remove_leftover_containers, self.cfg.container, self.state_dir)
            except EngineError as exc:  # the runtime is missing or down: the supervisor's boot says so, in status
                log.warning("container_leftover_check_failed", error=str(exc))
        stats = self._spec_for(None).env.get("PINSIDECAR_STATS_PATH")
        if stats and withdraw_apply_request(Path(stats)):  # the engine we boot must not apply a dead remap's map
            log.warning("apply_request_left_over_withdrawn", stats=stats)
        for rec in close_open_records(self.remaps.store, self.state_dir / ACTIVE_MAP_FILE):
            self.remaps.last = rec
        self.remaps.store.prune(KEEP_RECORDS)

    def _start_drift_watch(self, spec: EngineSpec) -> None:
        """Pin mode: watch the served map's live stats (one reader of our own, not the exporter's)."""
        sup = self.supervisor
        if self.cfg.engine.hook_mode != "pin" or sup is None or sup.map is None:
            return
        stats = spec.env.get("PINSIDECAR_STATS_PATH")
        if not stats:
            return
        self.watch = DriftWatch(self.cfg.drift, sup.map, reference=reference_counts(sup.map_path, sup.map))
        seeded = admission.seed_from_history(self.watch.detector, self.remaps.store.records())
        self._stats_reader = StatsReader(Path(stats))
        self._tasks.append(asyncio.create_task(self._watch_loop(), name="drift-watch"))
        log.info("drift_watch_started", map=sup.map.short_hash, label=sup.map.label, stats=stats,
                 reference=self.watch.reference_kind or "first window", remaps_last_day=seeded)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.remap.watch_interval_s)
            try:
                await self.watch_tick()
            except Exception as exc:  # the watch must never take the daemon down
                log.exception("drift_watch_failed", error=str(exc))

    async def watch_tick(self, now: float | None = None) -> list[WindowRecord]:
        """One look at the live stats: feed the drift watch, log each closed window, ask for a remap on a trip."""
        watch, reader = self.watch, self._stats_reader
        if watch is None or reader is None:
            return []
        reading = reader.read()
        records = watch.feed_reading(reading, now, error=reader.last_error) + watch.poll(now)
        for rec in records:
            sig = rec.signals
            log.info("drift_window", index=rec.index, tokens=rec.window.get("tokens"), judged=rec.judged,
                     state=rec.state, gain=None if sig is None else sig.projected_gain,
                     cold_rate=None if sig is None else sig.cold_rate, trip=rec.trip, status=rec.status)
            if rec.trip:
                await self._drift_trip(rec)
        return records

    async def _drift_trip(self, rec: WindowRecord) -> None:
        try:
            await self.request_remap(trigger="drift", reason=rec.status,
                                     detail={"window": rec.index, "signals": rec.as_dict().get("signals")})
        except ControlError as exc:
            log.warning("drift_remap_not_started", status=exc.status, reason=str(exc))
            if self.watch is not None and self.remaps.current is None:
                self.watch.detector.remap_finished(False)  # the trip marked a remap as running

    def _capture_store(self) -> Any:
        from pinsidecar.daemon.traffic_capture import CaptureStore

        g = self.cfg.gate
        # The store rotates files: the total cap is split over capture_max_files files.
        return CaptureStore(g.capture_dir, sample_rate=g.capture_sample_rate,  # type: ignore[arg-type]
                            max_file_bytes=max(1024, g.capture_max_bytes // g.capture_max_files),
                            max_files=g.capture_max_files)

    async def shutdown(self) -> None:
        """Drain and stop everything (SIGTERM path)."""
        self.notifier.stopping("stopping: draining requests")
        log.info("daemon_stopping")
        task = self.remaps.task
        if task is not None and not task.done():  # before the gate and the engine go: it closes its record
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.gate is not None:
            self.gate.hold()
            remaining = await self.gate.drain(self.cfg.control.drain_timeout_s)
            if remaining:
                log.warning("shutdown_drain_incomplete", in_flight=remaining)
        if self.supervisor is not None:
            await self.supervisor.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.gate is not None:
            await self.gate.stop()
        if self.control is not None:
            await self.control.stop()
        await self.maps.stop()
        if self.exporter is not None:
            self.exporter.stop()
        self.notifier.close()
        log.info("daemon_stopped")

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT (or :meth:`request_stop`), shut down. Returns the exit code."""
        # The token first: a daemon that would refuse mutating calls anyway must not start anything.
        self._token = read_token(self.cfg.control.token_file,  # type: ignore[arg-type]
                                 create=self.cfg.control.create_token)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            interval = self.notifier.watchdog_interval_s()
            while not self._stop.is_set():
                if interval is not None:
                    self.notifier.watchdog()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=interval or 3600.0)
        finally:
            await self.shutdown()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
        return 0

    # ------------------------------------------------------------------------------------------------ control

    def status(self) -> dict[str, Any]:
        sup = self.supervisor
        return {
            "daemon": {"version": __version__, "pid": os.getpid(),
                       "uptime_s": round(time.monotonic() - self.started_at, 1),
                       "config": str(self.cfg.path) if self.cfg.path else None,
                       "control": self.control.address if self.control else None,
                       "metrics": f"http://{self.cfg.metrics.host}:{self.cfg.metrics.port}/metrics"
                       if self.exporter else None,
                       "launcher": self.cfg.engine.launcher, "hook_mode": self.cfg.engine.hook_mode},
            "engine": sup.snapshot() if sup else {"state": EngineState.STOPPED},
            "gate": self.gate.snapshot() if self.gate is not None else None,
            "maps": {"dir": str(self.maps.directory), "entries": [e.to_json() for e in self.maps.entries()]},
            "last_drain_reboot": self.last_drain_reboot,
            "pin": self._pin_status(),
            "drift": self._drift_status(),
            "remap": self.remaps.status(),
        }

    def _pin_status(self) -> dict[str, Any] | None:
        """What the engine's hook says about its split (from its newest stats file): the backend, whether it has
        been checked on hardware, bytes per expert, and the attach-time self-check when one ran. None when the
        engine is not in pin mode or has not written stats yet."""
        path = self.stats_path
        if path is None or self.cfg.engine.hook_mode != "pin":
            return None
        try:
            snap = load_newest_stats(path)
        except (ArtifactError, OSError):
            return None
        meta = snap.meta or {}
        return {"backend": meta.get("backend"), "backend_verified": bool(meta.get("backend_verified", True)),
                "expert_bytes": meta.get("expert_bytes"), "tier_bytes": dict(snap.tier_bytes or {}),
                "selfcheck": meta.get("selfcheck")}

    def _drift_status(self) -> dict[str, Any] | None:
        watch = self.watch
        if watch is None:
            return None
        st = watch.status()
        last = watch.last_record
        if last is None:
            line = "no window closed yet"
        elif last.signals is not None and last.signals.exploitable_skew is False:
            line = NO_SKEW
        else:
            line = last.status
        return {**st, "line": line}

    async def request_remap(self, *, trigger: str, dry_run: bool = False, map_ref: str | None = None,
                            reason: str = "", detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """The one entry of every remap trigger ("drift", "alert", "manual", "timer"): one remap at a time, through
        the drift config's cooldown and daily cap; the remap runs in the background and this returns at once.
        Raises :class:`ControlError` (409 one runs, 429 cooldown or cap, 400 bad map or not pin mode, 503
        starting). A dry run changes nothing and returns the decision with its figures."""
        if self.supervisor is None:
            raise ControlError(503, "the daemon is still starting")
        return await self.remaps.request(trigger=trigger, dry_run=dry_run, map_ref=map_ref, reason=reason,
                                         detail=detail)

    # What the remap pipeline reads and calls (its RemapHost protocol).

    @property
    def capture(self) -> Any:
        return self.capture_store

    @property
    def served_map(self) -> tuple[Path | None, ExpertMap | None]:
        sup = self.supervisor
        return (sup.map_path, sup.map) if sup is not None else (None, None)

    @property
    def engine_url(self) -> str | None:
        launcher = self._launcher()
        return launcher.base_url if launcher is not None else None

    @property
    def model_name(self) -> str:
        return self._spec_for(None).model_name

    @property
    def stats_path(self) -> Path | None:
        return self._stats_reader.path if self._stats_reader is not None else None

    @property
    def drain_busy(self) -> bool:
        return self._drain_busy

    @property
    def active_map_file(self) -> Path:
        return self.state_dir / ACTIVE_MAP_FILE

    def library_entries(self) -> list[Any]:
        return self.maps.entries()

    def resolve_map(self, ref: str) -> Path:
        return self._resolve_map(ref)

    def commit_active_map(self, path: Path, map_hash: str) -> None:
        self._record_active_map(path, map_hash)
        if self.supervisor is not None:  # a map applied in place is what a restart boots from now on
            self.supervisor.committed(map_hash)

    def record_remap_metric(self, outcome: str, seconds: float | None) -> None:
        if self.exporter is not None:
            self.exporter.record_remap(outcome, seconds)

    def engine_map_path(self, path: Path) -> str:
        """``path`` as the engine sees it: the same file through the container's mount of the state folder, or
        the absolute path for a local engine."""
        if self.cfg.engine.launcher == "container":
            from pinsidecar.engine.container import container_path

            return container_path(path, self.cfg.container, self.state_dir)
        return str(Path(path).absolute())

    def engine_alive_probe(self) -> Callable[[], bool]:
        """True while the engine serving now still runs and is still the supervisor's (callable from a thread:
        a process poll or the container's init pid, no event loop)."""
        sup = self.supervisor
        launcher = sup.launcher if sup is not None else None
        if sup is None or launcher is None:
            return lambda: False
        return lambda: sup.launcher is launcher and launcher.alive()

    def applied_in_place(self, path: Path, emap: ExpertMap) -> None:
        """The hook swapped the engine onto ``emap``: the supervisor (status, what a restart boots), the exporter
        (through it) and the drift watch follow."""
        if self.supervisor is not None:
            self.supervisor.applied_in_place(path, emap)
        if self.watch is not None:
            self.watch.set_active_map(emap, reference_counts(path, emap))

    def record_apply_request(self, answer: ApplyAnswer) -> None:
        if self.exporter is not None:
            self.exporter.record_apply_request(answer.result, seconds=answer.seconds if answer.applied else None,
                                               rows=answer.rows, bytes_moved=answer.bytes_moved)

    def record_apply_outcome(self, outcome: str) -> None:
        if self.exporter is not None:
            self.exporter.record_apply_outcome(outcome)

    async def reboot_with(self, map_path: Path, *, reason: str, before_stop: RebootHook | None = None,
                          after_boot: RebootHook | None = None) -> dict[str, Any]:
        """A remap's drain-reboot onto ``map_path`` (``active-map.json`` is left to the commit)."""
        return await self._drain_reboot(map_path, self.cfg.control.drain_timeout_s, reason=reason,
                                        record_active=False, before_stop=before_stop, after_boot=after_boot)

    def _resolve_map(self, ref: str) -> Path:
        try:
            path = self.maps.resolve(ref)
        except MapNotFound as exc:
            raise ControlError(400, str(exc)) from None
        try:
            load_map(path)
        except (ArtifactError, OSError) as exc:
            raise ControlError(400, f"map rejected: {exc}") from None
        if self.cfg.engine.hook_mode != "pin":
            raise ControlError(400, f"engine.hook_mode is {self.cfg.engine.hook_mode!r}: a map is applied only in "
                               "pin mode (set engine.hook_mode = \"pin\")")
        return path

    async def drain_reboot(self, map_ref: str | None, timeout_s: float | None) -> dict[str, Any]:
        """The control API's drain-reboot: hold, drain (bounded), reboot (optionally with a new map, rolling back
        on failure), release. Refused while a remap runs (it owns the engine until it ends)."""
        if self.supervisor is None:
            raise ControlError(503, "the daemon is still starting")
        if self._drain_busy:
            raise ControlError(409, "a drain-reboot is already running")
        running = self.remaps.current
        if running is not None:
            raise ControlError(409, f"remap {running.id} (state {running.state}, trigger {running.trigger}) is "
                               "running; drain-reboot when it has ended")
        new_map = self._resolve_map(map_ref) if map_ref else None
        timeout = timeout_s if timeout_s is not None else self.cfg.control.drain_timeout_s
        return await self._drain_reboot(new_map, timeout)

    async def _drain_reboot(self, new_map: Path | None, timeout: float, *, reason: str = "drain-reboot",
                            record_active: bool = True, before_stop: RebootHook | None = None,
                            after_boot: RebootHook | None = None) -> dict[str, Any]:
        """The one drain-reboot (control API and remaps). While the gate holds: ``before_stop`` runs on the drained
        old engine (a reason returned: nothing is rebooted, ``skipped``), ``after_boot`` on the new one (a reason
        returned: roll back to the old map before anyone is served). ``record_active``: a successful switch is
        written to ``active-map.json`` now (a remap writes it at its commit instead)."""
        sup = self.supervisor
        if sup is None:
            raise ControlError(503, "the daemon is still starting")
        if self._drain_busy:
            raise ControlError(409, "a drain-reboot is already running")
        self._drain_busy = True
        t0 = time.monotonic()
        result: dict[str, Any] = {"ok": False, "started_at": utc_now(), "map": str(new_map) if new_map else None,
                                  "rolled_back": False, "reason": reason}
        try:
            hash_hit = True
            emap: ExpertMap | None = None
            if new_map is not None:
                emap = load_map(new_map)
                result["map_hash"] = emap.content_hash
                if sup.map is not None and not emap.same_geometry(sup.map):
                    hash_hit = False
                    log.info("drain_reboot_geometry_change", map=str(new_map), old=sup.map.geometry(),
                             new=emap.geometry(), note="another geometry: the expert tensors change shape, which "
                             "vLLM's compile cache does not key on (the boot record's cache_miss says if it hit)")
            result["hash_hit"] = hash_hit
            log.info("drain_reboot_begin", map=str(new_map) if new_map else None, timeout_s=timeout, reason=reason)
            async with sup.lock:
                sup._set_state(EngineState.DRAINING, "holding new requests, draining in-flight ones")
                hold_t0 = time.monotonic()
                if self.gate is not None:
                    self.gate.hold()
                try:
                    if self.gate is not None:
                        remaining = await self.gate.drain(timeout)
                        result["in_flight_cut"] = remaining
                    result["drain_s"] = round(time.monotonic() - t0, 3)
                    old_map = sup.map_path
                    why_not = await before_stop(result) if before_stop is not None else None
                    if why_not is not None:
                        result.update(skipped=True, error=why_not)
                        sup._set_state(EngineState.READY)
                    else:
                        await self._reboot_locked(sup, new_map, emap, old_map, reason, record_active, after_boot,
                                                  result)
                finally:
                    if self.gate is not None:
                        result["held_at_release"] = self.gate.held  # requests that waited out the reboot
                        if sup.launcher is not None and sup.state == EngineState.READY:
                            self.gate.set_upstream(sup.launcher.base_url)
                            self.gate.release()
                        # else no engine serves: the gate keeps holding until the supervisor's own restart
                        # serves (or refuses, once the supervisor has given up)
                        result["hold_s"] = round(time.monotonic() - hold_t0, 3)
        finally:
            self._drain_busy = False
            result["seconds"] = round(time.monotonic() - t0, 3)
            self.last_drain_reboot = result
            log.info("drain_reboot_end", **{k: v for k, v in result.items() if k != "engine_log"})
        return result

    async def _reboot_locked(self, sup: Supervisor, new_map: Path | None, emap: ExpertMap | None,
                             old_map: Path | None, reason: str, record_active: bool,
                             after_boot: RebootHook | None, result: dict[str, Any]) -> None:
        try:
            rec = await sup.reboot(reason, new_map, use_map=new_map is not None)
        except (EngineError, ArtifactError) as exc:
            result["error"] = str(exc).splitlines()[0]
            result["engine_log"] = getattr(exc, "log_tail", [])[-10:]
            await self._after_failed_reboot(sup, new_map, old_map, result)
            return
        result.update(boot_s=rec.seconds, cache_miss=rec.cache_miss)
        why_not = await after_boot(result) if after_boot is not None else None
        if why_not is not None:
            result["error"] = why_not
            await sup.stop_engine(EngineState.DRAINING)
            await self._after_failed_reboot(sup, new_map, old_map, result)
            return
        result["ok"] = True
        if new_map is not None and emap is not None:
            if record_active:
                self._record_active_map(new_map, rec.map_hash)
            if self.watch is not None:
                self.watch.set_active_map(emap, reference_counts(new_map, emap))

    async def _after_failed_reboot(self, sup: Supervisor, new_map: Path | None, old_map: Path | None,
                                   result: dict[str, Any]) -> None:
        if new_map is None:
            sup.note_failure(f"drain-reboot boot failed: {result['error']}")
            return
        log.error("drain_reboot_rollback", failed_map=str(new_map), back_to=str(old_map))
        try:
            await sup.boot("rollback", old_map, use_map=True)
            result["rolled_back"] = True
            result["error"] += f" (rolled back to {old_map or 'no map'}; the engine serves the old map)"
        except (EngineError, ArtifactError) as exc:
            result["rollback_error"] = str(exc).splitlines()[0]
            sup.note_failure(f"rollback failed: {result['rollback_error']}")

    def _record_active_map(self, path: Path, map_hash: str | None) -> None:
        try:
            atomic_write_json(self.state_dir / ACTIVE_MAP_FILE, {"path": str(path), "hash": map_hash,
                                                                 "activated_at": utc_now()})
        except OSError as exc:
            log.warning("active_map_not_recorded", error=str(exc))


def run_daemon(cfg: Config) -> int:
    """Entry point for ``pinsidecar run``."""
    return asyncio.run(Daemon(cfg).run())

