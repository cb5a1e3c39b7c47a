"""Remap in place against drain-reboot: what 8 streaming clients see during each, on one daemon, in one run.

The CPU demo lane (:class:`~bench.scenario.remap_lane.RemapLane`: a real ``pinsidecar run`` daemon, the vLLM
CPU engine on the demo model, maps of the demo's code and prose traffic built from its routing). Each round, with
``--clients`` clients streaming prose through the gate:

1. **in place**: an operator names the prose map while the code map serves (``POST /remap``); the remap applies it
   in place (the hook swaps the rows that change between the tiers while the engine keeps serving), checks parity
   on the same engine, verifies and commits;
2. **drain-reboot**: the control API's drain-reboot back onto the code map (the deploy a remap falls back to):
   the gate holds new requests, in-flight ones drain, the engine reboots, the gate releases.

For both, the figures are taken over the deploy itself (the apply request from sent to answered; the drain-reboot
call): the longest gap between two tokens a client saw (``longest_gap_s``, counting the wait for a response's
first token, which is what a request held by the gate sees; ``longest_gap_within_stream_s`` only between two
tokens of one response), and the requests failed and lost over the whole run around it. For the apply also the
hook's own seconds (how long it held the engine's step), the rows swapped and the bytes moved.

Run: ``python bench/remap_in_place.py [--rounds 1] [--clients 8] [--model DIR]
[--out bench/results/remap_in_place_vllm_cpu.json]``. Prints the JSON document and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root, so that siblings import as bench.<name>
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scenario.remap_lane import RemapLane, domain_prompts, lane_maps

__all__ = ["main"]

TARGET_APPLY_GAP_S = 1.0  # the target: at most this during an apply ...
TARGET_REBOOT_GAP_S = 20.0  # ... against at least this during a drain-reboot on the same box


def _engine_version() -> str:
    try:
        from importlib.metadata import version

        return f"vllm-cpu {version('vllm-cpu')}"
    except Exception:  # missing metadata: say so, the figure stands without it
        return "vllm (version unknown)"


async def _round(lane: RemapLane, n: int, clients: int, maps: dict[str, Any]) -> dict[str, Any]:
    prompts = domain_prompts("prose")
    load0 = os.getloadavg()[0]
    applied = await lane.remap_under_load(maps["prose"].path, prompts, clients=clients)
    rec = applied.pop("record")
    req = ((rec.get("apply") or {}).get("requests") or [{}])[0]
    in_place = {**applied, "load1_before": round(load0, 2), "remap": rec["id"], "outcome": rec["outcome"],
                "states": [s["state"] for s in rec["steps"]], "apply_outcome": (rec.get("apply") or {}).get("outcome"),
                "apply_seconds": req.get("seconds"), "apply_wait_s": req.get("wait_s"), "rows": req.get("rows"),
                "bytes_moved": req.get("bytes_moved"), "parity": (rec.get("verify") or {}).get("parity")}
    if rec["outcome"] != "committed" or in_place["apply_outcome"] != "applied":
        raise SystemExit(f"round {n}: the remap did not apply in place: {rec.get('outcome_reason')} "
                         f"({rec.get('apply')})")
    load1 = os.getloadavg()[0]
    rebooted = await lane.drain_reboot_under_load(maps["code"].path, prompts, clients=clients)
    dr = rebooted.pop("drain_reboot")
    drain = {**rebooted, "load1_before": round(load1, 2),
             **{k: dr.get(k) for k in ("ok", "seconds", "drain_s", "boot_s", "hold_s", "held_at_release",
                                       "in_flight_cut", "hash_hit")}}
    return {"round": n, "in_place": in_place, "drain_reboot": drain}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the demo model)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/remap_in_place_vllm_cpu.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pinsidecar-remap-in-place-") as td:
        tmp = Path(td)
        model = args.model
        if model is None:
            from pinsidecar.demo.model import build_demo_model

            model = Path(build_demo_model(tmp / "model"))
        maps = lane_maps(model, tmp / "lane" / "maps", hot_rows=(48,))
        lane = RemapLane(tmp / "lane", model, maps["code"].path)
        t0 = time.monotonic()
        rounds: list[dict[str, Any]] = []
        try:
            st = lane.start()
            boot_s = (st["engine"].get("last_boot") or {}).get("seconds")
            for n in range(1, args.rounds + 1):
                rounds.append(asyncio.run(_round(lane, n, args.clients, maps)))
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
        finally:
            stop = lane.stop()
    apply_gap = max(r["in_place"]["longest_gap_s"] for r in rounds)
    reboot_gap = min(r["drain_reboot"]["longest_gap_s"] for r in rounds)
    doc = {
        "figure": "remap_in_place_vs_drain_reboot_under_load",
        "engine": f"{_engine_version()}, demo model (float32, enforce_eager), process launcher",
        "command": "python bench/remap_in_place.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg()},
        "clients": args.clients,
        "note": "gaps are over the deploy itself (the apply request from sent to answered; the drain-reboot call); "
                "longest_gap_s counts a response's wait for its first token (a request the gate holds waits there), "
                "longest_gap_within_stream_s only gaps between two tokens of one response; failed/lost are over the "
                "whole load around the deploy",
        "initial_boot_s": boot_s,
        "rounds": rounds,
        "summary": {
            "in_place_longest_gap_s": apply_gap,
            "in_place_longest_gap_within_stream_s": max(r["in_place"]["longest_gap_within_stream_s"] for r in rounds),
            "in_place_failed": sum(r["in_place"]["failed"] for r in rounds),
            "in_place_lost": sum(r["in_place"]["lost"] for r in rounds),
            "apply_seconds": [r["in_place"]["apply_seconds"] for r in rounds],
            "rows": [r["in_place"]["rows"] for r in rounds],
            "bytes_moved": [r["in_place"]["bytes_moved"] for r in rounds],
            "drain_reboot_longest_gap_s": reboot_gap,
            "drain_reboot_failed": sum(r["drain_reboot"]["failed"] for r in rounds),
            "drain_reboot_lost": sum(r["drain_reboot"]["lost"] for r in rounds),
            "drain_reboot_boot_s": [r["drain_reboot"]["boot_s"] for r in rounds],
            "target": f"apply gap <= {TARGET_APPLY_GAP_S:g} s vs drain-reboot gap >= {TARGET_REBOOT_GAP_S:g} s",
            "target_met": apply_gap <= TARGET_APPLY_GAP_S and reboot_gap >= TARGET_REBOOT_GAP_S,
        },
        "seconds": round(time.monotonic() - t0, 1),
        "daemon_stop": stop,
    }
    text = json.dumps(doc, indent=1) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return doc


if __name__ == "__main__":
    main()
