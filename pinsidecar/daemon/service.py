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
implementation, :mod:`pinsidecar.daemon.drain`): the gate holds new requests, in-flight ones drain (bounded), the
engine reboots (with the new map if one is given), and once it serves the gate releases what it held; a boot that
fails, or a remap's check on the new engine, boots the old map again inside the hold (``rolled_back``).

**Remaps** (:meth:`Daemon.request_remap`, every trigger's one entry): one at a time, through the drift config's
cooldown and daily cap, run by :class:`~pinsidecar.remap.pipeline.RemapPipeline` in the background. A remap
deploys in place first (the hook swaps the candidate into the serving engine, the gate never holds; see
:mod:`pinsidecar.remap.apply`) and drain-reboots when it cannot.

**SIGTERM / SIGINT**: ``STOPPING=1``, the gate holds, in-flight requests drain (bounded), the engine stops, exit 0.
The active map survives restarts: ``<state_dir>/active-map.json`` (:mod:`pinsidecar.remap.commit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from pinsidecar_hook.contract import ArtifactError, ExpertMap, load_map

from pinsidecar import __version__
from pinsidecar.daemon.config import Config
from pinsidecar.daemon.control import ControlError, ControlServer, read_token
from pinsidecar.daemon.drain import DrainReboot
from pinsidecar.daemon.engine_state import EngineState
from pinsidecar.daemon.map_library import MapLibrary, MapNotFound
from pinsidecar.daemon.sdnotify import Notifier
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.drift import NO_SKEW, DriftWatch, WindowRecord
from pinsidecar.engine import EngineError, EngineProcess, EngineSpec, Launcher
from pinsidecar.engine.ports import check_ports_free
from pinsidecar.engine.process import stop_recorded_engine
from pinsidecar.live_stats import StatsReader, load_newest_stats
from pinsidecar.metrics.cache import cache_status
from pinsidecar.remap import admission
from pinsidecar.remap.candidates import find_by_label, reference_counts
from pinsidecar.remap.commit import committed_map
from pinsidecar.remap.host import RebootHook
from pinsidecar.remap.pipeline import COUNT_ENGINE_PID_FILE, RemapPipeline
from pinsidecar.remap.tools import RemapTools

if TYPE_CHECKING:
    from pinsidecar.metrics import Exporter

__all__ = ["run_daemon"]

log = structlog.get_logger(__name__)

ENGINE_PID_FILE = "engine.pid"


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
        self.drains = DrainReboot(self.state_dir, lambda: self.supervisor, lambda: self.gate, self._follow_map)
        self.capture: Any = None  # the gate's CaptureStore (gate.capture_dir), which a remap counts
        self.watch: DriftWatch | None = None
        self._stats_reader: StatsReader | None = None
        self.remaps = RemapPipeline(self, remap_tools)
        self._stop = asyncio.Event()
        self._ready_sent = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._token = ""

    # ------------------------------------------------------------------------------------------------ helpers

    def _spec_for(self, map_path: Path | None) -> EngineSpec:
        return self.cfg.engine_spec(map_path)

    def _initial_map(self) -> Path | None:
        if self.cfg.engine.hook_mode != "pin":
            return None
        return committed_map(self.state_dir, self.cfg.engine.map)  # active-map.json, else engine.map

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
                capture = self.capture = self._capture_store()
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
        self.remaps.recover(Path(stats) if stats else None)  # before the engine boots: see remap.recovery

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
        await self.remaps.stop()  # before the gate and the engine go: it closes its record
        await self.drains.hold_and_drain(self.cfg.control.drain_timeout_s)
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
        been checked on hardware, bytes per expert, the attach-time self-check when one ran, and the cache tier
        (:func:`~pinsidecar.metrics.cache.cache_status`, None without one). None when the
        engine is not in pin mode or has not written stats yet."""
        path = self.stats_path
        if path is None or self.cfg.engine.hook_mode != "pin":
            return None
        try:
            snap = load_newest_stats(path)
        except (ArtifactError, OSError):
            return None
        meta = snap.meta or {}
        ranks = meta.get("tp_size") if isinstance(meta.get("tp_size"), int) else 1
        tiers = dict(snap.tier_bytes or {})
        # Rank 0 writes the stats; under tensor parallel every rank holds an equal shard of every expert, and
        # routing (so every count) is the same on all of them.
        return {"backend": meta.get("backend"), "backend_verified": bool(meta.get("backend_verified", True)),
                "expert_bytes": meta.get("expert_bytes"), "tier_bytes": tiers, "tp_size": ranks,
                "lane_tier_bytes": {k: v * ranks for k, v in tiers.items()}, "selfcheck": meta.get("selfcheck"),
                "cache": cache_status(snap)}

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
        map_path = self._remap_candidate(map_ref) if map_ref else None
        busy = "a drain-reboot is running; try again when it has ended" if self.drains.busy else None
        return await self.remaps.request(trigger=trigger, dry_run=dry_run, map_path=map_path, reason=reason,
                                         detail=detail, blocked=busy)

    def _remap_candidate(self, ref: str) -> Path:
        """A map an operator names for a remap: as a drain-reboot resolves it, or a label in the maps folder."""
        try:
            return self.resolve_map(ref)
        except ControlError:
            by_label = find_by_label(self.maps.entries(), ref)
            if by_label is None:
                raise
            return by_label

    @property
    def last_drain_reboot(self) -> dict[str, Any] | None:
        return self.drains.last

    def _follow_map(self, path: Path, emap: ExpertMap) -> None:
        """The engine serves ``emap`` now (a switch or an apply in place): the drift watch judges against it."""
        if self.watch is not None:
            self.watch.set_active_map(emap, reference_counts(path, emap))

    # What the remap pipeline reads and calls (its RemapHost protocol).

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

    def library_entries(self) -> list[Any]:
        return self.maps.entries()

    def committed(self, path: Path, map_hash: str) -> None:
        """A remap wrote ``active-map.json`` for ``map_hash``: a map applied in place is what a restart boots now."""
        if self.supervisor is not None:
            self.supervisor.committed(map_hash)

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
        self._follow_map(path, emap)

    async def reboot_with(self, map_path: Path, *, reason: str, before_stop: RebootHook | None = None,
                          after_boot: RebootHook | None = None) -> dict[str, Any]:
        """A remap's drain-reboot onto ``map_path`` (``active-map.json`` is left to the commit)."""
        return await self.drains.run(map_path, self.cfg.control.drain_timeout_s, reason=reason,
                                     record_active=False, before_stop=before_stop, after_boot=after_boot)

    def resolve_map(self, ref: str) -> Path:
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
        """The control API's drain-reboot (:meth:`~pinsidecar.daemon.drain.DrainReboot.request`)."""
        return await self.drains.request(map_ref, timeout_s if timeout_s is not None else
                                         self.cfg.control.drain_timeout_s, remap=self.remaps.current,
                                         resolve=self.resolve_map)


def run_daemon(cfg: Config, remap_tools: RemapTools | None = None) -> int:
    """Entry point for ``pinsidecar run`` (``remap_tools``: a test's, :mod:`pinsidecar.testing.paused_daemon`)."""
    return asyncio.run(Daemon(cfg, remap_tools=remap_tools).run())

