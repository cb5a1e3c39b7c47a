"""The daemon's one drain-reboot: hold the gate, drain, reboot (onto a new map or not), release; roll back on failure.

Two callers, one implementation, so that what an operator's ``pinsidecar drain-reboot`` was tested to do is what
every remap's reboot does: the control API (:meth:`~pinsidecar.daemon.service.Daemon.drain_reboot`) and the remap
pipeline's reboot deploy (:meth:`~pinsidecar.daemon.remap_host.DaemonRemapHost.reboot_with`). :meth:`DrainReboot.run`:

1. refuses a second one while one runs (``busy``); a map given is validated first;
2. takes the supervisor's lock (no restart of its own in between), puts the engine in ``draining``
   (:meth:`~pinsidecar.daemon.supervisor.Supervisor.draining`), holds the gate (new requests wait, none fail) and
   drains in-flight requests for up to ``timeout`` seconds;
3. runs ``before_stop`` on the drained old engine: a reason returned means nothing is rebooted (``skipped``; the
   engine's state goes back to what the drain interrupted);
4. reboots; ``after_boot`` runs on the new engine before anyone is served by it: a reason returned (a remap's
   parity difference), or a boot that fails, boots the old map again inside the same hold (``rolled_back``);
5. releases the gate onto the engine that serves; with none serving the gate keeps holding until the
   supervisor's own restart serves (or refuses, once the supervisor has given up).

A map of a different geometry (``hash_hit`` false: another hot-row count) is allowed and logged; vLLM keeps the
expert tensors out of its compiled graph (the fused-MoE call is one custom op that finds the layer's weights by
name), so its compile cache hits anyway: on the H200 (vLLM 0.26, 2026-12-02) a drain-reboot from 99 to 92 hot
rows loaded the compiled graph from the cache and booted in 87 s against 150 s cold. The boot record's
``cache_miss`` says whether a boot hit. An operator's switch is recorded in ``active-map.json`` at once
(``record_active``); a remap's is left to its commit (:mod:`pinsidecar.remap.commit`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, ExpertMap, load_map, utc_now

from pinsidecar.daemon.engine_state import EngineState
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.engine import EngineError
from pinsidecar.errors import ControlError
from pinsidecar.remap.commit import active_map_path, write_active_map
from pinsidecar.remap.host import RebootHook

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class DrainReboot:
    """The drain-reboot of one daemon. ``supervisor`` and ``gate`` are read at each run (the daemon builds them at
    start); ``on_switch(path, emap)`` is told of a successful switch to another map (the drift watch follows)."""

    def __init__(self, state_dir: Path, supervisor: Callable[[], Supervisor | None], gate: Callable[[], Any],
                 on_switch: Callable[[Path, ExpertMap], None]) -> None:
        self.state_dir = state_dir
        self.supervisor = supervisor
        self.gate = gate
        self.on_switch = on_switch
        self.busy = False
        self.last: dict[str, Any] | None = None  # the last one's result, for status

    async def request(self, map_ref: str | None, timeout: float, *, remap: Any,
                      resolve: Callable[[str], Path]) -> dict[str, Any]:
        """An operator's drain-reboot (the control API's): refused while one runs, and while a remap runs
        (``remap``: its record; it owns the engine until it ends); ``map_ref`` is resolved by ``resolve``."""
        if self.supervisor() is None:
            raise ControlError(503, "the daemon is still starting")
        if self.busy:
            raise ControlError(409, "a drain-reboot is already running")
        if remap is not None:
            raise ControlError(409, f"remap {remap.id} (state {remap.state}, trigger {remap.trigger}) is "
                               "running; drain-reboot when it has ended")
        return await self.run(resolve(map_ref) if map_ref else None, timeout)

    async def run(self, new_map: Path | None, timeout: float, *, reason: str = "drain-reboot",
                  record_active: bool = True, before_stop: RebootHook | None = None,
                  after_boot: RebootHook | None = None) -> dict[str, Any]:
        """One drain-reboot (see the module docstring); returns its result, ``ok`` or not."""
        sup = self.supervisor()
        if sup is None:
            raise ControlError(503, "the daemon is still starting")
        if self.busy:
            raise ControlError(409, "a drain-reboot is already running")
        self.busy = True
        t0 = time.monotonic()
        result: dict[str, Any] = {"ok": False, "started_at": utc_now(), "map": str(new_map) if new_map else None,
                                  "rolled_back": False, "reason": reason}
        gate = self.gate()
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
                hold_t0 = time.monotonic()
                try:
                    with sup.draining("holding new requests, draining in-flight ones"):
                        if gate is not None:
                            gate.hold()
                            result["in_flight_cut"] = await gate.drain(timeout)
                        result["drain_s"] = round(time.monotonic() - t0, 3)
                        old_map = sup.map_path
                        why_not = await before_stop(result) if before_stop is not None else None
                        if why_not is not None:  # nothing rebooted: leaving draining() gives the state back
                            result.update(skipped=True, error=why_not)
                        else:
                            await self._reboot_locked(sup, new_map, emap, old_map, reason, record_active,
                                                      after_boot, result)
                finally:  # after draining() has given the state back: release onto an engine that serves
                    if gate is not None:
                        result["held_at_release"] = gate.held  # requests that waited out the reboot
                        if sup.serving and sup.launcher is not None:
                            gate.set_upstream(sup.launcher.base_url)
                            gate.release()
                        result["hold_s"] = round(time.monotonic() - hold_t0, 3)
        finally:
            self.busy = False
            result["seconds"] = round(time.monotonic() - t0, 3)
            self.last = result
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
                self.record_active_map(new_map, rec.map_hash)
            self.on_switch(new_map, emap)

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

    async def hold_and_drain(self, timeout: float) -> None:
        """The daemon is stopping: hold new requests, let in-flight ones finish (bounded); no reboot follows."""
        gate = self.gate()
        if gate is not None:
            gate.hold()
            remaining = await gate.drain(timeout)
            if remaining:
                log.warning("shutdown_drain_incomplete", in_flight=remaining)

    def record_active_map(self, path: Path, map_hash: str | None) -> None:
        """An operator's switch: the next start boots it (a disk that refuses is logged; the switch stands)."""
        try:
            write_active_map(active_map_path(self.state_dir), path, map_hash)
        except OSError as exc:
            log.warning("active_map_not_recorded", error=str(exc))
