"""Pin mode's stats path without an engine: the hook's writer thread and the daemon's reader.

The writer runs against a real pin-state object holding real counter tensors (what the split invoke fills); the
engine-level checks (exact counts from real traffic, an unwritable directory while serving) are in
``test_pin_cpu.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pinsidecar_hook.artifacts import ExpertMap, LayerPlacement, StatsSnapshot, load_stats, write_hook_request
from pinsidecar_hook.config import HookConfig
from pinsidecar_hook.pin import LayerPin
from pinsidecar_hook.stats_writer import StatsWriter, fallback_stats_path

from pinsidecar.stats import StatsReader, compare

E, K = 8, 2


def _map(tmp_path: Path) -> tuple[ExpertMap, Path]:
    layers = tuple(LayerPlacement(lid, (0, 1, 2, 3, 4, 5), (6, 7)) for lid in (0, 1))
    emap = ExpertMap(layer_ids=(0, 1), num_experts=E, top_k=K, hot_rows=6, layers=layers, label="t")
    path = tmp_path / "map.json"
    emap.save(path)
    return emap, path


def _pin_state(emap: ExpertMap) -> SimpleNamespace:
    layers = [LayerPin(layer_id=lid, name=f"layers.{lid}", row_map=torch.arange(E, dtype=torch.int32), hot_rows=6,
                       cold_rows=2, hot={}, cold={}, expert_counts=torch.zeros(E, dtype=torch.int64),
                       cold_counts=torch.zeros(1, dtype=torch.int64), token_counts=torch.zeros(1, dtype=torch.int64))
              for lid in emap.layer_ids]
    return SimpleNamespace(emap=emap, layers=layers, backend="cpu", tp_size=1,
                           summary={"tier_bytes": {"hbm": 10, "host": 5}, "peak_extra_total_bytes": 3})


def _count(state: SimpleNamespace, tokens: int) -> None:
    for layer in state.layers:
        layer.expert_counts[0] += tokens * K - tokens
        layer.expert_counts[7] += tokens
        layer.cold_counts += tokens
        layer.token_counts += tokens


def _writer(tmp_path: Path, stats_path: Path, histogram: bool = True) -> tuple[StatsWriter, SimpleNamespace, Path]:
    emap, map_path = _map(tmp_path)
    state = _pin_state(emap)
    cfg = HookConfig(mode="pin", map_path=map_path, stats_path=stats_path, flush_interval_s=60.0, histogram=histogram)
    return StatsWriter(state, cfg), state, map_path


class _Records(logging.Handler):
    """Collects the hook logger's records directly (the hook may have set propagate=False on its logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Records:
        logging.getLogger("pinsidecar_hook").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("pinsidecar_hook").removeHandler(self)

    def count(self, fragment: str) -> int:
        return len([r for r in self.records if fragment in r.getMessage()])


def _snap(boot: str, seq: int, sel: list[int], cold: list[int], tokens: int) -> StatsSnapshot:
    return StatsSnapshot(boot_id=boot, seq=seq, layer_ids=[0, 1], num_experts=E, top_k=K, selections=sel,
                         cold_selections=cold, tokens=tokens, written_at=time.time())


# ---------------------------------------------------------------------------------------------------- writer


def test_flush_writes_counters_with_increasing_seq(tmp_path: Path) -> None:
    writer, state, _ = _writer(tmp_path, tmp_path / "stats.json")
    _count(state, 5)
    writer.flush()
    first = load_stats(tmp_path / "stats.json")
    assert first.selections == [10, 10] and first.cold_selections == [5, 5] and first.tokens == 5
    assert first.histogram is not None and first.histogram[0][7] == 5
    assert first.tier_bytes == {"hbm": 10, "host": 5}
    writer.flush()
    assert load_stats(tmp_path / "stats.json").seq == first.seq + 1


def test_histogram_off_leaves_it_out(tmp_path: Path) -> None:
    writer, _state, _ = _writer(tmp_path, tmp_path / "stats.json", histogram=False)
    writer.flush()
    assert load_stats(tmp_path / "stats.json").histogram is None


def test_requests_flush_and_reset_echo_their_token(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    writer, state, _ = _writer(tmp_path, stats)
    _count(state, 3)
    writer.start()
    try:
        token = write_hook_request(stats, "flush")
        snap = _wait(stats, lambda s: s.meta.get("flush_token") == token)
        assert snap.tokens == 3
        token = write_hook_request(stats, "reset")
        snap = _wait(stats, lambda s: s.meta.get("flush_token") == token)
        assert snap.tokens == 0 and snap.selections == [0, 0]
    finally:
        writer.stop()


def _wait(path: Path, pred, timeout_s: float = 10.0) -> StatsSnapshot:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snap = load_stats(path)
            if pred(snap):
                return snap
        except Exception:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never satisfied the condition")


def test_unwritable_dir_counts_error_logs_once_and_uses_fallback(tmp_path: Path) -> None:
    # A regular file where the directory should be: unwritable even for root.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    stats = blocker / "stats.json"
    writer, state, _ = _writer(tmp_path, stats)
    fallback = fallback_stats_path(stats)
    fallback.unlink(missing_ok=True)
    _count(state, 2)
    with _Records() as records:
        assert writer.flush() == fallback
        assert writer.flush() == fallback
    snap = load_stats(fallback)
    assert snap.errors == {"stats_write": 2} and snap.tokens == 2
    assert records.count("cannot write stats") == 1
    # the daemon's reader finds it from the configured path
    reading = StatsReader(stats).read()
    assert reading is not None and reading.source == fallback and reading.errors == {"stats_write": 2}
    assert reading.from_fallback
    fallback.unlink()


def test_map_change_on_disk_is_noticed_once(tmp_path: Path) -> None:
    writer, _state, map_path = _writer(tmp_path, tmp_path / "stats.json")
    writer._check_map_file()
    assert not writer.snapshot().meta["map_changed_on_disk"]
    map_path.write_text(map_path.read_text() + "\n")
    with _Records() as records:
        writer._check_map_file()
        writer._check_map_file()
    assert writer.snapshot().meta["map_changed_on_disk"] is True
    assert records.count("changed on disk") == 1


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
