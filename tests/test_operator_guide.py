"""The GPU operator guide (docs/gpu-operator.md) runs, block by block, on vllm-cpu with the demo model.

The guide's promise is that every command in it ran (on the H200, through ``scripts/gpu_lane/run_guide.py``); this
test keeps that true between GPU runs: the same runner, the same blocks, with the demo model instead of the lane's
and the CPU engine's settings (float32, eager) in the variables the guide leaves to its environment. What the H200
adds (CUDA graphs, NVML, gigabytes pinned) is not here; what rots first (a renamed flag, a changed status key, a
metric that moved) is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pinsidecar.engine import free_port
from pinsidecar.testing.scripts import load_script

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "gpu-operator.md"
RUNNER = REPO / "scripts" / "gpu_lane" / "run_guide.py"


def _runner() -> Any:
    return load_script(RUNNER, "run_guide")


def test_the_guide_blocks_are_found_in_order_and_parse() -> None:
    run_guide = _runner()
    found = run_guide.blocks(GUIDE.read_text())  # type: ignore[attr-defined]
    headings = [b.heading for b in found]
    for section in ("1. Install", "2. Write the config", "3. Count boot", "4. Build the map", "5. Run the daemon",
                    "6. Send traffic", "7. Status"):
        assert any(h.startswith(section) for h in headings), (section, headings)
    assert not any("systemd" in h for h in headings)  # the systemd steps are text: on paper, never run
    script = run_guide.script(found)  # type: ignore[attr-defined]
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_the_guide_runs_end_to_end_on_vllm_cpu(demo_model_dir: Path, tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheel_dir), str(REPO)], check=True, capture_output=True)
    wheel = next(wheel_dir.glob("pinsidecar-*.whl"))
    home = tmp_path / "home"
    (home / "traffic").mkdir(parents=True)
    (home / "traffic" / "code.jsonl").write_text((REPO / "pinsidecar/demo/fixtures/code.jsonl").read_text())
    ports = [free_port()]
    for _ in range(3):
        ports.append(free_port(ports[-1] + 1))
    env = {**os.environ, "VLLM_PY": sys.executable, "MODEL": str(demo_model_dir), "PS_HOME": str(home),
           "WHEEL": str(wheel), "PIP_INSTALL_ARGS": f"--no-deps --target {tmp_path / 'site'}",
           "DTYPE": "float32", "ENFORCE_EAGER": "true", "HOT_ROWS": "48",
           "ENGINE_PORT": str(ports[0]), "GATE_PORT": str(ports[1]), "CONTROL_PORT": str(ports[2]),
           "METRICS_PORT": str(ports[3])}
    summary = tmp_path / "guide.json"
    log = tmp_path / "guide.log"
    proc = subprocess.run([sys.executable, str(RUNNER), str(GUIDE), "--log", str(log), "--json", str(summary)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    text = log.read_text() if log.exists() else proc.stdout
    daemon_log = home / "daemon.log"
    assert proc.returncode == 0, (text[-4000:], daemon_log.read_text()[-3000:] if daemon_log.exists() else "")
    doc = json.loads(summary.read_text())
    assert doc["exit_code"] == 0 and doc["failed_block"] is None and doc["blocks"] >= 8
    assert "'pinsidecar_hook'" in text  # vLLM's plugin entry point, from the installed wheel
    counts = json.loads((home / "counts" / "code.count_boot.json").read_text())
    assert counts["exact"] is True and counts["tokens"] > 0
    assert (home / "maps" / "code.json").is_file() and (home / "maps" / "code.counts.json").is_file()
    assert '"text_completion"' in text  # the request through the gate was answered
    assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
    assert 'pinsidecar_expert_bytes{tier="host"}' in text
    status = json.loads((home / "status.json").read_text())
    assert status["engine"]["state"] == "ready" and status["pin"]["backend"] == "cpu"
    entries = status["maps"]["entries"]
    assert entries and all(e["valid"] for e in entries), entries  # the guide puts nothing else in the maps folder
