"""bench/swap_gpu.py and bench/apply_gpu.py on the CPU with ``--small``, so the in-place remap benchmarks do not rot
between device sessions.

On the CPU both tiers are host memory and there are no streams, so their times mean nothing and the graph and
ordering sections are skipped; what is asserted is that they run through the production apply and that every
identity check holds (outputs against a fresh re-home, every expert's rows, addresses kept), and for the apply
under serving that the batched phase has a batch per pair with steps between them, the unbatched one a single
batch.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any


def _bench(name: str) -> Any:
    """``bench.<name>``, imported when its test runs (they import torch and the hook's swap machinery)."""
    return importlib.import_module(f"bench.{name}")


def test_swap_bench_small_runs_on_cpu(tmp_path: Path) -> None:
    swap_gpu = _bench("swap_gpu")
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


def test_apply_under_serving_bench_small_runs_on_cpu(tmp_path: Path) -> None:
    apply_gpu = _bench("apply_gpu")
    out = tmp_path / "apply_cpu.json"
    assert apply_gpu.main(["--small", "--device", "cpu", "--hold-ms", "0", "--reps", "2", "--gil-load", "1",
                           "--async-steps", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    geo = doc["geometry"]
    rows = geo["layers"] * min(geo["cold"], geo["hot"])
    batched, unbatched = doc["batched"], doc["unbatched"]
    for phase in (batched, unbatched):
        assert phase["rows"] == rows and phase["bytes_moved"] == 2 * rows * geo["expert_bytes"]
        assert phase["identity"]["vs_before"] == "4/4"
        assert phase["identity"]["rows_hold_original_bytes"] == f"{geo['layers'] * geo['experts']}/" \
            f"{geo['layers'] * geo['experts']}"
        assert phase["steps_before"] > 0 and phase["link_GBps"] > 0
        # the steps served mid-apply, recomputed over the final placement (the CPU: ordered by host syncs)
        assert phase["mid_apply_identity"].startswith("identical (") and phase["stream_batches"] == 0
    assert batched["identity"]["vs_fresh_rehome"] == "4/4"
    assert batched["batches"] == rows and batched["steps_during"] >= 1 and batched["hold_budget_ms"] == 0.0
    assert unbatched["batches"] == 1 and unbatched["hold_budget_ms"] is None
    assert doc["target_met"] is False  # the small geometry moves fewer than 800 rows
    # interleaved rounds: batched and one hold alternate, and every figure has its spread over both rounds
    assert len(doc["rounds"]) == 2 and doc["rounds"][0]["batched"] == batched
    assert doc["rounds"][1]["batched"]["identity"]["vs_before"] == "4/4"
    # --gil-load: a busy thread in every phase, and the batched apply again under Python's own switch interval
    switch = doc["rounds"][1]["batched_python_switch"]
    assert switch["switch_interval_ms"] is None and switch["gil_load_threads"] == 1
    assert switch["rows"] == rows and switch["identity"]["vs_before"] == "4/4"
    assert batched["switch_interval_ms"] == apply_gpu.swap.SWITCH_INTERVAL_S * 1e3
    # --async-steps: the batched apply again, ordered by host syncs (on the CPU both orders are host syncs)
    host = doc["rounds"][1]["batched_host_order"]
    assert host["ordering"] == "host" and batched["ordering"] == "stream" and host["async_steps"] is True
    assert host["rows"] == rows and host["identity"]["vs_before"] == "4/4"
    for name in ("batched", "unbatched", "batched_python_switch", "batched_host_order"):
        gap = doc["spread"][name]["longest_gap_ms"]
        assert gap["n"] == 2 and gap["min"] <= gap["median"] <= gap["max"]
        assert gap["values"] == [round(r[name]["longest_gap_ms"], 4) for r in doc["rounds"]]
