"""bench/gpu_lane.py end to end on vLLM CPU with the tiny demo model (``--small``), so the GPU lane's script does
not rot between device sessions: count boot with exact counts, usage and positional maps, the placements booted and
measured, token identity against the hook-off engine, live stats, the report and its plot.

On the CPU every placement is host memory, so the tok/s here mean nothing; what is asserted is that every part of
the pipeline ran and that its correctness checks hold. Four engine boots: a few minutes on a 2-core box.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent


def test_gpu_lane_small_runs_end_to_end(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_lane
    finally:
        sys.path.pop(0)
    out = tmp_path / "out"
    assert gpu_lane.main(["--small", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    doc = json.loads((out / "gpu_lane_vllm_cpu.json").read_text())
    engines = doc["engines"]
    assert set(engines) == {"count", "off", "p23", "u23"}
    for workload in ("code", "prose"):  # the count boot's counts are exact
        assert engines["count"]["workloads"][workload]["exact"], engines["count"]["workloads"][workload]
    live = engines["u23"]["live"]
    assert live["tokens_exact"] and live["selections_exact"] and 0 < live["cold_rate"] < 1
    assert live["backend"] == "cpu"
    assert doc["figures"]["token_identity_all_placements"] == 1.0
    for name in ("off", "p23", "u23"):
        assert engines[name]["decode"]["1"]["decode_tok_s_per_stream"] > 0
        assert engines[name]["decode"]["4"]["output_tok_s"] > 0
    p23, u23 = doc["placements"]["p23"], doc["placements"]["u23"]
    assert p23["params"] >= 1 and p23["usage_map_host_bytes"] == u23["host_bytes"] > 0
    assert (out / "gpu_lane_vllm_cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert doc["command"].startswith("python ") and doc["date"]
