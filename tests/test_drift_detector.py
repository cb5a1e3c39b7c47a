"""The drift detector's state machine: min tokens, margin, skew, consecutive windows, hysteresis, cooldown, cap."""

from __future__ import annotations

import numpy as np
import pytest

from pinsidecar.drift import NO_SKEW, Window
from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.detector import DriftDetector
from pinsidecar.drift.signals import Signals

CFG = DriftConfig(trip_gain=0.08, clear_gain=0.04, margin=0.05, consecutive_windows=2, cooldown_s=300.0,
                  max_remaps_per_day=3, min_tokens=256)


def sig(gain: float | None, skew: bool = True) -> Signals:
    """Signals as the detector reads them: only the gain and the skew verdict decide."""
    best = 0.05 if skew else 0.24
    return Signals(tokens=1000, uniform_cold_rate=0.25, cold_rate=0.2, cold_rate_source="histogram",
                   predicted_cold_rate=0.05, cold_rate_excess=0.15, divergence_per_layer=[0.1], divergence_max=0.1,
                   divergence_mean=0.1, divergence_reference="source counts", active_cold_rate=0.2,
                   candidate_cold_rate=None if gain is None else 0.2 - gain, projected_gain=gain, candidate_from=0,
                   split_cold_rate=best, best_cold_rate=best, skew_gap=0.25 - best, exploitable_skew=skew)


def win(i: int, tokens: int = 1000) -> Window:
    return Window(index=i, layer_ids=(0,), num_experts=4, top_k=1, tokens=tokens,
                  selections=np.array([tokens]), histogram=np.array([[tokens, 0, 0, 0]]))


class Run:
    """Feeds the detector one window per 60 s of its injected clock."""

    def __init__(self, cfg: DriftConfig = CFG) -> None:
        self.t = 0.0
        self.det = DriftDetector(cfg, clock=lambda: self.t)
        self.i = 0

    def step(self, gain: float | None, skew: bool = True, tokens: int = 1000, dt: float = 60.0):
        self.t += dt
        rec = self.det.observe(win(self.i, tokens), sig(gain, skew))
        self.i += 1
        return rec


def test_consecutive_windows_then_trip_then_one_remap_at_a_time() -> None:
    r = Run()
    a = r.step(0.2)
    assert not a.trip and a.state == "rising" and a.streak == 1 and "1 of 2" in a.why_not
    b = r.step(0.2)
    assert b.trip and b.why_not is None and b.state == "drifted" and b.remap_running
    c = r.step(0.2, dt=1000)
    assert not c.trip and "already running" in c.why_not
    r.det.remap_finished(deployed=True)
    assert r.det.state == "steady" and not r.det.remap_running


def test_a_window_below_the_trip_level_breaks_the_streak() -> None:
    r = Run()
    r.step(0.2)
    rec = r.step(0.06)
    assert rec.state == "steady" and rec.streak == 0 and "< trip level" in rec.why_not
    assert not r.step(0.2).trip  # a new streak starts from one


def test_never_trips_on_a_gain_under_the_margin() -> None:
    cfg = DriftConfig(trip_gain=0.0, clear_gain=0.0, margin=0.05, consecutive_windows=1, cooldown_s=0.0)
    r = Run(cfg)
    assert cfg.trip_level == 0.05
    assert not any(r.step(0.049).trip for _ in range(20))
    assert r.step(0.05).trip


def test_never_trips_without_exploitable_skew() -> None:
    r = Run(DriftConfig(consecutive_windows=1, cooldown_s=0.0))
    for _ in range(10):
        rec = r.step(0.5, skew=False)
        assert not rec.trip and rec.why_not.startswith(NO_SKEW) and rec.judged and rec.state == "steady"


def test_small_windows_are_recorded_but_neither_judged_nor_streak_breaking() -> None:
    r = Run()
    r.step(0.2)
    small = r.step(0.0, tokens=100)
    assert not small.judged and "too few tokens" in small.why_not and small.streak == 1
    assert r.step(0.2).trip


def test_hysteresis_stays_drifted_between_the_levels_and_clears_below() -> None:
    r = Run(DriftConfig(trip_gain=0.08, clear_gain=0.04, margin=0.05, consecutive_windows=1, cooldown_s=0.0))
    assert r.step(0.1).trip
    r.det.remap_finished(deployed=False)  # refused: the drift is still there
    mid = r.step(0.06)
    assert mid.state == "drifted" and not mid.trip and "between clear" in mid.why_not
    low = r.step(0.03)
    assert low.state == "steady" and low.why_not.startswith("cleared")


def test_a_refused_remap_is_retried_only_after_the_cooldown() -> None:
    r = Run(DriftConfig(consecutive_windows=1, cooldown_s=300.0, max_remaps_per_day=10))
    assert r.step(0.2).trip
    r.det.remap_finished(deployed=False)
    blocked = r.step(0.2, dt=100)
    assert not blocked.trip and blocked.state == "drifted" and "cooldown" in blocked.why_not
    assert blocked.cooldown_left_s == pytest.approx(200.0)
    assert r.step(0.2, dt=200).trip


def test_daily_cap_counts_remaps_in_a_rolling_day() -> None:
    r = Run(DriftConfig(consecutive_windows=1, cooldown_s=0.0, max_remaps_per_day=2))
    for _ in range(2):
        assert r.step(0.2).trip
        r.det.remap_finished(deployed=True)
    capped = r.step(0.2)
    assert not capped.trip and "daily cap: 2 remaps" in capped.why_not and capped.remaps_last_day == 2
    assert r.step(0.2, dt=86400).trip  # the first two have left the 24 h window


def test_remaps_off() -> None:
    r = Run(DriftConfig(consecutive_windows=1, max_remaps_per_day=0))
    assert "max_remaps_per_day = 0" in r.step(0.5).why_not
    r = Run(DriftConfig(consecutive_windows=1, enabled=False))
    assert "drift.enabled = false" in r.step(0.5).why_not


def test_a_window_without_a_gain_says_why() -> None:
    r = Run()
    rec = r.step(None)
    assert not rec.trip and not rec.judged and rec.why_not == "no projected gain"
    assert rec.as_dict()["status"].startswith("steady:")
