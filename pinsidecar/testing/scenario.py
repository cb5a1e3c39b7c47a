"""The "heal" scenario: one real ``pinsidecar run`` daemon under streaming load through a traffic shift, an
automatic in-place remap, an operator's drain-reboot onto another geometry and a SIGKILLed engine, with what the
clients saw second by second.

Shared by ``bench/heal_scenario.py`` (the figures: CPU short form, or the full form on a GPU engine) and
``tests/test_heal_scenario.py`` (what must hold), so both run the same thing the same way. The daemon is
:class:`~pinsidecar.testing.remap_lane.RemapLane`'s (the demo's config, the live remap source) with automatic
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

A :class:`Sampler` thread takes one sample a second: the tokens the clients received in that second (decode
tok/s), the longest wait any stream saw in it (between two tokens, or for a response's first token: what a request
held by the gate sees; a wait still in progress counts), the gate's held and in-flight requests, the live cold
rate (the cold share of the selections since the hook's previous stats write, read from the stats file with a
:class:`~pinsidecar.live_stats.StatsReader` of its own: the hook writes every 5 s, so it is carried between writes)
and the drift watch's newest window. The document (:meth:`HealScenario.document`) holds the stages, the requests
per stage, the remap's states and apply, the drain-reboot's answer, the kill, the recovery after the shift, the
cold rates before and after, every window and every sample; :func:`draw_timeline` draws it.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pinsidecar.demo.loop import Timeline
from pinsidecar.demo.sidecar import SERVED_MODEL_NAME
from pinsidecar.live_stats import StatsReader
from pinsidecar.testing.remap_lane import EVENT_LIMIT_S, OTHER_HOT_ROWS, LaneMap, RemapLane, _epoch, domain_prompts
from pinsidecar.testing.streaming import ClientStats, LoadResult, Request, load_during

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

STAGES = ("boot", "code", "shift", "remap", "prose", "reboot", "kill", "end")
# The figure's band: decode tok/s is "back" once its rolling median is at least this share of the pre-shift rate.
RECOVERED_SHARE = 0.9
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
                  "verify_tokens": opts.window_tokens},
        "metrics": {"nvml": opts.nvml},
    }
    if opts.engine:
        out["engine"] = dict(opts.engine)
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


class Sampler(threading.Thread):
    """One sample a second (see the module docstring), in a thread of its own: the event loop runs the clients,
    and a wait for the daemon must not delay a sample. Reads the clients' records without a lock: the loop only
    appends to their lists and bumps their counters."""

    def __init__(self, lane: RemapLane, clients: list[ClientStats], stage: Callable[[], str],
                 clock0: float, period_s: float = 1.0) -> None:
        super().__init__(name="heal-sampler", daemon=True)
        self.lane, self.clients, self.stage, self.clock0, self.period_s = lane, clients, stage, clock0, period_s
        self.samples: list[dict[str, Any]] = []
        self.windows: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self._reader = StatsReader(lane.state_dir / "stats.json")
        self._gap_at = [0] * len(clients)
        self._live_cold: float | None = None
        self._window_index = -1
        self._lock = threading.Lock()  # the scenario's thread notes windows too

    def run(self) -> None:
        prev_t, prev_tokens = time.time(), 0
        tick = time.monotonic()
        while not self.stop_event.is_set():
            tick += self.period_s
            self.stop_event.wait(max(0.0, tick - time.monotonic()))
            now = time.time()
            tokens = sum(c.tokens for c in self.clients)
            try:
                self.samples.append(self._sample(now, prev_t, tokens - prev_tokens))
            except Exception as exc:  # a sample must never end the sampling: keep the gap, say why
                log.warning("heal_sample_failed", error=str(exc))
            prev_t, prev_tokens = now, tokens

    def _stall(self, since: float, now: float) -> float:
        """The longest wait any stream saw in (since, now]: gaps that ended in it, and waits still in progress."""
        longest = 0.0
        for n, c in enumerate(self.clients):
            gaps = c.gaps
            end = len(gaps)
            for g in gaps[self._gap_at[n]:end]:
                if g.end > since:
                    longest = max(longest, g.seconds)
            self._gap_at[n] = end
            reqs = c.requests
            if reqs and reqs[-1].ended is None and c.last_at:
                longest = max(longest, now - c.last_at)
        return longest

    def _sample(self, now: float, since: float, tokens: int) -> dict[str, Any]:
        dt = max(1e-6, now - since)
        st = self.lane.sidecar.status(timeout_s=0.9) if self.lane.sidecar is not None else None
        reading = self._reader.read()
        if reading is not None and not reading.first and sum(reading.delta_selections) > 0:
            self._live_cold = reading.window_cold_ratio
        sample: dict[str, Any] = {
            "t": round(now - self.clock0, 2), "stage": self.stage(), "tokens": tokens,
            "tok_s": round(tokens / dt, 2), "stall_s": round(self._stall(since, now), 3),
            "in_flight_clients": sum(1 for c in self.clients if c.requests and c.requests[-1].ended is None),
            "live_cold_rate": self._live_cold, "status": st is not None}
        if st is not None:
            gate = st.get("gate") or {}
            eng = st.get("engine") or {}
            drift = st.get("drift") or {}
            remap = (st.get("remap") or {}).get("current") or {}
            last = drift.get("last_window") or {}
            sample.update(gate_held=gate.get("held"), gate_in_flight=gate.get("in_flight"),
                          gate_holding=gate.get("holding"), engine_state=eng.get("state"), engine_pid=eng.get("pid"),
                          map_hash=(eng.get("map") or {}).get("hash"), remap_state=remap.get("state"),
                          drift_state=drift.get("state"),
                          window_cold_rate=(last.get("signals") or {}).get("cold_rate"))
            self.note_window(st, now, sample["stage"])
        return sample

    def note_window(self, st: dict[str, Any], now: float, stage: str) -> None:
        """Keep the drift watch's newest window of ``st`` when it is new. The scenario also calls this with the
        status it read at the end of a stage, so a window that closed just before a stage change is kept with the
        stage its traffic was in, not the next one's sample."""
        drift = st.get("drift") or {}
        last = drift.get("last_window") or {}
        with self._lock:
            if not last or int(last.get("index", -1)) <= self._window_index:
                return
            self._window_index = int(last["index"])
        sig = last.get("signals") or {}
        self.windows.append({"index": last["index"], "t": round(now - self.clock0, 2), "stage": stage,
                             "judged": last.get("judged"), "tokens": (last.get("window") or {}).get("tokens"),
                             "cold_rate": sig.get("cold_rate"), "predicted_cold_rate": sig.get("predicted_cold_rate"),
                             "projected_gain": sig.get("projected_gain"), "state": last.get("state"),
                             "trip": last.get("trip"), "active_map": drift.get("active_map")})


