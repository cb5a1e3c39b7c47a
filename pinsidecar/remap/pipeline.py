"""The remap pipeline: from a trigger to a new map serving, or to the old one serving still, with a record of why.

One remap at a time runs through the states of :mod:`~pinsidecar.remap.record`; every transition is written to
disk before the next step starts, and every step is a plain call into a module of its own:

a. **choose the workload** (:mod:`~pinsidecar.remap.workload`): the traffic the gate captured (plus fixtures), or
   the drift watch's live windows (``remap.source = "live"``: pin mode counts the full histogram online, so no
   count boot is needed);
b. **the library first** (:mod:`~pinsidecar.remap.candidates`): a labelled map already on disk that fits the live
   window better than the active map by the margin is deployed as it is, with no count boot;
c. otherwise the **count boot**: :func:`~pinsidecar.runs.count_boot.run_profile` on a *second* engine on its own
   port while the serving engine keeps serving. That is fine on the CPU lane and on a host with a spare GPU; a
   host with one GPU cannot hold two engines and should use ``source = "live"``. Then **build** the candidate
   with the active map's geometry (so the reboot is a compile-cache hit) from that one traffic class: a blend of
   classes is never built, because on the reference deployment a map of mixed traffic cost the majority class
   10 % of its single-stream throughput against its own map (the reference deployment's figure, from the brief;
   not measured here: ``docs/design.md``);
d. **evaluate** (:func:`~pinsidecar.drift.decide`) on the newest drift window not used to build the candidate;
   refused -> ``refused``, with both predicted cold rates;
e. **deploy**, in place first (``applying``, :mod:`~pinsidecar.remap.apply`): the parity prompts are recorded on
   the serving engine, the hook swaps the rows that change while the engine keeps serving (the gate never holds),
   and parity is checked token for token on the same engine. When the candidate cannot be applied in place
   (another geometry, ``remap.in_place = false``) or the hook refuses, fails or does not answer, the **drain and
   hash-hit reboot** deploys it instead (``rebooting``), through the daemon's one drain-reboot (the gate holds
   clients meanwhile), with the parity prompts recorded on the old engine before it stops and checked on the new
   one before the gate releases (:mod:`~pinsidecar.remap.verify`); a difference rolls back inside the hold. An
   engine that dies mid-apply ends the remap: the supervisor restarts it with the committed map, never the
   candidate;
f. **verify** the live cold rate under the new map over ``remap.verify_tokens`` tokens;
g. **commit** (``active-map.json``, the drift watch, the metrics) or **roll back** to the previous map (in place
   when the candidate was applied in place, else by a reboot) and say why.

The pipeline never touches the serving engine before the deploy step, never writes the active map's file, and
updates ``active-map.json`` only at commit; :mod:`~pinsidecar.remap.recovery` relies on that after a crash, and
so does the supervisor: a map applied in place and not yet committed is never what a restart boots.

**Test hook**: ``PINSIDECAR_TEST_REMAP_PAUSE_AT=<state>[,<state>...]`` makes a remap stop (forever, until the
process is killed or stopped) right after it has entered and recorded one of those states. It exists so a test can
SIGKILL the sidecar in a given state; nothing else reads it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap, load_map
from pinsidecar_hook.contract.requests import HookRequestError
from pinsidecar_hook.contract.swap import SwapPlan, SwapPlanError, plan_swap

import pinsidecar.remap.admission as admission
from pinsidecar.drift import Decision, DriftWatch, Window, build_candidate, decide, pick_from_library
from pinsidecar.engine.process import stop_recorded_engine
from pinsidecar.errors import ControlError
from pinsidecar.placement.counts import sum_counts
from pinsidecar.remap.apply import (
    ApplyAnswer,
    ApplyClient,
    apply_summary,
    classify_answer,
    request_apply,
    stats_boot_id,
    token_parity,
    withdraw_apply_request,
)
from pinsidecar.remap.candidates import find_by_label, library_maps, reference_counts, save_candidate
from pinsidecar.remap.config import resolve_workloads
from pinsidecar.remap.record import TRIGGERS, RecordStore, RemapRecord, utc_stamp
from pinsidecar.remap.recovery import active_map_hash, close_record
from pinsidecar.remap.verify import ColdRateProbe, cold_rate_verdict, load_parity_prompts, parity_outputs
from pinsidecar.remap.workload import NotEnoughTraffic, WorkloadChoice, captured_workload, live_build_windows
from pinsidecar.runs.parity import ParityRef, PromptOutput, compare, prompts_digest
from pinsidecar.runs.workload import WorkloadRequest

if TYPE_CHECKING:
    from pinsidecar.daemon.config import Config

__all__ = ["COUNT_ENGINE_PID_FILE", "KEEP_RECORDS", "RemapPipeline", "RemapTools"]

log = structlog.get_logger(__name__)

PAUSE_ENV = "PINSIDECAR_TEST_REMAP_PAUSE_AT"  # a test hook, see the module docstring
COUNT_ENGINE_PID_FILE = "count-engine.pid"
# How often the pipeline looks again while it waits (for a held-out window, for verification tokens).
WAIT_STEP_S = 0.5
# How many finished records status shows, and how many (with their working files) stay on disk.
HISTORY = 10
KEEP_RECORDS = 200


class Aborted(Exception):
    """A step cannot go on; the remap ends ``aborted`` with this message and the old map keeps serving."""


class RemapHost(Protocol):
    """What the pipeline needs from the daemon (:class:`~pinsidecar.daemon.service.Daemon` implements it)."""

    cfg: Config
    watch: DriftWatch | None
    state_dir: Path

    @property
    def capture(self) -> Any: ...  # the gate's CaptureStore, or None

    @property
    def served_map(self) -> tuple[Path | None, ExpertMap | None]: ...

    @property
    def engine_url(self) -> str | None: ...

    @property
    def model_name(self) -> str: ...

    @property
    def stats_path(self) -> Path | None: ...

    @property
    def drain_busy(self) -> bool: ...

    @property
    def active_map_file(self) -> Path: ...  # what the daemon boots with; written only at a commit

    def library_entries(self) -> Sequence[Any]: ...

    def resolve_map(self, ref: str) -> Path: ...

    async def reboot_with(self, map_path: Path, *, reason: str,
                          before_stop: Callable[[dict[str, Any]], Awaitable[str | None]] | None = None,
                          after_boot: Callable[[dict[str, Any]], Awaitable[str | None]] | None = None,
                          ) -> dict[str, Any]: ...

    def commit_active_map(self, path: Path, map_hash: str) -> None: ...

    def record_remap_metric(self, outcome: str, seconds: float | None) -> None: ...

    # the in-place deploy

    def engine_map_path(self, path: Path) -> str: ...  # ``path`` as the engine sees it (a container's mount)

    def engine_alive_probe(self) -> Callable[[], bool]: ...  # thread-safe: the engine serving now still runs

    def applied_in_place(self, path: Path, emap: ExpertMap) -> None: ...  # the hook swapped the engine onto emap

    def record_apply_request(self, answer: ApplyAnswer) -> None: ...

    def record_apply_outcome(self, outcome: str) -> None: ...


def run_count_boot(workloads: Sequence[Path], out: Path, *, cfg: Config, port: int, label: str,
                   engine_log: Path, pid_file: Path) -> tuple[CountsArtifact, dict[str, Any]]:
    """The count boot of a remap: the serving engine's ``[engine]`` table, eager (counts do not depend on compiled
    graphs, and an eager boot is about twice as fast on CPU), on its own port, with ``remap.count_boot_env`` over
    its environment (its own CPU cores on the CPU lane). Blocking: run it in a thread."""
    from pinsidecar.runs.count_boot import run_profile

    engine = dataclasses.replace(cfg.engine, enforce_eager=True, env={**cfg.engine.env, **cfg.remap.count_boot_env})
    res = run_profile(None, list(workloads), out, concurrency=cfg.remap.count_boot_concurrency, port=port,
                      label=label, engine=engine, progress=False, engine_log=engine_log, pid_file=pid_file)
    return res.counts, res.summary()


@dataclass
class RemapTools:
    """The pipeline's blocking actions, injectable so the state machine can be tested without engines:
    ``count_boot`` (see :func:`run_count_boot`), ``parity`` (greedy outputs of an engine), ``cold_probe``
    (a poller of the live cold rate under a map) and ``apply`` (the hook's apply request,
    :func:`~pinsidecar.remap.apply.request_apply`)."""

    count_boot: Callable[..., tuple[CountsArtifact, dict[str, Any]]] = run_count_boot
    parity: Callable[[str, str, Sequence[WorkloadRequest]], list[PromptOutput]] = parity_outputs
    cold_probe: Callable[[Path, str], Any] = ColdRateProbe
    apply: ApplyClient = request_apply


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:500]


def _map_ref(path: Path | None, emap: ExpertMap | None) -> dict[str, Any] | None:
    if emap is None:
        return None
    return {"path": str(path) if path else None, "hash": emap.content_hash, "label": emap.label}


@dataclass
class _Run:
    """What one remap carries between its steps."""

    record: RemapRecord
    active_path: Path | None
    active: ExpertMap
    map_path: Path | None = None  # a candidate named by the operator
    choice: WorkloadChoice | None = None
    cut_at: float | None = None  # monotonic time the captured traffic was cut (capture source)
    candidate_path: Path | None = None
    candidate: ExpertMap | None = None
    candidate_counts: CountsArtifact | None = None
    decision: Decision | None = None
    source: str = ""  # where the candidate came from: "named", "library", "count_boot" or "live"
    parity_ref: list[PromptOutput] | None = None
    notes: list[str] = field(default_factory=list)


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
        self._pause_at = {s.strip() for s in os.environ.get(PAUSE_ENV, "").split(",") if s.strip()}

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

    # ------------------------------------------------------------------------------------------------ entry
    def _resolve(self, ref: str) -> Path:
        try:
            return self.host.resolve_map(ref)
        except ControlError:
            by_label = find_by_label(self.host.library_entries(), ref)
            if by_label is None:
                raise
            return by_label

    async def request(self, *, trigger: str, dry_run: bool = False, map_ref: str | None = None, reason: str = "",
                      detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start a remap (see :meth:`~pinsidecar.daemon.service.Daemon.request_remap` for the contract)."""
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
        map_path = self._resolve(map_ref) if map_ref else None
        if dry_run:
            return await self._dry_run(trigger, map_path, watch, active)
        running = self.current
        if running is not None:
            raise ControlError(409, f"remap {running.id} (state {running.state}, trigger {running.trigger}) is "
                               "already running; wait for it to end (pinsidecar status)",
                               {"running": running.summary()})
        if host.drain_busy:
            raise ControlError(409, "a drain-reboot is running; try again when it has ended")
        if trigger != "drift":  # the detector checked its own trip against the same cooldown and cap
            why = admission.blocked(watch.detector)
            if why is not None:
                raise ControlError(429, f"remap refused: {why}")
            admission.note_started(watch.detector)
        rec = RemapRecord.new(trigger, reason=reason, detail={**(detail or {}),
                                                               **({"map": str(map_path)} if map_path else {})},
                              previous_map=_map_ref(active_path, active),
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
        run = _Run(rec, active_path, active, map_path=map_path)
        self.task = asyncio.create_task(self._run(run), name=f"remap-{rec.id}")
        return {"accepted": True, "remap_id": rec.id, "trigger": trigger, "dry_run": False, "state": rec.state,
                "reason": f"remap {rec.id} started ({'candidate ' + str(map_path) if map_path else rec.state}); "
                          "follow it with pinsidecar status", "decision": None}

    async def _dry_run(self, trigger: str, map_path: Path | None, watch: DriftWatch,
                       active: ExpertMap) -> dict[str, Any]:
        """The decision a remap would reach now, from the live windows (or ``map_path``); changes nothing."""
        margin = self.host.cfg.drift.margin
        out = {"accepted": True, "remap_id": None, "trigger": trigger, "dry_run": True, "state": "dry_run"}
        held = watch.held_out_window()
        if held is None:
            self.host.record_remap_metric("dry_run", None)
            return {**out, "accepted": False, "decision": None,
                    "reason": "nothing to judge yet: the drift watch has no judged window (it needs "
                              f"drift.min_tokens = {watch.config.min_tokens} routed tokens of traffic)"}
        if map_path is not None:
            cand = load_map(map_path)
            d = decide(cand, active, watch.held_out_window(exclude=cand.source_counts) or held, margin,
                       source="named", allow_geometry_change=True)
        else:
            d = pick_from_library([m for _, m in library_maps(self.host.library_entries())], active, held, margin)
            if not d.deploy:
                try:
                    choice = live_build_windows(watch, held, max_windows=self.host.cfg.remap.live_windows,
                                                min_tokens=self.host.cfg.remap.min_count_tokens)
                    cand = build_candidate(choice.windows, active, label="dry-run")
                    d = decide(cand, active, held, margin)
                except NotEnoughTraffic as exc:
                    d = dataclasses.replace(d, reason=f"{d.reason}; no candidate from the live windows: {exc}")
        self.host.record_remap_metric("dry_run", None)
        log.info("remap_dry_run", trigger=trigger, deploy=d.deploy, reason=d.reason)
        return {**out, "reason": d.reason, "decision": d.as_dict()}

    # ------------------------------------------------------------------------------------------------ states
    async def _enter(self, run: _Run, state: str, detail: dict[str, Any] | None = None) -> None:
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
        if rec.state in self._pause_at:
            log.warning("remap_test_pause", remap=rec.id, state=rec.state, env=PAUSE_ENV)
            await asyncio.Event().wait()

    def _finish(self, run: _Run, state: str, reason: str, *, error: str | None = None,
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
        self.host.record_remap_metric(state, rec.seconds)

    async def _run(self, run: _Run) -> None:
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

    async def _cancelled(self, run: _Run) -> None:
        """The daemon is stopping: stop a count engine of ours, close the record as a restart would."""
        rec = run.record
        if rec.state == "count_boot":
            await asyncio.to_thread(stop_recorded_engine, self.count_pid_file)
        if rec.state == "applying":  # the engine is stopped next; its successor must not find the request
            withdraw_apply_request(self.host.stats_path)
        if not rec.terminal:
            close_record(rec, active_map_hash(self.host.active_map_file), "daemon stopped")
            self._save(rec)
            watch = self.host.watch
            if watch is not None:
                watch.remap_finished(False)
            log.warning("remap_cancelled", remap=rec.id, now=rec.state)

    async def _unexpected(self, run: _Run, exc: Exception) -> None:
        rec = run.record
        if rec.terminal:
            return
        msg = f"{type(exc).__name__}: {_first_line(exc)}"
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
                msg += f"; the rollback failed too: {_first_line(exc2)}"
        self._finish(run, "rolled_back", msg, error=msg)

    async def _steps(self, run: _Run) -> None:
        if run.map_path is None:
            await self._choose_and_build(run)
        else:
            run.candidate_path = run.map_path
            try:
                run.candidate = load_map(run.map_path)
            except (ArtifactError, OSError) as exc:
                raise Aborted(f"map {run.map_path}: {_first_line(exc)}") from None
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
    async def _choose_and_build(self, run: _Run) -> None:
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
                raise Aborted(_first_line(exc)) from None
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
            raise Aborted(f"building the candidate failed: {_first_line(exc)}; the old map keeps serving") from None
        await self._enter(run, "evaluating", {"path": str(run.candidate_path), "hash": run.candidate.content_hash,
                                              "label": label, "tokens": counts.tokens,
                                              "in_sample_cold_rate": run.candidate.predicted_cold_rate})

    async def _count_boot(self, run: _Run, label: str) -> tuple[CountsArtifact, dict[str, Any]]:
        host, rcfg, rec = self.host, self.host.cfg.remap, run.record
        assert run.choice is not None
        port = rcfg.count_port(host.cfg.engine.port)
        out = self.store.file(rec.id, ".counts.json")
        t0 = time.monotonic()
        try:
            counts, summary = await asyncio.to_thread(
                self.tools.count_boot, run.choice.files, out, cfg=host.cfg, port=port, label=label,
                engine_log=self.store.file(rec.id, ".count-engine.log"), pid_file=self.count_pid_file)
        except Exception as exc:
            raise Aborted(f"count boot failed (the old map keeps serving): {_first_line(exc)}") from None
        if counts.tokens < rcfg.min_count_tokens:
            raise Aborted(f"count boot yielded {counts.tokens} routed tokens, fewer than remap.min_count_tokens = "
                          f"{rcfg.min_count_tokens} (the old map keeps serving)")
        return counts, {"port": port, "seconds": round(time.monotonic() - t0, 3), "tokens": counts.tokens,
                        "selections": counts.selections,
                        **{k: summary.get(k) for k in ("requests", "boot_s", "exact", "label")}}

    # d. evaluate
    async def _held_out(self, run: _Run) -> tuple[Window | None, dict[str, Any]]:
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

    async def _evaluate(self, run: _Run) -> bool:
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

    # e. deploy: in place first, the drain-reboot as the fallback
    async def _deploy(self, run: _Run) -> None:
        rec, rcfg = run.record, self.host.cfg.remap
        assert run.decision is not None
        evaluated: dict[str, Any] = {"decision": run.decision.reason, "gain": run.decision.gain}
        plan, why_not = self._plan_in_place(run)
        if plan is None:
            if rcfg.in_place:  # wanted, and not possible: say why, in the record and the metrics
                rec.apply = {"in_place": False, "outcome": "fell_back_reboot", "reason": why_not, "requests": []}
                self.host.record_apply_outcome("fell_back_reboot")
                log.info("remap_not_in_place", remap=rec.id, reason=why_not)
                evaluated["in_place"] = why_not
            await self._enter(run, "rebooting", evaluated)
            await self._reboot_and_verify(run)
            return
        await self._enter(run, "applying", evaluated)
        fallback = await self._apply_and_verify(run, plan)
        if fallback is None:
            return
        await self._enter(run, "rebooting", {"in_place": fallback, "apply": rec.apply})
        await self._reboot_and_verify(run)

    def _plan_in_place(self, run: _Run) -> tuple[SwapPlan | None, str]:
        """The swap plan from the served map to the candidate, or why the candidate cannot be applied in place."""
        host, cand = self.host, run.candidate
        assert cand is not None
        if not host.cfg.remap.in_place:
            return None, "remap.in_place is false"
        if host.stats_path is None:
            return None, "cannot apply in place: the engine writes no live stats file (the hook answers there); " \
                         "rebooting"
        _, served = host.served_map
        try:
            return plan_swap(served or run.active, cand), ""
        except SwapPlanError as exc:
            return None, f"cannot apply in place: {_first_line(exc)}; rebooting"

    async def _apply(self, run: _Run, path: Path, emap: ExpertMap, purpose: str) -> ApplyAnswer:
        """One apply request, answered or not; never raises. A request that got no answer is withdrawn."""
        host, stats = self.host, self.host.stats_path
        assert stats is not None
        alive = host.engine_alive_probe()
        boot_before = stats_boot_id(stats)
        at = utc_stamp()
        t0 = time.monotonic()
        log.info("remap_apply_request", remap=run.record.id, purpose=purpose, map=str(path), hash=emap.content_hash)
        try:
            result, snap = await asyncio.to_thread(self.tools.apply, stats, host.engine_map_path(path),
                                                   emap.content_hash, timeout_s=host.cfg.remap.apply_timeout_s,
                                                   alive=alive)
        except Exception as exc:  # HookRequestError (no answer in time, or the engine exited), or an unreadable one
            withdraw_apply_request(stats)
            result_name = "engine_died" if not alive() else "timeout" if isinstance(exc, HookRequestError) \
                else "failed"
            answer = ApplyAnswer(result_name, _first_line(exc), purpose=purpose, map_hash=emap.content_hash,
                                 wait_s=round(time.monotonic() - t0, 3))
        else:
            answer = classify_answer(result, snap, map_hash=emap.content_hash, boot_before=boot_before,
                                     purpose=purpose, wait_s=time.monotonic() - t0)
        answer.at = at
        log.info("remap_apply_answer", remap=run.record.id, **answer.as_dict())
        host.record_apply_request(answer)
        assert run.record.apply is not None
        run.record.apply.setdefault("requests", []).append(answer.as_dict())
        self._save(run.record)
        return answer

    async def _apply_and_verify(self, run: _Run, plan: SwapPlan) -> str | None:
        """Apply the candidate in place, check parity on the same engine, verify, commit or roll back. Returns
        None once the remap has ended, or why the drain-reboot must deploy the candidate instead."""
        host, rcfg, rec = self.host, self.host.cfg.remap, run.record
        assert run.candidate is not None and run.candidate_path is not None
        rec.apply = {"in_place": True, "plan": {k: v for k, v in plan.as_dict().items() if k != "rows_per_layer"},
                     "requests": [], "outcome": None}
        self._save(rec)
        try:
            prompts = load_parity_prompts(rcfg.parity_prompts_path)
        except ValueError as exc:
            raise Aborted(f"parity prompts: {_first_line(exc)}") from None
        parity: dict[str, Any] = {"prompts": len(prompts), "prompts_file": str(rcfg.parity_prompts_path)}
        url = host.engine_url
        if url is None:
            raise Aborted("no engine serving to record the parity fixture from; nothing was applied")
        try:
            run.parity_ref = await asyncio.to_thread(self.tools.parity, url, host.model_name, prompts)
        except Exception as exc:
            raise Aborted(f"recording the parity fixture on the serving engine failed: {_first_line(exc)}; "
                          "nothing was applied") from None
        ref = ParityRef(model=host.model_name, mode="pin", prompts_file=str(rcfg.parity_prompts_path),
                        prompts_digest=prompts_digest(prompts), outputs=run.parity_ref,
                        map_hash=run.active.content_hash, map_label=run.active.label)
        await asyncio.to_thread(ref.save, self.store.file(rec.id, ".parity.json"))

        answer = await self._apply(run, run.candidate_path, run.candidate, "candidate")
        if answer.result == "engine_died":
            self._engine_died(run, answer)
            return None
        if not answer.applied:
            why = {"refused": "the hook refused the apply", "failed": "the apply failed (the hook swapped back)",
                   "timeout": f"the hook did not answer within remap.apply_timeout_s = {rcfg.apply_timeout_s:g} s"}
            reason = f"{why.get(answer.result, answer.result)}: {answer.reason}; deploying by a drain-reboot instead"
            rec.apply.update(outcome="fell_back_reboot", reason=reason)
            host.record_apply_outcome("fell_back_reboot")
            log.warning("remap_apply_fell_back", remap=rec.id, result=answer.result, reason=answer.reason)
            return reason
        host.applied_in_place(run.candidate_path, run.candidate)

        # parity on the same engine, token for token
        got: list[PromptOutput] | None = None
        try:
            got = await asyncio.to_thread(self.tools.parity, url, host.model_name, prompts)
        except Exception as exc:
            parity["error"] = _first_line(exc)
        if got is None:
            ok, why_parity = False, f"the engine did not answer the parity prompts ({parity.get('error')})"
            parity["ok"] = False
        else:
            ok, why_parity, figures = token_parity(run.parity_ref, got)
            parity.update(ok=ok, **figures)
        rec.verify = {"ready": True, "in_place": True, "parity": parity, "apply": answer.as_dict()}
        if not ok:
            await self._roll_back_in_place(run, f"parity after the apply: {why_parity}")
            return None

        await self._enter(run, "verifying", {"apply": answer.as_dict(), "parity": parity})
        ok, why, figures = await self._verify_cold_rate(run)
        rec.verify["cold_rate"] = {**figures, "reason": why}
        if ok:
            host.commit_active_map(run.candidate_path, run.candidate.content_hash)
            rec.apply["outcome"] = "applied"
            host.record_apply_outcome("applied")
            self._finish(run, "committed", why, detail={"cold_rate": figures, "in_place": True})
            return None
        log.warning("remap_verify_failed", remap=rec.id, reason=why)
        await self._roll_back_in_place(run, f"verification failed: {why}")
        return None

    def _committed_label(self, run: _Run) -> str:
        return run.active.label or run.active.short_hash

    def _engine_died(self, run: _Run, answer: ApplyAnswer) -> None:
        """The engine died (or restarted) mid-apply: the supervisor restarts it with the committed map, which the
        apply never changed; the remap ends here and never reboots with the candidate."""
        assert run.record.apply is not None
        reason = f"the engine died mid-apply; it restarts with the committed map {self._committed_label(run)}"
        run.record.apply.update(outcome="engine_died", reason=f"{reason} ({answer.reason})")
        self.host.record_apply_outcome("engine_died")
        log.error("remap_engine_died_mid_apply", remap=run.record.id, detail=answer.reason)
        self._finish(run, "rolled_back", reason, error=f"{reason} ({answer.reason})",
                     detail={"apply": answer.as_dict()})

    async def _roll_back_in_place(self, run: _Run, why: str) -> None:
        """Bring the old map back after an in-place apply: in place again (the cheap way), else by a reboot."""
        host, rec = self.host, run.record
        assert rec.apply is not None
        _, served = host.served_map
        detail: dict[str, Any] = {}
        if served is None or served.content_hash == run.active.content_hash:
            tail = f"the engine serves the committed map {self._committed_label(run)} again (it restarted with it)"
        elif run.active_path is None:
            tail = "the old map has no file to go back to; see pinsidecar status"
        else:
            back = await self._apply(run, run.active_path, run.active, "rollback")
            detail["rollback_apply"] = back.as_dict()
            if back.applied:
                host.applied_in_place(run.active_path, run.active)
                tail = "rolled back in place: the old map serves"
            elif back.result == "engine_died":
                tail = (f"the engine died during the rollback apply; it restarts with the committed map "
                        f"{self._committed_label(run)}")
            else:
                log.warning("remap_rollback_apply_failed", remap=rec.id, result=back.result, reason=back.reason)
                rb = await host.reboot_with(run.active_path, reason="rollback")
                detail["rollback_reboot"] = {k: rb.get(k) for k in ("ok", "seconds", "boot_s", "error")}
                tail = (f"the rollback apply {back.result} ({back.reason}), so the old map was rebooted: "
                        + ("it serves" if rb.get("ok") else f"the reboot failed too ({rb.get('error')}); see "
                           "pinsidecar status"))
        rec.apply["outcome"] = "rolled_back"
        host.record_apply_outcome("rolled_back")
        if rec.verify is not None:
            rec.verify["rollback"] = detail
        self._finish(run, "rolled_back", f"{why}; {tail}", error=why, detail=detail)

    # e-g. reboot, verify, commit or roll back
    async def _reboot_and_verify(self, run: _Run) -> None:
        host, rcfg, rec = self.host, self.host.cfg.remap, run.record
        assert run.candidate is not None and run.candidate_path is not None and run.decision is not None
        try:
            prompts = load_parity_prompts(rcfg.parity_prompts_path)
        except ValueError as exc:
            raise Aborted(f"parity prompts: {_first_line(exc)}") from None
        parity: dict[str, Any] = {"prompts": len(prompts), "prompts_file": str(rcfg.parity_prompts_path)}

        async def before_stop(result: dict[str, Any]) -> str | None:
            url = host.engine_url
            if url is None:
                return "no engine serving to record the parity fixture from"
            try:
                run.parity_ref = await asyncio.to_thread(self.tools.parity, url, host.model_name, prompts)
            except Exception as exc:
                return f"recording the parity fixture on the serving engine failed: {_first_line(exc)}"
            ref = ParityRef(model=host.model_name, mode="pin", prompts_file=str(rcfg.parity_prompts_path),
                            prompts_digest=prompts_digest(prompts), outputs=run.parity_ref,
                            map_hash=run.active.content_hash, map_label=run.active.label)
            await asyncio.to_thread(ref.save, self.store.file(rec.id, ".parity.json"))
            return None

        async def after_boot(result: dict[str, Any]) -> str | None:
            url = host.engine_url
            assert run.parity_ref is not None
            try:
                got = await asyncio.to_thread(self.tools.parity, url, host.model_name, prompts) if url else None
            except Exception as exc:
                got, parity["error"] = None, _first_line(exc)
            if got is None:
                parity["ok"] = False
                return f"parity: the new engine did not answer the parity prompts ({parity.get('error', 'no URL')})"
            report = compare(ParityRef(host.model_name, "pin", "", "", run.parity_ref), got)
            parity.update(ok=report.ok, tokens=report.tokens, differing_prompts=len(report.diffs))
            if not report.ok:
                parity["first_diff"] = report.diffs[0].describe()
                return f"parity: {report.diffs[0].describe()}"
            return None

        result = await host.reboot_with(run.candidate_path, reason="remap", before_stop=before_stop,
                                        after_boot=after_boot)
        reboot = {k: result.get(k) for k in ("ok", "seconds", "drain_s", "boot_s", "hold_s", "hash_hit",
                                             "cache_miss", "in_flight_cut", "held_at_release", "rolled_back",
                                             "error", "skipped")}
        rec.verify = {"ready": bool(result.get("ok")), "parity": parity, "reboot": reboot}
        if not result.get("ok"):
            error = result.get("error") or "the reboot failed"
            if result.get("skipped"):
                self._finish(run, "aborted", f"{error} (nothing was rebooted; the old map serves)", error=error,
                             detail={"reboot": reboot})
            else:
                rb = "rolled back: the old map serves" if result.get("rolled_back") else \
                    f"the rollback failed too ({result.get('rollback_error')})"
                self._finish(run, "rolled_back", f"{error}; {rb}", error=error, detail={"reboot": reboot})
            return
        await self._enter(run, "verifying", {"reboot": reboot, "parity": parity})
        ok, why, figures = await self._verify_cold_rate(run)
        rec.verify["cold_rate"] = {**figures, "reason": why}
        if ok:
            host.commit_active_map(run.candidate_path, run.candidate.content_hash)
            self._finish(run, "committed", why, detail={"cold_rate": figures})
            return
        log.warning("remap_verify_failed", remap=rec.id, reason=why)
        back = await host.reboot_with(run.active_path, reason="rollback") if run.active_path else {"ok": False}
        rolled = {k: back.get(k) for k in ("ok", "seconds", "boot_s", "error")}
        rec.verify["rollback"] = rolled
        tail = "rolled back: the old map serves" if back.get("ok") else \
            f"the rollback reboot failed ({back.get('error')}); see pinsidecar status"
        self._finish(run, "rolled_back", f"verification failed: {why}; {tail}", error=why, detail={"rollback": rolled})

    async def _verify_cold_rate(self, run: _Run) -> tuple[bool, str, dict[str, Any]]:
        host, rcfg = self.host, self.host.cfg.remap
        assert run.candidate is not None and run.decision is not None
        predicted = run.decision.candidate_cold_rate
        if host.stats_path is None:
            return cold_rate_verdict(_no_stats(), predicted, tokens_needed=rcfg.verify_tokens,
                                     tolerance=rcfg.verify_tolerance, requires_traffic=rcfg.verify_requires_traffic)
        probe = self.tools.cold_probe(host.stats_path, run.candidate.content_hash)
        deadline = time.monotonic() + rcfg.verify_timeout_s
        t0 = time.monotonic()
        while True:
            result = probe.poll()
            if getattr(probe, "restarted", False):
                return False, "the engine restarted while the new map was being verified", {"tokens": result.tokens}
            _, served = host.served_map
            if served is not None and served.content_hash != run.candidate.content_hash:
                # a restart boots the committed map, not one applied in place: the candidate no longer serves
                return False, (f"the engine restarted while the new map was being verified and serves "
                               f"{served.label or served.short_hash}"), {"tokens": result.tokens}
            if result.tokens >= rcfg.verify_tokens or time.monotonic() >= deadline:
                break
            await asyncio.sleep(WAIT_STEP_S)
        ok, why, figures = cold_rate_verdict(result, predicted, tokens_needed=rcfg.verify_tokens,
                                             tolerance=rcfg.verify_tolerance,
                                             requires_traffic=rcfg.verify_requires_traffic)
        figures["wait_s"] = round(time.monotonic() - t0, 3)
        return ok, why, figures


def _no_stats() -> Any:
    from pinsidecar.remap.verify import ColdRateResult

    return ColdRateResult(0, 0, 0)
