"""The pure parts of bench/apply_engine.py (the engine run is in tests/test_swap_engine.py): the baseline's windows,
the gap figures over recorded client gaps, the complement map, and the pair argument."""

from __future__ import annotations

from pathlib import Path

import pytest
from pinsidecar_hook.contract import plan_swap

from bench.apply_engine import _maps, complement_map, gap_figures
from pinsidecar.testing.artifacts import make_map
from pinsidecar.testing.streaming import ClientStats, Gap, LoadResult


def test_the_baseline_windows_have_the_apply_length_and_end_at_the_apply() -> None:
    # one 30 ms gap in each of [1,4] [4,7] [7,10] (from the end back), 90 ms before 1 s: outside every window
    load = _load([(0.5, 0.59, "token"), (2.0, 2.03, "token"), (5.0, 5.03, "token"), (8.0, 8.03, "token")])
    assert load.window_baseline(0.0, 10.0, 3.0) == {"windows": 3, "median_ms": pytest.approx(30.0),
                                                     "max_ms": pytest.approx(30.0)}
    assert load.window_baseline(5.0, 6.0, 2.0) == {"windows": 0, "median_ms": None, "max_ms": None}
    assert load.window_baseline(0.0, 10.0, 0.0)["windows"] == 0


def _load(gaps: list[tuple[float, float, str]]) -> LoadResult:
    c = ClientStats()
    c.gaps = [Gap(a, b, kind) for a, b, kind in gaps]
    return LoadResult([c], None)


def test_gap_figures_compare_the_apply_with_equal_quiet_windows() -> None:
    # quiet time 0..9 s, apply request 9..10 s: windows [8,9] [7,8] ... [0,1]; a 40 ms gap in one of nine windows,
    # 20 ms in the rest; 100 ms during the apply; a first-token wait of 500 ms is not a gap inside a stream
    gaps = [(t + 0.5, t + 0.52, "token") for t in range(9) if t != 3] + [(3.5, 3.54, "token"),
                                                                         (9.3, 9.4, "token"), (9.5, 10.0, "first")]
    fig = gap_figures(_load(gaps), 9.0, 10.0, 0.0)
    assert fig["gap_ms"] == pytest.approx(100.0)
    assert fig["baseline"]["windows"] == 9 and fig["baseline"]["median_ms"] == pytest.approx(20.0)
    assert fig["baseline"]["max_ms"] == pytest.approx(40.0) and fig["excess_ms"] == pytest.approx(80.0)
    short = gap_figures(_load(gaps), 9.0, 10.0, 8.5)  # no room for a window: no baseline, no excess
    assert short["baseline"]["windows"] == 0 and short["excess_ms"] is None


def test_complement_moves_every_cold_row_and_keeps_the_geometry() -> None:
    a = make_map(num_layers=3, num_experts=16, hot_rows=10, seed=4)
    b = complement_map(a)
    assert b.same_geometry(a) and b.content_hash != a.content_hash
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert set(la.cold) <= set(lb.hot) and set(lb.cold) <= set(la.hot)
    assert plan_swap(a, b).rows == 3 * 6  # every cold row of every layer
    with pytest.raises(ValueError, match="hot_rows >= cold_rows"):
        complement_map(make_map(num_layers=1, num_experts=16, hot_rows=4, seed=1))


def test_pair_argument() -> None:
    assert _maps("u=a.json,b.json:1,16") == ("u", Path("a.json"), Path("b.json"), [1, 16])
    assert _maps("c=a.json") == ("c", Path("a.json"), None, None)  # B: the complement; --clients
    with pytest.raises(SystemExit, match=r"NAME=A\.json"):
        _maps("nothing")


def test_a_pair_that_cannot_apply_is_its_own_result_and_boots_nothing(tmp_path: Path) -> None:
    import json

    from bench.apply_engine import main

    make_map(num_layers=2, num_experts=16, hot_rows=10, seed=1).save(tmp_path / "a.json")
    make_map(num_layers=2, num_experts=16, hot_rows=8, seed=2).save(tmp_path / "b.json")
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit, match="a pair failed"):
        main(["--model", str(tmp_path), "--pair", f"x={tmp_path / 'a.json'},{tmp_path / 'b.json'}",
              "--work", str(tmp_path / "w"), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert "different geometries" in doc["pairs"]["x"]["error"]
