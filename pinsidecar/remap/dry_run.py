"""``pinsidecar remap --dry-run``: the decision a remap would reach now, with its figures; nothing changes.

A dry run answers "would a remap deploy, and why" from what the daemon already has: the drift watch's newest
judged window, the library, and a candidate built from the live windows (never a count boot, never a record,
never the gate's cooldown). It is how an operator, or a test of the alert chain, reads the decision without paying
for one, so it runs the same :func:`~pinsidecar.remap.decision.decide` the pipeline does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ExpertMap, load_map

from pinsidecar.drift import DriftWatch
from pinsidecar.remap.candidates import build_candidate, library_maps
from pinsidecar.remap.decision import decide, pick_from_library
from pinsidecar.remap.host import RemapHost
from pinsidecar.remap.traffic import NotEnoughTraffic, live_build_windows

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


def dry_run_decision(host: RemapHost, trigger: str, map_path: Path | None, watch: DriftWatch,
                     active: ExpertMap) -> dict[str, Any]:
    """The decision a remap would reach now, from the live windows (or ``map_path``); changes nothing."""
    margin, rcfg = host.cfg.drift.margin, host.cfg.remap
    out = {"accepted": True, "remap_id": None, "trigger": trigger, "dry_run": True, "state": "dry_run"}
    held = watch.held_out_window()
    if held is None:
        return {**out, "accepted": False, "decision": None,
                "reason": "nothing to judge yet: the drift watch has no judged window (it needs "
                          f"drift.min_tokens = {watch.config.min_tokens} routed tokens of traffic)"}
    if map_path is not None:
        cand = load_map(map_path)
        d = decide(cand, active, watch.held_out_window(exclude=cand.source_counts) or held, margin,
                   source="named", allow_geometry_change=True)
    else:
        d = pick_from_library([m for _, m in library_maps(host.library_entries())], active, held, margin)
        if not d.deploy:
            try:
                choice = live_build_windows(watch, held, max_windows=rcfg.live_windows,
                                            min_tokens=rcfg.min_count_tokens)
                cand = build_candidate(choice.windows, active, label="dry-run")
                d = decide(cand, active, held, margin)
            except NotEnoughTraffic as exc:
                d = dataclasses.replace(d, reason=f"{d.reason}; no candidate from the live windows: {exc}")
    log.info("remap_dry_run", trigger=trigger, deploy=d.deploy, reason=d.reason)
    return {**out, "reason": d.reason, "decision": d.as_dict()}
