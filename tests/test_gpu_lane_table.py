"""docs/results.md's engine tables come from a report (bench/gpu_lane_table.py): checked on the committed FP8 run."""

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


def test_the_results_engine_tables_are_the_committed_interleaved_runs() -> None:
    """docs/results.md's bf16 (2026-12-02) and FP8 (2026-12-01) tables and their ratios are the rendering of the
    committed runs, not a retyping of them; the README's headline figure is the bf16 run's."""
    table = _table()
    results = (REPO / "docs" / "results.md").read_text()
    for name, n_rows in (("gpu_lane_h200_table_2026-12-02.json", 5), ("gpu_lane_h200_fp8-block.json", 6)):
        doc = json.loads((REPO / "bench" / "results" / name).read_text())
        text = table.render(doc)  # type: ignore[attr-defined]
        rows = [line for line in text.splitlines() if line.startswith(("| ", "- "))]
        assert len([r for r in rows if r.startswith("| ")]) == n_rows and all(row in results for row in rows), name
    doc = json.loads((REPO / "bench" / "results" / "gpu_lane_h200_table_2026-12-02.json").read_text())
    ratio = doc["figures_reps"]["usage_over_positional_23pct_1stream"]["median"]
    assert f"**{ratio:.2f}×**" in (REPO / "README.md").read_text()
