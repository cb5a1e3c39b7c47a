"""The drift watch as metrics: each drift signal beside its threshold, the detector's state, "no exploitable skew".

The watch (the daemon's :class:`~pinsidecar.drift.DriftWatch`) is a live input read at scrape time, like every
other source: no gauge is pushed, so a scrape always shows the watch as it is now, and nothing is left stale when
the watch is replaced (a new map) or goes away (count mode).

Why "a signal and its threshold as two series": a dashboard draws them as two lines on one panel, and an alert
rule compares them (``signal > signal_threshold``) without copying a number out of the config into the rule, so
retuning ``[drift]`` moves the alert with it. The pairs come from :meth:`~pinsidecar.drift.Signals.series`, the
detector's own table, and a signal added there is exported even before it gets a name here
(``pinsidecar_drift_<key>`` + ``_threshold``).

Cardinality is bounded: every family has either no labels or a label with a fixed set of values (``state``,
``stat``), except the per-layer divergence, which is exported only up to :data:`MAX_LAYER_SERIES` layers
(every MoE model we know has at most ~100 MoE layers; a model with more gets the max and mean only).

The remaps themselves (outcomes, durations, the one in progress) are :mod:`pinsidecar.metrics.remap`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from pinsidecar_hook.contract import ExpertMap
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.detector import STATES, WindowRecord

__all__: list[str] = []  # nothing here is another package's business

# Per-layer divergence series only up to this many layers: one series per MoE layer is what a heatmap needs, and
# the largest MoE models have ~60-100 MoE layers; beyond this only max and mean are exported.
MAX_LAYER_SERIES = 128

# Signals.series() key -> (metric name, help). The threshold series is "<name>_threshold", except for the
# projected gain, which has two (trip and clear: the detector's hysteresis).
SERIES_METRICS: dict[str, tuple[str, str]] = {
    "cold_rate_excess": ("pinsidecar_drift_cold_selection_excess_ratio",
                         "Signal a: the last window's live cold-selection ratio minus the active map's prediction."),
    "divergence_max": ("pinsidecar_drift_divergence",
                       "Signal b: Jensen-Shannon divergence (bits) between the last window and the active map's "
                       "source counts, over layers (stat=max|mean)."),
    "projected_gain": ("pinsidecar_drift_projected_gain_ratio",
                       "Signal c (decides): cold-ratio points a map rebuilt from the previous window would save on "
                       "the last window, out of sample."),
    "skew_gap": ("pinsidecar_drift_skew_gap_ratio",
                 "How far below uniform the best reachable cold ratio is; under its threshold: no exploitable skew."),
}


class DriftView(Protocol):
    """What the collector reads from the drift watch (:class:`pinsidecar.drift.DriftWatch` is one)."""

    config: DriftConfig
    active: ExpertMap  # the map the signals were computed against (its layer ids label the per-layer series)
    records: Sequence[WindowRecord]  # the recent windows' records, oldest first

    @property
    def last_record(self) -> WindowRecord | None: ...

    def status(self, now: float | None = None) -> dict[str, Any]: ...


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return GaugeMetricFamily(name, doc, value=float(value))


def last_judged(records: Sequence[WindowRecord]) -> WindowRecord | None:
    """The most recent record the detector judged (enough tokens, signals computed)."""
    for rec in reversed(records):
        if rec.judged and rec.signals is not None:
            return rec
    return None


class DriftCollector:
    """``pinsidecar_drift_*`` from the watch ``watch()`` returns at each scrape; None (count mode, no map yet)
    exports nothing.

    The signals are those of the last **judged** window, the ones the detector decided on: a short window (a quiet
    spell, a restart) has noisy signals the detector ignores, and exporting them would let an alert's ``for:``
    clock flap on windows the daemon itself does not count. ``pinsidecar_drift_window_tokens`` is the last closed
    window's, judged or not. Series whose value is unknown (no histogram, no earlier window) are left out rather
    than exported as 0, so a dashboard shows a gap, not a false "no drift"."""

    def __init__(self, watch: Callable[[], DriftView | None]) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Metric]:
        watch = self.watch()
        if watch is None:
            return
        cfg = watch.config
        st = watch.status()
        record = watch.last_record
        yield from self._detector(cfg, st, record)
        if record is None:
            return
        yield from _window(cfg, record)
        judged = last_judged(watch.records)
        if judged is not None:
            yield from _signals(cfg, judged, watch.active.layer_ids)

    @staticmethod
    def _detector(cfg: DriftConfig, st: Mapping[str, Any], record: WindowRecord | None) -> Iterator[Metric]:
        state = GaugeMetricFamily("pinsidecar_drift_state",
                                  "1 for the drift detector's state (steady, rising, drifted), 0 for the others.",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if st.get("state") == s else 0.0)
        yield state
        yield GaugeMetricFamily("pinsidecar_drift_enabled", "1 when drift.enabled (the detector may trip).",
                                value=1.0 if cfg.enabled else 0.0)
        yield GaugeMetricFamily("pinsidecar_drift_consecutive_windows",
                                "Judged windows in a row at or above the trip level.", value=st.get("streak", 0))
        yield GaugeMetricFamily("pinsidecar_drift_consecutive_windows_threshold",
                                "drift.consecutive_windows: windows in a row before a trip.",
                                value=cfg.consecutive_windows)
        yield GaugeMetricFamily("pinsidecar_drift_cooldown_remaining_seconds",
                                "Seconds before the cooldown lets the next remap start (0: none).",
                                value=st.get("cooldown_left_s", 0.0))
        done = int(st.get("remaps_last_day", 0))
        yield GaugeMetricFamily("pinsidecar_drift_remaps_last_day", "Remaps started in the last 24 h.", value=done)
        yield GaugeMetricFamily("pinsidecar_drift_remaps_left_today",
                                "Remaps the daily cap (drift.max_remaps_per_day, rolling 24 h) still allows.",
                                value=max(0, cfg.max_remaps_per_day - done))
        yield GaugeMetricFamily("pinsidecar_drift_open_window_tokens", "Tokens in the window that is still open.",
                                value=st.get("open_window_tokens", 0))
        if record is not None:
            yield CounterMetricFamily("pinsidecar_drift_windows", "Windows closed since the daemon started.",
                                      value=record.index + 1)

    # (the per-window families are module functions: they only need the config and the record)


def _window(cfg: DriftConfig, record: WindowRecord) -> Iterator[Metric]:
    yield GaugeMetricFamily("pinsidecar_drift_window_tokens", "Routed tokens in the last closed window.",
                            value=record.window.get("tokens", 0))
    yield GaugeMetricFamily("pinsidecar_drift_window_tokens_threshold",
                            "drift.min_tokens: a window with fewer tokens is recorded, not judged.",
                            value=cfg.min_tokens)
    yield GaugeMetricFamily("pinsidecar_drift_window_judged", "1 when the last closed window was judged.",
                            value=1.0 if record.judged else 0.0)


def _signals(cfg: DriftConfig, record: WindowRecord, layer_ids: Sequence[int]) -> Iterator[Metric]:
    sig = record.signals
    assert sig is not None
    # a: the live cold ratio against the rate above which signal a alerts (the map's prediction + cold_rate_alert)
    if (g := _gauge("pinsidecar_drift_cold_selection_ratio",
                    "Signal a: cold-selection ratio of the last closed window under the active map.",
                    sig.cold_rate)) is not None:
        yield g
    if sig.predicted_cold_rate is not None:
        yield GaugeMetricFamily("pinsidecar_drift_predicted_cold_selection_ratio",
                                "The cold-selection ratio the active map predicted.", value=sig.predicted_cold_rate)
        yield GaugeMetricFamily("pinsidecar_drift_cold_selection_ratio_threshold",
                                "The predicted ratio plus drift.cold_rate_alert: above it, signal a alerts.",
                                value=min(1.0, sig.predicted_cold_rate + cfg.cold_rate_alert))
    # c's explanation: the two rates the gain is the difference of
    for name, doc, value in (
            ("pinsidecar_drift_active_map_cold_selection_ratio",
             "The active map's cold-selection ratio on the last window's histogram.", sig.active_cold_rate),
            ("pinsidecar_drift_candidate_cold_selection_ratio",
             "A map rebuilt from the previous window, on the last window (out of sample).", sig.candidate_cold_rate),
            ("pinsidecar_drift_uniform_cold_selection_ratio",
             "Any map's cold-selection ratio on uniform routing (cold rows / experts).", sig.uniform_cold_rate)):
        if (g := _gauge(name, doc, value)) is not None:
            yield g
    if sig.exploitable_skew is not None:
        yield GaugeMetricFamily("pinsidecar_drift_exploitable_skew",
                                "1 when the routing has exploitable skew; 0: no exploitable skew (no map helps, "
                                "the detector never trips).", value=1.0 if sig.exploitable_skew else 0.0)
    for key, (value, threshold) in sig.series(cfg).items():
        yield from _series(key, value, threshold, cfg, sig.divergence_mean)
    layers = sig.divergence_per_layer
    if layers is not None and len(layers) <= MAX_LAYER_SERIES:
        lids = layer_ids if len(layer_ids) == len(layers) else range(len(layers))
        fam = GaugeMetricFamily("pinsidecar_drift_layer_divergence",
                                "Signal b per MoE layer (Jensen-Shannon, bits); only up to "
                                f"{MAX_LAYER_SERIES} layers.", labels=["layer"])
        for lid, v in zip(lids, layers, strict=False):
            if v is not None:
                fam.add_metric([str(lid)], float(v))
        yield fam


def _series(key: str, value: float | None, threshold: float | None, cfg: DriftConfig,
            divergence_mean: float | None) -> Iterator[Metric]:
    name, doc = SERIES_METRICS.get(key, (f"pinsidecar_drift_{key}", f"Drift signal {key}."))
    if key == "divergence_max":
        fam = GaugeMetricFamily(name, doc, labels=["stat"])
        for stat, v in (("max", value), ("mean", divergence_mean)):
            if v is not None and not math.isnan(v):
                fam.add_metric([stat], float(v))
        if fam.samples:
            yield fam
    elif (g := _gauge(name, doc, value)) is not None:
        yield g
    if key == "projected_gain":
        yield GaugeMetricFamily(f"{name}_trip_threshold",
                                "The trip level: max(drift.trip_gain, drift.margin).", value=cfg.trip_level)
        yield GaugeMetricFamily(f"{name}_clear_threshold",
                                "drift.clear_gain: once drifted, the gain must fall below this to clear.",
                                value=cfg.clear_gain)
    elif threshold is not None:
        yield GaugeMetricFamily(f"{name}_threshold", f"The threshold of {name}.", value=threshold)
