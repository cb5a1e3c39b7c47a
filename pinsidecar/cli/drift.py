"""``pinsidecar drift``: the drift watch offline.

``replay`` runs recorded windows (one counts file each, in order) through the same detector and deploy decision
the daemon runs, so an operator can see, on their own traffic, which windows would trip, which remaps would be
deployed or refused and why, and tune the ``[drift]`` thresholds before the daemon acts on them.
"""

from __future__ import annotations

from typing import Any

import click
from pinsidecar_hook.contract import load_counts, load_map

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option
from pinsidecar.cli.maps import format_table

__all__: list[str] = []  # nothing here is another package's business


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _pts(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}"


def _replay_human(r: dict[str, Any]) -> str:
    m, cfg = r["map"], r["config"]
    lines = [
        f"map {m['label'] or '-'} ({m['hash'].split(':', 1)[-1][:12]}): {m['hot_rows']} hot / {m['cold_rows']} cold "
        f"rows per layer; {len(r['windows'])} windows; divergence against {r['reference']}",
        f"trip at gain >= {100 * max(cfg['trip_gain'], cfg['margin']):.1f} pts for {cfg['consecutive_windows']} "
        f"windows, clear below {100 * cfg['clear_gain']:.1f} pts, deploy margin {100 * cfg['margin']:.1f} pts, "
        f"skew margin {100 * cfg['skew_margin']:.1f} pts",
        "",
    ]
    rows = []
    for w in r["windows"]:
        s = w["signals"] or {}
        verdict = "TRIP" if w["trip"] else (w["why_not"] or "")
        rows.append([w["index"], w["window"]["source"], w["window"]["tokens"], _pct(s.get("active_cold_rate")),
                     _pct(s.get("candidate_cold_rate")), _pts(s.get("projected_gain")),
                     "-" if s.get("divergence_max") is None else f"{s['divergence_max']:.3f}",
                     _pts(s.get("skew_gap")), w["state"], verdict[:70]])
    lines.append(format_table(["#", "window", "tokens", "cold", "rebuilt", "gain pts", "JS max", "skew pts",
                               "state", "trip / why not"], rows))
    lines.append("")
    if not r["decisions"]:
        lines.append("no trips: no remap would start")
    for d in r["decisions"]:
        lines.append(f"trip at window {d['trip']}: {'DEPLOY' if d['deploy'] else 'refused'}: {d['reason']}")
    for warning in r["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def register(main: click.Group) -> None:
    @main.group("drift")
    def drift_group() -> None:
        """The drift watch offline: replay recorded windows through the detector and the deploy decision."""

    @drift_group.command("replay")
    @click.option("--map", "map_path", required=True, type=click.Path(dir_okay=False),
                  help="The active map (what the engine served during the recording).")
    @click.argument("counts", nargs=-1, required=True, type=click.Path(dir_okay=False))
    @click.option("--config", "config_path", type=click.Path(dir_okay=False),
                  help="A TOML file whose [drift] table sets the thresholds (default: the built-in defaults).")
    @click.option("--source-counts", multiple=True, type=click.Path(dir_okay=False),
                  help="The counts the map was built from (repeatable): the divergence is measured against them. "
                       "Default: the first judged window.")
    @click.option("--window-seconds", type=click.FloatRange(min=0, min_open=True), default=None,
                  help="Seconds each window lasts on the replay clock (cooldown, daily cap). Default: each counts "
                       "file's own duration, else drift.max_window_s.")
    @json_option
    @handle_errors
    def replay_cmd(map_path: str, counts: tuple[str, ...], config_path: str | None,
                   source_counts: tuple[str, ...], window_seconds: float | None, as_json: bool) -> None:
        """Run COUNTS (one counts file per window, in order) through the drift detector and deploy decision."""
        from pinsidecar.drift import load_drift_config
        from pinsidecar.remap.replay import replay
        from pinsidecar.schema import ConfigError

        try:
            cfg = load_drift_config(config_path)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        active = load_map(map_path)
        windows = [load_counts(p) for p in counts]
        refs = [load_counts(p) for p in source_counts]
        result = replay(active, windows, cfg, names=list(counts), source_counts=refs, window_s=window_seconds)
        emit(result, as_json, _replay_human)
