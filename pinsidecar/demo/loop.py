"""The demo loop: the whole product on one machine, unattended, on vLLM CPU with the tiny local MoE model.

It is what ``bash scripts/demo.sh`` runs on a fresh clone, so it needs nothing but the package: the model is built
locally (:mod:`pinsidecar.demo.model`), the traffic is the shipped prompt fixtures, the engine is the vLLM CPU
build. The stages, in order (each one is a line of the timeline at the end):

1. ``model`` - build the demo model (skipped when the work folder has it);
2. ``count_boot`` - a count boot on domain A (code): the engine in count mode replays A's training prompts;
3. ``map`` - the usage map from those counts (48 hot / 16 cold experts per layer), its counts beside it (what
   the drift watch measures divergence against);
4. ``daemon_start`` - a daemon config in the work folder, and ``pinsidecar run``: the gate, the control API, the
   metrics exporter (live from here to the end), and the engine in pin mode serving that map;
5. ``domain_a`` - a few clients send held-out A prompts through the gate; windows close with their live cold
   rate. What the map buys: the same traffic's cold rate under the positional baseline (the same number of
   cold experts, whole layers first: what ``--cpu-offload-gb`` does), from the routing the hook counted;
6. ``detect`` - the clients shift to domain B (prose); the code map's cold rate jumps (a map is a per-workload
   artifact) and the drift watch trips;
7. ``remap.*`` - the remap, followed state by state: the captured B traffic, the library check, the count boot
   on a second engine beside the serving one, the new map, its evaluation on a held-out window, the apply in
   place (the hook swaps the rows that change while the engine keeps serving; parity checked token for token on
   the same engine), the verification of the live cold rate, the commit. Should the apply not be possible, the
   remap falls back to a drain and hash-hit reboot (parity checked inside the hold) and the demo shows that;
8. ``after`` - B under the new map: the cold rate back down;
9. ``stop`` - the daemon is stopped (it drains and stops its engine); so it is on Ctrl-C or any failure, and
   nothing is left running (:meth:`~pinsidecar.demo.sidecar.Sidecar.stop`).

**The figure**: the live cold rate after the remap (the pipeline's verification, over ``remap.verify_tokens``)
is at most half the rate of the window that tripped; otherwise the demo fails with the figures. The summary
(``demo-summary.json``, and ``--json`` on stdout) holds the timeline, the cold rates, the remap's essentials and
the requests sent, completed and failed through the gate (none should fail: an apply only pauses the engine's
steps while the hook copies, and if the remap falls back to a reboot the gate holds them through it). The daemon's
files (config, logs, state, maps) are under ``<workdir>/run``, renewed by each run.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog
from pinsidecar_hook.contract import CountsArtifact, atomic_write_json, load_counts

from pinsidecar import placement
from pinsidecar.demo.sidecar import BOOT_TIMEOUT_S, MAX_HOLD_S, SERVED_MODEL_NAME, DemoPorts, Sidecar, demo_config

__all__ = ["DemoFailed", "DemoOptions", "run_demo"]

log = structlog.get_logger(__name__)

# 48 of 64 experts hot per layer: 25 % of the experts in host memory, close to the reference system's split
# (295 hot / 89 cold of 384 experts per layer, 23 % cold; docs/design.md).
DEFAULT_HOT_ROWS = 48
# The figure: the cold rate after the remap is at most this times the rate at the trip.
REQUIRED_RATIO = 0.5
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
# Concurrent clients: enough to keep the CPU engine batching, few enough to leave the count engine a core.
CLIENTS = 3
# The demo's remap deploys in place (remap.in_place, the default): no "rebooting" unless the apply falls back.
REMAP_STATES = ("choosing_workload", "library_check", "count_boot", "building", "evaluating", "applying",
                "verifying")
STAGES = ("model", "count_boot", "map", "daemon_start", "domain_a", "detect",
          *(f"remap.{s}" for s in REMAP_STATES), "after", "stop")


@dataclass
class DemoOptions:
    workdir: Path
    hot_rows: int = DEFAULT_HOT_ROWS
    domain_a: str = "code"
    domain_b: str = "prose"
    port: int = 8000  # the serving engine's; gate, control and count engine take the usual ports or free ones
    metrics_port: int = 9108
    clients: int = CLIENTS
    rebuild_model: bool = False
    reuse_counts: bool = True


class Display(Protocol):
    """What the loop tells a person as it goes. The CLI passes its terminal (:class:`pinsidecar.cli._terminal
    .Terminal`); ``None`` (tests, ``--json``) shows nothing."""

    @property
    def bars(self) -> bool:
        """Whether replays should draw their progress bar."""

    def step(self, title: str) -> None:
        """A step starts."""

    def note(self, text: str) -> None:
        """One line of the current step's result."""

    def waiting(self, what: str, until: Callable[[], bool] | None = ...) -> AbstractContextManager[
            Callable[[str], None]]:
        """Something is being waited for during this block; the block may change the text as it goes."""

    def engine_boot(self, base_url: str, what: str = ...) -> AbstractContextManager[Callable[[str], None]]:
        """The engine at ``base_url`` is booting during this block (show that it is, until it answers)."""


