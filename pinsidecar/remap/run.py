"""One remap in flight: what its steps hand each other (:class:`RemapRun`), and how a step gives up (:class:`Aborted`).

The record (:class:`~pinsidecar.remap.record.RemapRecord`) is what is persisted and shown; a run also carries
what only the running process needs (the loaded maps, the decision object, the capture's cut time). Both the
pipeline's steps and the deploys (:mod:`~pinsidecar.remap.deploy`) read and fill it, so it lives apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import CountsArtifact, ExpertMap

from pinsidecar.remap.decision import Decision
from pinsidecar.remap.record import RemapRecord
from pinsidecar.remap.traffic import WorkloadChoice

__all__: list[str] = []  # nothing here is another package's business


class Aborted(Exception):
    """A step cannot go on; the remap ends ``aborted`` with this message and the old map keeps serving."""


def first_line(exc: BaseException) -> str:
    """An exception as one record-sized line (its type when it has no message)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:500]


def map_ref(path: Path | None, emap: ExpertMap | None) -> dict[str, Any] | None:
    """A map as a record names it: ``{"path", "hash", "label"}``."""
    if emap is None:
        return None
    return {"path": str(path) if path else None, "hash": emap.content_hash, "label": emap.label}


@dataclass
class RemapRun:
    """What one remap carries between its steps."""

    record: RemapRecord
    active_path: Path | None
    active: ExpertMap
    map_path: Path | None = None  # a candidate named by the operator
    choice: WorkloadChoice | None = None
    cut_at: float | None = None  # monotonic time the captured traffic was cut (capture source)
    candidate_path: Path | None = None
    candidate: ExpertMap | None = None
    candidate_counts: CountsArtifact | None = None
    decision: Decision | None = None
    source: str = ""  # where the candidate came from: "named", "library", "count_boot" or "live"
    notes: list[str] = field(default_factory=list)

    @property
    def committed_label(self) -> str:
        """The map a restart boots while the remap has not committed: the one that served when it started."""
        return self.active.label or self.active.short_hash