def recovery(samples: list[dict[str, Any]], shift_t: float, until_t: float, *, baseline_s: int, rolling_s: int,
             share: float = RECOVERED_SHARE) -> dict[str, Any]:
    """How long decode throughput took to come back after the shift.

    ``baseline_tok_s``: the median tok/s of the last ``baseline_s`` samples before ``shift_t``. ``rolling``: at
    each sample the median of it and the ``rolling_s - 1`` samples before it. The rate is *back* from the first
    sample after the last one in [shift_t, until_t] whose rolling median is below ``share`` x the baseline (it
    stays back from there to ``until_t``, the prose stage's end); ``recovery_s`` is that sample's time minus
    ``shift_t``, 0 when the rolling median never fell below the band, None when it is still below at ``until_t``.
    """
    before = [s["tok_s"] for s in samples if s["t"] < shift_t][-baseline_s:]
    if not before:
        return {"baseline_tok_s": None, "recovery_s": None, "definition": "no samples before the shift"}
    base = statistics.median(before)
    rates = [s["tok_s"] for s in samples]
    out: dict[str, Any] = {"baseline_tok_s": round(base, 2), "share": share, "rolling_s": rolling_s,
                           "baseline_s": baseline_s,
                           "definition": f"median tok/s of the last {baseline_s} s before the shift; recovered from "
                                         f"the first second after the last one (shift .. prose end) whose trailing "
                                         f"{rolling_s}-s median tok/s is below {share:g} x that"}
    window = [(s["t"], statistics.median(rates[max(0, i - rolling_s + 1):i + 1])) for i, s in enumerate(samples)
              if shift_t <= s["t"] <= until_t]
    if not window or base <= 0:
        return {**out, "recovery_s": None}
    below = [i for i, (_, m) in enumerate(window) if m < share * base]
    out["min_rolling_tok_s"] = round(min(m for _, m in window), 2)
    out["dipped"] = bool(below)
    if not below:
        out["recovery_s"] = 0.0
    elif below[-1] + 1 < len(window):
        out["recovery_s"] = round(window[below[-1] + 1][0] - shift_t, 2)
    else:
        out["recovery_s"] = None
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


