"""The remap record: one remap's state machine as data, persisted on disk at every transition.

A remap takes minutes (a count boot, a reboot, a verification under live traffic) and the sidecar can die at any
point of it. So its whole state is one small JSON file, ``<state_dir>/remaps/<id>.json``, written atomically
(:func:`~pinsidecar_hook.contract.atomic_write_json`) every time the state changes: after a crash the next daemon
reads exactly where each remap was and closes it (:mod:`~pinsidecar.remap.recovery`). The same dict is what
``pinsidecar status`` shows and what the metrics read.

States, in the order a remap runs them (a library hit skips ``count_boot`` and ``building``; a candidate named by
the operator skips everything before ``evaluating``):

``choosing_workload`` -> ``library_check`` -> ``count_boot`` -> ``building`` -> ``evaluating`` -> ``applying`` ->
``rebooting`` -> ``verifying``, then one terminal state: ``committed``, ``rolled_back``, ``refused``, ``aborted``
or ``commit_failed`` (verified, but ``active-map.json`` could not be written: the old map was put back).

The deploy step is ``applying`` (the hook swaps the candidate in place while the engine serves) or ``rebooting``
(drain and reboot); a remap that applied in place goes straight on to ``verifying``, one whose apply could not be
done falls back from ``applying`` to ``rebooting``, and one with ``remap.in_place = false`` (or a candidate of
another geometry) goes from ``evaluating`` to ``rebooting``. What the apply did is the record's ``apply``.

Which state may follow which is :data:`TRANSITIONS`, checked (:func:`pinsidecar.transitions.check_transition`,
the check the engine's states go through too) by :meth:`RemapRecord.enter` and :meth:`RemapRecord.finish` on
every change: a record is what recovery and the operator trust about the engine
(``rolled_back`` says the old map serves, ``committed`` that ``active-map.json`` names the candidate), so a step
the pipeline never meant to take is a bug that must stop the remap there (the pipeline then closes it as an
unforeseen failure, the old map serving), never a record that says it happened.

Every finished state appends one step (``state``, when it began, its seconds, a ``detail`` dict), so the steps
are the remap's timeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import atomic_write_json

from pinsidecar.transitions import check_transition

__all__ = ["STATES", "TERMINAL_STATES"]

log = structlog.get_logger(__name__)

STATES = ("choosing_workload", "library_check", "count_boot", "building", "evaluating", "applying", "rebooting",
          "verifying")
# Before the deploy step ("applying" or "rebooting") nothing has touched the serving engine: a remap cut short
# there is simply aborted.
PRE_REBOOT_STATES = STATES[:5]
# The deploy states: the engine may serve the candidate (wholly or, mid-apply, partly) from here on.
DEPLOY_STATES = ("applying", "rebooting")
# commit_failed: verified, then active-map.json could not be written (a full or read-only state folder); the old
# map was put back, because a map that a restart would not boot must not stay serving.
TERMINAL_STATES = ("committed", "rolled_back", "refused", "aborted", "commit_failed")
# How a remap ended, as the metrics label it ("dry_run": a decision that changed nothing, never a record).
OUTCOMES = ("committed", "rolled_back", "refused", "aborted", "commit_failed", "dry_run")
TRIGGERS = ("drift", "alert", "manual", "timer")

# The allowed transitions: state -> the states that may follow it (terminal states end a remap: none follow).
# "aborted" is open to every step that has not yet changed what the engine serves, and to the deploy states
# (their own prerequisites, the parity prompts, can still fail before anything moved); "rolled_back" to every
# state in which the engine may serve the candidate. "committed" follows "verifying" in the pipeline; recovery may
# also close a record found in a deploy state as committed, because a record save that fails is logged and the
# remap goes on (the serving map never depends on the record), so the record on disk can lag the commit.
TRANSITIONS: dict[str, frozenset[str]] = {
    "choosing_workload": frozenset({"library_check", "aborted"}),
    "library_check": frozenset({"count_boot", "building", "evaluating", "aborted"}),
    "count_boot": frozenset({"building", "aborted"}),
    "building": frozenset({"evaluating", "aborted"}),
    "evaluating": frozenset({"applying", "rebooting", "refused", "aborted"}),
    "applying": frozenset({"rebooting", "verifying", "rolled_back", "aborted", "committed"}),
    "rebooting": frozenset({"verifying", "rolled_back", "aborted", "committed"}),
    "verifying": frozenset({"committed", "commit_failed", "rolled_back"}),
    **{t: frozenset() for t in TERMINAL_STATES},
}


def _check(remap_id: str, frm: str, to: str) -> None:
    """Raise :class:`~pinsidecar.transitions.IllegalTransition` unless :data:`TRANSITIONS` lets ``to`` follow
    ``frm`` (a bug in whoever asked for it)."""
    check_transition(TRANSITIONS, f"remap {remap_id}", frm, to)


def utc_stamp(t: float | None = None) -> str:
    """ISO-8601 UTC with milliseconds: steps of a demo remap are seconds apart."""
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _new_id(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t)) + "-" + secrets.token_hex(3)


@dataclass
class RemapRecord:
    """One remap. Mutated only by the pipeline (through :meth:`enter` and :meth:`finish`), saved by the store."""

    id: str
    trigger: str
    reason: str = ""
    dry_run: bool = False
    state: str = STATES[0]
    outcome: str | None = None
    started_at: str = ""
    ended_at: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    candidate: dict[str, Any] | None = None  # {"path", "hash", "label", "source"}
    decision: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    # the in-place deploy: the swap plan (rows, bytes), each apply request and its answer, how it ended (see
    # pinsidecar.remap.apply); None when the remap never reached the deploy step
    apply: dict[str, Any] | None = None
    error: str | None = None
    previous_map: dict[str, Any] | None = None  # what served when the remap started: {"path", "hash", "label"}
    detail: dict[str, Any] = field(default_factory=dict)  # the trigger's own detail (window, alert, map asked for)
    # when the current state began (epoch seconds and the monotonic clock: wall time for people, monotonic for
    # the step's seconds); not persisted as such, the steps carry it
    _state_t0: float = field(default=0.0, repr=False)
    _state_wall: float = field(default=0.0, repr=False)
    _t0: float = field(default=0.0, repr=False)

    @classmethod
    def new(cls, trigger: str, reason: str = "", detail: dict[str, Any] | None = None,
            previous_map: dict[str, Any] | None = None, state: str = STATES[0]) -> RemapRecord:
        now, mono = time.time(), time.monotonic()
        return cls(id=_new_id(now), trigger=trigger, reason=reason, state=state, started_at=utc_stamp(now),
                   previous_map=previous_map, detail=dict(detail or {}), _state_t0=mono, _state_wall=now, _t0=mono)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def seconds(self) -> float:
        """From the start to now (or to the end)."""
        if self.terminal and self.steps:
            return round(sum(s["seconds"] for s in self.steps), 3)
        return round(time.monotonic() - self._t0, 3) if self._t0 else 0.0

    def _close_step(self, detail: dict[str, Any] | None) -> dict[str, Any]:
        now = time.monotonic()
        step = {"state": self.state, "at": utc_stamp(self._state_wall or None),
                "seconds": round(max(0.0, now - self._state_t0), 3) if self._state_t0 else 0.0,
                "detail": dict(detail or {})}
        self.steps.append(step)
        self._state_t0, self._state_wall = now, time.time()
        return step

    def enter(self, state: str, detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the current state (its step gets ``detail``) and move to ``state``. Returns the closed step."""
        if state not in STATES:
            raise ValueError(f"unknown remap state {state!r}")
        _check(self.id, self.state, state)
        step = self._close_step(detail)
        self.state = state
        return step

    def finish(self, state: str, *, reason: str = "", error: str | None = None,
               detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the current state and end the remap in terminal ``state`` (the outcome has the same name)."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"not a terminal remap state: {state!r}")
        _check(self.id, self.state, state)
        step = self._close_step(detail)
        self.state, self.outcome = state, state
        self.ended_at = utc_stamp()
        if error is not None:
            self.error = error
        if reason:
            self.detail["outcome_reason"] = reason
        return step

    # ------------------------------------------------------------------------------------------------ as data
    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "trigger": self.trigger, "reason": self.reason, "dry_run": self.dry_run,
                "state": self.state, "outcome": self.outcome, "started_at": self.started_at,
                "ended_at": self.ended_at, "steps": list(self.steps), "candidate": self.candidate,
                "decision": self.decision, "verify": self.verify, "apply": self.apply, "error": self.error,
                "previous_map": self.previous_map, "detail": self.detail, "seconds": self.seconds,
                "outcome_reason": self.detail.get("outcome_reason")}

    def summary(self) -> dict[str, Any]:
        """The short form status keeps for history."""
        d = self.decision or {}
        return {"id": self.id, "trigger": self.trigger, "state": self.state, "outcome": self.outcome,
                "started_at": self.started_at, "ended_at": self.ended_at, "seconds": self.seconds,
                "candidate": (self.candidate or {}).get("label"), "gain": d.get("gain"), "error": self.error,
                "outcome_reason": self.detail.get("outcome_reason"),
                "apply": (self.apply or {}).get("outcome")}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RemapRecord:
        rec = cls(id=str(doc["id"]), trigger=str(doc.get("trigger", "")), reason=str(doc.get("reason", "")),
                  dry_run=bool(doc.get("dry_run", False)), state=str(doc["state"]), outcome=doc.get("outcome"),
                  started_at=str(doc.get("started_at", "")), ended_at=doc.get("ended_at"),
                  steps=list(doc.get("steps") or []), candidate=doc.get("candidate"), decision=doc.get("decision"),
                  verify=doc.get("verify"), apply=doc.get("apply"), error=doc.get("error"),
                  previous_map=doc.get("previous_map"),
                  detail=dict(doc.get("detail") or {}))
        if rec.state not in STATES + TERMINAL_STATES:
            raise ValueError(f"unknown state {rec.state!r}")
        return rec


