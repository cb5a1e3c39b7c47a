"""Remap in place on the real vLLM CPU engine, through a real ``pinsidecar run`` daemon on the demo lane.

One daemon serves the module (:class:`~bench.scenario.remap_lane.RemapLane`; maps of the demo's code and prose
traffic at 48 hot rows and, another geometry, 56), so the engine boots three times in all: the start, the reboot
the geometry change needs, and the supervisor's restart after the engine is killed mid-apply. The engine runs
with live hook faults (:func:`~pinsidecar.testing.hook_faults.live_engine_env`), none until step 3 sets a stall,
so that no restart is needed to inject it. In order:

1. 8 clients stream prose through the gate while an operator names the prose map (same geometry) for the code map
   the engine serves: the remap goes ``evaluating`` -> ``applying`` -> ``verifying`` -> ``committed`` with no
   drain and no boot; no stream waits more than a second between two tokens during the apply, no request fails
   or is lost; the stats report the prose map; the metrics count one apply.
2. The code map with 56 hot rows, named while clients stream code: the hot tensor would change shape, so the
   remap reboots onto it, and the record says why it did not apply in place.
3. The engine is SIGKILLed while the hook holds an apply (a stall injected: ``testing.hook_faults``): the remap ends
   saying so, the supervisor restarts the engine with the committed map (the code map of step 2), never the
   candidate.

The figures are printed, and written to ``$PINSIDECAR_FIGURES_DIR/remap_in_place.json`` when that is set;
``bench/remap_in_place.py`` puts the apply side by side with a drain-reboot on the same daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.scenario.remap_lane import LaneMap, RemapLane, domain_prompts, lane_maps
from pinsidecar.testing import hook_faults

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CLIENTS = 8
MAX_GAP_S = 1.0  # the figure: the longest gap between two streamed tokens during an apply
STALL_S = 120  # the hook holds the apply this long in step 3: the test kills the engine well before


@pytest.fixture(scope="module")
def maps(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LaneMap]:
    return lane_maps(demo_model_dir, tmp_path_factory.mktemp("lane") / "maps")


@pytest.fixture(scope="module")
def lane(demo_model_dir: Path, maps: dict[str, LaneMap]) -> Iterator[RemapLane]:
    tmp = maps["code"].path.parent.parent
    lane = RemapLane(tmp, demo_model_dir, maps["code"].path, engine_env=hook_faults.live_engine_env(tmp / "faults"))
    try:
        st = lane.start()
        assert st["engine"]["map"]["hash"] == maps["code"].hash
        yield lane
    finally:
        stop = lane.stop()
        assert not stop.get("leftover_engines"), stop


def _figure(name: str, doc: dict[str, Any]) -> None:
    print(f"\nREMAP IN PLACE {name}:", json.dumps(doc, indent=1))
    out_dir = os.environ.get("PINSIDECAR_FIGURES_DIR")
    if out_dir:
        path = Path(out_dir) / "remap_in_place.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, name: doc}, indent=1) + "\n")


def _states(rec: dict[str, Any]) -> list[str]:
    return [s["state"] for s in rec["steps"]]


def test_a_same_geometry_map_applies_in_place_while_8_clients_stream(lane: RemapLane,
                                                                   maps: dict[str, LaneMap]) -> None:
    boots = lane.status()["engine"]["boots"]
    fig = asyncio.run(lane.remap_under_load(maps["prose"].path, domain_prompts("prose"), clients=CLIENTS))
    rec = fig.pop("record")
    _figure("apply", {**fig, "apply": rec.get("apply"), "parity": (rec.get("verify") or {}).get("parity"),
                      "states": _states(rec)})
    assert rec["outcome"] == "committed", (rec.get("outcome_reason"), rec.get("apply"))
    assert _states(rec) == ["evaluating", "applying", "verifying"]  # applied in place: never rebooting
    (req,) = rec["apply"]["requests"]
    assert req["result"] == "applied" and req["rows"] > 0 and req["bytes_moved"] > 0, req
    assert rec["apply"]["outcome"] == "applied" and req["rows"] == rec["apply"]["plan"]["rows"]
    assert rec["verify"]["in_place"] and rec["verify"]["parity"]["ok"], rec["verify"]
    assert rec["verify"]["cold_rate"]["status"] in ("verified", "unverified"), rec["verify"]["cold_rate"]
    # the figure: no stream stood still for more than a second during the apply; nothing failed or was lost
    assert fig["longest_gap_within_stream_s"] <= MAX_GAP_S, fig
    assert fig["failed"] == 0 and fig["lost"] == 0 and fig["completed"] == fig["sent"] > 0, fig
    # the engine serves the prose map, without a boot, and the next boot will too
    st = lane.status()
    assert st["engine"]["boots"] == boots and st["engine"]["map"]["hash"] == maps["prose"].hash
    assert st["engine"]["restart_map"] is None
    assert lane.stats()["map_hash"] == maps["prose"].hash
    assert (lane.active_map() or {}).get("hash") == maps["prose"].hash
    assert st["remap"]["last_apply"]["outcome"] == "applied" and st["remap"]["last_apply"]["rows"] == req["rows"]
    text = lane.metrics()
    assert 'pinsidecar_remap_apply_total{outcome="applied"} 1.0' in text
    assert f"pinsidecar_remap_apply_rows_swapped_total {float(req['rows'])}" in text
    assert "pinsidecar_remap_apply_seconds_count 1.0" in text


def test_a_map_of_another_geometry_falls_back_to_a_reboot_saying_why(lane: RemapLane,
                                                                    maps: dict[str, LaneMap]) -> None:
    boots = lane.status()["engine"]["boots"]
    fig = asyncio.run(lane.remap_under_load(maps["code-56"].path, domain_prompts("code"), clients=4))
    rec = fig.pop("record")
    _figure("geometry_change_reboot", {**fig, "apply": rec.get("apply"), "states": _states(rec),
                                       "reboot": (rec.get("verify") or {}).get("reboot")})
    assert rec["outcome"] == "committed", (rec.get("outcome_reason"), rec.get("apply"))
    assert _states(rec) == ["evaluating", "rebooting", "verifying"]
    why = rec["apply"]["reason"]
    assert rec["apply"]["outcome"] == "fell_back_reboot" and rec["apply"]["requests"] == []
    assert why.startswith("cannot apply in place: candidate code-56 has another geometry than the active map prose")
    assert "hot_rows 48 -> 56" in why and why.endswith("; rebooting")
    assert rec["verify"]["reboot"]["ok"] and rec["verify"]["reboot"]["hash_hit"] is False
    assert fig["failed"] == 0 and fig["lost"] == 0, fig  # the gate held them through the reboot
    st = lane.status()
    assert st["engine"]["boots"] == boots + 1 and st["engine"]["map"]["hash"] == maps["code-56"].hash
    assert 'pinsidecar_remap_apply_total{outcome="fell_back_reboot"} 1.0' in lane.metrics()


def test_an_engine_killed_mid_apply_restarts_with_the_committed_map(lane: RemapLane,
                                                                   maps: dict[str, LaneMap]) -> None:
    committed = maps["code-56"]  # what step 2 committed
    faults = lane.tmp / "faults"
    hook_faults.set_live_faults(faults, stall_s=STALL_S)  # the next apply holds the step lock
    st = lane.status()
    assert st["engine"]["map"]["hash"] == committed.hash
    engine_log = lane.state_dir / "engine.log"
    stall_mark = "holding the step lock mid-apply (fault injection)"

    async def action() -> dict[str, Any]:
        await asyncio.to_thread(lane.wait_for_windows, 2)
        remap_id = await asyncio.to_thread(lane.request_remap, maps["prose-56"].path)
        end = time.monotonic() + 300
        while stall_mark not in engine_log.read_text(errors="replace"):  # the hook holds the apply now
            assert time.monotonic() < end, "the hook never stalled in the apply"
            await asyncio.sleep(0.1)
        killed = await asyncio.to_thread(lane.kill_engine)
        hook_faults.set_live_faults(faults)  # none for the engine the supervisor starts next
        return {"remap_id": remap_id, "killed": killed, "record": await asyncio.to_thread(lane.wait_remap_end,
                                                                                          remap_id)}

    from pinsidecar.demo.sidecar import SERVED_MODEL_NAME
    from pinsidecar.testing.streaming import load_during

    result = asyncio.run(load_during(lane.gate_url, SERVED_MODEL_NAME, action, clients=2,
                                     prompts=domain_prompts("prose"), limit_s=900))
    rec = result.action["record"]
    _figure("engine_killed_mid_apply", {"states": _states(rec), "apply": rec.get("apply"),
                                        "reason": rec.get("outcome_reason"), **result.figure()})
    assert rec["outcome"] == "rolled_back" and _states(rec) == ["evaluating", "applying"], rec
    assert rec["outcome_reason"] == "the engine died mid-apply; it restarts with the committed map code-56"
    assert rec["apply"]["outcome"] == "engine_died"
    st = lane.wait("the engine back after the kill", lambda s: s["engine"]["state"] == "ready"
                   and s["engine"]["pid"] != result.action["killed"])
    boot = st["engine"]["last_boot"]
    assert boot["reason"] == "crash" and boot["map_hash"] == committed.hash, boot  # never the candidate
    assert st["engine"]["map"]["hash"] == committed.hash
    assert (lane.active_map() or {}).get("hash") == committed.hash
    assert not (lane.state_dir / "stats.json.request").exists()  # withdrawn: the new engine never saw it
    lane.wait("the new engine's stats", lambda s: lane.stats()["map_hash"] == committed.hash, 120)
    assert 'pinsidecar_remap_apply_total{outcome="engine_died"} 1.0' in lane.metrics()
