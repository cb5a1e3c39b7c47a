"""What the demo reports: the lines a person reads as it goes, and the figures of its summary.

The loop's stages (:mod:`pinsidecar.demo.stages`) read the daemon's status and remap records; these functions turn
those documents into one line for a person (a closed drift window, a finished remap state) or into the summary's
parts (``demo-summary.json``: the remap's essentials, the cold-rate figures and whether they meet
:data:`REQUIRED_RATIO`, and the one-line verdict). They are pure functions of the documents, so the wording and the
figures can be read (and tested) apart from the engine.

A map's cold rate is shown with what it is: ``in-sample`` (the map scored on the counts it was built from, which
flatters it) or ``held-out`` (scored on a drift window it was not built from, which is what the remap judges and
verifies against). Each map is shown with one of them only, the best it has (:class:`Prediction`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

# The figure: the cold rate after the remap is at most this times the rate at the trip.
REQUIRED_RATIO = 0.5


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} pts"


def secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def short_hash(h: str | None) -> str:
    return (h or "").split(":", 1)[-1][:12] or "-"


@dataclass(frozen=True)
class Prediction:
    """The one figure a map is shown with: its expected cold rate, and what kind of figure it is."""

    cold_rate: float | None
    kind: str  # "in-sample" or "held-out"

    def __str__(self) -> str:
        return f"{self.kind} {pct(self.cold_rate)}"


def window_line(rec: dict[str, Any], prediction: Prediction | None = None) -> str:
    """One closed drift window for a person. ``prediction`` is the figure the demo showed for the map serving it;
    without one, the map's own figure is shown, which is in-sample."""
    w, s = rec.get("window") or {}, rec.get("signals") or {}
    label = rec.get("active_label") or short_hash(rec.get("active_map"))
    head = f"window {rec['index']}: {w.get('tokens', 0):>5} tokens under map {label}"
    shown = prediction or Prediction(s.get("predicted_cold_rate"), "in-sample")
    cold = f"live cold rate {pct(s.get('cold_rate'))} ({shown})"
    if not rec.get("judged"):
        why = rec.get("why_not") or ""
        if why.startswith("too few tokens"):
            return f"{head}, too few to judge"
        if "no earlier window" in why:
            why = "the first window (a rebuilt map is built on the window before)"
        return f"{head}, {cold}; not judged: {why[:80]}"
    line = f"{head}, {cold}, a map rebuilt from the window before would gain {pts(s.get('projected_gain'))}"
    if rec.get("trip"):
        return f"{line}: DRIFT, remap started"
    state = rec.get("state", "")
    if state == "rising":
        return f"{line}: rising ({rec.get('streak')} window)"
    if rec.get("remap_running"):
        return f"{line}: {state} (remap running)"
    return f"{line}: {state}"


def apply_line(d: dict[str, Any]) -> str:
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


def window_brief(rec: dict[str, Any], phase: str) -> dict[str, Any]:
    """One closed drift window as the summary keeps it: its figures, and the demo's phase when it closed."""
    s = rec.get("signals") or {}
    return {"index": rec.get("index"), "phase": phase, "tokens": (rec.get("window") or {}).get("tokens"),
            "judged": rec.get("judged"), "cold_rate": s.get("cold_rate"),
            "predicted_cold_rate": s.get("predicted_cold_rate"), "projected_gain": s.get("projected_gain"),
            "divergence_max": s.get("divergence_max"), "state": rec.get("state"), "trip": rec.get("trip"),
            "map": rec.get("active_label") or short_hash(rec.get("active_map"))}


def step_line(step: dict[str, Any]) -> str:
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
                       f"{d.get('tokens')} routed tokens (engine up in {secs(d.get('boot_s'))})")
    if state == "building":
        return head + (f"new map {d.get('label')} ({short_hash(d.get('hash'))}), same geometry, from "
                       f"{d.get('tokens', 0)} counted tokens")
    if state == "evaluating":
        return head + str(d.get("decision", "")) + (f"; {d['in_place']}" if d.get("in_place") else "")
    if state == "applying":
        return head + apply_line(d)
    if state == "rebooting":
        r, p = d.get("reboot") or {}, d.get("parity") or {}
        hit = "hash hit" if r.get("hash_hit") else "NOT a hash hit"
        miss = "compile-cache MISS" if r.get("cache_miss") else "no cache miss"
        return head + (f"drain + reboot: engine up in {secs(r.get('boot_s'))}, gate held {secs(r.get('hold_s'))} "
                       f"({r.get('held_at_release', 0)} requests waited), {hit}, {miss}; parity "
                       f"{'ok' if p.get('ok') else 'FAILED'} ({p.get('tokens', 0)} tokens of {p.get('prompts', 0)} "
                       "greedy prompts)")
    if state == "verifying":
        c = d.get("cold_rate") or {}
        if c:
            return head + (f"live cold rate {pct(c.get('live_cold_rate'))} over {c.get('tokens')} tokens under "
                           f"the new map (held-out {pct(c.get('predicted_cold_rate'))}): {c.get('status')}")
    return head + ", ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, dict | list))


def remap_essentials(rec: dict[str, Any], state_dir: Path) -> dict[str, Any]:
    """The remap record's essentials for the summary, with where the full record and the count engine's log are."""
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


def cold_rate_figures(summary: dict[str, Any], after_windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure: the cold rate at the trip, after the remap (its verification, else the judged windows
    under the new map), and their ratio against :data:`REQUIRED_RATIO`."""
    essentials = summary["remap"]
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
        "domain_a": (summary.get("placement") or {}).get("usage_cold_rate"),
        "positional_domain_a": (summary.get("placement") or {}).get("positional_cold_rate"),
        "at_trip": trip, "after": after, "after_windows": windows_rate,
        "predicted": (essentials.get("decision") or {}).get("candidate_cold_rate"),
        "held_out_under_old_map": (essentials.get("decision") or {}).get("active_cold_rate"),
        "ratio": ratio, "required_ratio": REQUIRED_RATIO,
        "ok": ratio is not None and ratio <= REQUIRED_RATIO,
    }


def verdict(summary: dict[str, Any]) -> tuple[bool, str]:
    """(passed, the figure that decided it or why it failed): the loop completed, the cold rate after the remap is
    at most :data:`REQUIRED_RATIO` of the rate at the trip, and no request through the gate failed."""
    if summary.get("error"):
        logs = summary.get("logs") or {}
        where = f" (logs: {logs.get('daemon')}, {logs.get('engine')})" if logs else ""
        return False, f"the loop did not complete: {summary['error']}{where}"
    c, q = summary.get("cold_rate") or {}, summary.get("requests") or {}
    if c.get("ratio") is None:
        return False, "no cold rate after the remap to judge"
    figure = (f"cold rate {pct(c.get('at_trip'))} at the trip -> {pct(c.get('after'))} after the remap "
              f"({c['ratio']:.2f}x; the demo needs <= {REQUIRED_RATIO:.2f}x)")
    if not c.get("ok"):
        return False, figure
    if not q.get("sent"):
        return False, "no request went through the gate"
    if q.get("failed") or q.get("completed") != q.get("sent"):
        first = (q.get("errors") or ["?"])[0]
        return False, f"{q.get('failed')} of {q.get('sent')} requests through the gate failed (first: {first})"
    retried = f" ({q['retried']} sent twice: a connection closed unanswered)" if q.get("retried") else ""
    return True, f"{figure}; {q['completed']} of {q['sent']} requests served, none failed{retried}"
