"""Keep one engine running: boot, wait for readiness (bounded), watch liveness, restart with backoff, give up.

The supervisor owns the engine's lifecycle and nothing else; the daemon drives drain-reboots through
:meth:`Supervisor.draining` and :meth:`Supervisor.reboot` and reads :meth:`Supervisor.snapshot` for status. The
engine's states and the transitions allowed between them are data (:mod:`~pinsidecar.daemon.engine_state`), and
every change the supervisor makes is checked against that table. What it leans on lives beside it: how
it knows the engine is alive (:mod:`~pinsidecar.daemon.liveness`), what a boot records and what the engine's log
says about it (:mod:`~pinsidecar.daemon.boots`), and whom it tells (:mod:`~pinsidecar.daemon.peers`). Why it works
the way it does:

- **Blocking launcher calls run in threads.** :class:`~pinsidecar.engine.Launcher` is synchronous (it is shared
  with the CLI tools), and a boot waits minutes; the daemon's event loop must keep feeding the systemd watchdog
  and answering the control API meanwhile.
- **A hang is several misses.** A local engine's exit is noticed at once (an exit watch), a container's at the
  next check. A live engine must fail ``health_failures`` checks in a row (one missed probe is a GC pause, not a
  hang), so a hung one is restarted within ``health_failures x (health_interval_s + health_timeout_s)``.
- **The gate follows the engine**: the supervisor holds it the moment it loses the engine (crash or hang), points
  it at the restarted engine and releases it once that serves, and makes it refuse (503 at once) when it gives
  up. Requests that arrive meanwhile wait, bounded, exactly as during a drain-reboot; only those the engine had
  taken when it died fail. A drain-reboot holds the supervisor's lock and drives the gate itself.
- **Backoff and the crash loop.** Each failed boot or crash in a row doubles the wait before the next boot
  (``backoff_initial_s`` .. ``backoff_max_s``); ``crash_loop_limit`` of them in a row puts the supervisor in the
  ``failed`` state: it stops restarting, the daemon stays up, and status and metrics say why. An engine that
  stays ready ``stable_after_s`` resets the count. A drain-reboot (an operator asking) clears ``failed``. A boot
  that pin mode refused is ``failed`` at once with the hook's reason: the same boot would refuse again.
- **Every boot is recorded** (:class:`~pinsidecar.daemon.boots.BootRecord`), with whether the compile cache
  missed: a remap keeps the map's geometry and so the kernel shapes, so a miss means something fed the compile
  caches' key that should not have.
- **A map applied in place is not what a restart boots.** A remap may swap the serving engine onto a candidate
  without a boot (:meth:`Supervisor.applied_in_place`); until the daemon commits it (:meth:`Supervisor.committed`),
  a crash restart boots the map the engine was booted with, the committed one, so a candidate that was never
  verified cannot come back on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, ExpertMap, load_map, utc_now

from pinsidecar.daemon.boots import (
    BootRecord,
    PinRefusedError,
    compile_cache_evidence,
    geometry_key,
    is_cache_miss,
    pin_refusal,
    rotate_log,
)
from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.daemon.engine_state import EngineState, check_engine_transition
from pinsidecar.daemon.liveness import ExitWatch, HealthProbe
from pinsidecar.daemon.peers import BootObserver, EngineGate
from pinsidecar.engine import EngineError, EngineProcess, EngineSpec, Launcher

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class Supervisor:
    """Runs one engine. ``spec_for(map_path)`` builds the engine spec for a map; ``make_launcher(spec)`` builds a
    fresh launcher for each boot (launchers are single-use)."""

    def __init__(self, spec_for: Callable[[Path | None], EngineSpec], make_launcher: Callable[[EngineSpec], Launcher],
                 cfg: SupervisorConfig, *, ready_timeout_s: float, stop_timeout_s: float,
                 map_path: Path | None = None, observer: BootObserver | None = None,
                 on_state: Callable[[str, str], None] | None = None, gate: EngineGate | None = None) -> None:
        self.spec_for = spec_for
        self.make_launcher = make_launcher
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.map_path = map_path
        self.map: ExpertMap | None = load_map(map_path) if map_path is not None else None
        # While a map applied in place is not committed: the map a restart boots instead of the one serving.
        self.restart_map: tuple[Path | None, ExpertMap | None] | None = None
        self.observer = observer
        self.on_state = on_state
        self.gate = gate
        self.launcher: Launcher | None = None
        self.state = EngineState.STOPPED
        self.detail = ""
        self.boots: deque[BootRecord] = deque(maxlen=50)
        self.failures_in_row = 0
        self.restarts_total = 0
        self.ready_since: float | None = None
        self.lock = asyncio.Lock()  # held for every boot/stop; the daemon holds it across a drain-reboot
        self._closing = False
        self._wake = asyncio.Event()
        self._probe = HealthProbe()
        self._exit_watch: ExitWatch | None = None
        self._exited: Launcher | None = None  # the serving engine's process exited; the loop has not acted yet

    # ------------------------------------------------------------------------------------------------ observer

    def _tell(self, event: Callable[[BootObserver], None]) -> None:
        if self.observer is None:
            return
        try:
            event(self.observer)
        except Exception as exc:  # metrics must never take the supervisor down
            log.warning("boot_observer_failed", observer=type(self.observer).__name__, error=str(exc))

    def _set_state(self, state: str, detail: str = "") -> None:
        """The one place the engine's state changes: checked against the table (engine_state.TRANSITIONS)."""
        check_engine_transition(self.state, state, detail)
        if state != self.state or detail != self.detail:
            log.info("engine_state", state=state, detail=detail or None)
        self.state, self.detail = state, detail
        exported = EngineState.EXPORTED.get(state, state)
        self._tell(lambda o: o.on_state(exported))
        if self.on_state is not None:
            self.on_state(state, detail)

    # ------------------------------------------------------------------------------------------------ boot / stop

    def _previous_ok(self, geometry: str) -> BootRecord | None:
        for rec in reversed(self.boots):
            if rec.ok and rec.geometry == geometry:
                return rec
        return None

    async def boot(self, reason: str, map_path: Path | None = None, *, use_map: bool = False) -> BootRecord:
        """Start an engine and wait until it serves. Call with :attr:`lock` held and no engine running.

        ``use_map``: boot with ``map_path`` (None = no map); otherwise with the current map. On success the map
        becomes current. Raises :class:`EngineError` (``EngineBootError`` with the last log lines) on failure;
        the engine is stopped and the state is left to the caller.
        """
        if self.launcher is not None:
            raise EngineError("boot() while an engine is running; stop it first")
        if use_map:
            mp = map_path
            emap = load_map(mp) if mp is not None else None
        elif self.restart_map is not None:  # the committed map, not one applied in place since
            mp, emap = self.restart_map
        else:
            mp, emap = self.map_path, self.map
        geometry = geometry_key(emap)
        spec = self.spec_for(mp)
        rotate_log(spec.log_path)
        launcher = self.make_launcher(spec)
        self._set_state(EngineState.STARTING, reason)
        t0 = time.monotonic()
        try:
            self.launcher = launcher
            await asyncio.to_thread(launcher.start)
            await asyncio.to_thread(launcher.wait_ready, self.ready_timeout_s)
        except (EngineError, OSError) as exc:
            seconds = time.monotonic() - t0
            self.launcher = None
            with contextlib.suppress(Exception):
                await asyncio.to_thread(launcher.stop, 5.0)
            rec = BootRecord(reason, utc_now(), False, round(seconds, 3), str(mp) if mp else None,
                             emap.content_hash if emap else None, geometry, False, str(exc).splitlines()[0],
                             tuple(getattr(exc, "log_tail", ())[-10:]))
            self.boots.append(rec)
            log.error("engine_boot_failed", reason=reason, seconds=rec.seconds, error=str(exc))
            refusal = pin_refusal(spec.log_path)
            if refusal is not None:
                raise PinRefusedError(f"pin mode refused to boot: {refusal}") from exc
            if isinstance(exc, EngineError):
                raise
            raise EngineError(str(exc)) from exc
        seconds = time.monotonic() - t0
        prev = self._previous_ok(geometry)
        evidence = compile_cache_evidence(spec.log_path)
        cache_miss = evidence if evidence is not None else is_cache_miss(seconds, prev, self.cfg)
        rec = BootRecord(reason, utc_now(), True, round(seconds, 3), str(mp) if mp else None,
                         emap.content_hash if emap else None, geometry, cache_miss)
        self.boots.append(rec)
        self.map_path, self.map = mp, emap
        self.restart_map = None
        self.ready_since = time.monotonic()
        if cache_miss:
            log.warning("engine_boot_cache_miss", seconds=rec.seconds, previous_seconds=prev.seconds if prev else None,
                        geometry=geometry, evidence="engine log" if evidence is not None else "boot time",
                        hint="a boot with the same geometry should hit the compile cache")
        self._tell(lambda o: o.on_boot(reason=reason, seconds=seconds, map_hash=rec.map_hash or "",
                                       cache_miss=cache_miss))
        if emap is not None:
            served = emap
            self._tell(lambda o: o.on_map(served))
        self._watch_exit(launcher)
        self._set_state(EngineState.READY)
        return rec

    def applied_in_place(self, map_path: Path, emap: ExpertMap) -> None:
        """The hook swapped the serving engine onto ``emap`` without a boot. Status and the observer follow at
        once; a restart keeps booting the map of the last boot until :meth:`committed` (see the module
        docstring). Applying the boot map back in place (a rollback) clears that."""
        if self.restart_map is None:
            self.restart_map = (self.map_path, self.map)
        self.map_path, self.map = map_path, emap
        boot_map = self.restart_map[1]
        if boot_map is not None and boot_map.content_hash == emap.content_hash:
            self.restart_map = None
        log.info("engine_map_applied_in_place", map=str(map_path), hash=emap.content_hash,
                 restart_boots=str(self.restart_map[0]) if self.restart_map else str(map_path))
        self._tell(lambda o: o.on_map(emap))

    def committed(self, map_hash: str) -> None:
        """The daemon committed ``map_hash``: when it is the map serving, a restart boots it from now on."""
        if self.map is not None and self.map.content_hash == map_hash:
            self.restart_map = None

    def _watch_exit(self, launcher: Launcher) -> None:
        if self._exit_watch is not None:
            self._exit_watch.close()
            self._exit_watch = None
        if isinstance(launcher, EngineProcess) and launcher.pid is not None:
            self._exit_watch = ExitWatch(launcher.pid, lambda: self._engine_exited(launcher))

    def _engine_exited(self, launcher: Launcher) -> None:
        """The serving engine's process just exited (called by the exit watch on the event loop)."""
        if launcher is not self.launcher or self._closing:
            return  # stopped on purpose (stop_engine drops it first), or replaced
        self._exited = launcher
        if self.lock.locked():
            # a drain-reboot (or a boot) owns the engine now: the gate already holds and the owner reboots it
            log.warning("engine_exited_during_drain_reboot", pid=launcher.pid)
        else:
            self.lose("engine process exited")
        self.wake()

    def lose(self, why: str) -> None:
        """The serving engine is gone or hung: never say ready again until a new one serves, and hold the gate so
        requests wait for the restart instead of failing at a dead engine."""
        self.ready_since = None
        self._set_state(EngineState.BACKOFF, f"{why}; restarting")
        if self.gate is not None:
            self.gate.hold()

    def _serve(self) -> None:
        """A boot of the loop's own reached ready: point the gate at the engine and let requests through."""
        launcher = self.launcher
        if self.gate is not None and launcher is not None:
            self.gate.set_upstream(launcher.base_url)
            self.gate.release()

    async def stop_engine(self, state: str = EngineState.STOPPED, timeout_s: float | None = None) -> int | None:
        """Stop the running engine (if any). Call with :attr:`lock` held."""
        launcher, self.launcher = self.launcher, None
        self.ready_since = None
        if self._exit_watch is not None:
            self._exit_watch.close()
            self._exit_watch = None
        if launcher is None:
            return None
        if state == EngineState.STOPPED:
            self._set_state(EngineState.STOPPING)
        code = await asyncio.to_thread(launcher.stop, self.stop_timeout_s if timeout_s is None else timeout_s)
        self._set_state(state)
        return code

    @property
    def serving(self) -> bool:
        """An engine runs and the gate may send it requests (ready, or unhealthy and not yet restarted)."""
        return self.launcher is not None and self.state in EngineState.LIVE

    @contextlib.contextmanager
    def draining(self, detail: str) -> Iterator[None]:
        """The engine is drained for a reboot (the daemon's drain-reboot): the state is ``draining`` inside.

        Hold :attr:`lock` around it (no boot of the supervisor's own may start in between). Inside, the caller
        reboots (:meth:`reboot`) or decides not to; when it leaves with the state still ``draining`` and the
        engine it found still the supervisor's (nothing was stopped), the state it interrupted comes back, detail
        and all: a drain that rebooted nothing changed nothing. An engine stopped and not booted again stays
        ``draining``, and the loop boots it."""
        if not self.lock.locked():
            raise RuntimeError("Supervisor.draining() needs the supervisor's lock held (async with sup.lock)")
        interrupted, launcher = (self.state, self.detail), self.launcher
        self._set_state(EngineState.DRAINING, detail)
        try:
            yield
        finally:
            if self.state == EngineState.DRAINING and self.launcher is launcher:
                self._set_state(*interrupted)

    # ------------------------------------------------------------------------------------------------ the loop

    def _backoff_s(self) -> float:
        n = max(1, self.failures_in_row)
        return min(self.cfg.backoff_initial_s * 2 ** (n - 1), self.cfg.backoff_max_s)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake early on :meth:`wake` (shutdown, an operator clearing ``failed``, the engine exiting)."""
        self._wake.clear()
        if self._exited is not None and self._exited is self.launcher:
            return  # the engine exited before we got here: act now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    def wake(self) -> None:
        self._wake.set()

    def note_failure(self, reason: str, permanent: bool = False) -> float | None:
        """Count a crash or failed boot; returns the backoff to wait, or None once the crash-loop limit is hit
        or the failure is ``permanent`` (a missing runtime or image: a retry cannot fix it) (state ``failed``)."""
        self.failures_in_row += 1
        self.restarts_total += 1
        if permanent or self.failures_in_row >= self.cfg.crash_loop_limit:
            why = "a retry cannot fix this" if permanent else f"{self.failures_in_row} failures in a row"
            self._set_state(EngineState.FAILED,
                            f"{why} ({reason}); not restarting "
                            "(fix the cause, then `pinsidecar drain-reboot` or restart the daemon)")
            if self.gate is not None:
                self.gate.refuse(f"the engine failed ({self.detail})")
            return None
        wait = self._backoff_s()
        self._set_state(EngineState.BACKOFF, f"{reason}; next boot in {wait:.1f} s")
        return wait

    async def _record_failure(self, reason: str, permanent: bool = False) -> None:
        wait = self.note_failure(reason, permanent)
        if wait is not None:
            await self._sleep(wait)

    async def _check(self, launcher: Launcher, misses: int) -> tuple[str | None, int]:
        """One liveness check. Returns (reason to restart or None, consecutive health misses)."""
        if not await self._probe.alive(launcher):
            return "crash", misses
        if await self._probe.healthy(launcher, self.cfg.health_timeout_s):
            if self.state == EngineState.UNHEALTHY:
                self._set_state(EngineState.READY)
            return None, 0
        if self._exited is launcher:
            return "crash", misses  # it exited while we probed: not a hang
        misses += 1
        if misses >= self.cfg.health_failures:
            return "unhealthy", misses
        self._set_state(EngineState.UNHEALTHY, f"/health failed {misses} time(s) in a row")
        return None, misses

    async def run(self) -> None:
        """Boot and keep the engine alive until :meth:`close`. Never raises for engine trouble."""
        reason = "start"
        misses = 0
        while not self._closing:
            if self.state == EngineState.FAILED:
                await self._sleep(self.cfg.health_interval_s)
                continue
            if self.launcher is None:
                failure, permanent = "", False
                async with self.lock:
                    if self._closing or self.launcher is not None or self.state == EngineState.FAILED:
                        continue
                    try:
                        await self.boot(reason)
                        misses = 0
                        self._serve()
                    except (EngineError, ArtifactError) as exc:
                        failure = f"boot failed: {str(exc).splitlines()[0]}"
                        permanent = bool(getattr(exc, "permanent", False))  # EngineSetupError: no retry fixes it
                if failure:
                    if self._closing:
                        break
                    await self._record_failure(failure, permanent)  # sleeps the backoff outside the lock
                    reason = "retry"
                    continue
            await self._sleep(self.cfg.health_interval_s)
            if self._closing or self.lock.locked():
                continue  # a drain-reboot owns the engine right now
            launcher = self.launcher
            if launcher is None:
                continue
            problem, misses = await self._check(launcher, misses)
            if (self.ready_since is not None and self.failures_in_row
                    and time.monotonic() - self.ready_since >= self.cfg.stable_after_s):
                log.info("engine_stable", after_failures=self.failures_in_row)
                self.failures_in_row = 0
            if problem is None:
                continue
            async with self.lock:
                if self.launcher is not launcher or self._closing:
                    continue  # replaced or stopped while we looked
                log.warning("engine_lost", reason=problem, pid=launcher.pid,
                            last_log=launcher.last_log_lines(5))
                self.lose("engine process exited" if problem == "crash"
                          else f"engine hung: /health failed {misses} time(s) in a row")
                self._exited = None
                await self.stop_engine(EngineState.BACKOFF, timeout_s=5.0)
            misses = 0
            reason = problem
            await self._record_failure(problem)

    async def reboot(self, reason: str, map_path: Path | None = None, *, use_map: bool = False) -> BootRecord:
        """Stop the engine and boot it again (with ``map_path`` when ``use_map``). Call with :attr:`lock` held.
        An operator-driven reboot clears the crash count and the ``failed`` state (through ``draining``, the
        one way out of ``failed``, also when no engine runs to stop)."""
        if self.state != EngineState.DRAINING:
            self._set_state(EngineState.DRAINING, f"rebooting ({reason})")
        await self.stop_engine(EngineState.DRAINING)
        self.failures_in_row = 0
        return await self.boot(reason, map_path, use_map=use_map)

    async def close(self) -> None:
        """Stop supervising and stop the engine."""
        self._closing = True
        self.wake()
        launcher = self.launcher
        if launcher is not None and self.lock.locked():
            # A boot is waiting in a thread: stopping the engine makes wait_ready return at once.
            await asyncio.to_thread(launcher.stop, self.stop_timeout_s)
        async with self.lock:
            await self.stop_engine(EngineState.STOPPED)
        await self._probe.close()

    # ------------------------------------------------------------------------------------------------ status

    def snapshot(self) -> dict[str, Any]:
        launcher = self.launcher
        last_ok = next((b for b in reversed(self.boots) if b.ok), None)
        state, detail = self.state, self.detail
        if state == EngineState.READY and isinstance(launcher, EngineProcess) and not launcher.alive():
            # the exit watch fires within a loop iteration; this covers the moment in between (and no pidfd)
            state, detail = EngineState.BACKOFF, "engine process exited; restarting"
        return {
            "state": state,
            "detail": detail,
            "pid": launcher.pid if launcher is not None else None,
            "url": launcher.base_url if launcher is not None else None,
            "ready_for_s": round(time.monotonic() - self.ready_since, 1) if self.ready_since else None,
            "failures_in_row": self.failures_in_row,
            "restarts_total": self.restarts_total,
            "map": None if self.map is None else {
                "path": str(self.map_path), "hash": self.map.content_hash, "label": self.map.label,
                "geometry": self.map.geometry()},
            # a map applied in place and not committed serves; a restart would boot this one
            "restart_map": None if self.restart_map is None or self.restart_map[1] is None else {
                "path": str(self.restart_map[0]), "hash": self.restart_map[1].content_hash,
                "label": self.restart_map[1].label},
            "last_boot": asdict(self.boots[-1]) if self.boots else None,
            "last_ok_boot_seconds": last_ok.seconds if last_ok else None,
            "boots": len(self.boots),
        }

