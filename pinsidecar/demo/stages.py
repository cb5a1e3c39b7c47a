"""The demo loop's stages, in order, as the methods of one run (:class:`DemoRun`).

:func:`pinsidecar.demo.loop.run_demo` calls them one after the other; a run keeps its state between them (the
daemon, the clients, the drift windows seen, the summary so far) so that a failure at any point still reports what
was measured, and :meth:`DemoRun.stop` always leaves nothing running. Each stage waits on the daemon's status
(:meth:`DemoRun.wait`) within a bound of its own: a loaded 2-core box is slow, and a wait past its bound is a
failure, with the daemon's log.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pinsidecar_hook.contract import CountsArtifact, load_counts

from pinsidecar import placement
from pinsidecar.demo.options import DemoOptions, Display
from pinsidecar.demo.report import Prediction, pct, pts, short_hash, step_line, window_brief, window_line
from pinsidecar.demo.sidecar import BOOT_TIMEOUT_S, MAX_HOLD_S, SERVED_MODEL_NAME, DemoPorts, Sidecar, demo_config
from pinsidecar.demo.timeline import Timeline, epoch

__all__: list[str] = []  # nothing here is another package's business

# How often the demo reads the daemon's status (its drift watch reads the stats every second).
POLL_S = 0.5
# Judged windows of domain A before the shift, and of domain B under the new map at the end.
A_WINDOWS = 2
AFTER_WINDOWS = 2
# Bounds of the waits (a loaded 2-core box is slow; a wait past these is a failure, with the daemon's log).
BOOT_LIMIT_S = BOOT_TIMEOUT_S + 60.0  # the engine's own ready_timeout_s, and the daemon's start before it
DOMAIN_A_LIMIT_S = 600.0
DETECT_LIMIT_S = 600.0
REMAP_LIMIT_S = 1800.0
AFTER_LIMIT_S = 600.0


@dataclass
class _RoutingTally:
    """Domain A's routing as the hook counted it (its own reader of the stats file: deltas of the histogram and
    of the cold selections under the served map), to score the positional baseline on the same traffic."""

    histogram: np.ndarray | None = None
    selections: int = 0
    cold: int = 0

    def add(self, reading: Any) -> None:
        if reading is None or reading.first or reading.restarted or reading.reset:
            return
        if reading.delta_histogram is not None:
            h = np.asarray(reading.delta_histogram, dtype=np.int64)
            self.histogram = h if self.histogram is None else self.histogram + h
        self.selections += max(0, sum(reading.delta_selections))
        self.cold += max(0, sum(reading.delta_cold_selections))


class DemoRun:
    """One demo run's state between its stages (so a failure at any point still reports what was measured)."""

    def __init__(self, opts: DemoOptions, show: Display) -> None:
        self.opts = opts
        self.show = show
        self.timeline = Timeline()
        self.work = opts.workdir.absolute()
        self.run_dir = self.work / "run"
        self.model_dir = self.work / "model"
        self.summary: dict[str, Any] = {"ok": False, "workdir": str(self.work), "model": str(self.model_dir),
                                        "domains": {"a": opts.domain_a, "b": opts.domain_b}}
        self.sidecar: Sidecar | None = None
        self.clients: Any = None
        self.windows: list[dict[str, Any]] = []
        self.seen_window = -1
        self.phase = ""
        self.print_windows = True
        self.unprinted: list[int] = []  # windows that closed while a remap was followed (recorded, not printed)
        # The one figure each map is shown with, by content hash (report.Prediction): the first map's in-sample
        # rate, the remap's candidate's held-out rate once the pipeline has judged it.
        self.predictions: dict[str, Prediction] = {}

    # ------------------------------------------------------------------------------------------ stages 1-3
    def build_model(self) -> None:
        from pinsidecar.demo.model import build_demo_model

        show, opts = self.show, self.opts
        show.step("model: the tiny local MoE model, its routing shaped per traffic domain")
        with self.timeline.stage("model", "demo model"):
            if opts.rebuild_model or not (self.model_dir / "config.json").exists():
                with show.waiting("building the demo model"):
                    build_demo_model(self.model_dir, force=opts.rebuild_model)
                show.note(f"built {self.model_dir}")
            else:
                show.note(f"reusing {self.model_dir}")

    def count_boot(self, port: int) -> CountsArtifact:
        from pinsidecar.counts.count_boot import run_count_boot
        from pinsidecar.demo.model import fixture_path

        show, a = self.show, self.opts.domain_a
        out = self.work / f"counts-{a}.json"
        show.step(f"count boot: vLLM CPU in count mode replays domain A ({a}) training prompts")
        with self.timeline.stage("count_boot", f"count boot ({a})"):
            if self.opts.reuse_counts and out.exists():
                show.note(f"reusing {out} (--fresh counts again)")
                self.summary["count_boot"] = {"reused": str(out)}
                return load_counts(out)
            with show.engine_boot(f"http://127.0.0.1:{port}", "count engine booting"):
                result = run_count_boot(self.model_dir, [fixture_path(a)], out, port=port, label=a,
                                     progress=show.bars, engine_log=self.work / "count-boot.log")
        s = result.summary()
        self.summary["count_boot"] = s
        show.note(f"{s['requests']} requests, {s['tokens']} routed tokens, {s['selections']} expert selections "
                  f"({'exact' if s['exact'] else 'NOT exact'}); engine up in {s['boot_s']:.1f} s -> {out}")
        return result.counts

    def build_map(self, counts: CountsArtifact) -> tuple[Path, Any, Any]:
        from pinsidecar.remap.candidates import counts_path_for

        show, a = self.show, self.opts.domain_a
        show.step(f"map: the usage map of {a}, and the positional baseline for the same budget")
        with self.timeline.stage("map", "usage map"):
            names = [a]  # the one builder `map build` and remap use, so the demo's map carries their meta
            xbytes = placement.resolve_expert_bytes([counts], names, counts)
            usage = placement.build_map([counts], self.opts.hot_rows, xbytes, names=names, label=a).map
            map_path = self.run_dir / "maps" / f"{a}.json"
            counts.save(counts_path_for(map_path))  # beside the map: the drift watch's divergence reference
            placement.save_map(usage, map_path)
            positional = placement.positional_for(usage)
        self.summary["map"] = {"path": str(map_path), "hash": usage.content_hash, "label": usage.label,
                               "hot_rows": usage.hot_rows, "cold_rows": usage.cold_rows,
                               "predicted_cold_rate": usage.predicted_cold_rate}
        self.predictions[usage.content_hash] = Prediction(usage.predicted_cold_rate, "in-sample")
        show.note(f"map {a} ({usage.short_hash}): {usage.hot_rows} hot / {usage.cold_rows} cold experts per layer, "
                  f"in-sample cold rate {pct(usage.predicted_cold_rate)} (on the counts it was built from) "
                  f"-> {map_path}")
        return map_path, usage, positional

    # ------------------------------------------------------------------------------------------ the daemon
    def status(self) -> dict[str, Any]:
        """The daemon's status; a daemon that died is a failure, with its log's last lines."""
        sc = self.sidecar
        assert sc is not None
        st = sc.status()
        if st is None and not sc.alive():
            tail = "\n".join("  | " + line for line in sc.log_tail(15))
            raise RuntimeError(f"the daemon exited (code {sc.exit_code}); its log {sc.log_path} ends:\n{tail}")
        return st or {}

    def wait(self, what: str, done: Callable[[dict[str, Any]], bool], limit_s: float,
             tick: Callable[[dict[str, Any], float], str] | None = None) -> dict[str, Any]:
        """Poll the status until ``done(status)``; prints windows as they close; ``tick`` gives the indicator
        text. Raises ``TimeoutError`` past ``limit_s``."""
        t0 = time.monotonic()
        with self.show.waiting(what) as update:
            while True:
                st = self.status()
                self.new_windows(st)
                if st and done(st):
                    return st
                elapsed = time.monotonic() - t0
                if elapsed > limit_s:
                    sc = self.sidecar
                    raise TimeoutError(f"{what}: not done within {limit_s:.0f} s (daemon log: "
                                       f"{sc.log_path if sc else '-'})")
                if tick is not None and st:
                    update(tick(st, elapsed))
                time.sleep(POLL_S)

    def new_windows(self, st: dict[str, Any]) -> None:
        """Record (and print, unless a remap is being followed) the drift window that closed since the last look."""
        rec = ((st or {}).get("drift") or {}).get("last_window")
        if not rec or rec.get("index", -1) <= self.seen_window:
            return
        self.seen_window = rec["index"]
        self.windows.append(window_brief(rec, self.phase))
        if self.print_windows:
            self.show.note(window_line(rec, self.predictions.get(rec.get("active_map") or "")))
        else:
            self.unprinted.append(rec["index"])

    def start_daemon(self, map_path: Path, ports: DemoPorts) -> dict[str, Any]:
        from pinsidecar.daemon.config import load_config

        show = self.show
        config = demo_config(self.run_dir / "pinsidecar.toml", model_dir=self.model_dir, map_path=map_path,
                             run_dir=self.run_dir, ports=ports)
        cfg = load_config(config)  # the daemon validates it again; a bad one should fail here, not in a log
        state_dir = cfg.daemon.state_dir
        self.sidecar = Sidecar(config, state_dir=state_dir, control_port=ports.control,
                               log_path=self.run_dir / "daemon.log")
        metrics_url = f"http://127.0.0.1:{ports.metrics}/metrics"
        self.summary.update(
            config=str(config), metrics_url=metrics_url, gate_url=f"http://127.0.0.1:{ports.gate}",
            control_url=f"http://127.0.0.1:{ports.control}/status", ports=ports.__dict__,
            logs={"daemon": str(self.sidecar.log_path), "engine": str(state_dir / "engine.log"),
                  "remaps": str(state_dir / "remaps")})
        show.step("daemon: pinsidecar run, the engine in pin mode with the code map")
        with self.timeline.stage("daemon_start", "daemon + engine boot"):
            self.sidecar.start()
            show.note(f"config {config}; logs {self.sidecar.log_path} and {state_dir / 'engine.log'}")
            show.note(f"metrics {metrics_url} (pinsidecar_cold_selection_ratio, pinsidecar_drift_*, "
                      "pinsidecar_remaps_total): live from now to the end")
            show.note(f"clients -> gate http://127.0.0.1:{ports.gate}; control http://127.0.0.1:{ports.control}")
            st = self.wait("engine booting (pin mode)",
                           lambda s: (s.get("engine") or {}).get("state") == "ready", BOOT_LIMIT_S,
                           lambda s, t: f"engine {(s.get('engine') or {}).get('state', 'starting')}")
        eng = st["engine"]
        boot = eng.get("last_boot") or {}
        show.note(f"engine ready in {boot.get('seconds', 0):.1f} s, serving map {eng['map']['label']} "
                  f"({short_hash(eng['map']['hash'])})")
        self.summary["engine_boot_s"] = boot.get("seconds")
        return cfg.engine_spec().env

    # ------------------------------------------------------------------------------------------ traffic
    def domain_a(self, engine_env: dict[str, str], positional: Any, usage: Any) -> None:
        from pinsidecar.demo.clients import GateClients
        from pinsidecar.demo.model import load_prompts
        from pinsidecar.drift.signals import cold_rate_on
        from pinsidecar.live_stats import StatsReader

        show, a = self.show, self.opts.domain_a
        reader = StatsReader(Path(engine_env["PINSIDECAR_STATS_PATH"]))
        reader.read()  # the baseline: what the readiness probe routed is not domain A's traffic
        tally = _RoutingTally()
        self.clients = GateClients(self.summary["gate_url"], SERVED_MODEL_NAME, clients=self.opts.clients,
                                   timeout_s=MAX_HOLD_S + 60)
        show.step(f"traffic: {self.opts.clients} clients send held-out {a} prompts through the gate")
        self.phase = "a"
        first = self.seen_window
        with self.timeline.stage("domain_a", f"{a} traffic"):
            self.clients.switch(a, load_prompts(f"{a}_heldout"))

            def judged_a(st: dict[str, Any]) -> bool:
                tally.add(reader.read())
                remap = st.get("remap") or {}
                if remap.get("current") or remap.get("last"):
                    raise RuntimeError("a remap started on stationary domain-A traffic (a false trip): see "
                                       f"{self.summary['logs']['daemon']}")
                return sum(1 for w in self.windows if w["index"] > first and w["judged"]) >= A_WINDOWS

            self.wait(f"{a} traffic", judged_a, DOMAIN_A_LIMIT_S,
                      lambda s, t: f"{a} traffic: {self.clients.snapshot().completed} requests served")
        tally.add(reader.read())
        usage_rate = tally.cold / tally.selections if tally.selections else None
        pos_rate = cold_rate_on(positional.hot_mask(), tally.histogram) if tally.histogram is not None else None
        usage_hist = cold_rate_on(usage.hot_mask(), tally.histogram) if tally.histogram is not None else None
        self.summary["placement"] = {
            "traffic": f"{a}_heldout, live through the gate", "selections": tally.selections,
            "usage_cold_rate": usage_rate, "usage_cold_rate_from_histogram": usage_hist,
            "positional_cold_rate": pos_rate}
        times = f": {pos_rate / usage_rate:.1f}x the host reads" if usage_rate and pos_rate else ""
        show.note(f"what the map buys on held-out {a}: {pct(usage_rate)} of expert selections cold; positional "
                  f"offload of the same {usage.cold_rows} experts per layer (what --cpu-offload-gb does) would see "
                  f"{pct(pos_rate)}{times}")

    def detect(self) -> dict[str, Any]:
        from pinsidecar.demo.model import load_prompts

        show, a, b = self.show, self.opts.domain_a, self.opts.domain_b
        show.step(f"shift: the clients now send {b}; the {a} map was not built for it")
        self.phase = "b"
        start = self.timeline.now()
        self.clients.switch(b, load_prompts(b) + load_prompts(f"{b}_heldout"))
        self.summary["shift_at_s"] = round(start, 1)

        def started(st: dict[str, Any]) -> bool:
            remap = st.get("remap") or {}
            return bool(remap.get("current") or remap.get("last"))

        st = self.wait("watching for drift", started, DETECT_LIMIT_S,
                       lambda s, t: f"{b} traffic, drift watch: {(s.get('drift') or {}).get('state', '?')}")
        rec = st["remap"]["current"] or st["remap"]["last"]
        trip_at = self.timeline.from_wall(epoch(rec.get("started_at")))
        self.timeline.add("detect", f"shift to {b} -> drift trip", start,
                          (trip_at if trip_at is not None else self.timeline.now()) - start)
        sig = (rec.get("detail") or {}).get("signals") or {}
        show.note(f"drift detected {(trip_at or self.timeline.now()) - start:.0f} s after the shift: window "
                  f"{(rec.get('detail') or {}).get('window')} saw {pct(sig.get('cold_rate'))} cold under the {a} map, "
                  f"a map rebuilt from {b} would gain {pts(sig.get('projected_gain'))}; remap {rec['id']} "
                  f"(trigger {rec['trigger']})")
        return rec

    def follow_remap(self, remap_id: str) -> dict[str, Any]:
        show = self.show
        show.step(f"remap {remap_id}: count, build, evaluate, apply in place, verify, commit")
        self.phase = "remap"
        printed = 0

        def steps_of(st: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
            remap = st.get("remap") or {}
            cur, last = remap.get("current"), remap.get("last")
            if cur and cur.get("id") == remap_id:
                return cur, False
            if last and last.get("id") == remap_id:
                return last, True
            return None, False

        def done(st: dict[str, Any]) -> bool:
            nonlocal printed
            rec, ended = steps_of(st)
            if rec is None:
                return False
            for step in rec.get("steps", [])[printed:]:
                show.note(step_line(step))
            printed = len(rec.get("steps", []))
            return ended

        def tick(st: dict[str, Any], elapsed: float) -> str:
            rec, _ = steps_of(st)
            return f"remap: {rec.get('state') if rec else '?'}"

        # Windows still close while the remap runs (the drift watch goes on): recorded, not printed.
        self.print_windows = False
        try:
            st = self.wait("remap", done, REMAP_LIMIT_S, tick)
        finally:
            self.print_windows = True
        rec, _ = steps_of(st)
        assert rec is not None
        cand, decision = rec.get("candidate") or {}, rec.get("decision") or {}
        if cand.get("hash"):
            self.predictions[cand["hash"]] = Prediction(decision.get("candidate_cold_rate"), "held-out")
        # The first step's wall-clock start places the remap on the timeline; each later step starts where the one
        # before ended, by its (monotonic) seconds: a wall clock stepped mid-remap (NTP, a VM resumed) must not
        # reorder the stages. Seen: the wall clock ran 12 s ahead of the monotonic one during a 4-minute count boot.
        at: float | None = None
        for step in rec.get("steps", []):
            if at is None:
                at = self.timeline.from_wall(epoch(step.get("at")))
            if at is not None:
                self.timeline.add(f"remap.{step['state']}", f"remap: {step['state'].replace('_', ' ')}", at,
                                  step.get("seconds", 0.0))
                at += float(step.get("seconds") or 0.0)
        self.summary["remap_committed_at_s"] = round(self.timeline.now(), 1)
        outcome = rec.get("outcome")
        show.note(f"{outcome}: {rec.get('outcome_reason') or rec.get('error') or ''}")
        if self.unprinted:
            lo, hi = self.unprinted[0], self.unprinted[-1]
            which = f"window {lo}" if lo == hi else f"windows {lo}-{hi}"
            show.note(f"({which} closed while the remap ran: not shown here, listed in demo-summary.json)")
            self.unprinted.clear()
        return rec

    def after(self) -> list[dict[str, Any]]:
        show, b = self.show, self.opts.domain_b
        show.step(f"after: {b} under the new map")
        self.phase = "after"
        first = self.seen_window
        with self.timeline.stage("after", f"{b} under the new map"):
            self.wait(f"{b} traffic under the new map",
                      lambda st: sum(1 for w in self.windows if w["index"] > first and w["judged"]) >= AFTER_WINDOWS,
                      AFTER_LIMIT_S, lambda s, t: f"{b} traffic under the new map")
        return [w for w in self.windows if w["index"] > first and w["judged"]]

    def stop(self) -> None:
        """Stop the clients and the daemon; never leaves an engine running. Ctrl-C is ignored meanwhile."""
        old = None
        with contextlib.suppress(ValueError):  # not the main thread: no signal handling to change
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            start = self.timeline.now()
            if self.clients is not None:
                self.summary["requests"] = self._requests(self.clients.stop(timeout_s=60))
            if self.sidecar is not None:
                with self.show.waiting("stopping the daemon (it drains the gate and stops its engine)"):
                    self.summary["daemon_stop"] = self.sidecar.stop()
                self.timeline.add("stop", "daemon stop", start, self.timeline.now() - start)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)

    @staticmethod
    def _requests(counts: Any) -> dict[str, Any]:
        d = counts.as_dict()
        d["errors"], d["retries"] = d["errors"][:5], d["retries"][:5]
        return d
