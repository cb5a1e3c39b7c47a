"""Drift signals: the divergence statistic's properties, the out-of-sample gain, the skew verdict."""

from __future__ import annotations

import numpy as np
import pytest
from pinsidecar_hook.contract import ArtifactError

from pinsidecar.drift import Window
from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.signals import cold_rate_on, compute_signals, js_divergence, split_half_cold_rate, top_mask
from pinsidecar.placement import build_usage_map
from pinsidecar.testing.artifacts import make_counts, make_map


def window(i: int = 0, **kwargs) -> Window:
    return Window.from_counts(make_counts(**{"tokens": 1000, "seed": i, **kwargs}), i)


# ------------------------------------------------------------------------------------------- divergence (b)
def test_jensen_shannon_is_symmetric_bounded_and_finite_on_zero_counts() -> None:
    p = np.array([[10, 0, 5, 0], [1, 1, 1, 1], [4, 0, 0, 0]])
    q = np.array([[0, 10, 0, 5], [1, 1, 1, 1], [0, 0, 0, 9]])
    js = js_divergence(p, q)
    assert np.allclose(js, js_divergence(q, p))
    assert js[0] == pytest.approx(1.0) and js[2] == pytest.approx(1.0)  # disjoint support: the bound, 1 bit
    assert js[1] == pytest.approx(0.0)
    assert np.isfinite(js).all()
    assert np.isnan(js_divergence(np.zeros((1, 4)), np.ones((1, 4))))[0]  # nothing to compare: unknown, not 0


def test_divergence_is_small_within_a_domain_and_large_across() -> None:
    ref = make_counts(tokens=5000, domain=0, seed=1)
    active = build_usage_map([ref], 48)
    cfg = DriftConfig()
    same = compute_signals(window(2, domain=0), active, cfg, reference=ref)
    other = compute_signals(window(3, domain=1), active, cfg, reference=ref)
    assert same.divergence_reference == "source counts" and len(same.divergence_per_layer) == 4
    assert same.divergence_max < 0.05 < cfg.divergence_alert < other.divergence_max
    assert other.divergence_mean <= other.divergence_max


# -------------------------------------------------------------------------------------- projected gain (c)
def test_in_sample_gain_flatters_itself_out_of_sample_does_not() -> None:
    """Why the gain is out of sample: on a uniform router, a window's own top experts "beat" the uniform cold
    fraction by pure noise (in sample), while a map built on the previous window does not."""
    hot_rows = 48
    cfg = DriftConfig()
    active = build_usage_map([make_counts(tokens=4000, seed=99, skew=0.0)], hot_rows)
    in_sample, out_of_sample = [], []
    prev = window(0, skew=0.0, tokens=512)
    for i in range(1, 30):
        cur = window(i, skew=0.0, tokens=512)
        in_sample.append(cold_rate_on(top_mask(cur.histogram, hot_rows), cur.histogram))
        s = compute_signals(cur, active, cfg, previous=prev)
        out_of_sample.append(s.candidate_cold_rate)
        prev = cur
    assert np.mean(in_sample) < 0.25 - 0.03  # ~21 % "cold" where any map really sees 25 %
    assert np.mean(out_of_sample) == pytest.approx(0.25, abs=0.01)


def test_gain_needs_a_previous_window_and_says_so() -> None:
    active = make_map(counts=make_counts(tokens=3000, seed=1), hot_rows=48)
    s = compute_signals(window(2), active, DriftConfig())
    assert s.projected_gain is None and s.candidate_cold_rate is None
    assert any("no earlier window" in n for n in s.notes)
    assert s.exploitable_skew is True  # the skew verdict does not need a candidate


def test_gain_after_a_shift_is_large_and_from_the_previous_window() -> None:
    active = make_map(counts=make_counts(tokens=3000, domain=0, seed=1), hot_rows=48)
    prev, cur = window(5, domain=1), window(6, domain=1)
    s = compute_signals(cur, active, DriftConfig(), previous=prev)
    assert s.candidate_from == 5 and s.projected_gain == pytest.approx(s.active_cold_rate - s.candidate_cold_rate)
    assert s.projected_gain > 0.1 and s.exploitable_skew is True
    assert s.cold_rate_source == "histogram" and s.cold_rate == pytest.approx(s.active_cold_rate)


# ------------------------------------------------------------------------------------------- cold rate (a)
def test_cold_rate_is_the_hooks_own_count_when_it_served_the_active_map() -> None:
    active = make_map(counts=make_counts(tokens=3000, seed=1), hot_rows=48)
    w = window(2)
    live = Window(index=0, layer_ids=w.layer_ids, num_experts=w.num_experts, top_k=w.top_k, tokens=w.tokens,
                  selections=w.selections, histogram=None, cold_selections=w.selections // 10,
                  map_hash=active.content_hash)
    s = compute_signals(live, active, DriftConfig())
    assert s.cold_rate_source == "live" and s.cold_rate == pytest.approx(0.1, abs=1e-3)
    assert s.cold_rate_excess == pytest.approx(s.cold_rate - active.predicted_cold_rate)
    assert s.projected_gain is None and s.exploitable_skew is None
    assert any("PINSIDECAR_STATS_HISTOGRAM" in n for n in s.notes)


# ----------------------------------------------------------------------------------------------------- skew
def test_split_half_estimate_is_honest_on_uniform_routing_and_finds_real_skew() -> None:
    flat = make_counts(tokens=1000, seed=3, skew=0.0).counts
    skewed = make_counts(tokens=1000, seed=3, skew=1.2).counts
    assert split_half_cold_rate(flat, 48) == pytest.approx(0.25, abs=0.015)
    assert split_half_cold_rate(skewed, 48) < 0.15
    assert split_half_cold_rate(skewed, 48) == split_half_cold_rate(skewed, 48)  # seeded: replays repeat


def test_the_shift_window_is_not_called_flat() -> None:
    """In the window where traffic shifts, the active map and the previous-window candidate are both fitted to the
    old traffic; the split-half estimate keeps a skewed new domain from being called "no exploitable skew"."""
    active = make_map(counts=make_counts(tokens=3000, domain=0, seed=1), hot_rows=48)
    s = compute_signals(window(5, domain=1), active, DriftConfig(), previous=window(4, domain=0))
    assert s.exploitable_skew is True and s.best_cold_rate == s.split_cold_rate


def test_a_window_of_another_model_is_refused_with_a_clear_error() -> None:
    active = make_map(num_layers=4, num_experts=64, hot_rows=48)
    with pytest.raises(ArtifactError, match="different models"):
        compute_signals(window(0, num_experts=32, top_k=4), active, DriftConfig())


def test_series_pairs_each_signal_with_its_threshold() -> None:
    cfg = DriftConfig()
    active = make_map(counts=make_counts(tokens=3000, seed=1), hot_rows=48)
    s = compute_signals(window(2), active, cfg, previous=window(1))
    series = s.series(cfg)
    assert series["projected_gain"] == (s.projected_gain, cfg.trip_level)
    assert series["skew_gap"] == (s.skew_gap, cfg.skew_margin)
    assert set(series) == {"cold_rate_excess", "divergence_max", "projected_gain", "skew_gap"}