class _Silent:
    bars = False

    def step(self, title: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    @contextlib.contextmanager
    def waiting(self, what: str, until: Callable[[], bool] | None = None) -> Iterator[Callable[[str], None]]:
        yield lambda text: None

    def engine_boot(self, base_url: str, what: str = "") -> AbstractContextManager[Callable[[str], None]]:
        return self.waiting(what)


class DemoFailed(RuntimeError):
    """The demo could not complete the loop, or the figure missed; ``summary`` has what was measured."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


# ------------------------------------------------------------------------------------------------------ helpers
def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} pts"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def _short(h: str | None) -> str:
    return (h or "").split(":", 1)[-1][:12] or "-"


def _epoch(stamp: str | None) -> float | None:
    """Epoch seconds of a remap record's ``at`` (``2025-01-01T12:00:00.123Z``)."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class Timeline:
    """Stages with their start (seconds from the demo's start) and duration."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.stages: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, stage: str, label: str, start_s: float, seconds: float) -> None:
        self.stages.append({"stage": stage, "label": label, "start_s": round(start_s, 1),
                            "seconds": round(max(0.0, seconds), 1)})

    @contextlib.contextmanager
    def stage(self, stage: str, label: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(stage, label, start, self.now() - start)

    def from_wall(self, epoch: float | None) -> float | None:
        return None if epoch is None else epoch - self.wall0

    def as_list(self) -> list[dict[str, Any]]:
        return sorted(self.stages, key=lambda s: s["start_s"])


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


def _window_line(rec: dict[str, Any]) -> str:
    """One closed drift window for a person."""
    w, s = rec.get("window") or {}, rec.get("signals") or {}
    head = f"window {rec['index']}: {w.get('tokens', 0):>5} tokens"
    cold = f"live cold rate {_pct(s.get('cold_rate'))} (map predicts {_pct(s.get('predicted_cold_rate'))})"
    if not rec.get("judged"):
        why = rec.get("why_not") or ""
        if why.startswith("too few tokens"):
            return f"{head}, too few to judge"
        if "no earlier window" in why:
            why = "the first window (a rebuilt map is built on the window before)"
        return f"{head}, {cold}; not judged: {why[:80]}"
    line = f"{head}, {cold}, gain of a rebuilt map {_pts(s.get('projected_gain'))}"
    if rec.get("trip"):
        return f"{line}: DRIFT, remap started"
    state = rec.get("state", "")
    if state == "rising":
        return f"{line}: rising ({rec.get('streak')} window)"
    if rec.get("remap_running"):
        return f"{line}: {state} (remap running)"
    return f"{line}: {state}"


def _apply_line(d: dict[str, Any]) -> str:
    """The applying step for a person: what the hook did while the engine kept serving, or why it fell back."""
    if d.get("in_place"):  # fell back: the applying step hands over to rebooting with the reason
        return f"not in place: {d['in_place']}"
    a, p = d.get("apply") or {}, d.get("parity") or {}
    if a.get("result") != "applied" or not p:  # the remap ended here (rolled back, the engine died)
        return f"{a.get('result', 'not applied')}: {a.get('reason') or ''}".rstrip(": ")
    return (f"applied in place: the hook swapped {a.get('rows', 0)} rows ({(a.get('bytes_moved') or 0) / 2**20:.2f} "
            f"MiB) in {1000 * float(a.get('seconds') or 0.0):.1f} ms while the engine kept serving (the gate never "
            f"held); parity {'ok' if p.get('ok') else 'FAILED'} ({p.get('tokens', 0)} tokens of "
            f"{p.get('prompts', 0)} greedy prompts, same engine)")


def _window_brief(rec: dict[str, Any], phase: str) -> dict[str, Any]:
    s = rec.get("signals") or {}
    return {"index": rec.get("index"), "phase": phase, "tokens": (rec.get("window") or {}).get("tokens"),
            "judged": rec.get("judged"), "cold_rate": s.get("cold_rate"),
            "predicted_cold_rate": s.get("predicted_cold_rate"), "projected_gain": s.get("projected_gain"),
            "divergence_max": s.get("divergence_max"), "state": rec.get("state"), "trip": rec.get("trip"),
            "map": rec.get("active_label") or _short(rec.get("active_map"))}


def _step_line(step: dict[str, Any]) -> str:
    """One finished remap state for a person, from the record's step."""
    state, d, sec = step.get("state", ""), step.get("detail") or {}, step.get("seconds", 0.0)
    head = f"{state:<17} {sec:6.1f} s  "
    if state == "choosing_workload":
        return head + (f"the newest {d.get('captured', 0)} requests the gate captured "
                       f"({d.get('requests', 0)} to count)")
    if state == "library_check":
        why = d.get("reason") or f"{d.get('maps', 0)} maps in the library"
        return head + (why if d.get("deploy") else f"{why}: count boot")
    if state == "count_boot":
        return head + (f"a second engine on :{d.get('port')} beside the serving one: {d.get('requests')} requests, "
                       f"{d.get('tokens')} routed tokens (engine up in {_secs(d.get('boot_s'))})")
    if state == "building":
        return head + (f"new map {d.get('label')} ({_short(d.get('hash'))}), same geometry; "
                       f"in-sample cold rate {_pct(d.get('in_sample_cold_rate'))}")
    if state == "evaluating":
        return head + str(d.get("decision", "")) + (f"; {d['in_place']}" if d.get("in_place") else "")
    if state == "applying":
        return head + _apply_line(d)
    if state == "rebooting":
        r, p = d.get("reboot") or {}, d.get("parity") or {}
        hit = "hash hit" if r.get("hash_hit") else "NOT a hash hit"
        miss = "compile-cache MISS" if r.get("cache_miss") else "no cache miss"
        return head + (f"drain + reboot: engine up in {_secs(r.get('boot_s'))}, gate held {_secs(r.get('hold_s'))} "
                       f"({r.get('held_at_release', 0)} requests waited), {hit}, {miss}; parity "
                       f"{'ok' if p.get('ok') else 'FAILED'} ({p.get('tokens', 0)} tokens of {p.get('prompts', 0)} "
                       "greedy prompts)")
    if state == "verifying":
        c = d.get("cold_rate") or {}
        if c:
            return head + (f"live cold rate {_pct(c.get('live_cold_rate'))} over {c.get('tokens')} tokens under "
                           f"the new map (predicted {_pct(c.get('predicted_cold_rate'))}): {c.get('status')}")
    return head + ", ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, dict | list))


# ------------------------------------------------------------------------------------------------------ the run
class _Run:
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
        from pinsidecar.demo.model import fixture_path
        from pinsidecar.runs.count_boot import run_profile

        show, a = self.show, self.opts.domain_a
        out = self.work / f"counts-{a}.json"
        show.step(f"count boot: vLLM CPU in count mode replays domain A ({a}) training prompts")
        with self.timeline.stage("count_boot", f"count boot ({a})"):
            if self.opts.reuse_counts and out.exists():
                show.note(f"reusing {out} (--fresh counts again)")
                self.summary["count_boot"] = {"reused": str(out)}
                return load_counts(out)
            with show.engine_boot(f"http://127.0.0.1:{port}", "count engine booting"):
                result = run_profile(self.model_dir, [fixture_path(a)], out, port=port, label=a,
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
            usage = placement.build_usage_map([counts], self.opts.hot_rows, label=a,
                                              expert_bytes=int(counts.meta.get("expert_bytes", 0) or 0))
            map_path = self.run_dir / "maps" / f"{a}.json"
            counts.save(counts_path_for(map_path))  # beside the map: the drift watch's divergence reference
            placement.save_map(usage, map_path)
            positional = placement.positional_for(usage)
        self.summary["map"] = {"path": str(map_path), "hash": usage.content_hash, "label": usage.label,
                               "hot_rows": usage.hot_rows, "cold_rows": usage.cold_rows,
                               "predicted_cold_rate": usage.predicted_cold_rate}
        show.note(f"map {a} ({usage.short_hash}): {usage.hot_rows} hot / {usage.cold_rows} cold experts per layer, "
                  f"in-sample cold rate {_pct(usage.predicted_cold_rate)} -> {map_path}")
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
        self.windows.append(_window_brief(rec, self.phase))
        if self.print_windows:
            self.show.note(_window_line(rec))

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
                  f"({_short(eng['map']['hash'])})")
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
        show.note(f"what the map buys on held-out {a}: {_pct(usage_rate)} of expert selections cold; positional "
                  f"offload of the same {usage.cold_rows} experts per layer (what --cpu-offload-gb does) would see "
                  f"{_pct(pos_rate)}{times}")

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
        trip_at = self.timeline.from_wall(_epoch(rec.get("started_at")))
        self.timeline.add("detect", f"shift to {b} -> drift trip", start,
                          (trip_at if trip_at is not None else self.timeline.now()) - start)
        sig = (rec.get("detail") or {}).get("signals") or {}
        show.note(f"drift detected {(trip_at or self.timeline.now()) - start:.0f} s after the shift: window "
                  f"{(rec.get('detail') or {}).get('window')} saw {_pct(sig.get('cold_rate'))} cold under the {a} map, "
                  f"a map rebuilt from {b} would gain {_pts(sig.get('projected_gain'))}; remap {rec['id']} "
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
                show.note(_step_line(step))
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
        # The first step's wall-clock start places the remap on the timeline; each later step starts where the one
        # before ended, by its (monotonic) seconds: a wall clock stepped mid-remap (NTP, a VM resumed) must not
        # reorder the stages. Seen: the wall clock ran 12 s ahead of the monotonic one during a 4-minute count boot.
        at: float | None = None
        for step in rec.get("steps", []):
            if at is None:
                at = self.timeline.from_wall(_epoch(step.get("at")))
            if at is not None:
                self.timeline.add(f"remap.{step['state']}", f"remap: {step['state'].replace('_', ' ')}", at,
                                  step.get("seconds", 0.0))
                at += float(step.get("seconds") or 0.0)
        self.summary["remap_committed_at_s"] = round(self.timeline.now(), 1)
        outcome = rec.get("outcome")
        show.note(f"{outcome}: {rec.get('outcome_reason') or rec.get('error') or ''}")
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
        d["errors"] = d["errors"][:5]
        return d


def _remap_essentials(rec: dict[str, Any], state_dir: Path) -> dict[str, Any]:
    steps = rec.get("steps") or []
    detail = {s["state"]: s.get("detail") or {} for s in steps}
    verify = rec.get("verify") or {}
    reboot = verify.get("reboot") or {}
    decision = rec.get("decision") or {}
    apply = rec.get("apply") or {}
    first = (apply.get("requests") or [{}])[0]
    return {
        "id": rec.get("id"), "trigger": rec.get("trigger"), "outcome": rec.get("outcome"), "error": rec.get("error"),
        "reason": rec.get("outcome_reason"), "seconds": rec.get("seconds"),
        "steps": [{"state": s["state"], "seconds": s.get("seconds")} for s in steps],
        "record": str(state_dir / "remaps" / f"{rec.get('id')}.json"),
        "count_engine_log": str(state_dir / "remaps" / f"{rec.get('id')}.count-engine.log"),
        "trip": {"window": (rec.get("detail") or {}).get("window"),
                 "cold_rate": ((rec.get("detail") or {}).get("signals") or {}).get("cold_rate"),
                 "projected_gain": ((rec.get("detail") or {}).get("signals") or {}).get("projected_gain")},
        "workload": detail.get("choosing_workload"),
        "count_boot": detail.get("count_boot"),
        "candidate": {**(rec.get("candidate") or {}),
                      "in_sample_cold_rate": (detail.get("building") or {}).get("in_sample_cold_rate")},
        "decision": {k: decision.get(k) for k in ("deploy", "reason", "candidate_cold_rate", "active_cold_rate",
                                                  "gain", "margin", "after_capture_cut", "held_out")},
        "deploy": "in place" if apply.get("outcome") == "applied" else "reboot" if reboot else None,
        "apply": {"outcome": apply.get("outcome"), "reason": apply.get("reason"), "result": first.get("result"),
                  "seconds": first.get("seconds"), "wait_s": first.get("wait_s"), "rows": first.get("rows"),
                  "bytes_moved": first.get("bytes_moved")} if apply else None,
        "reboot": {k: reboot.get(k) for k in ("ok", "hash_hit", "cache_miss", "boot_s", "drain_s", "hold_s",
                                              "held_at_release", "in_flight_cut", "seconds", "rolled_back")}
        if reboot else None,
        "parity": verify.get("parity"),
        "verify": verify.get("cold_rate"),
    }


def _figures(run: _Run, after_windows: list[dict[str, Any]]) -> dict[str, Any]:
    essentials = run.summary["remap"]
    trip = essentials["trip"]["cold_rate"]
    verify = essentials.get("verify") or {}
    after = verify.get("live_cold_rate")
    judged = [w for w in after_windows if w.get("cold_rate") is not None]
    tokens = sum(w.get("tokens") or 0 for w in judged)
    windows_rate = (sum((w["cold_rate"] or 0.0) * (w.get("tokens") or 0) for w in judged) / tokens) if tokens else None
    if after is None:
        after = windows_rate
    ratio = after / trip if after is not None and trip else None
    return {
        "domain_a": (run.summary.get("placement") or {}).get("usage_cold_rate"),
        "positional_domain_a": (run.summary.get("placement") or {}).get("positional_cold_rate"),
        "at_trip": trip, "after": after, "after_windows": windows_rate,
        "predicted": (essentials.get("decision") or {}).get("candidate_cold_rate"),
        "held_out_under_old_map": (essentials.get("decision") or {}).get("active_cold_rate"),
        "ratio": ratio, "required_ratio": REQUIRED_RATIO,
        "ok": ratio is not None and ratio <= REQUIRED_RATIO,
    }


def run_demo(opts: DemoOptions, display: Display | None = None) -> dict[str, Any]:
    """Run the loop and return the summary (also written to ``<workdir>/demo-summary.json``).

    Raises :class:`DemoFailed` (with the summary so far) when the loop does not complete or the figure misses;
    ``KeyboardInterrupt`` goes through, after the daemon and its engines are stopped."""
    show: Display = display if display is not None else _Silent()
    run = _Run(opts, show)
    run.work.mkdir(parents=True, exist_ok=True)
    if run.run_dir.exists():  # the daemon's state of a previous run (its active map, records) must not carry over
        shutil.rmtree(run.run_dir)
    summary = run.summary
    ok = False
    try:
        run.build_model()
        ports, moved = DemoPorts.pick(engine=opts.port, metrics=opts.metrics_port)
        counts = run.count_boot(ports.count)
        map_path, usage, positional = run.build_map(counts)
        for note in moved:
            show.note(note)
        engine_env = run.start_daemon(map_path, ports)
        run.domain_a(engine_env, positional, usage)
        trip = run.detect()
        rec = run.follow_remap(trip["id"])
        state_dir = Path(summary["logs"]["remaps"]).parent
        summary["remap"] = _remap_essentials(rec, state_dir)
        if rec.get("outcome") != "committed":
            raise RuntimeError(f"remap {rec.get('id')} ended {rec.get('outcome')}: "
                               f"{rec.get('outcome_reason') or rec.get('error')} (record: "
                               f"{summary['remap']['record']})")
        summary["cold_rate"] = _figures(run, run.after())
        ok = True
    except KeyboardInterrupt:
        summary["error"] = "interrupted"
        raise
    except Exception as exc:  # any failure: stop everything (below), say what and where the logs are
        expected = isinstance(exc, RuntimeError | TimeoutError | OSError | ValueError)
        summary["error"] = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        log.warning("demo_failed", error=summary["error"], exc_info=not expected)
    finally:
        run.stop()
        summary["timeline"] = run.timeline.as_list()
        summary["windows"] = run.windows
        summary["seconds"] = round(run.timeline.now(), 1)
        summary["ok"] = ok and bool((summary.get("cold_rate") or {}).get("ok")) \
            and (summary.get("requests") or {}).get("failed", 1) == 0
        with contextlib.suppress(OSError):
            atomic_write_json(run.work / "demo-summary.json", summary)
    if not ok:
        logs = summary.get("logs") or {}
        where = f"; logs: {logs.get('daemon')}, {logs.get('engine')}" if logs else ""
        raise DemoFailed(f"{summary.get('error')}{where}", summary)
    figures, requests = summary["cold_rate"], summary.get("requests") or {}
    if not figures["ok"]:
        raise DemoFailed(f"the cold rate after the remap is {_pct(figures['after'])}, not at most "
                         f"{REQUIRED_RATIO:.0%} of the {_pct(figures['at_trip'])} at the trip", summary)
    if requests.get("failed"):
        raise DemoFailed(f"{requests['failed']} of {requests['sent']} requests through the gate failed (first: "
                         f"{(requests.get('errors') or ['?'])[0]})", summary)
    return summary
