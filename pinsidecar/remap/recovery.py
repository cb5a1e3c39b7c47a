"""After a crash: close the remaps a dead sidecar left open, so the record says what the engine serves.

The pipeline never leaves the serving engine depending on a half-done remap, by construction:

- a candidate map is written into the library atomically and only after its count boot, under a new file name;
  the file of the map that serves is never written;
- ``<state_dir>/active-map.json`` (what the daemon boots with) changes only at commit, after verification.

So on start the daemon boots from ``active-map.json``, the map that served before the remap (or, if the remap had
committed, the new one), and :func:`close_open_records` only has to make the records agree:

- a remap cut short before its deploy step (``applying`` or ``rebooting``) never touched the engine: ``aborted``
  ("sidecar restarted during <state>");
- one cut short in ``applying``, ``rebooting`` or ``verifying``: the daemon stops the engine its predecessor left
  (which may serve the candidate, applied in place, or be mid-apply), withdraws any apply request still waiting
  beside the stats file (the new engine must not find it), and boots the map of ``active-map.json``. If that is
  the candidate, the commit had been written and only the record lagged: ``committed``; otherwise the old map
  serves again: ``rolled_back``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from pinsidecar.remap.record import PRE_REBOOT_STATES, RecordStore, RemapRecord

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


def _active_hash(active_map_file: Path) -> str | None:
    try:
        return str(json.loads(active_map_file.read_text())["hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def close_record(rec: RemapRecord, active_hash: str | None, why: str) -> None:
    """End one open record by the rules of the module docstring (``why``: "sidecar restarted", "daemon stopped")."""
    was = rec.state
    detail: dict[str, Any] = {"recovered": True, "was": was}
    if was in PRE_REBOOT_STATES:
        rec.finish("aborted", reason=f"{why} during {was}; the engine kept serving the old map",
                   error=f"{why} during {was}", detail=detail)
    elif rec.candidate and active_hash is not None and rec.candidate.get("hash") == active_hash:
        rec.finish("committed", reason=f"{why} during {was}, after the commit was written; the candidate serves",
                   detail=detail)
    else:
        prev = rec.previous_map or {}
        back = prev.get("label") or prev.get("hash") or "the old map"
        rec.finish("rolled_back", reason=f"{why} during {was}; the daemon boots from active-map.json, so {back} "
                   "serves again", error=f"{why} during {was}", detail=detail)


def active_map_hash(active_map_file: Path) -> str | None:
    """The hash ``active-map.json`` records (None: no file, or unreadable)."""
    return _active_hash(active_map_file)


def close_open_records(store: RecordStore, active_map_file: Path, *,
                       why: str = "sidecar restarted") -> list[RemapRecord]:
    """Close every non-terminal record in ``store`` (see the module docstring); returns the records closed."""
    closed: list[RemapRecord] = []
    active = _active_hash(active_map_file)
    removed = store.remove_temp_files()
    if removed:
        log.info("remap_temp_files_removed", files=removed)
    for rec in store.records():
        if rec.terminal:
            continue
        was = rec.state
        close_record(rec, active, why)
        store.save(rec)
        log.warning("remap_closed_after_restart", remap=rec.id, was=was, now=rec.state)
        closed.append(rec)
    return closed
