"""The hook's one side thread (``pinsidecar_hook.flusher``), serving both modes, without an engine.

The flusher runs against the modes' real sources: pin mode's ``PinState`` (its counters are the tensors the split
invoke fills) and count mode's ``CountState`` (the tensors the router capture fills). The engine-level checks
(exact counts from real traffic, an unwritable stats directory while serving, the exit flush) are in
``test_pin_cpu.py`` and ``test_count_mode.py``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from pinsidecar_hook.contract import (
    ExpertMap,
    HookConfig,
    LayerPlacement,
    ModelInfo,
    load_counts,
    load_stats,
    request_and_wait,
    request_path,
    write_hook_request,
)
from pinsidecar_hook.count import CountState
from pinsidecar_hook.flusher import Flusher, WriteInfo
from pinsidecar_hook.pin import LayerPin, PinState

from pinsidecar.live_stats import StatsReader
from pinsidecar.testing.wait import wait_until

E, K = 8, 2


def _map(tmp_path: Path) -> tuple[ExpertMap, Path]:
    layers = tuple(LayerPlacement(lid, (0, 1, 2, 3, 4, 5), (6, 7)) for lid in (0, 1))
    emap = ExpertMap(layer_ids=(0, 1), num_experts=E, top_k=K, hot_rows=6, layers=layers, label="t")
    path = tmp_path / "map.json"
    emap.save(path)
    return emap, path


def _pin_state(tmp_path: Path, stats_path: Path, histogram: bool = True) -> PinState:
    emap, map_path = _map(tmp_path)
    layers = [LayerPin(layer_id=lid, name=f"layers.{lid}", row_map=torch.arange(E, dtype=torch.int32), hot_rows=6,
                       cold_rows=2, hot={}, cold={}, expert_counts=torch.zeros(E, dtype=torch.int64),
                       cold_counts=torch.zeros(1, dtype=torch.int64), token_counts=torch.zeros(1, dtype=torch.int64))
              for lid in emap.layer_ids]
    cfg = HookConfig(mode="pin", map_path=map_path, stats_path=stats_path, flush_interval_s=60.0, histogram=histogram)
    return PinState(emap=emap, layers=layers, backend="cpu", rank=0, tp_size=1, cfg=cfg,
                    summary={"tier_bytes": {"hbm": 10, "host": 5}, "peak_extra_total_bytes": 3})


def _count_state(counts_path: Path) -> CountState:
    cfg = HookConfig(mode="count", counts_path=counts_path, flush_interval_s=60.0, workload="w")
    return CountState([0, 1], cfg, E, K, torch.device("cpu"), writer=True, meta={"expert_bytes": 4},
                      model_info=ModelInfo(path="/m"))


def _pin_traffic(state: PinState, tokens: int) -> None:
    for layer in state.layers:
        layer.expert_counts[0] += tokens * K - tokens
        layer.expert_counts[7] += tokens
        layer.cold_counts += tokens
        layer.token_counts += tokens


def _count_traffic(state: CountState, tokens: int) -> None:
    ids = torch.tensor([[0, 7]] * tokens)
    for i in range(len(state.layer_ids)):
        state.capture_fn(i, None)(ids)


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


# ---------------------------------------------------------------------------------------------------- writes


def test_pin_flush_writes_counters_with_increasing_seq(tmp_path: Path) -> None:
    state = _pin_state(tmp_path, tmp_path / "stats.json")
    flusher = state.make_flusher()
    _pin_traffic(state, 5)
    assert flusher.flush() == tmp_path / "stats.json"
    first = load_stats(tmp_path / "stats.json")
    assert first.selections == [10, 10] and first.cold_selections == [5, 5] and first.tokens == 5
    assert first.histogram is not None and first.histogram[0][7] == 5
    assert first.tier_bytes == {"hbm": 10, "host": 5} and first.boot_id == state.boot_id
    assert first.flush_token == "" and "flush_token" not in first.meta
    flusher.flush()
    assert load_stats(tmp_path / "stats.json").seq == first.seq + 1


def test_histogram_off_leaves_it_out(tmp_path: Path) -> None:
    state = _pin_state(tmp_path, tmp_path / "stats.json", histogram=False)
    state.make_flusher().flush()
    assert load_stats(tmp_path / "stats.json").histogram is None


def test_count_snapshot_is_exact_and_carries_the_write_info(tmp_path: Path) -> None:
    state = _count_state(tmp_path / "counts.json")
    _count_traffic(state, 4)
    art = state.snapshot(WriteInfo(seq=3, flush_token="t", errors={"counts_write": 2})).counts
    assert art.tokens == 4 and art.consistent and art.counts[0].tolist() == [4, 0, 0, 0, 0, 0, 0, 4]
    assert art.flush_token == "t" and art.meta["seq"] == 3 and art.meta["write_errors"] == 2
    assert art.workload == "w" and art.model.path == "/m"


# ---------------------------------------------------------------------------------------------------- requests


def test_one_flusher_class_serves_both_modes_requests(tmp_path: Path) -> None:
    """Count and pin mode run the same thread with the same request semantics: the answer echoes the token in the
    artifact's top-level flush_token, a reset zeroes first, and the request file is gone afterwards."""
    pin = _pin_state(tmp_path, tmp_path / "stats.json")
    count = _count_state(tmp_path / "counts.json")
    flushers = [pin.make_flusher(),
                Flusher(count, tmp_path / "counts.json", interval_s=60.0, name="count", what="counts",
                        write_error_key="counts_write")]
    _pin_traffic(pin, 3)
    _count_traffic(count, 3)
    for f in flushers:
        f.start()
    try:
        for path, load in ((tmp_path / "stats.json", load_stats), (tmp_path / "counts.json", load_counts)):
            flushed = request_and_wait(path, "flush", load, timeout_s=10)
            assert flushed.tokens == 3 and flushed.flush_token.startswith("flush-")
            cleared = request_and_wait(path, "reset", load, timeout_s=10)
            assert cleared.tokens == 0 and cleared.flush_token.startswith("reset-")
            wait_until(lambda p=path: not request_path(p).exists(), "the request file removed", 5.0, step_s=0.05)
    finally:
        for f in flushers:
            f.stop()


