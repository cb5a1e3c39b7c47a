"""The sidecar daemon: one asyncio process that fronts, supervises and reports on one engine.

:class:`Daemon` is the wiring: it builds the parts, starts and stops them in order, and is the control API's
target. What the parts do lives in their own modules, each reading the others only through what is wired here:

- the supervisor (:mod:`~pinsidecar.daemon.supervisor`) runs the engine; the drain-reboot
  (:mod:`~pinsidecar.daemon.drain`) is the one way to reboot it on purpose;
- the drift loop (:mod:`~pinsidecar.daemon.drift_loop`) feeds the drift watch from the live stats and asks for a
  remap on a trip;
- the remap host (:mod:`~pinsidecar.daemon.remap_host`) is the daemon as the remap pipeline sees it;
- the status view (:mod:`~pinsidecar.daemon.status_view`) gathers ``GET /status`` from all of them.

``pinsidecar run`` calls :func:`run_daemon`. The start order is chosen so that nothing is half-up:

1. the config is already validated; the control token is read (mode 0600 or the daemon refuses to start);
2. what a previous run left behind is cleaned up: an engine process group still running from a SIGKILLed daemon
   (recorded in ``<state_dir>/engine.pid`` and ``count-engine.pid``; stopped only when its start time matches, see
   :func:`~pinsidecar.engine.process.stop_recorded_engine`), and remap records left open (closed by
   :mod:`pinsidecar.remap.recovery`: the engine boots from ``active-map.json``, which a remap changes only at
   commit, so the old map serves);
3. the Prometheus exporter, the gate (clients' entry point), the control API and the maps library start;
4. the supervisor boots the engine and keeps it alive (:mod:`pinsidecar.daemon.supervisor`); in pin mode the
   drift loop starts the drift watch (:class:`~pinsidecar.drift.DriftWatch`) on the served map and reads the
   engine's live stats every ``remap.watch_interval_s``; a trip asks for a remap;
5. ``READY=1`` goes to systemd when the engine is first ready (or has failed for good: the daemon stays up to
   report that, and systemd must not kill it for a slow start); the main loop sends ``WATCHDOG=1`` at half of
   ``WATCHDOG_USEC`` and ``STATUS=`` on every state change.

**Drain-reboot** (:meth:`Daemon.drain_reboot` from the control API, and every remap's reboot through the remap
host: one implementation, :mod:`pinsidecar.daemon.drain`): the gate holds new requests, in-flight ones drain
(bounded), the engine reboots (with the new map if one is given), and once it serves the gate releases what it
held; a boot that fails, or a remap's check on the new engine, boots the old map again inside the hold
(``rolled_back``).

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
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from pinsidecar_hook.contract import ArtifactError, load_map

from pinsidecar import __version__
from pinsidecar.daemon.config import Config
from pinsidecar.daemon.control import ControlError, ControlServer, read_token
from pinsidecar.daemon.drain import DrainReboot
from pinsidecar.daemon.drift_loop import DriftLoop
from pinsidecar.daemon.engine_state import EngineState
from pinsidecar.daemon.map_library import MapLibrary, MapNotFound
from pinsidecar.daemon.remap_host import DaemonRemapHost
from pinsidecar.daemon.sdnotify import Notifier
from pinsidecar.daemon.status_view import StatusView
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.drift import DriftWatch
from pinsidecar.engine import EngineError, EngineProcess, EngineSpec, Launcher
from pinsidecar.engine.ports import check_ports_free
from pinsidecar.engine.process import stop_recorded_engine
from pinsidecar.remap.candidates import find_by_label
from pinsidecar.remap.commit import committed_map
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
        self.capture: Any = None  # the gate's CaptureStore (gate.capture_dir), which a remap counts
        # the roles, each in its own module: the drift loop, the remap host (the pipeline's view of the daemon),
        # the status view; they read each other only through the parts wired here
        self.drift = DriftLoop(self.request_remap, lambda: self.remaps.current is not None)
        self.drains = DrainReboot(self.state_dir, lambda: self.supervisor, lambda: self.gate, self.drift.follow_map)
        self.remaps = RemapPipeline(DaemonRemapHost(self), remap_tools)
        self.view = StatusView(self)
        self._stop = asyncio.Event()
        self._ready_sent = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._token = ""

    @property
    def watch(self) -> DriftWatch | None:
        """The drift loop's watch (None until it runs): what the exporter and the tests read."""
        return self.drift.watch

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
                                     drift=lambda: self.drift.watch, remap=self.remaps.current_json,
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
        self._start_drift_loop(spec)
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

    def _start_drift_loop(self, spec: EngineSpec) -> None:
        """Pin mode: watch the served map's live stats (the drift loop reads them with a reader of its own)."""
        sup, stats = self.supervisor, spec.env.get("PINSIDECAR_STATS_PATH")
        if self.cfg.engine.hook_mode != "pin" or sup is None or sup.map is None or not stats:
            return
        self._tasks.append(self.drift.start(self.cfg.drift, self.cfg.remap.watch_interval_s, Path(stats),
                                            sup.map_path, sup.map, self.remaps.store.records()))

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
        return self.view.document()

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

