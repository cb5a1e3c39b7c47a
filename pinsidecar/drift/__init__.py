"""Drift watch: notice that the traffic no longer fits the active row map, and whether a new map would fit it better.

The loop's last room, as a pipeline of plain steps with I/O at the edges:

- :mod:`~pinsidecar.drift.windows` — stats readings cut into windows of recent traffic, sized by tokens;
- :mod:`~pinsidecar.drift.signals` — per window: live cold rate vs predicted, per-layer Jensen-Shannon divergence,
  the out-of-sample projected gain of a rebuilt map, and whether the routing has any exploitable skew;
- :mod:`~pinsidecar.drift.detector` — the state machine (hysteresis, consecutive windows, cooldown, daily cap)
  that says when a remap should start;
- :mod:`~pinsidecar.drift.watch` — the one object the daemon holds and replay drives;
- :mod:`~pinsidecar.drift.config` — the ``[drift]`` thresholds.

What the watch does not do is decide a deploy: whether a candidate map may replace the active one is the remap's
evaluation (:mod:`pinsidecar.remap.decision`), and so is the offline replay of both (:mod:`pinsidecar.remap.replay`),
because the remap room sits above this one.
"""

from pinsidecar.drift.config import DriftConfig, check_drift_config, load_drift_config, parse_drift_table
from pinsidecar.drift.detector import STATES, DriftDetector, WindowRecord
from pinsidecar.drift.signals import NO_SKEW, Signals, compute_signals, js_divergence
from pinsidecar.drift.watch import DriftWatch
from pinsidecar.drift.windows import LiveSample, LiveWindows, Window, sample_from_reading

__all__ = [
    "NO_SKEW",
    "DriftWatch",
    "Window",
    "WindowRecord",
    "load_drift_config",
]
