"""Replay recorded windows through the drift watch and the deploy decision: how an operator tunes the thresholds on
their own traffic (``pinsidecar drift replay``).

Each counts file is one window, in order. The windows go through the same :class:`~pinsidecar.drift.watch.
DriftWatch` (signals and detector) and the same :func:`~pinsidecar.remap.decision.decide` the daemon runs (so this
lives with the remap, which sits above the drift watch); what the daemon does with I/O (a count boot, a reboot) is
stood in for by the recording itself:

- on a trip at window ``t``, the candidate is the map built from the traffic the pipeline would count: window
  ``t``, with the active map's hot rows;
- it is judged on window ``t + 1``, the next window, which it was not built from (held out); the detector sees
  that window while the remap is still "running", as the daemon would;
- after a deploy the candidate is the active map from window ``t + 2`` on (window ``t + 1`` was served by the old
  map while the remap ran); a refusal leaves the active map in place and is recorded with its figures.

Windows have no wall-clock time of their own, so the replay's monotonic clock advances by each window's duration:
``window_s`` when given, else the counts file's ``ended_at - started_at`` when that is positive, else
``max_window_s`` (the longest a live window can last). The cooldown and the daily cap run on that clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.watch import DriftWatch
from pinsidecar.drift.windows import Window
from pinsidecar.placement import check_compatible, sum_counts
from pinsidecar.remap.candidates import build_candidate
from pinsidecar.remap.decision import Decision, decide

__all__ = ["replay"]


def _duration(counts: CountsArtifact, fallback: float) -> float:
    try:
        d = (datetime.fromisoformat(counts.ended_at) - datetime.fromisoformat(counts.started_at)).total_seconds()
    except (TypeError, ValueError):
        return fallback
    return d if d > 0 else fallback


def replay(active: ExpertMap, windows: Sequence[CountsArtifact], config: DriftConfig, *,
           names: Sequence[str] | None = None, source_counts: Sequence[CountsArtifact] = (),
           window_s: float | None = None) -> dict[str, Any]:
    """Run ``windows`` (in order) through the drift watch under ``active``; the JSON document ``drift replay``
    prints: ``windows`` (one record each), ``trips`` (indices), ``decisions`` (one per trip), and the set-up."""
    names = list(names) if names is not None else [f"window{i}" for i in range(len(windows))]
    if not windows:
        raise ArtifactError(None, "no windows to replay", "pass one counts file per window, in order")
    for name, c in zip(names, windows, strict=True):
        check_compatible(active, c, "the map", name)
    warnings: list[str] = []
    reference = None
    if source_counts:
        for c in source_counts:
            check_compatible(active, c, "the map", "--source-counts")
        reference = sum_counts(list(source_counts))
        known = set(active.source_counts)
        if known and not {c.digest() for c in source_counts} <= known:
            warnings.append("--source-counts are not (all) among the counts the map records as its source; the "
                            "divergence is measured against them anyway")
    clock_now = 0.0
    watch = DriftWatch(config, active, reference=reference, clock=lambda: clock_now)
    records: list[dict[str, Any]] = []
    trips: list[int] = []
    decisions: list[dict[str, Any]] = []
    pending: tuple[int, ExpertMap, CountsArtifact] | None = None
    for i, (name, counts) in enumerate(zip(names, windows, strict=True)):
        start = clock_now
        clock_now += window_s if window_s is not None else _duration(counts, config.max_window_s)
        window = Window.from_counts(counts, i, started=start, ended=clock_now, map_hash=watch.active.content_hash,
                                    source=name)
        record = watch.observe(window, now=clock_now)
        records.append(record.as_dict())
        if pending is not None:
            trip_at, candidate, built_from = pending
            pending = None
            decision = decide(candidate, watch.active, window, config.margin)
            decisions.append(_decision_json(decision, trip_at, i))
            watch.remap_finished(decision.deploy, candidate if decision.deploy else None, built_from, now=clock_now)
        if record.trip:
            trips.append(i)
            pending = (i, build_candidate([counts], watch.active, label=f"replay-{name}"), counts)
    if pending is not None:
        trip_at, candidate, _ = pending
        decisions.append({"trip": trip_at, "held_out_window": None, "deploy": False,
                          "reason": "refused: the recording ends at the trip, so there is no held-out window to "
                                    "judge the candidate on", "candidate_cold_rate": None, "active_cold_rate": None,
                          "gain": None, "margin": config.margin, "candidate_hash": candidate.content_hash,
                          "active_hash": watch.active.content_hash})
    return {
        "map": {"hash": active.content_hash, "label": active.label, "hot_rows": active.hot_rows,
                "cold_rows": active.cold_rows, "predicted_cold_rate": active.predicted_cold_rate},
        "config": config.as_dict(),
        "reference": "source counts" if reference is not None else "first judged window",
        "windows": records,
        "trips": trips,
        "decisions": decisions,
        "deployed": [d["candidate_hash"] for d in decisions if d["deploy"]],
        "final_map": watch.active.content_hash,
        "warnings": warnings,
    }


def _decision_json(d: Decision, trip_at: int, held_out: int) -> dict[str, Any]:
    return {"trip": trip_at, "held_out_window": held_out, **d.as_dict()}
