"""The README's engine table comes from a report (bench/gpu_lane_table.py): checked on the committed FP8 run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "bench" / "results" / "gpu_lane_h200_fp8-block.json"


def _table() -> Any:
    from bench import gpu_lane_table

    return gpu_lane_table


def test_rows_carry_medians_with_their_spread_and_the_ratios() -> None:
    table = _table()
    doc = json.loads(REPORT.read_text())
    text = table.render(doc)  # type: ignore[attr-defined]
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[1] for r in rows][:2] == ["all in HBM (hook off): the bound",
                                                      "usage map, nothing cold (the split's own cost)"]
    off = doc["engines"]["off"]["decode"]["1"]["reps"]["decode_tok_s_per_stream"]
    assert f"{off['median']:.0f} ({off['min']:.0f}-{off['max']:.0f})" in rows[0]
    ratio = doc["figures_reps"]["usage_over_positional_23pct_1stream"]
    assert f"{ratio['median']:.2f}× ({ratio['min']:.2f}-{ratio['max']:.2f}) at 1" in text
    assert "Beats its own bound" not in text


def test_a_row_that_beats_its_bound_is_flagged() -> None:
    table = _table()
    doc = copy.deepcopy(json.loads(REPORT.read_text()))
    u0 = doc["engines"]["u0"]["decode"]["1"]["reps"]["decode_tok_s_per_stream"]
    u0["median"] = doc["engines"]["off"]["decode"]["1"]["reps"]["decode_tok_s_per_stream"]["median"] + 1
    assert table.beats_bound(doc) == [f"u0 at 1 stream(s): {u0['median']:.0f} > bound {u0['median'] - 1:.0f}"]  # type: ignore[attr-defined]
    assert "Beats its own bound" in table.render(doc)  # type: ignore[attr-defined]


def test_the_readmes_bf16_table_is_the_committed_interleaved_run() -> None:
    """The README's 23 % bf16 rows are the rendering of the committed 2026-12-02 run, not a retyping of it."""
    table = _table()
    doc = json.loads((REPO / "bench" / "results" / "gpu_lane_h200_table_2026-12-02.json").read_text())
    rows = [line for line in table.render(doc).splitlines() if line.startswith("| ")]  # type: ignore[attr-defined]
    readme = (REPO / "README.md").read_text()
    assert len(rows) == 5 and all(row in readme for row in rows)
