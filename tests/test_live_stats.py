"""The daemon's one reader of the stats file: deltas across restarts and resets, the hook's fallback file, one
reader per consumer, tolerance of bad files."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pinsidecar_hook.contract import ArtifactError, fallback_stats_path

from pinsidecar.live_stats import StatsReader, compare, load_newest_stats
from pinsidecar.testing.metrics import make_stats


@pytest.fixture
def paths(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(configured stats path, its fallback); the fallback lives in the system temp dir and is removed after."""
    configured = tmp_path / "stats.json"
    fallback = fallback_stats_path(configured)
    fallback.unlink(missing_ok=True)
    yield configured, fallback
    fallback.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- rules


def test_reader_missing_file_is_none_not_an_error(paths: tuple[Path, Path]) -> None:
    reader = StatsReader(paths[0])
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
    make_stats("boot-a", 1, (16, 16), (4, 2)).save(path)
    r1 = reader.read()
    assert r1 is not None and r1.first and r1.restarted
    assert r1.delta_selections == [16, 16] and r1.cold_ratio == pytest.approx(6 / 32)

    make_stats("boot-a", 2, (36, 36), (4, 12)).save(path)
    r2 = reader.read()
    assert r2 is not None and not r2.restarted and not r2.reset
    assert r2.delta_selections == [20, 20] and r2.delta_cold_selections == [0, 10] and r2.delta_tokens == 20
    assert r2.window_cold_ratio == pytest.approx(10 / 40)
    assert r2.window_cold_ratio_per_layer == [0.0, pytest.approx(0.5)]

    r3 = reader.read()  # no new write: zero window, ratio unknown rather than 0
    assert r3 is not None and r3.delta_selections == [0, 0] and r3.window_cold_ratio is None

    make_stats("boot-b", 1, (4, 4), (1, 1)).save(path)  # new boot: counters restart, never a negative delta
    r4 = reader.read()
    assert r4 is not None and r4.restarted and r4.delta_selections == [4, 4]

    make_stats("boot-b", 5, (2, 2), (0, 0)).save(path)  # same boot, counters went down: a reset
    r5 = reader.read()
    assert r5 is not None and r5.reset and not r5.restarted and r5.delta_selections == [2, 2]


def test_seq_going_backwards_in_same_boot_id_is_a_restart() -> None:
    prev = make_stats("same", 9, (10, 10), (0, 0))
    now = make_stats("same", 3, (40, 40), (0, 0))
    reading = compare(prev, now, Path("x"))
    assert reading.restarted and reading.delta_selections == [40, 40]


def test_error_deltas_are_never_negative_and_survive_a_reset() -> None:
    a = make_stats("b", 1, (10, 10), (1, 1), errors={"stats_write": 2})
    b = make_stats("b", 2, (2, 2), (0, 0), errors={"stats_write": 3, "stats_thread": 1})  # reset: errors stay
    assert compare(a, b, Path("x")).delta_errors == {"stats_write": 1, "stats_thread": 1}
    c = make_stats("b", 3, (3, 3), (0, 0), errors={"stats_write": 1})  # went down: count the new value
    assert compare(b, c, Path("x")).delta_errors == {"stats_write": 1}
    assert compare(None, c, Path("x")).delta_errors == {"stats_write": 1}


def test_reader_histogram_delta() -> None:
    a = make_stats("b", 1, (2, 2), (0, 0))
    a.histogram = [[1, 1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0]]
    b = make_stats("b", 2, (4, 4), (0, 0))
    b.histogram = [[1, 1, 2, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 2]]
    reading = compare(a, b, Path("x"))
    assert reading.delta_histogram is not None
    assert reading.delta_histogram.tolist() == [[0, 0, 2, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 2]]


# ---------------------------------------------------------------------------------------------------- files


def test_rewrites_in_quick_succession_are_all_seen(tmp_path: Path) -> None:
    """Same size, same second, perhaps the same inode: the reader must not serve the previous parse."""
    path = tmp_path / "stats.json"
    reader = StatsReader(path, use_fallback=False)
    for seq in range(1, 6):
        make_stats("b", seq, (10 + seq, 10 + seq), (1, 1), written_at=1000.0).save(path)
        reading = reader.read()
        assert reading is not None and reading.snapshot.seq == seq
        assert reading.delta_selections == ([11, 11] if seq == 1 else [1, 1])


def test_the_fallback_file_is_read_and_the_newer_file_wins(paths: tuple[Path, Path]) -> None:
    configured, fallback = paths
    reader = StatsReader(configured)
    make_stats("b", 1, written_at=1000.0, errors={"stats_write": 1}).save(fallback)
    r1 = reader.read()
    assert r1 is not None and r1.source == fallback and r1.errors == {"stats_write": 1}
    make_stats("b", 2, (150, 250), written_at=1010.0).save(configured)  # the hook can write its path again
    r2 = reader.read()
    assert r2 is not None and r2.source == configured and not r2.restarted and r2.delta_selections == [50, 50]
    assert load_newest_stats(configured).seq == 2


def test_a_leftover_in_the_other_file_is_not_a_restart(paths: tuple[Path, Path]) -> None:
    configured, fallback = paths
    make_stats("b", 3, written_at=1000.0).save(fallback)  # left over from when the hook fell back
    make_stats("b", 9, (400, 500), written_at=1090.0).save(configured)
    reader = StatsReader(configured)
    assert reader.read() is not None
    configured.write_text("{ half-written")  # the newer file cannot be read for a moment
    r = reader.read()
    assert r is not None and not r.restarted and not r.reset and r.delta_selections == [0, 0]
    assert r.snapshot.seq == 9  # the last good reading, not the leftover
    make_stats("b", 10, (410, 510), written_at=1100.0).save(configured)
    r = reader.read()
    assert r is not None and r.delta_selections == [10, 10]


def test_two_readers_of_one_file_each_see_every_change(tmp_path: Path) -> None:
    """The exporter and the drift watch each hold their own reader: readings are per reader."""
    path = tmp_path / "stats.json"
    exporter_side, drift_side = StatsReader(path), StatsReader(path)

    def window(reader: StatsReader) -> list[int]:
        reading = reader.read()
        assert reading is not None
        return reading.delta_selections

    make_stats("b", 1, (100, 100)).save(path)
    assert window(exporter_side) == [100, 100]
    make_stats("b", 2, (130, 130)).save(path)
    assert window(exporter_side) == [30, 30]
    assert window(drift_side) == [130, 130]  # its own first look
    assert window(exporter_side) == [0, 0]
    assert window(drift_side) == [0, 0]


def test_load_newest_stats_names_both_files_when_neither_reads(paths: tuple[Path, Path]) -> None:
    configured, fallback = paths
    with pytest.raises(ArtifactError, match="no readable stats file") as info:
        load_newest_stats(configured)
    assert str(configured) in str(info.value) and str(fallback) in str(info.value)
    make_stats("b", 4, written_at=time.time()).save(fallback)
    assert load_newest_stats(configured).seq == 4
