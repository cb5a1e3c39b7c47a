"""The heal scenario's per-second sampler: what the clients and the daemon looked like, second by second.

A :class:`Sampler` thread takes one sample a second: the tokens the clients received in that second (decode
tok/s), the longest wait any stream saw in it (between two tokens, or for a response's first token: what a request
held by the gate sees; a wait still in progress counts), the gate's held and in-flight requests, the live cold
rate (the cold share of the selections since the hook's previous stats write, read from the stats file with a
:class:`~pinsidecar.live_stats.StatsReader` of its own: the hook writes every 5 s, so it is carried between writes)
and the drift watch's newest window. It is a thread of its own so that neither the clients' event loop nor the
scenario's waits for the daemon can delay a sample (:mod:`bench.scenario.heal` starts and stops it). The
daemon's status is fetched by a poller thread of its own and the sampler takes the newest answer: on a loaded
2-core box a status call took up to 2.5 s, and calls made in the sampler's loop once delayed its ticks past a whole
8-s stage, which then had no sample.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from bench.scenario.remap_lane import RemapLane
from pinsidecar.live_stats import StatsReader
from pinsidecar.testing.streaming import ClientStats

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger("bench.scenario.heal")  # the scenario's events, under its logger


STATUS_STALE_S = 5.0  # an older status than this is not the daemon's now: the sample says it had none


class _StatusPoller(threading.Thread):
    """Fetches the daemon's status over and over, keeping the newest answer and when it came. A slow or failing
    call delays only the next call, never a sample."""

    def __init__(self, lane: RemapLane, period_s: float, stop_event: threading.Event) -> None:
        super().__init__(name="heal-status-poller", daemon=True)
        self.lane, self.period_s, self.stop_event = lane, period_s, stop_event
        self.latest: tuple[float, dict[str, Any]] | None = None  # (monotonic time of the answer, status)
        self.error: str | None = None

    def run(self) -> None:
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                st = self.lane.sidecar.status(timeout_s=2.0) if self.lane.sidecar is not None else None
            except Exception as exc:  # keep polling; the samples say the status is missing or stale
                st, self.error = None, f"{type(exc).__name__}: {exc}"
            if st is not None:
                self.latest, self.error = (time.monotonic(), st), None
            self.stop_event.wait(max(0.0, self.period_s - (time.monotonic() - t0)))

    def fresh(self) -> dict[str, Any] | None:
        latest = self.latest
        return latest[1] if latest is not None and time.monotonic() - latest[0] <= STATUS_STALE_S else None


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
        self._status = _StatusPoller(lane, period_s, self.stop_event)

    def run(self) -> None:
        self._status.start()
        prev_t, prev_tokens = time.time(), 0
        tick = time.monotonic()
        while not self.stop_event.is_set():
            tick += self.period_s
            self.stop_event.wait(max(0.0, tick - time.monotonic()))
            now = time.time()
            stage = self.stage()  # the stage at the tick, not after the status call: that can take a while
            tokens = sum(c.tokens for c in self.clients)
            try:
                sample = self._sample(now, prev_t, tokens - prev_tokens, stage)
            except Exception as exc:  # a sample must never end the sampling, nor drop the second: say why
                log.warning("heal_sample_failed", error=str(exc))
                sample = {"t": round(now - self.clock0, 2), "stage": stage, "tokens": tokens - prev_tokens,
                          "tok_s": round((tokens - prev_tokens) / max(1e-6, now - prev_t), 2),
                          "stall_s": round(self._stall(prev_t, now), 3), "live_cold_rate": self._live_cold,
                          "status": False, "error": f"{type(exc).__name__}: {exc}"}
            sample["took_s"] = round(time.time() - now, 3)  # a slow sample shows here, not as a missing stage
            self.samples.append(sample)
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

    def _sample(self, now: float, since: float, tokens: int, stage: str) -> dict[str, Any]:
        dt = max(1e-6, now - since)
        st = self._status.fresh()
        reading = self._reader.read()
        if reading is not None and not reading.first and sum(reading.delta_selections) > 0:
            self._live_cold = reading.window_cold_ratio
        sample: dict[str, Any] = {
            "t": round(now - self.clock0, 2), "stage": stage, "tokens": tokens,
            "tok_s": round(tokens / dt, 2), "stall_s": round(self._stall(since, now), 3),
            "in_flight_clients": sum(1 for c in self.clients if c.requests and c.requests[-1].ended is None),
            "live_cold_rate": self._live_cold, "status": st is not None}
        if st is None and self._status.error:
            sample["status_error"] = self._status.error
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
