"""The heal scenario's figures from the daemon's own log, for a run whose scenario document was lost.

``bench/heal_scenario.py`` writes its JSON document (and, since 2026-12-02, one at every stage); a run cut short
before that existed kept only what the daemon logged (JSON lines: every drift window, the trip, each remap step,
the apply's answer, the drain-reboot, the engine's boots and its loss) and the scenario's stage lines in the device
call's log. This reads both and writes the figures they hold: stage start times, every window's cold rate, the
time from the shift to the trip and to the commit, the apply, the reboot, the kill. Per-second tok/s is not in
them (the scenario's sampler had it), so it is not reported.

    python bench/heal_log_summary.py bench/results/heal_h200_2026-12-02/daemon.log \\
        --stages bench/results/heal_h200_2026-12-02/device-call.log --out .../summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["main", "summarize"]

STAGE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \[info\s*\] heal_stage\s+stage=(\w+)")


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "timestamp" in d:
            d["t"] = _t(d["timestamp"])
            out.append(d)
    return out


def _stages(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    out: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = STAGE.match(line.strip())
        if m:
            out.setdefault(m.group(2), _t(m.group(1).replace(" ", "T") + "+00:00"))
    return out


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def summarize(events: list[dict[str, Any]], stages: dict[str, float]) -> dict[str, Any]:
    """The figures of one scenario run from its daemon events and stage start times (epoch seconds)."""
    t0 = stages.get("boot", events[0]["t"] if events else 0.0)
    rel = {k: round(v - t0, 1) for k, v in sorted(stages.items(), key=lambda kv: kv[1])}
    shift = stages.get("shift")
    windows = [{"t": round(e["t"] - t0, 1), "index": e.get("index"), "tokens": e.get("tokens"),
                "cold_rate": round(e.get("cold_rate") or 0.0, 4), "state": e.get("state")}
               for e in events if e.get("event") == "drift_window"]
    boots = [{"t": round(e["t"] - t0, 1), "seconds": e.get("seconds"), "warmup_s": e.get("warmup_s")}
             for e in events if e.get("event") == "engine_ready"]
    reasons = [e.get("detail") for e in events if e.get("event") == "engine_state" and e.get("state") == "starting"]
    for boot, reason in zip(boots, reasons, strict=False):
        boot["reason"] = reason
    trip = next((e for e in events if e.get("event") == "drift_trip"), None)
    steps = [{"done": e.get("done"), "seconds": e.get("seconds")} for e in events if e.get("event") == "remap_step"]
    answer = next((e for e in events if e.get("event") == "remap_apply_answer"), None)
    end = next((e for e in events if e.get("event") == "remap_end"), None)
    reboot = next((e for e in events if e.get("event") == "drain_reboot_end"), None)
    lost = next((e for e in events if e.get("event") == "engine_lost"), None)
    broke = [e for e in events if e.get("event") == "engine response broke off mid-stream"]
    out: dict[str, Any] = {"stages_s": rel, "boots": boots, "windows": windows}
    if shift is not None:
        before = [w["cold_rate"] for w in windows if w["t"] < shift - t0]
        commit_t = end["t"] if end else None
        drifted = [w["cold_rate"] for w in windows if shift - t0 <= w["t"] and (commit_t is None or
                                                                                 w["t"] <= commit_t - t0)]
        after = [w["cold_rate"] for w in windows if commit_t is not None and commit_t - t0 < w["t"]
                 and ("reboot" not in stages or w["t"] < stages["reboot"] - t0)]
        out["cold_rate"] = {"before_shift_mean": _mean(before), "after_shift_until_commit_mean": _mean(drifted),
                            "after_commit_mean": _mean(after), "windows_before": len(before),
                            "windows_after": len(after)}
        out["shift_to_trip_s"] = round(trip["t"] - shift, 1) if trip else None
        out["shift_to_commit_s"] = round(end["t"] - shift, 1) if end else None
    if trip:
        out["trip"] = {"window": trip.get("window"), "gain": trip.get("gain"), "streak": trip.get("streak")}
    if end:
        out["remap"] = {"outcome": end.get("outcome"), "seconds": end.get("seconds"), "reason": end.get("reason"),
                        "steps": steps}
    if answer:
        out["apply"] = {k: answer.get(k) for k in ("result", "rows", "bytes_moved", "layers", "batches",
                                                    "hold_max_s", "seconds", "wall_s", "link_GBps", "wait_s")}
    if reboot:
        out["drain_reboot"] = {k: reboot.get(k) for k in ("ok", "boot_s", "hold_s", "drain_s", "held_at_release",
                                                          "in_flight_cut", "hash_hit", "cache_miss", "map_hash")}
    if lost:
        out["kill"] = {"t": round(lost["t"] - t0, 1), "reason": lost.get("reason"),
                       "streams_broken_off": sum(1 for e in broke if e["t"] >= lost["t"] - 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("daemon_log", type=Path)
    ap.add_argument("--stages", type=Path, help="the log with the scenario's heal_stage lines")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = {"source": str(args.daemon_log), "command": "python bench/heal_log_summary.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), **summarize(_events(args.daemon_log), _stages(args.stages))}
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
