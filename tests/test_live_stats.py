"""The daemon's one reader of the stats file: deltas across restarts and resets, tolerance of bad files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pinsidecar_hook.contract import StatsSnapshot

from pinsidecar.live_stats import StatsReader, compare

E, K = 8, 2


def _snap(boot: str, seq: int, sel: list[int], cold: list[int], tokens: int) -> StatsSnapshot:
    return StatsSnapshot(boot_id=boot, seq=seq, layer_ids=[0, 1], num_experts=E, top_k=K, selections=sel,
                         cold_selections=cold, tokens=tokens, written_at=time.time())


# ---------------------------------------------------------------------------------------------------- reader


def test_reader_missing_file_is_none_not_an_error(tmp_path: Path) -> None:
    reader = StatsReader(tmp_path / "nothing.json", use_fallback=False)
    assert reader.read() is None and reader.last_error is None


def test_reader_corrupt_file_is_none_with_error(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    path.write_text('{"format": "pinsidecar.stats", "version": 1, "boot_id": "b"')
    reader = StatsReader(path, use_fallback=False)
    assert reader.read() is None
    assert reader.last_error is not None and "stats.json" in reader.last_error


def test_reader_deltas_restart_and_reset(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    reader = StatsReader(path, use_fallback=False)
    _snap("boot-a", 1, [16, 16], [4, 2], 8).save(path)
    r1 = reader.read()
    assert r1 is not None and r1.first and r1.restarted
    assert r1.delta_selections == [16, 16] and r1.cold_ratio == pytest.approx(6 / 32)

    _snap("boot-a", 2, [36, 36], [4, 12], 18).save(path)
    r2 = reader.read()
    assert r2 is not None and not r2.restarted and not r2.reset
    assert r2.delta_selections == [20, 20] and r2.delta_cold_selections == [0, 10] and r2.delta_tokens == 10
    assert r2.window_cold_ratio == pytest.approx(10 / 40)
    assert r2.window_cold_ratio_per_layer == [0.0, pytest.approx(0.5)]

    r3 = reader.read()  # no new write: zero window, ratio unknown rather than 0
    assert r3 is not None and r3.delta_selections == [0, 0] and r3.window_cold_ratio is None

    _snap("boot-b", 1, [4, 4], [1, 1], 2).save(path)  # new boot: counters restart, never a negative delta
    r4 = reader.read()
    assert r4 is not None and r4.restarted and r4.delta_selections == [4, 4]

    _snap("boot-b", 5, [2, 2], [0, 0], 1).save(path)  # same boot, counters went down: a reset
    r5 = reader.read()
    assert r5 is not None and r5.reset and not r5.restarted and r5.delta_selections == [2, 2]


def test_seq_going_backwards_in_same_boot_id_is_a_restart() -> None:
    prev = _snap("same", 9, [10, 10], [0, 0], 5)
    now = _snap("same", 3, [40, 40], [0, 0], 20)
    reading = compare(prev, now, Path("x"))
    assert reading.restarted and reading.delta_selections == [40, 40]


def test_reader_histogram_delta(tmp_path: Path) -> None:
    a = _snap("b", 1, [2, 2], [0, 0], 1)
    a.histogram = [[1, 1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0]]
    b = _snap("b", 2, [4, 4], [0, 0], 2)
    b.histogram = [[1, 1, 2, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 2]]
    reading = compare(a, b, Path("x"))
    assert reading.delta_histogram is not None
    assert reading.delta_histogram.tolist() == [[0, 0, 2, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 2]]