def test_token_is_echoed_until_the_next_request_and_never_served_twice(tmp_path: Path) -> None:
    state = _pin_state(tmp_path, tmp_path / "stats.json")
    flusher = state.make_flusher()
    stats = tmp_path / "stats.json"
    token = write_hook_request(stats, "reset")
    assert flusher.serve_request() and not request_path(stats).exists()
    _pin_traffic(state, 2)
    flusher.flush()  # a periodic write keeps the token
    assert load_stats(stats).flush_token == token and load_stats(stats).tokens == 2
    # the same request again (its file could not be removed, say): not served again, so no second reset
    request_path(stats).write_text(json.dumps({"op": "reset", "token": token}))
    assert not flusher.serve_request() and not request_path(stats).exists()
    assert int(state.layers[0].token_counts) == 2


def test_malformed_request_file_is_dropped_and_the_thread_goes_on(tmp_path: Path) -> None:
    state = _count_state(tmp_path / "counts.json")
    flusher = Flusher(state, tmp_path / "counts.json", interval_s=60.0, name="count", what="counts",
                      write_error_key="counts_write")
    request_path(tmp_path / "counts.json").write_text("{not json")
    assert flusher.poll_once(time.monotonic(), time.monotonic() + 60) > 0
    assert not request_path(tmp_path / "counts.json").exists() and flusher.errors == {}


def test_periodic_write_when_the_interval_is_up(tmp_path: Path) -> None:
    state = _count_state(tmp_path / "counts.json")
    flusher = Flusher(state, tmp_path / "counts.json", interval_s=60.0, name="count", what="counts",
                      write_error_key="counts_write")
    now = time.monotonic()
    assert flusher.poll_once(now, now + 1) == now + 1 and flusher.seq == 0  # not yet
    assert flusher.poll_once(now + 2, now + 1) == now + 62 and flusher.seq == 1


def test_a_failing_round_is_counted_and_the_thread_survives(tmp_path: Path) -> None:
    class Broken:
        def snapshot(self, info: WriteInfo):  # type: ignore[no-untyped-def]
            raise RuntimeError("device gone")

        def reset(self) -> None:
            pass

    flusher = Flusher(Broken(), tmp_path / "x.json", interval_s=1.0, name="pin", what="stats",
                      write_error_key="stats_write")
    with _Records() as records:
        for _ in range(3):
            flusher.poll_once(time.monotonic(), 0.0)
    assert flusher.errors == {"flush_thread": 3}
    assert records.count("flush thread error") == 1


# ---------------------------------------------------------------------------------------------------- failures


def test_unwritable_dir_counts_error_logs_once_and_uses_fallback(tmp_path: Path) -> None:
    # A regular file where the directory should be: unwritable even for root.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    stats = blocker / "stats.json"
    state = _pin_state(tmp_path, stats)
    flusher = state.make_flusher()
    fallback = flusher.fallback_path
    assert fallback is not None
    fallback.unlink(missing_ok=True)
    _pin_traffic(state, 2)
    with _Records() as records:
        assert flusher.flush() == fallback
        assert flusher.flush() == fallback
    snap = load_stats(fallback)
    assert snap.errors == {"stats_write": 2} and snap.tokens == 2
    assert records.count("cannot write stats to") == 1
    # the daemon's reader finds it from the configured path
    reading = StatsReader(stats).read()
    assert reading is not None and reading.source == fallback and reading.errors == {"stats_write": 2}
    assert reading.from_fallback
    fallback.unlink()


def test_count_mode_without_fallback_counts_the_error_and_writes_later(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    state = _count_state(blocker / "counts.json")
    flusher = Flusher(state, blocker / "counts.json", interval_s=60.0, name="count", what="counts",
                      write_error_key="counts_write")
    with _Records() as records:
        assert flusher.flush() is None and flusher.flush() is None
    assert flusher.errors == {"counts_write": 2} and records.count("cannot write counts to") == 1
    blocker.unlink()  # the directory becomes writable
    assert flusher.flush() == blocker / "counts.json"
    assert load_counts(blocker / "counts.json").meta["write_errors"] == 2


def test_map_change_on_disk_is_noticed_once(tmp_path: Path) -> None:
    state = _pin_state(tmp_path, tmp_path / "stats.json")
    assert not state.snapshot(WriteInfo(1, "")).meta["map_changed_on_disk"]
    map_path = state.cfg.map_path
    assert map_path is not None
    map_path.write_text(map_path.read_text() + "\n")
    with _Records() as records:
        assert state.snapshot(WriteInfo(2, "")).meta["map_changed_on_disk"] is True
        assert state.snapshot(WriteInfo(3, "")).meta["map_changed_on_disk"] is True
    assert records.count("changed on disk") == 1


@pytest.mark.parametrize("final_flush", [True, False])
def test_stop_ends_the_thread_and_may_write_once_more(tmp_path: Path, final_flush: bool) -> None:
    state = _pin_state(tmp_path, tmp_path / "stats.json")
    flusher = state.make_flusher()
    flusher.start()
    flusher.stop(final_flush=final_flush)
    assert flusher._thread is not None and not flusher._thread.is_alive()
    assert (tmp_path / "stats.json").exists() == final_flush
