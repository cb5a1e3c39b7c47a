"""The "heal" scenario: one real ``pinsidecar run`` daemon under streaming load through a traffic shift, an
automatic in-place remap, an operator's drain-reboot onto another geometry and a SIGKILLed engine, with what the
clients saw second by second.

Shared by ``bench/heal_scenario.py`` (the figures: CPU short form, or the full form on a GPU engine) and
``tests/test_heal_scenario.py`` (what must hold), so both run the same thing the same way. The daemon is
:class:`~bench.scenario.remap_lane.RemapLane`'s (the demo's config, the live remap source) with automatic
remaps on and a cooldown longer than the run (so exactly one automatic remap happens), plus whatever engine keys a
GPU lane gives; the clients are :func:`~pinsidecar.testing.streaming.load_during`'s, whose prompts switch from
the demo's code prompts to its prose ones mid-run. The stages (:data:`STAGES`), back to back:

1. ``boot``: the daemon starts in pin mode with the code map; its engine serves;
2. ``code``: code traffic until ``code_windows`` judged drift windows closed (no remap may start: a false trip);
3. ``shift``: every client switches to prose; the drift watch trips by itself;
4. ``remap``: the automatic remap, followed state by state to its end (it must apply in place and commit);
5. ``prose``: prose under the new map for ``prose_s``;
6. ``reboot``: ``POST /drain-reboot`` onto ``prose-<other hot rows>``, another geometry (the gate holds requests);
7. ``kill``: the engine's process group is SIGKILLed; the supervisor restarts it; ``settle_s`` of serving after;
8. ``end``: the clients are served twice more and stop; the daemon stops (nothing left running).

A sampler thread takes one sample a second (:mod:`~bench.scenario.sampler`). The document
(:meth:`HealScenario.document`) holds the stages, the requests per stage, the remap's states and apply, the
drain-reboot's answer, the kill, the recovery after the shift, the cold rates before and after, every window and
every sample (the figures: :mod:`~bench.scenario.figures`);
:func:`~bench.scenario.plot.draw_timeline` draws it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bench.scenario.figures import (
    apply_request_gaps,
    cold_rates,
    gaps_in,
    kill_figures,
    long_gaps,
    per_stage,
    recovery,
    states,
)
from bench.scenario.jit_cache import compiles_since, per_kernel
from bench.scenario.remap_lane import EVENT_LIMIT_S, OTHER_HOT_ROWS, LaneMap, RemapLane, domain_prompts
from bench.scenario.sampler import Sampler
from pinsidecar.demo.sidecar import SERVED_MODEL_NAME
from pinsidecar.demo.timeline import Timeline
from pinsidecar.testing.streaming import ClientStats, Request, load_during

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

STAGES = ("boot", "code", "shift", "remap", "prose", "reboot", "kill", "end")
# How long the automatic remap may take from its trip to its end (a live remap: no count boot; verify ~ a window).
REMAP_END_LIMIT_S = 600.0


@dataclass(frozen=True)
class ScenarioOptions:
    """How long each stage runs and how the daemon is set up. :data:`SHORT` is the CPU/CI form, :data:`FULL`
    the GPU form; ``engine`` (``[engine]`` keys over the demo's) and ``nvml`` are the GPU lane's."""

    clients: int = 4
    code_windows: int = 3  # judged drift windows of code before the shift (the pre-shift rate is taken there)
    prose_s: float = 60.0  # prose under the new map
    settle_s: float = 30.0  # serving after the drain-reboot and after the restart that follows the kill
    max_tokens: int = 32  # per request (ignore_eos: every request streams this many tokens)
    window_tokens: int = 512  # drift windows; min_tokens, remap.min_count_tokens and verify_tokens follow it
    rolling_s: int = 5  # the rolling median's width (samples, one a second) for the recovery figure
    baseline_s: int = 10  # the pre-shift rate: the median tok/s over the code stage's last this many seconds
    other_hot_rows: int = OTHER_HOT_ROWS  # the drain-reboot's geometry: maps["prose-<this>"]
    engine: dict[str, Any] = field(default_factory=dict)
    nvml: bool = False
    limit_s: float = EVENT_LIMIT_S  # bound of each wait (boots on a loaded box can take minutes)
    apply_ordering: str = "host"  # [remap.advanced] apply_ordering: how the hook orders the apply's batches
    jit_cache_dir: str = ""  # the engine's own TRITON_CACHE_DIR, so the document lists what it compiled when


SHORT = ScenarioOptions(clients=2, code_windows=2, prose_s=8.0, settle_s=5.0, rolling_s=3, baseline_s=6)
FULL = ScenarioOptions(clients=16, code_windows=4, prose_s=60.0, settle_s=30.0, window_tokens=4096,
                       baseline_s=30)


def scenario_overrides(opts: ScenarioOptions) -> dict[str, dict[str, Any]]:
    """The daemon config's changes for the scenario, over :class:`RemapLane`'s: automatic remaps from the live
    source, deployed in place, one of them only (the cooldown outlasts the run), the GPU lane's engine keys."""
    half = max(1, opts.window_tokens // 2)
    out: dict[str, dict[str, Any]] = {
        "drift": {"auto_remap": True, "cooldown_s": 3600, "window_tokens": opts.window_tokens, "min_tokens": half,
                  "consecutive_windows": 2},
        "remap": {"source": "live", "in_place": True, "min_count_tokens": half,
                  "verify_tokens": opts.window_tokens, "advanced": {"apply_ordering": opts.apply_ordering}},
        "metrics": {"nvml": opts.nvml},
    }
    engine = dict(opts.engine)
    if opts.jit_cache_dir:
        engine["env"] = {**(engine.get("env") or {}), "TRITON_CACHE_DIR": opts.jit_cache_dir}
    if engine:
        out["engine"] = engine
    return out


class SwitchablePrompts(Sequence[str]):
    """The clients' prompts, switched from one traffic class to another while they stream (the clients index it
    afresh for every request). Indexing wraps, so a switch to a shorter list between a client's ``len`` and its
    index cannot raise."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self._items = domain_prompts(domain)

    def switch(self, domain: str) -> None:
        self.domain, self._items = domain, domain_prompts(domain)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        items = self._items
        return items[i % len(items)] if isinstance(i, int) else items[i]


class HealScenario:
    """One run of the scenario on one daemon (see the module docstring): :meth:`run`, then :meth:`document`."""

    def __init__(self, work: Path, model_dir: Path, maps: dict[str, LaneMap], opts: ScenarioOptions) -> None:
        other = f"prose-{opts.other_hot_rows}"
        missing = [m for m in ("code", "prose", other) if m not in maps]
        if missing:
            raise ValueError(f"the scenario needs maps {missing} (have {sorted(maps)})")
        self.opts, self.maps, self.other = opts, maps, maps[other]
        self.lane = RemapLane(work, model_dir, maps["code"].path, overrides=scenario_overrides(opts))
        self.timeline = Timeline()
        self.clients = [ClientStats() for _ in range(opts.clients)]
        self.prompts = SwitchablePrompts("code")
        self.sampler: Sampler | None = None
        self.stage = ""
        self._stage_start = 0.0
        self._spans: dict[str, tuple[float, float]] = {}
        self.facts: dict[str, Any] = {}
        self.error: str | None = None
        # Called with each stage as it begins: the command line writes the document so far, so a run cut short (a
        # device call's deadline) still leaves its samples and the stages it finished.
        self.on_stage: Callable[[str], None] | None = None
        self.daemon_stop: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ stages
    def enter(self, stage: str) -> None:
        """End the current stage and begin ``stage`` at the same instant: the stages tile the run."""
        now = self.timeline.now()
        if self.stage:
            self.timeline.add(self.stage, self.stage, self._stage_start, now - self._stage_start)
            self._spans[self.stage] = (self._stage_start, now)  # unrounded: requests are counted by these
        self.stage, self._stage_start = stage, now
        if stage:
            log.info("heal_stage", stage=stage, t=round(now, 1))
        if self.on_stage is not None:
            self.on_stage(stage)

    def _wall_span(self, stage: str) -> tuple[float, float] | None:
        """A finished stage's wall-clock span (None: it did not run)."""
        span = self._spans.get(stage)
        return None if span is None else (self.timeline.wall0 + span[0], self.timeline.wall0 + span[1])

    def run(self) -> None:
        """All stages; the daemon is stopped and the sampler ended whatever happens (an error is kept in the
        document and raised)."""
        try:
            self.enter("boot")
            self.sampler = Sampler(self.lane, self.clients, lambda: self.stage, self.timeline.wall0)
            self.sampler.start()
            st = self.lane.start()
            self.facts["boot"] = {"engine_pid": st["engine"]["pid"], "map_hash": st["engine"]["map"]["hash"],
                                  "last_boot": st["engine"].get("last_boot")}
            self.enter("code")
            result = asyncio.run(load_during(self.lane.gate_url, SERVED_MODEL_NAME, self._stages,
                                             clients=self.opts.clients, max_tokens=self.opts.max_tokens,
                                             limit_s=self.opts.limit_s, prompts=self.prompts, stats=self.clients))
            self.facts["load"] = result.figure()
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                self.daemon_stop = self.lane.stop()
            finally:
                if self.sampler is not None:
                    self.sampler.stop_event.set()
                    self.sampler.join(10)
                self.enter("")  # closes the last stage

    async def _stages(self) -> None:
        lane, opts = self.lane, self.opts
        await asyncio.to_thread(lane.wait_for_windows, opts.code_windows)
        st = await asyncio.to_thread(lane.status)  # never a blocking call on the clients' event loop
        if self.sampler is not None:
            self.sampler.note_window(st, time.time(), self.stage)
        if (st.get("remap") or {}).get("current") or (st.get("remap") or {}).get("last"):
            raise AssertionError(f"a remap started on stationary code traffic (a false trip): {st['remap']}")
        self.enter("shift")
        self.facts["shift_t"] = self.timeline.now()
        self.prompts.switch("prose")
        st = await asyncio.to_thread(lane.wait, "the drift watch to trip on prose",
                                     lambda s: bool((s.get("remap") or {}).get("current")
                                                    or (s.get("remap") or {}).get("last")), opts.limit_s)
        if self.sampler is not None:  # the window that tripped is the shift's, however late the sampler reads it
            self.sampler.note_window(st, time.time(), self.stage)
        rec = st["remap"]["current"] or st["remap"]["last"]
        self.enter("remap")
        self.facts["remap_observed"] = observed = [rec["state"]]
        record = await asyncio.to_thread(self._follow_remap, rec["id"], observed)
        self.facts["remap"] = record
        if record.get("outcome") != "committed":
            raise AssertionError(f"the automatic remap ended {record.get('outcome')}: "
                                 f"{record.get('outcome_reason') or record.get('error')}")
        self.enter("prose")
        await asyncio.sleep(opts.prose_s)
        self.enter("reboot")
        self.facts["reboot"] = await asyncio.to_thread(lane.drain_reboot, self.other.path)
        st = await asyncio.to_thread(lane.status)
        self.facts["after_reboot"] = {"map_hash": st["engine"]["map"]["hash"], "engine_pid": st["engine"]["pid"],
                                      "last_boot": st["engine"].get("last_boot"), "gate": st.get("gate")}
        await asyncio.sleep(opts.settle_s)
        self.enter("kill")
        await self._kill()
        await asyncio.sleep(opts.settle_s)
        self.enter("end")

    def _follow_remap(self, remap_id: str, observed: list[str]) -> dict[str, Any]:
        """Poll the status until remap ``remap_id`` ends, noting each state it was seen in; its record."""
        def ended(st: dict[str, Any]) -> bool:
            remap = st.get("remap") or {}
            cur, last = remap.get("current"), remap.get("last")
            if cur and cur.get("id") == remap_id and cur.get("state") != observed[-1]:
                observed.append(cur["state"])
            return bool(last and last.get("id") == remap_id and not cur)

        self.lane.wait(f"remap {remap_id} to end", ended, REMAP_END_LIMIT_S)
        return self.lane.record(remap_id)

    async def _kill(self) -> None:
        lane = self.lane
        before = await asyncio.to_thread(lane.status)
        pid = await asyncio.to_thread(lane.kill_engine)
        at = lane.killed_at or time.time()
        self.facts["kill"] = {"t": round(at - self.timeline.wall0, 2), "at": at, "pid": pid,
                              "gate_in_flight_before": (before.get("gate") or {}).get("in_flight")}
        st = await asyncio.to_thread(lane.wait, "the engine back after the kill",
                                     lambda s: s["engine"]["state"] == "ready" and s["engine"]["pid"] != pid,
                                     self.opts.limit_s)
        self.facts["kill"].update(new_pid=st["engine"]["pid"], last_boot=st["engine"].get("last_boot"),
                                  back_t=round(time.time() - self.timeline.wall0, 2),
                                  map_hash=st["engine"]["map"]["hash"])

    # ------------------------------------------------------------------------------------------------ figures
    def _requests(self) -> list[Request]:
        return [r for c in self.clients for r in c.requests]

    def document(self) -> dict[str, Any]:
        """The figures of the run (whatever part of it ran)."""
        stages = [{**s, "end_s": round(s["start_s"] + s["seconds"], 1)} for s in self.timeline.as_list()
                  if s["stage"]]
        samples = self.sampler.samples if self.sampler else []
        windows = self.sampler.windows if self.sampler else []
        reqs = self._requests()
        sent = len(reqs)
        completed = sum(r.outcome == "completed" for r in reqs)
        failed = sum(r.outcome == "failed" for r in reqs)
        by_stage = {s["stage"]: s for s in stages}
        rec = self.facts.get("remap") or {}
        req = ((rec.get("apply") or {}).get("requests") or [{}])[0]
        reboot = self.facts.get("reboot") or {}
        shift_t = self.facts.get("shift_t")
        prose_end = (by_stage.get("prose") or {}).get("end_s")
        compiles = compiles_since(Path(self.opts.jit_cache_dir), self.timeline.wall0) \
            if self.opts.jit_cache_dir else None
        doc: dict[str, Any] = {
            "figure": "heal_scenario",
            "ok": self.error is None,
            "shift_t": None if shift_t is None else round(shift_t, 2),
            "error": self.error,
            "options": {**asdict(self.opts)},
            "maps": {k: {"path": str(m.path), "hash": m.hash} for k, m in self.maps.items()},
            "stage_order": [s["stage"] for s in stages],
            "stages": stages,
            "requests": {"sent": sent, "completed": completed, "failed": failed, "lost": sent - completed - failed,
                         "per_stage": per_stage(stages, samples, self._requests(), self._spans, self.timeline.wall0),
                         "errors": [e for c in self.clients for e in c.errors][:10]},
            "boot": self.facts.get("boot"),
            "remap": {"id": rec.get("id"), "trigger": rec.get("trigger"), "outcome": rec.get("outcome"),
                      "outcome_reason": rec.get("outcome_reason"), "states": states(rec),
                      "observed_states": self.facts.get("remap_observed"),
                      "steps": rec.get("steps"), "candidate": rec.get("candidate"),
                      "trip": (rec.get("detail") or {}).get("signals"),
                      "apply": {"outcome": (rec.get("apply") or {}).get("outcome"), "result": req.get("result"),
                                "rows": req.get("rows"), "bytes_moved": req.get("bytes_moved"),
                                "seconds": req.get("seconds"), "wait_s": req.get("wait_s"),
                                "reason": (rec.get("apply") or {}).get("reason")},
                      "verify": {k: (rec.get("verify") or {}).get(k) for k in ("in_place", "cold_rate", "parity")},
                      "waits": [w for w in (*(gaps_in(rec, x, self.clients, self.timeline.wall0)
                                              for x in ("applying", "verifying")),
                                            apply_request_gaps(rec, self.clients, self.timeline.wall0,
                                                               self._wall_span("prose"))) if w]},
            "reboot": {"map": self.other.label, "map_hash": self.other.hash,
                       **{k: reboot.get(k) for k in ("ok", "seconds", "drain_s", "boot_s", "hold_s",
                                                     "held_at_release", "in_flight_cut", "hash_hit", "cache_miss",
                                                     "error")},
                       "initial_boot_s": ((self.facts.get("boot") or {}).get("last_boot") or {}).get("seconds"),
                       "after": self.facts.get("after_reboot"),
                       "note": "hash_hit: the daemon's word (false for another geometry: its compile caches key on "
                               "the hot tensor's shape); cache_miss: the supervisor's, from the engine log's "
                               "compile-cache lines, else boot seconds against the last boot of that geometry"},
            "gaps": long_gaps(self.clients, self.timeline.wall0, stages, compiles),
            "jit": None if compiles is None else {
                "cache_dir": self.opts.jit_cache_dir, "compiles": len(compiles), "per_kernel": per_kernel(compiles),
                "list": compiles[:400],
                "note": "Triton kernels the engine compiled during the run (its own TRITON_CACHE_DIR; t, t_end: "
                        "seconds from the run's start, first and last file written); gaps[].compiles names those "
                        "a wait overlapped"},
            "kill": kill_figures(self.facts.get("kill"), self._requests()),
            "recovery": recovery(samples, shift_t, prose_end, baseline_s=self.opts.baseline_s,
                                 rolling_s=self.opts.rolling_s) if shift_t is not None and prose_end else None,
            "cold_rate": cold_rates(windows, samples),
            "windows": windows,
            "samples": samples,
            "daemon_stop": self.daemon_stop,
            "host": {"cpus": os.cpu_count(), "load_avg_end": os.getloadavg()},
        }
        doc["checks"] = checks(doc)
        return doc


def checks(doc: dict[str, Any]) -> dict[str, bool]:
    """What must hold of a run, by name (the test asserts each; the bench prints them)."""
    rem, reb, kill, reqs = doc["remap"], doc["reboot"], doc["kill"], doc["requests"]
    return {
        "stages_in_order": doc["stage_order"] == list(STAGES),
        "remap_automatic": rem.get("trigger") == "drift",
        "remap_in_place": "applying" in rem["states"] and "rebooting" not in rem["states"]
        and rem["apply"]["result"] == "applied",
        "remap_committed": rem.get("outcome") == "committed",
        "reboot_deployed_other_geometry": bool(reb.get("ok")) and (reb.get("after") or {}).get("map_hash")
        == reb.get("map_hash"),
        "engine_restarted_after_kill": kill.get("new_pid") not in (None, kill.get("pid")),
        "none_lost": reqs["lost"] == 0,
        "failed_at_most_in_flight_at_kill": reqs["failed"] <= kill.get("in_flight_at_kill", 0),
        # a request sent after the kill reaches the dying engine at most unread: the gate holds and resends it
        "none_sent_after_kill_failed": kill.get("failed_sent_after_kill", 0) == 0,
        "samples": len(doc["samples"]) > 0,
    }