class RecordStore:
    """The folder of remap records (``<state_dir>/remaps``). Every :meth:`save` is atomic."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, remap_id: str) -> Path:
        return self.directory / f"{remap_id}.json"

    def file(self, remap_id: str, suffix: str) -> Path:
        """A remap's own working file (``<id><suffix>``: its captured workload, counts, parity reference, log)."""
        return self.directory / f"{remap_id}{suffix}"

    def save(self, record: RemapRecord) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path(record.id), record.to_json())

    def _record_files(self) -> list[Path]:
        """Record files, oldest first (ids start with their UTC start time); not temp or working files."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("*.json") if not p.name.startswith(".") and p.name.count(".") == 1)

    @staticmethod
    def _read(path: Path) -> RemapRecord | None:
        try:
            return RemapRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # one corrupt record must not stop the daemon
            log.warning("remap_record_unreadable", path=str(path), error=str(exc))
            return None

    def records(self) -> Iterator[RemapRecord]:
        """Every readable record, oldest first. A file that cannot be read is logged and skipped."""
        for p in self._record_files():
            rec = self._read(p)
            if rec is not None:
                yield rec

    def history(self, n: int = 10) -> list[RemapRecord]:
        """The newest ``n`` readable records, oldest first (reads only those files)."""
        out = [r for r in (self._read(p) for p in self._record_files()[-n:]) if r is not None]
        return out

    def prune(self, keep: int) -> int:
        """Delete all but the newest ``keep`` records, with their working files. Returns how many went."""
        old = self._record_files()[:-keep] if keep > 0 else self._record_files()
        for p in old:
            rid = p.name.removesuffix(".json")
            for f in self.directory.glob(f"{rid}.*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        return len(old)

    def remove_temp_files(self) -> list[str]:
        """Temp files a killed writer left in the folder (``.<name>.*.tmp``, a count boot's hidden counts)."""
        removed = []
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                if p.name.startswith("."):
                    try:
                        os.unlink(p)
                        removed.append(p.name)
                    except OSError:
                        pass
        return removed
