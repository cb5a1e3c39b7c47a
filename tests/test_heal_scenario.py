"""The heal scenario's short form on vLLM CPU: a real ``pinsidecar run`` daemon, 2 streaming clients all along,
through a shift from code to prose, the automatic remap it trips (in place), an operator's drain-reboot onto a map
of another geometry, and the engine SIGKILLed under load (:mod:`bench.scenario.heal`; the figures and the
GPU form: ``bench/heal_scenario.py``).

One run, then what must hold of it: the stages ran in order; the remap was the drift watch's own, applied in
place and committed; the drain-reboot deployed the 56-row map; the supervisor restarted the killed engine (a new
pid) with it; no request was lost and no more failed than were in flight at the kill; the JSON document and the
timeline were written, with a sample a second. The daemon asks for the stream-ordered apply
(``[remap.advanced] apply_ordering``): the CPU has no stream, so the hook serves it with host syncs, and the run
shows the key reaching the hook through the request without a refusal.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from bench.scenario.heal import SHORT, STAGES, HealScenario
from bench.scenario.plot import draw_timeline
from bench.scenario.remap_lane import OTHER_HOT_ROWS, lane_maps

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    tmp = tmp_path_factory.mktemp("heal")
    maps = lane_maps(demo_model_dir, tmp / "lane" / "maps")
    scenario = HealScenario(tmp / "lane", demo_model_dir, maps, dataclasses.replace(SHORT, apply_ordering="stream"))
    try:
        scenario.run()
    finally:
        doc = scenario.document()
        out, png = tmp / "heal.json", tmp / "heal.png"
        out.write_text(json.dumps(doc, indent=1) + "\n")
        draw_timeline(doc, png)
        print("\nHEAL SCENARIO:", json.dumps({k: doc[k] for k in ("stages", "requests", "kill", "recovery",
                                                                  "cold_rate")}, indent=1))
    return doc, out, png


def test_the_stages_ran_in_order_and_the_daemon_stopped_clean(run: tuple[dict[str, Any], Path, Path]) -> None:
    doc, _, _ = run
    assert doc["ok"], doc["error"]
    assert doc["stage_order"] == list(STAGES)
    ends = [s["end_s"] for s in doc["stages"]]
    assert ends == sorted(ends) and all(s["seconds"] >= 0 for s in doc["stages"])
    assert not doc["daemon_stop"].get("leftover_engines") and not doc["daemon_stop"].get("killed"), doc["daemon_stop"]


def test_the_drift_watch_tripped_and_the_remap_applied_in_place(run: tuple[dict[str, Any], Path, Path]) -> None:
    rem = run[0]["remap"]
    assert rem["trigger"] == "drift" and rem["outcome"] == "committed", (rem["outcome"], rem["outcome_reason"])
    assert "applying" in rem["states"] and "verifying" in rem["states"] and "rebooting" not in rem["states"], rem
    assert rem["states"][0] == "choosing_workload", rem["states"]
    assert rem["apply"]["outcome"] == rem["apply"]["result"] == "applied" and rem["apply"]["rows"] > 0, rem["apply"]
    assert rem["verify"]["in_place"] and rem["verify"]["parity"]["ok"], rem["verify"]
    waits = {w["state"]: w for w in rem["waits"]}
    req = waits["apply_request"]  # the request's own window lies inside the applying step's
    assert 0 < req["seconds"] <= waits["applying"]["seconds"] and req["hook_wall_s"] > 0, waits
    assert req["longest_gap_s"] <= waits["applying"]["longest_gap_s"], waits


def test_the_drain_reboot_deployed_the_other_geometry(run: tuple[dict[str, Any], Path, Path]) -> None:
    doc = run[0]
    reb = doc["reboot"]
    assert reb["map"] == f"prose-{OTHER_HOT_ROWS}" and reb["ok"], reb
    assert reb["after"]["map_hash"] == reb["map_hash"] == doc["maps"][f"prose-{OTHER_HOT_ROWS}"]["hash"]
    assert reb["hash_hit"] is False  # another geometry (hash_hit: the same one); vLLM's compile cache still hits
    assert reb["boot_s"] > 0 and reb["hold_s"] >= reb["boot_s"]


def test_the_killed_engine_restarted_and_no_request_was_lost(run: tuple[dict[str, Any], Path, Path]) -> None:
    doc = run[0]
    kill, reqs = doc["kill"], doc["requests"]
    assert kill["new_pid"] not in (None, kill["pid"]), kill
    assert kill["last_boot"]["reason"] == "crash", kill["last_boot"]
    assert kill["map_hash"] == doc["reboot"]["map_hash"]  # the committed map, the drain-reboot's
    assert reqs["lost"] == 0 and all(s["lost"] == 0 for s in reqs["per_stage"]), reqs
    assert reqs["failed"] <= kill["in_flight_at_kill"], (reqs, kill)
    assert kill["failed_sent_after_kill"] == 0, kill  # sent to the dying engine, unread: the gate resent them
    assert sum(s["failed"] for s in reqs["per_stage"] if s["stage"] != "kill") == 0, reqs["per_stage"]
    assert reqs["completed"] + reqs["failed"] == reqs["sent"] > 0
    by = {s["stage"]: s for s in reqs["per_stage"]}
    assert all(by[s]["completed"] > 0 for s in ("code", "prose", "end")), by


def test_the_document_and_the_timeline_were_written(run: tuple[dict[str, Any], Path, Path]) -> None:
    doc, out, png = run
    assert json.loads(out.read_text())["checks"] == doc["checks"] and all(doc["checks"].values()), doc["checks"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = doc["samples"]
    wall = doc["stages"][-1]["end_s"] - doc["stages"][1]["start_s"]
    assert len(samples) >= 0.8 * wall, (len(samples), wall)  # one a second, from the load's start
    odd = [s for s in samples if s.get("error") or s.get("took_s", 0) > 1.0]  # what a missing stage would be
    assert {s["stage"] for s in samples} >= set(STAGES[1:-1]), ({s["stage"] for s in samples}, doc["stages"], odd)
    assert sum(s["tokens"] for s in samples) > 0 and any(s["live_cold_rate"] is not None for s in samples)
    rec = doc["recovery"]
    assert rec["baseline_tok_s"] > 0 and "recovery_s" in rec, rec
    cold = doc["cold_rate"]
    assert cold["before"]["windows"] is not None and cold["at_shift"]["windows"] is not None, cold
