"""``bench/cpu_tier.py`` on the CPU: its tiny geometry runs and writes what the GPU run fills in (the link figures
and the per-expert comparison need a GPU, so they are absent here, not zero)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import cpu_tier


def test_the_cpu_tier_bench_writes_its_host_figures(tmp_path: Path) -> None:
    out = tmp_path / "cpu_tier.json"
    assert cpu_tier.main(["--out", str(out), "--small", "--reps", "2", "--pool", "4", "--host-gib", "0.05"]) == 0
    r = json.loads(out.read_text())
    assert r["geometry"] == {"hidden": 256, "intermediate": 128, "expert_bytes": 3 * 256 * 128 * 2}
    assert r["host_read_gbps"]["median"] > 0
    assert set(r["cpu_expert_us"]) == {"1", "4", "16"}
    assert all(v["min"] <= v["median"] <= v["max"] for v in r["cpu_expert_us"].values())
    assert "per_expert" not in r and "link_uva_gbps" not in r  # no GPU here: no link, no comparison
