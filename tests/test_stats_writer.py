"""Pin mode's stats path without an engine: the hook's writer thread.

The writer runs against a real pin-state object holding real counter tensors (what the split invoke fills); the
engine-level checks (exact counts from real traffic, an unwritable directory while serving) are in
``test_pin_cpu.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from pinsidecar_hook.contract import ExpertMap, LayerPlacement, StatsSnapshot, load_stats, write_hook_request
from pinsidecar_hook.contract.env import HookConfig
from pinsidecar_hook.pin import LayerPin
from pinsidecar_hook.stats_writer import StatsWriter, fallback_stats_path

from pinsidecar.live_stats import StatsReader

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
