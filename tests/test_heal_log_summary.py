"""bench/heal_log_summary.py reads the figures of a heal run from the daemon's log: checked on the H200 run's log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "bench" / "results" / "heal_h200_2026-12-02"


def _mod() -> Any:
    from bench import heal_log_summary

    return heal_log_summary


def test_the_committed_summary_is_what_the_logs_say(tmp_path: Path) -> None:
    mod = _mod()
    out = tmp_path / "s.json"
    mod.main([str(RUN / "daemon.log"), "--stages", str(RUN / "device-call.log"), "--out", str(out)])  # type: ignore[attr-defined]
    got, committed = json.loads(out.read_text()), json.loads((RUN / "summary.json").read_text())
    for key in ("stages_s", "boots", "windows", "cold_rate", "shift_to_trip_s", "shift_to_commit_s", "apply",
                "drain_reboot", "kill"):
        assert got[key] == committed[key], key
    assert list(got["stages_s"]) == ["boot", "code", "shift", "remap", "prose", "reboot", "kill"]
    assert got["apply"]["result"] == "applied" and got["remap"]["outcome"] == "committed"
    assert got["cold_rate"]["after_shift_until_commit_mean"] > 2 * got["cold_rate"]["before_shift_mean"]
    assert got["shift_to_trip_s"] < got["shift_to_commit_s"]


def test_a_log_without_a_remap_has_no_remap_figures() -> None:
    mod = _mod()
    events = [{"event": "engine_ready", "t": 10.0, "seconds": 9.0}, {"event": "drift_window", "t": 12.0, "index": 0,
                                                                    "tokens": 100, "cold_rate": 0.05}]
    doc = mod.summarize(events, {"boot": 1.0, "code": 10.0})  # type: ignore[attr-defined]
    assert doc["boots"] == [{"t": 9.0, "seconds": 9.0, "warmup_s": None}]
    assert "remap" not in doc and "apply" not in doc and "shift_to_trip_s" not in doc
