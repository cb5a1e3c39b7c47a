"""Live windows: closed by tokens or by the time cap, cut by restarts, resets and map changes, never negative."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pinsidecar_hook.contract import StatsSnapshot

from pinsidecar.drift import DriftWatch, Window
from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.windows import LiveSample, LiveWindows, sample_from_reading
from pinsidecar.live_stats import compare
from pinsidecar.testing.artifacts import make_counts, make_map

LAYERS = (0, 1)
E, K = 8, 2


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sample(tokens: int, *, map_hash: str = "m1", restarted: bool = False, reset: bool = False, first: bool = False,
           hist: bool = True, cold: int = 0, seed: int = 0) -> LiveSample:
    rng = np.random.default_rng(seed)
    h = np.stack([rng.multinomial(tokens * K, [1 / E] * E) for _ in LAYERS]) if tokens > 0 else np.zeros((2, E), int)
    return LiveSample(layer_ids=LAYERS, num_experts=E, top_k=K, tokens=tokens, selections=h.sum(axis=1).tolist(),
                      cold_selections=[cold, cold], histogram=h if hist else None, map_hash=map_hash,
                      restarted=restarted, reset=reset, first=first)


def test_windows_close_by_tokens_and_keep_exact_sums() -> None:
    clock = Clock()
    lw = LiveWindows(100, 60.0, clock=clock)
    assert lw.feed(sample(40, seed=1)) == [] and lw.open_tokens == 40
    clock.t += 1
    (w,) = lw.feed(sample(70, seed=2, cold=5))
    assert w.closed_by == "tokens" and w.tokens == 110 and w.index == 0
    assert (w.histogram.sum(axis=1) == 110 * K).all() and w.total_selections == 2 * 220
    assert w.cold_selections.tolist() == [5, 5] and w.map_hash == "m1"
    assert (w.started, w.ended) == (100.0, 101.0)
    assert lw.open_tokens == 0


def test_a_quiet_engine_still_closes_its_window_by_time() -> None:
    clock = Clock()
    lw = LiveWindows(1000, 30.0, clock=clock)
    lw.feed(sample(10))
    clock.t += 29.9
    assert lw.poll() == []
    clock.t += 0.2
    (w,) = lw.poll()
    assert w.closed_by == "time" and w.tokens == 10 and w.duration_s == pytest.approx(30.1)
    assert not w.judgeable(DriftConfig().min_tokens)
    clock.t += 100
    assert lw.poll() == []  # nothing open, nothing emitted: empty windows are never emitted


def test_time_cap_reached_between_readings_puts_the_new_reading_in_the_next_window() -> None:
    clock = Clock()
    lw = LiveWindows(1000, 30.0, clock=clock)
    lw.feed(sample(10))
    clock.t += 45
    (w,) = lw.feed(sample(20))
    assert w.closed_by == "time" and w.tokens == 10 and lw.open_tokens == 20


def test_the_window_starts_at_its_first_token_not_at_the_last_close() -> None:
    clock = Clock()
    lw = LiveWindows(1000, 30.0, clock=clock)
    lw.feed(sample(0))
    clock.t += 500  # an idle engine: no window open, none closed
    assert lw.poll() == []
    lw.feed(sample(5))
    clock.t += 10
    assert lw.poll() == []


@pytest.mark.parametrize(("event", "kwargs"), [("restart", {"restarted": True}), ("reset", {"reset": True}),
                                                ("map_change", {"map_hash": "m2"})])
def test_restart_reset_and_map_change_start_a_new_window(event: str, kwargs: dict) -> None:
    clock = Clock()
    lw = LiveWindows(1000, 60.0, clock=clock)
    lw.feed(sample(300, seed=1))
    (w,) = lw.feed(sample(50, seed=2, **kwargs))
    assert w.closed_by == event and w.tokens == 300
    assert lw.open_tokens == 50  # the reading's counts (since the restart / reset / new map) begin the next window
    (nxt,) = lw.flush()
    assert nxt.tokens == 50 and nxt.map_hash == kwargs.get("map_hash", "m1") and nxt.index == 1


def test_negative_deltas_are_never_read_as_traffic() -> None:
    lw = LiveWindows(1000, 60.0, clock=Clock())
    lw.feed(sample(300, seed=1))
    bad = LiveSample(layer_ids=LAYERS, num_experts=E, top_k=K, tokens=-100, selections=[-200, -200],
                     cold_selections=[0, 0], histogram=-np.ones((2, E), dtype=np.int64), map_hash="m1")
    (w,) = lw.feed(bad)
    assert w.closed_by == "reset" and w.tokens == 300 and (w.histogram >= 0).all()
    assert lw.open_tokens == 0


def test_the_first_reading_is_a_baseline_not_traffic() -> None:
    lw = LiveWindows(100, 60.0, clock=Clock())
    assert lw.feed(sample(5000, first=True, restarted=True)) == [] and lw.open_tokens == 0


def test_a_window_without_histograms_knows_its_cold_rate_only() -> None:
    lw = LiveWindows(100, 60.0, clock=Clock())
    (w,) = lw.feed(sample(150, hist=False, cold=30))
    assert w.histogram is None and w.cold_selections.tolist() == [30, 30]
    with pytest.raises(ValueError, match="PINSIDECAR_STATS_HISTOGRAM"):
        w.to_counts()


def test_adapter_from_a_stats_reading_and_the_watch_end_to_end() -> None:
    """StatsReading -> LiveSample -> window -> record, with the reader's restart rule carried through."""

    def snap(boot: str, seq: int, hist: np.ndarray, cold: list[int]) -> StatsSnapshot:
        return StatsSnapshot(boot_id=boot, seq=seq, layer_ids=list(LAYERS), num_experts=E, top_k=K,
                             selections=hist.sum(axis=1).tolist(), cold_selections=cold,
                             tokens=int(hist[0].sum()) // K, map_hash=emap.content_hash, histogram=hist.tolist())

    emap = make_map(2, E, 6, seed=1, top_k=K)
    h1 = np.full((2, E), 10, dtype=np.int64)
    h2 = h1 + np.arange(E) * 3
    first = compare(None, snap("a", 1, h1, [20, 20]), Path("s.json"))
    second = compare(first.snapshot, snap("a", 2, h2, [30, 30]), Path("s.json"))
    s = sample_from_reading(second, now=5.0)
    assert s.tokens == int((h2 - h1)[0].sum()) // K and (s.histogram == h2 - h1).all()
    assert s.cold_selections == [10, 10] and not s.restarted and s.map_hash == emap.content_hash
    restarted = compare(second.snapshot, snap("b", 1, h1, [20, 20]), Path("s.json"))
    assert sample_from_reading(restarted).restarted

    clock = Clock()
    watch = DriftWatch(DriftConfig(window_tokens=40, min_tokens=20), emap, clock=clock)
    assert watch.feed_reading(None) == [] and watch.feed_reading(first) == []  # baseline
    (rec,) = watch.feed_reading(second)
    assert rec.index == 0 and rec.signals is not None and rec.signals.cold_rate_source == "live"
    assert rec.signals.cold_rate == pytest.approx(20 / (h2 - h1).sum())
    assert watch.status()["last_window"]["index"] == 0


def test_recorded_windows_round_trip_through_counts() -> None:
    counts = make_counts(2, E, K, 300, seed=3)
    w = Window.from_counts(counts, 4, started=1.0, ended=2.0, source="w.json")
    assert w.closed_by == "recorded" and w.cold_selections is None
    back = w.to_counts()
    assert back.digest() == counts.digest()