def _states(rec: dict[str, Any]) -> list[str]:
    return [s["state"] for s in rec.get("steps") or []]


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

    def _per_stage(self, stages: list[dict[str, Any]], samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Requests per stage: sent in it, completed / failed in it (by when they ended), lost (sent in it,
        never ended); and of its samples: the median decode tok/s, the longest wait, the most requests held."""
        w0, reqs, out = self.timeline.wall0, self._requests(), []
        for s in stages:
            start, end = self._spans.get(s["stage"], (s["start_s"], s["end_s"]))
            a, b = w0 + start, w0 + end
            last = s is stages[-1]

            def within(t: float | None, a: float = a, b: float = b, last: bool = last) -> bool:
                return t is not None and a <= t and (t < b or last)

            mine = [x for x in samples if x["stage"] == s["stage"]]
            out.append({"stage": s["stage"], "sent": sum(within(r.sent) for r in reqs),
                        "completed": sum(r.outcome == "completed" and within(r.ended) for r in reqs),
                        "failed": sum(r.outcome == "failed" and within(r.ended) for r in reqs),
                        "lost": sum(r.ended is None and within(r.sent) for r in reqs),
                        "median_tok_s": _median([x["tok_s"] for x in mine]),
                        "longest_stall_s": max((x["stall_s"] for x in mine), default=None),
                        "most_held": max((x.get("gate_held") or 0 for x in mine), default=None)})
        return out

    def _gaps_in(self, rec: dict[str, Any], state: str) -> dict[str, Any] | None:
        """The longest waits the clients saw while the remap was in ``state`` (its step's wall-clock span):
        between two tokens of a stream, and counting a response's wait for its first token."""
        step = next((x for x in rec.get("steps") or [] if x["state"] == state), None)
        if step is None or not step.get("at"):
            return None
        t0 = _epoch(step["at"])
        t1 = t0 + float(step.get("seconds") or 0.0)
        load = LoadResult(self.clients, None)
        return {"state": state, "t": round(t0 - self.timeline.wall0, 2), "seconds": round(t1 - t0, 3),
                "longest_gap_within_stream_s": round(load.longest_gap(t0, t1, "token"), 3),
                "longest_gap_s": round(load.longest_gap(t0, t1, None), 3)}

    def _kill_figures(self) -> dict[str, Any]:
        kill = dict(self.facts.get("kill") or {})
        at = kill.pop("at", None)
        if at is None:
            return kill
        reqs = self._requests()
        in_flight = [r for r in reqs if r.sent <= at and (r.ended is None or r.ended > at)]
        failed = [r for r in reqs if r.outcome == "failed" and r.ended is not None and r.ended > at]
        # The clients' view of "in flight" (sent, not yet read to its end: a slow client may still be reading a
        # response the engine finished) and the gate's (forwarded, relay not finished) just before the kill.
        kill.update(in_flight_at_kill=len(in_flight), failed_in_flight=sum(r.outcome == "failed" for r in in_flight),
                    failed_after_kill=len(failed), failed_sent_after_kill=sum(r.sent > at for r in failed),
                    failed_requests=[{"sent_s": round(r.sent - at, 3), "ended_s": round((r.ended or at) - at, 3)}
                                     for r in failed][:20],
                    failed_note="seconds relative to the SIGKILL: a negative sent_s was in flight at the kill")
        kill["ok"] = kill["failed_after_kill"] <= kill["in_flight_at_kill"] and kill.get("new_pid") not in (
            None, kill.get("pid"))
        return kill

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
                         "per_stage": self._per_stage(stages, samples),
                         "errors": [e for c in self.clients for e in c.errors][:10]},
            "boot": self.facts.get("boot"),
            "remap": {"id": rec.get("id"), "trigger": rec.get("trigger"), "outcome": rec.get("outcome"),
                      "outcome_reason": rec.get("outcome_reason"), "states": _states(rec),
                      "observed_states": self.facts.get("remap_observed"),
                      "steps": rec.get("steps"), "candidate": rec.get("candidate"),
                      "trip": (rec.get("detail") or {}).get("signals"),
                      "apply": {"outcome": (rec.get("apply") or {}).get("outcome"), "result": req.get("result"),
                                "rows": req.get("rows"), "bytes_moved": req.get("bytes_moved"),
                                "seconds": req.get("seconds"), "wait_s": req.get("wait_s"),
                                "reason": (rec.get("apply") or {}).get("reason")},
                      "verify": {k: (rec.get("verify") or {}).get(k) for k in ("in_place", "cold_rate", "parity")},
                      "waits": [w for w in (self._gaps_in(rec, x) for x in ("applying", "verifying")) if w]},
            "reboot": {"map": self.other.label, "map_hash": self.other.hash,
                       **{k: reboot.get(k) for k in ("ok", "seconds", "drain_s", "boot_s", "hold_s",
                                                     "held_at_release", "in_flight_cut", "hash_hit", "cache_miss",
                                                     "error")},
                       "initial_boot_s": ((self.facts.get("boot") or {}).get("last_boot") or {}).get("seconds"),
                       "after": self.facts.get("after_reboot"),
                       "note": "hash_hit: the daemon's word (false for another geometry: its compile caches key on "
                               "the hot tensor's shape); cache_miss: the supervisor's, from the engine log's "
                               "compile-cache lines, else boot seconds against the last boot of that geometry"},
            "kill": self._kill_figures(),
            "recovery": recovery(samples, shift_t, prose_end, baseline_s=self.opts.baseline_s,
                                 rolling_s=self.opts.rolling_s) if shift_t is not None and prose_end else None,
            "cold_rate": self._cold_rates(windows, samples),
            "windows": windows,
            "samples": samples,
            "daemon_stop": self.daemon_stop,
            "host": {"cpus": os.cpu_count(), "load_avg_end": os.getloadavg()},
        }
        doc["checks"] = checks(doc)
        return doc

    @staticmethod
    def _cold_rates(windows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> dict[str, Any]:
        """The judged drift windows' cold rates (median per stage) and the live stats' (median of the samples)."""
        def of(stage: str) -> dict[str, Any]:
            return {"windows": _median([w["cold_rate"] for w in windows if w["stage"] == stage and w["judged"]]),
                    "live": _median([s["live_cold_rate"] for s in samples if s["stage"] == stage])}

        return {"source": "windows: the drift watch's judged windows closed in the stage (median); live: the "
                          "cold share since the hook's previous stats write, sampled each second (median)",
                "before": of("code"), "at_shift": of("shift"), "after": of("prose"), "after_reboot": of("reboot")}


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


def draw_timeline(doc: dict[str, Any], png: Path) -> Path:
    """The run as one picture: decode tok/s (each second, and the rolling median), the cold rate (live and per
    drift window) and the longest wait per second, the stages shaded and labelled, the shift, the remap's apply,
    the drain-reboot and the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = doc["samples"]
    t = [s["t"] for s in samples]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, sharex=True, figsize=(12, 8), height_ratios=[3, 2, 1.5])
    rate = [s["tok_s"] for s in samples]
    ax1.plot(t, rate, lw=0.8, color="tab:blue", label="decode tok/s (each second)")
    rec = doc.get("recovery") or {}
    w = int(rec.get("rolling_s") or 5)
    ax1.plot(t, [statistics.median(rate[max(0, i - w + 1):i + 1]) for i in range(len(rate))], lw=1.8,
             color="navy", label=f"rolling median ({w} s)")
    if rec.get("baseline_tok_s"):
        ax1.axhline(rec["baseline_tok_s"] * rec.get("share", RECOVERED_SHARE), ls=":", color="gray",
                    label=f"{rec.get('share', RECOVERED_SHARE):g} x pre-shift rate")
    ax1.set_ylabel("tok/s")
    ax2.plot(t, [s.get("live_cold_rate") for s in samples], color="tab:red", lw=1.2, label="live cold rate (stats)")
    win = doc.get("windows") or []
    ax2.scatter([x["t"] for x in win], [x["cold_rate"] for x in win], s=14, color="darkred", zorder=3,
                label="drift window cold rate")
    ax2.set_ylabel("cold rate")
    ax2.set_ylim(bottom=0)
    ax3.plot(t, [s["stall_s"] for s in samples], color="tab:purple", lw=1, label="longest wait (s)")
    ax3.plot(t, [s.get("gate_held") or 0 for s in samples], color="tab:orange", lw=1, label="gate: held requests")
    ax3.set_ylabel("stall s / held")
    ax3.set_xlabel("seconds since the run began")
    colors = ("#f2f2f2", "#dde8f5")
    for n, s in enumerate(doc["stages"]):
        for ax in (ax1, ax2, ax3):
            ax.axvspan(s["start_s"], s["end_s"], color=colors[n % 2], zorder=0)
        ax1.text((s["start_s"] + s["end_s"]) / 2, 1.01 + 0.05 * (n % 2), s["stage"],  # staggered: short stages
                 transform=ax1.get_xaxis_transform(), ha="center", va="bottom", fontsize=8)
    marks = [(doc["shift_t"], "shift")] if doc.get("shift_t") is not None else []
    for w in (doc.get("remap") or {}).get("waits") or []:
        if w["state"] == "applying" and w.get("t") is not None:
            marks.append((w["t"], "apply"))
    if (doc.get("kill") or {}).get("t") is not None:
        marks += [(doc["kill"]["t"], "SIGKILL"), (doc["kill"].get("back_t"), "serving again")]
    marks = [(x, label) for x, label in marks if x is not None]
    for n, (x, label) in enumerate(marks):
        for ax in (ax1, ax2, ax3):
            ax.axvline(x, color="black", lw=0.8, ls="--")
        ax1.text(x, 0.95 - 0.07 * (n % 2), f" {label}", transform=ax1.get_xaxis_transform(), fontsize=8, va="top")
    for ax in (ax1, ax2, ax3):
        ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
        ax.grid(alpha=0.3)
    apply = (doc.get("remap") or {}).get("apply") or {}
    title = (f"heal scenario: {doc['options']['clients']} clients; remap {apply.get('result')} in place "
             f"({apply.get('rows')} rows, {apply.get('seconds')} s); recovery "
             f"{rec.get('recovery_s')} s; lost {doc['requests']['lost']}, failed {doc['requests']['failed']}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
