"""bench/swap_gpu.py on the CPU with ``--small``, so the in-place remap benchmark does not rot between device sessions.

On the CPU both tiers are host memory and there are no streams, so its times mean nothing and the graph and
ordering sections are skipped; what is asserted is that it runs through the production apply and that every
identity check holds (outputs against a fresh re-home, every expert's rows, addresses kept).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_swap_bench_small_runs_on_cpu(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import swap_gpu
    finally:
        sys.path.pop(0)
    out = tmp_path / "swap_cpu.json"
    assert swap_gpu.main(["--small", "--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["geometry"]["experts"] == 32 and doc["geometry"]["cold"] == 12
    assert [s["rows"] for s in doc["swaps"]] == [2, 20, 24]  # 1, 10 and (capped at the 12 cold rows) 12 per layer
    assert all(s["applies"] == 2 and s["bytes_moved"] == 2 * s["rows"] * doc["geometry"]["expert_bytes"]
               for s in doc["swaps"])
    identity = doc["identity"]
    for key in ("after_apply_vs_fresh_rehome", "after_apply_vs_before", "after_swap_back_vs_before"):
        assert identity[key] == "16/16", (key, identity)
    assert identity["experts_rows_hold_original_bytes"] == "64/64"
    assert doc["addresses_kept"] is True and "graph" not in doc and "ordering" not in doc
