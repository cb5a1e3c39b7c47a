"""The drift watch's thresholds: the ``[drift]`` table of the daemon's TOML file, as one frozen dataclass.

Every number the detector and the deploy decision compare against lives here, so an operator tunes them in one
place and ``pinsidecar drift replay --config FILE`` replays recorded windows with exactly what the daemon would
use. The policy (whether the watch may act, the trip level, the deploy margin, the cooldown and the daily cap) is
in ``[drift]`` itself; how windows are cut and judged (window sizes, hysteresis, the alert thresholds) is tuning,
in ``[drift.advanced]`` (:data:`~pinsidecar.schema.ADVANCED`). The field metadata
(:data:`~pinsidecar.schema.MIN`, :data:`~pinsidecar.schema.POSITIVE`) is the one table validator's
(:mod:`pinsidecar.schema`), so the daemon can take :class:`DriftConfig` as a section as it is;
:func:`load_drift_config` validates only the ``[drift]`` table of a file, through the same validator.

Gains, margins and cold rates are **absolute fractions of router selections** (0.08 = 8 percentage points of all
selections moving from cold to hot), not ratios of rates: what a cold selection costs (a host read across PCIe) is
per selection, and an absolute figure cannot explode when the active map's cold rate is already near zero.

Where the defaults come from: the CPU demo (the tiny demo MoE model, 64 experts, top-8, 48 hot rows per layer,
requests of 50-90 routed tokens), measured on windows of its recorded routing (``tests/test_drift_recorded.py``).
On stationary traffic the out-of-sample projected gain of a map rebuilt from the previous window stayed at or
under 3.2 points over 236 windows of 256-2048 tokens (mean 1.1); a shift from code to prose shows 42-45 points; a
uniform router shows under 1 point of gain and of skew. The defaults sit between those with room on both sides.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar.schema import (
    ADVANCED,
    MIN,
    POSITIVE,
    ConfigError,
    Deprecation,
    Problems,
    build_section,
    read_toml,
    usable,
    warn_deprecations,
    written_key,
)

__all__ = ["DRIFT_SECTION", "DriftConfig", "check_drift_config"]

DRIFT_SECTION = "drift"


@dataclass(frozen=True)
class DriftConfig:
    """Thresholds of the drift watch (see the module docstring for units and where the defaults come from)."""

    enabled: bool = True
    # false: the detector still watches, judges and exports every window (alert rules can act on the metrics), but
    # never starts a remap itself; the other triggers (the Alertmanager webhook, `pinsidecar remap`, the systemd
    # timer) still do, through the same cooldown and daily cap. For sites where Alertmanager decides.
    auto_remap: bool = True
    # A window closes after this many routed tokens: ~15 demo requests; at the CPU demo's throughput a few seconds
    # to a minute. Below ~500 tokens the out-of-sample gain of a one-window map gets noisy (5 points at 256).
    window_tokens: int = field(default=1024, metadata={POSITIVE: True, **ADVANCED})
    # A window with fewer tokens is recorded but never judged (a quiet spell, or cut short by a restart).
    min_tokens: int = field(default=256, metadata={POSITIVE: True, **ADVANCED})
    # A quiet engine still closes its window this long after the window's first token (monotonic seconds).
    max_window_s: float = field(default=60.0, metadata={POSITIVE: True, **ADVANCED})
    # Trip when the projected gain is at least this (absolute cold-rate fraction) for `consecutive_windows`
    # windows. Stationary demo traffic: <= 3.2 points; a domain shift: >= 42 points.
    trip_gain: float = field(default=0.08, metadata={MIN: 0})
    # Once drifted, stay drifted until the gain falls below this (hysteresis: no flapping around trip_gain).
    clear_gain: float = field(default=0.04, metadata={MIN: 0, **ADVANCED})
    # Consecutive judged windows at or above trip_gain before a trip: with 2, a shift trips by its third window at
    # the latest (the gain needs one window of the new traffic to build a candidate from, see signals.py); on the
    # demo it trips on the second, since the shift window itself already shows a gain.
    consecutive_windows: int = field(default=2, metadata={POSITIVE: True, **ADVANCED})
    # At least this long between two remaps: longer than one CPU-demo remap (count boot + reboot, ~1-2 min), so
    # the effect of one remap is measured before the next can start.
    cooldown_s: float = field(default=300.0, metadata={MIN: 0})
    # At most this many remaps started in any 24 h (rolling); 0 turns automatic remaps off.
    max_remaps_per_day: int = field(default=6, metadata={MIN: 0})
    # A candidate map is deployed only if it beats the active map by at least this on a held-out window, and the
    # detector never trips on a gain below it: above the stationary demo noise (at most 3.2 points).
    margin: float = field(default=0.05, metadata={MIN: 0})
    # "No exploitable skew" when the best cold rate reachable with this geometry on the traffic is less than this
    # below the uniform cold fraction (cold_rows / num_experts). Demo: >= 20 points; a uniform router: < 1 point;
    # a reported near-uniform router (top-32 of 512 covering 10 % of selections, uniform 6.25 %): under 4 points.
    skew_margin: float = field(default=0.05, metadata={MIN: 0, **ADVANCED})
    # Signal a's threshold (explains, never decides): live cold rate minus the map's predicted rate. The demo's
    # code map predicts 1.5 % in sample and sees ~6 % on held-out code, 47 % on prose.
    cold_rate_alert: float = field(default=0.10, metadata={MIN: 0, **ADVANCED})
    # Signal b's threshold (explains, never decides): largest per-layer Jensen-Shannon divergence, in bits, between
    # a window and the counts the active map was built from. Stationary demo windows: <= 0.05; code vs prose: ~0.45.
    divergence_alert: float = field(default=0.2, metadata={MIN: 0, **ADVANCED})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def trip_level(self) -> float:
        """The gain a window needs to count towards a trip: never below the deploy margin."""
        return max(self.trip_gain, self.margin)


def check_drift_config(cfg: DriftConfig, section: str = DRIFT_SECTION, *, problems: Problems | None = None) -> None:
    """Cross-field checks the per-field metadata cannot express, each naming the keys where the file has them
    (``[drift]`` or ``[drift.advanced]``). Every problem goes to ``problems``; without it, a :class:`ConfigError`
    holding them all is raised."""
    own = Problems() if problems is None else problems

    def key(name: str) -> str:
        return written_key(cfg, name, section)

    for name in ("trip_gain", "clear_gain", "margin", "skew_margin", "cold_rate_alert"):
        value = getattr(cfg, name)
        if value > 1 and usable(cfg, name):
            own.add(f"{key(name)}: a fraction of selections between 0 and 1, got {value!r} (write 8 points as 0.08)")
    if cfg.clear_gain > cfg.trip_gain and usable(cfg, "clear_gain", "trip_gain"):
        own.add(f"{key('clear_gain')}: must be <= {key('trip_gain')} ({cfg.trip_gain}) for hysteresis, got "
                f"{cfg.clear_gain} (lower it, or raise {key('trip_gain')})")
    if cfg.min_tokens > cfg.window_tokens and usable(cfg, "min_tokens", "window_tokens"):
        own.add(f"{key('min_tokens')}: must be <= {key('window_tokens')} ({cfg.window_tokens}), got "
                f"{cfg.min_tokens} (lower it, or raise {key('window_tokens')})")
    if problems is None:
        own.raise_any()


def parse_drift_table(raw: Any, base: Path = Path("."), deprecations: list[Deprecation] | None = None,
                      ) -> DriftConfig:
    """Validate an already-parsed ``[drift]`` table (a dict; absent keys take the defaults). Keys at their old
    place go to ``deprecations`` (``None``: logged as warnings). Raises one :class:`ConfigError` holding every
    problem of the table."""
    problems = Problems()
    cfg = build_section(DRIFT_SECTION, DriftConfig, raw, base, deprecations=deprecations, problems=problems)
    check_drift_config(cfg, problems=problems)
    problems.raise_any()
    return cfg


def load_drift_config(path: str | os.PathLike[str] | None) -> DriftConfig:
    """The ``[drift]`` table of a TOML file (the daemon's config, or a file with only that table), validated.

    Other tables in the file are ignored here: the daemon validates them when it loads the file. ``None`` gives
    the defaults. Raises :class:`~pinsidecar.schema.ConfigError` naming the file and the key; a key at its old
    place is logged as a deprecation warning naming the file and the key's new place.
    """
    if path is None:
        return DriftConfig()
    p = Path(path)
    doc = read_toml(p)
    found: list[Deprecation] = []
    try:
        cfg = parse_drift_table(doc.get(DRIFT_SECTION, {}), p.resolve().parent, found)
    except ConfigError as exc:
        raise exc.within(p) from None
    warn_deprecations(found, p)
    return cfg
