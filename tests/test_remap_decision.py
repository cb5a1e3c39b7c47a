"""The deploy decision: out of sample, by the margin, same geometry only; the map library before a count boot."""

from __future__ import annotations

import pytest
from pinsidecar_hook.contract import ArtifactError

from pinsidecar.drift import Window
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import build_candidate
from pinsidecar.remap.decision import decide, pick_from_library
from pinsidecar.testing.artifacts import make_counts, make_map

MARGIN = 0.05


def traffic(domain: int, seed: int, tokens: int = 1500):
    return make_counts(tokens=tokens, domain=domain, seed=seed)


CODE = build_usage_map([traffic(0, 1, 4000)], 48, label="code")
PROSE = build_usage_map([traffic(1, 2, 4000)], 48, label="prose")


def test_deploys_a_better_candidate_with_both_rates_on_the_held_out_window() -> None:
    held = Window.from_counts(traffic(1, 10), 7)
    d = decide(PROSE, CODE, held, MARGIN)
    assert d.deploy and d.reason.startswith("deploy:")
    assert d.candidate_cold_rate < d.active_cold_rate - MARGIN and d.gain == pytest.approx(
        d.active_cold_rate - d.candidate_cold_rate)
    assert d.held_out == {"window": 7, "tokens": 1500, "source": "domain1"}
    assert d.as_dict()["candidate_hash"] == PROSE.content_hash and d.candidate is PROSE


def test_refuses_a_worse_candidate_and_one_under_the_margin() -> None:
    worse = decide(PROSE, CODE, traffic(0, 11), MARGIN)
    assert not worse.deploy and "worse than the active map" in worse.reason
    assert worse.candidate_cold_rate > worse.active_cold_rate
    sibling = build_usage_map([traffic(0, 12, 4000)], 48, label="code-again")  # same traffic, another sample
    close = decide(sibling, CODE, traffic(0, 13), MARGIN)
    assert not close.deploy and "under the margin" in close.reason and abs(close.gain) < MARGIN


def test_refuses_another_geometry_it_would_not_be_a_hash_hit_reboot() -> None:
    other = build_usage_map([traffic(1, 2, 4000)], 40, label="prose-40")
    d = decide(other, CODE, traffic(1, 10), MARGIN)
    assert not d.deploy and "not a hash-hit reboot" in d.reason and "hot_rows 40 vs 48" in d.reason
    assert d.candidate_cold_rate is None and d.active_cold_rate is None


def test_refuses_the_active_map_and_an_in_sample_judgement() -> None:
    assert "is the active map" in decide(CODE, CODE, traffic(0, 3), MARGIN).reason
    window = traffic(1, 20)
    built_from_it = build_candidate([window], CODE, label="from-window")
    d = decide(built_from_it, CODE, window, MARGIN)
    assert not d.deploy and "in-sample" in d.reason


def test_held_out_traffic_of_another_model_is_an_error() -> None:
    with pytest.raises(ArtifactError, match="different models"):
        decide(PROSE, CODE, make_counts(num_experts=32, top_k=4, tokens=100), MARGIN)


def test_build_candidate_keeps_the_active_geometry() -> None:
    active = make_map(4, 64, 48, seed=3, expert_bytes=1024)
    cand = build_candidate([Window.from_counts(traffic(1, 5), 0)], active, label="prose")
    assert cand.same_geometry(active) and cand.label == "prose"


def test_library_first_picks_the_map_of_the_traffic_class_served_now() -> None:
    random_map = make_map(4, 64, 48, seed=5, top_k=8)
    small = build_usage_map([traffic(1, 2, 4000)], 32, label="prose-32")
    d = pick_from_library([random_map, small, CODE, PROSE], CODE, Window.from_counts(traffic(1, 30), 3), MARGIN)
    assert d.deploy and d.source == "library" and d.candidate_label == "prose"
    stay = pick_from_library([random_map, PROSE], CODE, traffic(0, 31), MARGIN)
    assert not stay.deploy and stay.source == "library"  # code traffic: nothing beats the code map
    empty = pick_from_library([CODE, small], CODE, traffic(1, 30), MARGIN)
    assert not empty.deploy and "no library map" in empty.reason
