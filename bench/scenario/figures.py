"""The heal scenario's figures: pure functions of what a run recorded (its samples, windows, requests, stages).

:meth:`bench.scenario.heal.HealScenario.document` assembles the document from these; they take what the
run kept, not the run, so that each figure's definition can be read (and checked) in one place: the recovery of
decode throughput after the shift, the requests per stage, the clients' longest waits during a remap state, what
the kill cost, and the cold rates per stage.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.scenario.remap_lane import _epoch
from pinsidecar.testing.streaming import ClientStats, LoadResult, Request

__all__: list[str] = []  # nothing here is another package's business

# The figure's band: decode tok/s is "back" once its rolling median is at least this share of the pre-shift rate.
RECOVERED_SHARE = 0.9


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


def states(rec: dict[str, Any]) -> list[str]:
    return [s["state"] for s in rec.get("steps") or []]


def per_stage(stages: list[dict[str, Any]], samples: list[dict[str, Any]], reqs: list[Request],
              spans: dict[str, tuple[float, float]], wall0: float) -> list[dict[str, Any]]:
    """Requests per stage: sent in it, completed / failed in it (by when they ended), lost (sent in it,
    never ended); and of its samples: the median decode tok/s, the longest wait, the most requests held.
    ``spans``: the stages' unrounded (start, end) from the run's start, where known; ``wall0``: its wall clock."""
    out = []
    for s in stages:
        start, end = spans.get(s["stage"], (s["start_s"], s["end_s"]))
        a, b = wall0 + start, wall0 + end
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


def gaps_in(rec: dict[str, Any], state: str, clients: list[ClientStats], wall0: float) -> dict[str, Any] | None:
    """The longest waits the clients saw while the remap was in ``state`` (its step's wall-clock span):
    between two tokens of a stream, and counting a response's wait for its first token."""
    step = next((x for x in rec.get("steps") or [] if x["state"] == state), None)
    if step is None or not step.get("at"):
        return None
    t0 = _epoch(step["at"])
    t1 = t0 + float(step.get("seconds") or 0.0)
    load = LoadResult(clients, None)
    return {"state": state, "t": round(t0 - wall0, 2), "seconds": round(t1 - t0, 3),
            "longest_gap_within_stream_s": round(load.longest_gap(t0, t1, "token"), 3),
            "longest_gap_s": round(load.longest_gap(t0, t1, None), 3)}


def apply_request_gaps(rec: dict[str, Any], clients: list[ClientStats], wall0: float,
                       baseline: tuple[float, float] | None = None) -> dict[str, Any] | None:
    """The longest waits while the candidate's apply request was out (sent to answered): the hook's batches lie
    inside it, the parity reference and the verify outside, so a long gap in ``applying`` can be told apart.
    ``baseline`` (a wall-clock span with no apply, the same traffic: the prose stage after the commit): the longest
    gap inside a stream in each window of the request's length there, so the apply's gap reads against what the
    traffic alone does (``excess_ms``: the apply's gap minus the windows' median)."""
    reqs = (rec.get("apply") or {}).get("requests") or []
    if not reqs or not reqs[0].get("at"):
        return None
    t0 = _epoch(reqs[0]["at"])
    t1 = t0 + float(reqs[0].get("wait_s") or 0.0)
    load = LoadResult(clients, None)
    out = {"state": "apply_request", "t": round(t0 - wall0, 2), "seconds": round(t1 - t0, 3),
           "hook_wall_s": reqs[0].get("wall_s"), "hold_max_s": reqs[0].get("hold_max_s"),
           "longest_gap_within_stream_s": round(load.longest_gap(t0, t1, "token"), 3),
           "longest_gap_s": round(load.longest_gap(t0, t1, None), 3)}
    if baseline is not None:
        base = load.window_baseline(baseline[0], baseline[1], t1 - t0)
        out["baseline"] = base
        out["excess_ms"] = None if base["median_ms"] is None else round(
            out["longest_gap_within_stream_s"] * 1e3 - base["median_ms"], 2)
    return out


def long_gaps(clients: list[ClientStats], wall0: float, stages: list[dict[str, Any]],
              compiles: list[dict[str, Any]] | None = None, *, min_s: float = 0.25,
              limit: int = 400) -> list[dict[str, Any]]:
    """The ``limit`` longest waits of at least ``min_s`` the clients saw, in time order, each with its stage and
    (given ``compiles``, :func:`bench.scenario.jit_cache.compiles_since` on the run's clock) the kernels
    compiled while it lasted: where serving stood still, and whether a JIT compile was why."""
    found = sorted(((g, n) for n, c in enumerate(clients) for g in c.gaps if g.seconds >= min_s),
                   key=lambda x: -x[0].seconds)[:limit]
    out = []
    for g, n in sorted(found, key=lambda x: x[0].start):
        t, end = g.start - wall0, g.end - wall0
        stage = next((s["stage"] for s in stages if s["start_s"] <= t < s["end_s"]), None)
        item: dict[str, Any] = {"t": round(t, 2), "seconds": round(g.seconds, 3), "kind": g.kind, "client": n,
                                "stage": stage}
        if compiles is not None:
            item["compiles"] = sorted({c["kernel"] for c in compiles if c["t"] <= end and c["t_end"] >= t})
        out.append(item)
    return out


def kill_figures(facts: dict[str, Any] | None, reqs: list[Request]) -> dict[str, Any]:
    """What the SIGKILL cost the clients, from the kill's facts (its wall-clock ``at``, the pids) and the
    requests."""
    kill = dict(facts or {})
    at = kill.pop("at", None)
    if at is None:
        return kill
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


def cold_rates(windows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The judged drift windows' cold rates (median per stage) and the live stats' (median of the samples)."""
    def of(stage: str) -> dict[str, Any]:
        return {"windows": _median([w["cold_rate"] for w in windows if w["stage"] == stage and w["judged"]]),
                "live": _median([s["live_cold_rate"] for s in samples if s["stage"] == stage])}

    return {"source": "windows: the drift watch's judged windows closed in the stage (median); live: the "
                      "cold share since the hook's previous stats write, sampled each second (median)",
            "before": of("code"), "at_shift": of("shift"), "after": of("prose"), "after_reboot": of("reboot")}
