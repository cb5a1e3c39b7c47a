"""The drift watch and the remaps as metrics: each signal beside its threshold, the detector's state, skew, the remap
in progress; read at scrape time from a real :class:`~pinsidecar.drift.DriftWatch` fed recorded windows."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.drift import DriftWatch, Window
from pinsidecar.drift.config import DriftConfig
from pinsidecar.metrics import Exporter
from pinsidecar.metrics.drift import MAX_LAYER_SERIES, SERIES_METRICS
from pinsidecar.metrics.remap import REMAP_OUTCOMES
from pinsidecar.testing.artifacts import make_counts, make_map

CFG = DriftConfig(window_tokens=1024, min_tokens=256, consecutive_windows=2, cooldown_s=300.0, max_remaps_per_day=6)


def samples(exp: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(exp.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(s: dict, name: str, **labels: str) -> float:
    return s[(name, tuple(sorted(labels.items())))]


def names(s: dict) -> set[str]:
    return {n for n, _ in s}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def watch_with(domains: list[int], cfg: DriftConfig = CFG, hot_rows: int = 48, **counts_kw: Any) -> DriftWatch:
    """A watch over a code-domain map (domain 0), fed one 1024-token window per entry of ``domains``."""
    clock = Clock()
    source = make_counts(tokens=4000, domain=0, seed=99, **counts_kw)
    emap = make_map(hot_rows=hot_rows, counts=source, label="domain0")
    watch = DriftWatch(cfg, emap, reference=source, clock=clock)
    for i, d in enumerate(domains):
        clock.t += 30.0
        win = Window.from_counts(make_counts(tokens=1024, domain=d, seed=i, **counts_kw), i, started=clock.t - 30,
                                 ended=clock.t)
        watch.observe(win)
    return watch


def test_nothing_without_a_watch_and_the_detector_before_the_first_window() -> None:
    exp = Exporter(nvml=None, process_metrics=False)
    assert not any(n.startswith("pinsidecar_drift_") for n in names(samples(exp)))
    exp = Exporter(nvml=None, process_metrics=False, drift=watch_with([]))
    s = samples(exp)
    assert value(s, "pinsidecar_drift_state", state="steady") == 1
    assert value(s, "pinsidecar_drift_remaps_left_today") == 6
    assert "pinsidecar_drift_projected_gain_ratio" not in names(s)  # unknown: left out, not 0


def test_each_signal_beside_its_threshold_on_a_domain_shift() -> None:
    watch = watch_with([0, 0, 1, 1, 1])
    exp = Exporter(nvml=None, process_metrics=False, drift=lambda: watch)
    s = samples(exp)
    rec = watch.last_record
    assert rec is not None and rec.trip and rec.signals is not None
    sig = rec.signals
    # every (value, threshold) pair the detector knows is exported as two series
    for key in sig.series(CFG):
        name = SERIES_METRICS[key][0]
        assert any(n == name for n in names(s)), name
        thresholds = [n for n in names(s) if n.startswith(name + "_") and n.endswith("threshold")]
        assert thresholds, f"no threshold series for {name}"
    assert value(s, "pinsidecar_drift_projected_gain_ratio") == pytest.approx(sig.projected_gain)
    assert value(s, "pinsidecar_drift_projected_gain_ratio_trip_threshold") == CFG.trip_level
    assert value(s, "pinsidecar_drift_projected_gain_ratio_clear_threshold") == CFG.clear_gain
    assert value(s, "pinsidecar_drift_projected_gain_ratio") > CFG.trip_level
    assert value(s, "pinsidecar_drift_divergence", stat="max") == pytest.approx(sig.divergence_max)
    assert value(s, "pinsidecar_drift_divergence", stat="mean") == pytest.approx(sig.divergence_mean)
    assert value(s, "pinsidecar_drift_divergence_threshold") == CFG.divergence_alert
    assert value(s, "pinsidecar_drift_cold_selection_ratio") == pytest.approx(sig.cold_rate)
    assert value(s, "pinsidecar_drift_cold_selection_ratio_threshold") == pytest.approx(
        sig.predicted_cold_rate + CFG.cold_rate_alert)
    assert value(s, "pinsidecar_drift_cold_selection_ratio") > value(s,
                                                                    "pinsidecar_drift_cold_selection_ratio_threshold")
    assert value(s, "pinsidecar_drift_exploitable_skew") == 1
    assert value(s, "pinsidecar_drift_state", state="drifted") == 1
    assert value(s, "pinsidecar_drift_state", state="steady") == 0
    assert value(s, "pinsidecar_drift_consecutive_windows") == 2
    assert value(s, "pinsidecar_drift_consecutive_windows_threshold") == 2
    assert value(s, "pinsidecar_drift_windows_total") == 5
    assert value(s, "pinsidecar_drift_window_tokens") == 1024
    assert value(s, "pinsidecar_drift_window_tokens_threshold") == CFG.min_tokens
    # the trip started a remap: the cooldown runs and the cap has one fewer
    assert value(s, "pinsidecar_drift_cooldown_remaining_seconds") == pytest.approx(300.0)
    assert value(s, "pinsidecar_drift_remaps_left_today") == 5
    assert [value(s, "pinsidecar_drift_layer_divergence", layer=str(i)) for i in range(4)] == pytest.approx(
        sig.divergence_per_layer)


def test_stationary_traffic_stays_under_the_trip_threshold() -> None:
    s = samples(Exporter(nvml=None, process_metrics=False, drift=watch_with([0, 0, 0, 0])))
    assert value(s, "pinsidecar_drift_projected_gain_ratio") < value(
        s, "pinsidecar_drift_projected_gain_ratio_trip_threshold")
    assert value(s, "pinsidecar_drift_state", state="steady") == 1


def test_no_exploitable_skew_is_a_zero() -> None:
    s = samples(Exporter(nvml=None, process_metrics=False, drift=watch_with([0, 0, 0], skew=0.0)))
    assert value(s, "pinsidecar_drift_exploitable_skew") == 0
    assert value(s, "pinsidecar_drift_skew_gap_ratio") < value(s, "pinsidecar_drift_skew_gap_ratio_threshold")


def test_per_layer_series_are_bounded() -> None:
    many = MAX_LAYER_SERIES + 1
    watch = watch_with([0, 0], hot_rows=6, num_layers=many, num_experts=8, top_k=2)
    s = samples(Exporter(nvml=None, process_metrics=False, drift=watch))
    assert "pinsidecar_drift_layer_divergence" not in names(s)
    assert ("pinsidecar_drift_divergence", (("stat", "max"),)) in s


def test_remaps_by_outcome_start_at_zero_and_durations_are_a_histogram() -> None:
    exp = Exporter(nvml=None, process_metrics=False, wall_clock=lambda: 2000.0)
    s = samples(exp)
    assert {value(s, "pinsidecar_remaps_total", outcome=o) for o in REMAP_OUTCOMES} == {0}
    assert value(s, "pinsidecar_remap_running") == 0
    assert "pinsidecar_remap_last_end_timestamp_seconds" not in names(s)
    exp.record_remap("committed", seconds=95.0)
    exp.record_remap("refused")  # R1's old call shape still works: no duration sample
    s = samples(exp)
    assert value(s, "pinsidecar_remaps_total", outcome="committed") == 1
    assert value(s, "pinsidecar_remaps_total", outcome="refused") == 1
    assert value(s, "pinsidecar_remap_duration_seconds_count") == 1
    assert value(s, "pinsidecar_remap_duration_seconds_bucket", le="60.0") == 0
    assert value(s, "pinsidecar_remap_duration_seconds_bucket", le="120.0") == 1
    assert value(s, "pinsidecar_remap_last_end_timestamp_seconds") == 2000.0
    with pytest.raises(ValueError, match="remap seconds"):
        exp.record_remap("committed", seconds=-1.0)


def test_the_running_remap_is_read_at_scrape_time() -> None:
    current: dict[str, Any] | None = {"id": "r1", "trigger": "alert", "state": "count_boot",
                                      "started_at": "2033-05-18T03:33:20Z", "steps": []}
    exp = Exporter(nvml=None, process_metrics=False, remap=lambda: current, wall_clock=lambda: 2_000_000_100.0)
    s = samples(exp)
    assert value(s, "pinsidecar_remap_running") == 1
    assert value(s, "pinsidecar_remap_state", state="count_boot", trigger="alert") == 1
    assert value(s, "pinsidecar_remap_state", state="rebooting", trigger="alert") == 0
    assert value(s, "pinsidecar_remap_running_seconds") == 100.0
    current = {**current, "state": "committed"}
    s = samples(exp)
    assert value(s, "pinsidecar_remap_running") == 0
    assert "pinsidecar_remap_state" not in names(s)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_metrics_is_clean_with_drift_and_remaps() -> None:
    exp = Exporter(nvml=None, process_metrics=False, drift=watch_with([0, 0, 1, 1, 1]),
                   remap=lambda: {"trigger": "drift", "state": "building", "started_at": 1.0})
    exp.record_remap("committed", seconds=10.0)
    proc = subprocess.run(["promtool", "check", "metrics"], input=exp.render(), capture_output=True, timeout=30)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        proc.stdout.decode() + proc.stderr.decode()


def test_signals_are_the_last_judged_windows() -> None:
    watch = watch_with([0, 0, 1, 1, 1])
    gain = watch.last_record.signals.projected_gain  # type: ignore[union-attr]
    short = make_counts(tokens=100, domain=0, seed=50)  # under min_tokens: recorded, not judged
    watch.observe(Window.from_counts(short, 5, started=2000.0, ended=2001.0))
    assert not watch.last_record.judged  # type: ignore[union-attr]
    s = samples(Exporter(nvml=None, process_metrics=False, drift=watch))
    assert value(s, "pinsidecar_drift_window_tokens") == 100 and value(s, "pinsidecar_drift_window_judged") == 0
    assert value(s, "pinsidecar_drift_projected_gain_ratio") == pytest.approx(gain)


def test_auto_remap_off_watches_and_exports_but_never_trips() -> None:
    """``[drift] auto_remap = false``: the detector reaches "drifted" and the signals are exported (an alert rule can
    act on them), but it starts no remap itself."""
    from dataclasses import replace

    watch = watch_with([0, 0, 1, 1, 1], cfg=replace(CFG, auto_remap=False))
    rec = watch.last_record
    assert rec is not None and not rec.trip and rec.state == "drifted"
    assert "drift.auto_remap = false" in (rec.why_not or "")
    assert not any(r.trip for r in watch.records)
    s = samples(Exporter(nvml=None, process_metrics=False, drift=watch))
    assert value(s, "pinsidecar_drift_state", state="drifted") == 1
    assert value(s, "pinsidecar_drift_projected_gain_ratio") > value(
        s, "pinsidecar_drift_projected_gain_ratio_trip_threshold")
    assert value(s, "pinsidecar_drift_remaps_left_today") == CFG.max_remaps_per_day
