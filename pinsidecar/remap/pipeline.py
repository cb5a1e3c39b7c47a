"""The remap pipeline: from a trigger to a new map serving, or to the old one serving still, with a record of why.

One remap at a time runs through the states of :mod:`~pinsidecar.remap.record` (its table of allowed transitions
is checked at every change); every transition is written to disk before the next step starts, and every step is a
plain call into a module of its own:

a. **choose the workload** (:mod:`~pinsidecar.remap.traffic`): the traffic the gate captured (plus fixtures), or
   the drift watch's live windows (``remap.source = "live"``: pin mode counts the full histogram online, so no
   count boot is needed);
b. **the library first** (:mod:`~pinsidecar.remap.candidates`): a labelled map already on disk that fits the live
   window better than the active map by the margin is deployed as it is, with no count boot;
c. otherwise the **count boot** (:func:`~pinsidecar.remap.tools.run_count_boot`) on a *second* engine on its own
   port while the serving engine keeps serving. That is fine on the CPU lane and on a host with a spare GPU; a
   host with one GPU cannot hold two engines and should use ``source = "live"``. Then **build** the candidate
   with the active map's geometry (so the reboot is a compile-cache hit) from that one traffic class: a blend of
   classes is never built, because on the reference deployment a map of mixed traffic cost the majority class
   10 % of its single-stream throughput against its own map (the reference deployment's figure, from the brief;
   not measured here: ``docs/design.md``);
d. **evaluate** (:func:`~pinsidecar.remap.decision.decide`) on the newest drift window not used to build the candidate;
   refused -> ``refused``, with both predicted cold rates;
e-g. **deploy, verify, commit** (:mod:`~pinsidecar.remap.deploy`): in place when the swap plan allows it
   (:class:`~pinsidecar.remap.in_place.InPlaceDeploy`, ``applying``), else, or when the hook cannot, by the drain
   and hash-hit reboot (:class:`~pinsidecar.remap.reboot.RebootDeploy`, ``rebooting``); parity on the engine
   serving the candidate, the live cold rate (``verifying``), then ``active-map.json`` written durably
   (:mod:`~pinsidecar.remap.commit`) and ``committed``, or the deploy's own way back to the old map and why.

The pipeline never touches the serving engine before the deploy step, never writes the active map's file, and
updates ``active-map.json`` only at commit; :mod:`~pinsidecar.remap.recovery` relies on that after a crash, and
so does the supervisor: a map applied in place and not yet committed is never what a restart boots. The
pipeline's blocking actions are :class:`~pinsidecar.remap.tools.RemapTools` (a test replaces them, and sets the
states a remap pauses in), and all it asks of the daemon is :class:`~pinsidecar.remap.host.RemapHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, load_map

import pinsidecar.remap.admission as admission
from pinsidecar.drift import Window
from pinsidecar.engine.process import stop_recorded_engine
from pinsidecar.errors import ControlError
from pinsidecar.placement.counts import sum_counts
from pinsidecar.remap.apply import apply_summary, withdraw_apply_request
from pinsidecar.remap.candidates import build_candidate, library_maps, reference_counts, save_candidate
from pinsidecar.remap.commit import active_map_path
from pinsidecar.remap.config import resolve_workloads
from pinsidecar.remap.decision import decide, pick_from_library
from pinsidecar.remap.deploy import Deploy, DeployContext, verify_and_commit
from pinsidecar.remap.dry_run import dry_run_decision
from pinsidecar.remap.host import RemapHost
from pinsidecar.remap.in_place import InPlaceDeploy, swap_plan
from pinsidecar.remap.reboot import RebootDeploy
from pinsidecar.remap.record import TRIGGERS, RecordStore, RemapRecord
from pinsidecar.remap.recovery import active_map_hash, close_open_records, close_record
from pinsidecar.remap.run import Aborted, RemapRun, first_line, map_ref
from pinsidecar.remap.tools import RemapTools
from pinsidecar.remap.traffic import NotEnoughTraffic, captured_workload, live_build_windows

__all__ = ["COUNT_ENGINE_PID_FILE", "RemapPipeline"]

log = structlog.get_logger(__name__)

COUNT_ENGINE_PID_FILE = "count-engine.pid"
# How often the pipeline looks again while it waits for a held-out window.
WAIT_STEP_S = 0.5
# How many finished records status shows, and how many (with their working files) stay on disk.
HISTORY = 10
KEEP_RECORDS = 200


class RemapPipeline:
    """Runs remaps for one daemon: :meth:`request` is every trigger's way in (and the control API's), one remap
    runs at a time as a background task, its record in ``<state_dir>/remaps``."""

    def __init__(self, host: RemapHost, tools: RemapTools | None = None) -> None:
        self.host = host
        self.tools = tools or RemapTools()
        self.store = RecordStore(host.state_dir / "remaps")
        self.current: RemapRecord | None = None
        self.last: RemapRecord | None = None
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        history = self.store.history(HISTORY)
        return {"current": self.current.to_json() if self.current else None,
                "last": self.last.to_json() if self.last else None,
                "history": [r.summary() for r in history],
                "last_apply": self._last_apply(history)}

    def _last_apply(self, history: Sequence[RemapRecord]) -> dict[str, Any] | None:
        """The newest remap's in-place deploy (the running one first; a restart reads it from the records)."""
        for rec in (self.current, self.last, *reversed(history)):
            if rec is not None and rec.apply:
                return apply_summary(rec.id, rec.state, rec.apply)
        return None

    def current_json(self) -> dict[str, Any] | None:
        return self.current.to_json() if self.current else None

    @property
    def count_pid_file(self) -> Path:
        return self.host.state_dir / COUNT_ENGINE_PID_FILE

    def recover(self, stats_path: Path | None) -> None:
        """At start, before the engine boots: withdraw an apply request a killed predecessor left beside the stats
        file (the engine must not apply a dead remap's map), close its open records, prune old ones."""
        if withdraw_apply_request(stats_path):
            log.warning("apply_request_left_over_withdrawn", stats=str(stats_path))
        for rec in close_open_records(self.store, active_map_path(self.host.state_dir)):
            self.last = rec
        self.store.prune(KEEP_RECORDS)

    async def stop(self) -> None:
        """The daemon is stopping: cancel the running remap, which closes its record as a restart would."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------------------------------------ entry
    async def request(self, *, trigger: str, dry_run: bool = False, map_path: Path | None = None, reason: str = "",
                      detail: dict[str, Any] | None = None, blocked: str | None = None) -> dict[str, Any]:
        """Start a remap (see :meth:`~pinsidecar.daemon.service.Daemon.request_remap` for the contract):
        ``map_path`` a candidate the operator named (resolved by the caller), ``blocked`` why the caller cannot
        have a remap start now (a drain-reboot runs; a dry run is still answered)."""
        host = self.host
        if trigger not in TRIGGERS:
            raise ControlError(400, f"unknown remap trigger {trigger!r} (one of {', '.join(TRIGGERS)})")
        if host.cfg.engine.hook_mode != "pin":
            raise ControlError(400, f"engine.hook_mode is {host.cfg.engine.hook_mode!r}: remaps need pin mode "
                               "(set engine.hook_mode = \"pin\" and engine.map)")
        active_path, active = host.served_map
        watch = host.watch
        if watch is None or active is None:
            raise ControlError(503, "the daemon is still starting (no map served yet); try again when the engine "
                               "is ready")
        if dry_run:
            answer = dry_run_decision(host, trigger, map_path, watch, active)  # reads the watch: on the loop
            self._metric("dry_run", None)
            return answer
        running = self.current
        if running is not None:
            raise ControlError(409, f"remap {running.id} (state {running.state}, trigger {running.trigger}) is "
                               "already running; wait for it to end (pinsidecar status)",
                               {"running": running.summary()})
        if blocked is not None:
            raise ControlError(409, blocked)
        if trigger != "drift":  # the detector checked its own trip against the same cooldown and cap
            why = admission.blocked(watch.detector)
            if why is not None:
                raise ControlError(429, f"remap refused: {why}")
            admission.note_started(watch.detector)
        rec = RemapRecord.new(trigger, reason=reason, detail={**(detail or {}),
                                                               **({"map": str(map_path)} if map_path else {})},
                              previous_map=map_ref(active_path, active),
                              state="evaluating" if map_path else "choosing_workload")
        try:
            self.store.save(rec)
        except OSError as exc:
            watch.remap_finished(False)
            raise ControlError(500, f"cannot write the remap record in {self.store.directory}: {exc.strerror}; "
                               "nothing was started") from None
        self.current = rec
        log.info("remap_started", remap=rec.id, trigger=trigger, reason=reason, state=rec.state,
                 map=str(map_path) if map_path else None)
        run = RemapRun(rec, active_path, active, map_path=map_path)
        self.task = asyncio.create_task(self._run(run), name=f"remap-{rec.id}")
        return {"accepted": True, "remap_id": rec.id, "trigger": trigger, "dry_run": False, "state": rec.state,
                "reason": f"remap {rec.id} started ({'candidate ' + str(map_path) if map_path else rec.state}); "
                          "follow it with pinsidecar status", "decision": None}

    # ------------------------------------------------------------------------------------------------ states
    async def _enter(self, run: RemapRun, state: str, detail: dict[str, Any] | None = None) -> None:
        rec = run.record
        step = rec.enter(state, detail)
        self._save(rec)
        log.info("remap_step", remap=rec.id, done=step["state"], seconds=step["seconds"], now=state)
        await self._maybe_pause(rec)

    def _save(self, rec: RemapRecord) -> None:
        """Persist a transition. A disk that refuses the write is logged and the remap goes on: the serving map
        never depends on the record (the daemon boots from active-map.json), only the history would be stale."""
        try:
            self.store.save(rec)
        except OSError as exc:
            log.error("remap_record_not_written", remap=rec.id, state=rec.state, error=exc.strerror)

    async def _maybe_pause(self, rec: RemapRecord) -> None:
        if rec.state in self.tools.pause_at:  # a test's: see RemapTools
            log.warning("remap_test_pause", remap=rec.id, state=rec.state)
            await asyncio.Event().wait()

    def _metric(self, outcome: str, seconds: float | None) -> None:
        exporter = self.host.exporter
        if exporter is not None:
            exporter.record_remap(outcome, seconds)

    def _finish(self, run: RemapRun, state: str, reason: str, *, error: str | None = None,
                detail: dict[str, Any] | None = None) -> None:
        rec = run.record
        step = rec.finish(state, reason=reason, error=error, detail=detail)
        self._save(rec)
        log.info("remap_end", remap=rec.id, outcome=state, done=step["state"], seconds=rec.seconds, reason=reason)
        watch = self.host.watch
        if watch is not None:
            if state == "committed" and run.candidate is not None:
                watch.remap_finished(True, run.candidate, reference=run.candidate_counts)
            else:
                watch.remap_finished(False)
                # what serves now: an engine restarted mid-apply boots the committed map behind the pipeline's back
                served_path, served = self.host.served_map
                if served is not None and watch.active.content_hash != served.content_hash:
                    watch.set_active_map(served, reference_counts(served_path, served))
        self._metric(state, rec.seconds)

    async def _run(self, run: RemapRun) -> None:
        rec = run.record
        try:
            await self._maybe_pause(rec)
            await self._steps(run)
        except Aborted as exc:
            self._finish(run, "aborted", str(exc), error=str(exc))
        except asyncio.CancelledError:
            await self._cancelled(run)
            raise
        except Exception as exc:  # a bug or an unforeseen failure: the record must still end, the old map serve
            log.exception("remap_failed", remap=rec.id, state=rec.state)
            await self._unexpected(run, exc)
        finally:
            if self.current is rec:
                self.current = None
            self.last = rec

    async def _cancelled(self, run: RemapRun) -> None:
        """The daemon is stopping: stop a count engine of ours, close the record as a restart would."""
        rec = run.record
        if rec.state == "count_boot":
            await asyncio.to_thread(stop_recorded_engine, self.count_pid_file)
        if rec.state == "applying":  # the engine is stopped next; its successor must not find the request
            withdraw_apply_request(self.host.stats_path)
        if not rec.terminal:
            close_record(rec, active_map_hash(active_map_path(self.host.state_dir)), "daemon stopped")
            self._save(rec)
            watch = self.host.watch
            if watch is not None:
                watch.remap_finished(False)
            log.warning("remap_cancelled", remap=rec.id, now=rec.state)

    async def _unexpected(self, run: RemapRun, exc: Exception) -> None:
        rec = run.record
        if rec.terminal:
            return
        msg = f"{type(exc).__name__}: {first_line(exc)}"
        if rec.state == "applying":
            withdraw_apply_request(self.host.stats_path)
        if rec.state not in ("applying", "rebooting", "verifying"):
            self._finish(run, "aborted", msg, error=msg)
            return
        _, served = self.host.served_map
        if served is not None and served.content_hash != run.active.content_hash and run.active_path is not None:
            try:
                back = await self.host.reboot_with(run.active_path, reason="rollback")
                msg += f"; rolled back to {run.active.label or run.active.short_hash} (ok={back.get('ok')})"
            except Exception as exc2:
                msg += f"; the rollback failed too: {first_line(exc2)}"
        self._finish(run, "rolled_back", msg, error=msg)

    async def _steps(self, run: RemapRun) -> None:
        if run.map_path is None:
            await self._choose_and_build(run)
        else:
            run.candidate_path = run.map_path
            try:
                run.candidate = load_map(run.map_path)
            except (ArtifactError, OSError) as exc:
                raise Aborted(f"map {run.map_path}: {first_line(exc)}") from None
            run.candidate_counts = reference_counts(run.map_path, run.candidate)
            run.source = "named"
        assert run.candidate is not None and run.candidate_path is not None
        run.record.candidate = {"path": str(run.candidate_path), "hash": run.candidate.content_hash,
                                "label": run.candidate.label, "source": run.source}
        self._save(run.record)
        if not await self._evaluate(run):
            return
        await self._deploy(run)

    # a-c: workload, library, count boot or live windows, build
    async def _choose_and_build(self, run: RemapRun) -> None:
        host, rcfg, watch = self.host, self.host.cfg.remap, self.host.watch
        assert watch is not None
        rec = run.record
        held = watch.held_out_window()
        if rcfg.source == "live":
            if held is None:
                raise Aborted("no judged drift window yet: the live source needs traffic (drift.min_tokens = "
                              f"{watch.config.min_tokens} routed tokens per window)")
            try:
                run.choice = live_build_windows(watch, held, max_windows=rcfg.live_windows,
                                                min_tokens=rcfg.min_count_tokens)
            except NotEnoughTraffic as exc:
                raise Aborted(str(exc)) from None
        else:
            fixtures = resolve_workloads(rcfg, None)  # made absolute when the config was loaded
            run.cut_at = time.monotonic()
            try:
                run.choice = await asyncio.to_thread(
                    captured_workload, host.capture, fixtures, self.store.file(rec.id, ".workload.jsonl"),
                    limit=rcfg.capture_requests, min_requests=rcfg.min_requests)
            except (NotEnoughTraffic, ValueError, OSError) as exc:
                raise Aborted(first_line(exc)) from None
        await self._enter(run, "library_check", run.choice.as_dict())

        # b. the library first
        lib = library_maps(host.library_entries())
        detail: dict[str, Any]
        if held is None:
            detail = {"checked": False, "reason": "no judged drift window to judge library maps on", "maps": len(lib)}
        else:
            d = pick_from_library([m for _, m in lib], run.active, held, host.cfg.drift.margin)
            detail = {"checked": True, "maps": len(lib), **d.as_dict()}
            if d.deploy and d.candidate is not None:
                path = next(p for p, m in lib if m.content_hash == d.candidate.content_hash)
                run.candidate_path, run.candidate = path, d.candidate
                run.candidate_counts = reference_counts(path, d.candidate)
                run.source = "library"
                log.info("remap_library_hit", remap=rec.id, map=str(path), label=d.candidate.label, gain=d.gain)
                await self._enter(run, "evaluating", detail)
                return
        label = f"{rec.trigger}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        if run.choice.source == "live":
            run.source = "live"
            await self._enter(run, "building", detail)
            counts = sum_counts([w.to_counts(workload=label) for w in run.choice.windows])
        else:
            run.source = "count_boot"
            await self._enter(run, "count_boot", detail)
            counts, info = await self._count_boot(run, label)
            await self._enter(run, "building", info)
        try:
            sources: Sequence[CountsArtifact | Window] = run.choice.windows if run.choice.source == "live" \
                else [counts]
            run.candidate = build_candidate(sources, run.active, label=label)
            run.candidate_counts = counts
            run.candidate_path = await asyncio.to_thread(save_candidate, host.cfg.maps_dir, run.candidate, counts,
                                                         lib)
        except (ArtifactError, OSError, ValueError) as exc:
            raise Aborted(f"building the candidate failed: {first_line(exc)}; the old map keeps serving") from None
        await self._enter(run, "evaluating", {"path": str(run.candidate_path), "hash": run.candidate.content_hash,
                                              "label": label, "tokens": counts.tokens,
                                              "in_sample_cold_rate": run.candidate.predicted_cold_rate})

    async def _count_boot(self, run: RemapRun, label: str) -> tuple[CountsArtifact, dict[str, Any]]:
        host, rcfg, rec = self.host, self.host.cfg.remap, run.record
        assert run.choice is not None
        port = rcfg.count_port(host.cfg.engine.port)
        out = self.store.file(rec.id, ".counts.json")
        t0 = time.monotonic()
        try:
            counts, summary = await asyncio.to_thread(
                self.tools.count_boot, run.choice.files, out, engine=host.cfg.engine, remap=rcfg, port=port,
                label=label, engine_log=self.store.file(rec.id, ".count-engine.log"), pid_file=self.count_pid_file)
        except Exception as exc:
            raise Aborted(f"count boot failed (the old map keeps serving): {first_line(exc)}") from None
        if counts.tokens < rcfg.min_count_tokens:
            raise Aborted(f"count boot yielded {counts.tokens} routed tokens, fewer than remap.min_count_tokens = "
                          f"{rcfg.min_count_tokens} (the old map keeps serving)")
        return counts, {"port": port, "seconds": round(time.monotonic() - t0, 3), "tokens": counts.tokens,
                        "selections": counts.selections,
                        **{k: summary.get(k) for k in ("requests", "boot_s", "exact", "label")}}

    # d. evaluate
    async def _held_out(self, run: RemapRun) -> tuple[Window | None, dict[str, Any]]:
        watch, cand = self.host.watch, run.candidate
        assert watch is not None and cand is not None
        exclude = set(cand.source_counts)
        if run.cut_at is None:
            return watch.held_out_window(exclude=exclude), {}
        deadline = time.monotonic() + self.host.cfg.remap.held_out_wait_s
        while True:
            for w in reversed(watch.recent):
                if w.started >= run.cut_at and w.histogram is not None and w.judgeable(watch.config.min_tokens) \
                        and w.to_counts().digest() not in exclude:
                    return w, {"after_capture_cut": True}
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(WAIT_STEP_S)
        w = watch.held_out_window(exclude=exclude)
        return w, {"after_capture_cut": False,
                   "note": "no window began after the capture was cut within remap.held_out_wait_s: judged on the "
                           "newest window, which overlaps the counted traffic"}

    async def _evaluate(self, run: RemapRun) -> bool:
        assert run.candidate is not None
        held, note = await self._held_out(run)
        if held is None:
            raise Aborted("no held-out drift window to judge the candidate on (the drift watch needs "
                          f"drift.min_tokens = {self.host.cfg.drift.min_tokens} routed tokens of traffic)")
        d = decide(run.candidate, run.active, held, self.host.cfg.drift.margin,
                   source=run.source if run.source in ("library", "named") else "rebuild",
                   allow_geometry_change=run.source == "named")  # an operator's map: a budget change is theirs
        run.decision = d
        run.record.decision = {**d.as_dict(), **note}
        if not d.deploy:
            self._finish(run, "refused", d.reason, detail={"decision": d.reason})
            return False
        return True  # the deploy step closes "evaluating" with the decision as it enters its own state

    # e-g. deploy (in place first, the drain-reboot when it cannot), verify, commit or roll back
    async def _deploy(self, run: RemapRun) -> None:
        """Choose the deploy from the swap plan (a plan: in place; none: the reboot, saying why when in place was
        wanted), run it, hand over to the reboot when the hook could not apply, then verify and commit."""
        rec = run.record
        assert run.decision is not None
        ctx = DeployContext(self.host, self.tools, run, self.store.file(rec.id, ".parity.json"),
                            enter=functools.partial(self._enter, run), save=functools.partial(self._save, rec),
                            finish=functools.partial(self._finish, run))
        handover: dict[str, Any] = {"decision": run.decision.reason, "gain": run.decision.gain}
        plan, why_not = swap_plan(self.host, run)
        deploy: Deploy = RebootDeploy(ctx) if plan is None else InPlaceDeploy(ctx, plan)
        if plan is None and self.host.cfg.remap.in_place:  # wanted, and not possible: say why (record, metrics)
            rec.apply = {"in_place": False, "outcome": None, "reason": why_not, "requests": []}
            ctx.apply_outcome("fell_back_reboot")
            log.info("remap_not_in_place", remap=rec.id, reason=why_not)
            handover["in_place"] = why_not
        await self._enter(run, deploy.state, handover)
        result = await deploy.deploy()
        if result.fall_back is not None:  # the hook could not: the drain-reboot deploys it instead
            deploy = RebootDeploy(ctx)
            await self._enter(run, deploy.state, {"in_place": result.fall_back, "apply": rec.apply})
            result = await deploy.deploy()
        if result.serving:
            await verify_and_commit(deploy)
