"""bench/placement.py on the CPU with ``--small`` (one batch, one budget, one step), so the kernel-level placement
benchmark does not rot between device sessions; and the grouped experts path it uses, split against unsplit.

On the CPU every tier is host memory, so its times mean nothing; what is asserted is that every section ran, that
the placements hold the host bytes they should, and that every step's outputs are bit-identical across placements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pinsidecar.testing import moe


def test_placement_bench_small_runs_on_cpu(tmp_path: Path) -> None:
    from bench import placement

    out = tmp_path / "placement_cpu.json"
    argv = ["--small", "--device", "cpu", "--reps", "1", "--warmup", "0", "--batches", "b1", "--budgets", "23",
            "--out", str(out)]
    assert placement.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["geometry"]["experts"] == 64 and doc["geometry"]["layers"] >= 2
    assert [p["name"] for p in doc["profiles"]] == ["calibrated", "demo"]
    cases = doc["placements"]["cases"]
    names = {(c["placement"], c["profile"]) for c in cases}
    assert names == {(p, prof) for p in ("all_hbm", "positional23", "usage23") for prof in ("calibrated", "demo")}
    for c in cases:
        assert c["reps"] == 1 and c["mean_ms"] > 0
        assert c["bit_identical_steps"] == c["steps_checked"] == 1, c
        if c["placement"] == "all_hbm":
            assert c["unique_cold_experts_per_step"] == 0 and c["cold_bytes_per_step"] == 0
    maps = doc["placements"]["maps"]["calibrated"]["23"]
    assert maps["cold_experts_per_layer_usage"] == 15  # ceil(23 % of 64)
    assert maps["usage_cold_selection_rate_heldout"] < maps["positional_cold_selection_rate_heldout"]
    assert doc["figures"]["bit_identical_fraction"] == 1.0
    assert {r["tokens"] for r in doc["micro"]["rows"]} == {1, 16}
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("cold_fraction", [0.0, 0.3, 1.0])
def test_grouped_split_is_bit_identical_to_grouped_unsplit_on_cpu(cold_fraction: float) -> None:
    from pinsidecar_hook.backends import torch_ref
    from pinsidecar_hook.kernels import grouped

    if not grouped.grouped_mm_available():
        pytest.skip("torch._grouped_mm is missing in this torch")
    g = torch.Generator().manual_seed(3)
    e, d, n, k = 16, 64, 32, 4
    w13 = (torch.randn(e, 2 * n, d, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(e, d, n, generator=g) / 8).to(torch.bfloat16)
    for tokens in (1, 5, 16):
        ids, weights, row_map, hot_rows = moe.routing_case(tokens, k, e, cold_fraction, True, g)
        x = torch.randn(tokens, d, generator=g).to(torch.bfloat16)
        ref = torch_ref.unsplit(x, w13, w2, weights, ids, impl="grouped_mm")
        loop = torch_ref.unsplit(x, w13, w2, weights, ids)
        h13, c13 = moe.rehome_weights(w13, row_map, hot_rows)
        h2, c2 = moe.rehome_weights(w2, row_map, hot_rows)
        out = torch_ref.split(x, h13, h2, c13, c2, weights, ids, row_map, hot_rows, impl="grouped_mm")
        assert torch.equal(out, ref)
        assert (out.float() - loop.float()).norm() <= 1e-2 * loop.float().norm()
