"""Where each stage of a run fell in time: its start (seconds from the run's start) and its duration.

The demo loop's summary holds it (``pinsidecar demo`` prints it at the end), and the heal scenario
(``bench/scenario/heal.py``) records its stages in it too, so it lives in neither. Stages are placed by the
monotonic clock; what the daemon reports with a wall-clock stamp (a remap record's ``at``) is placed through
:meth:`Timeline.from_wall` and :func:`epoch`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

__all__: list[str] = []  # nothing here is another package's business


def epoch(stamp: str | None) -> float | None:
    """Epoch seconds of a remap record's ``at`` (``2025-01-01T12:00:00.123Z``)."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class Timeline:
    """Stages with their start (seconds from the demo's start) and duration."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.stages: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, stage: str, label: str, start_s: float, seconds: float) -> None:
        self.stages.append({"stage": stage, "label": label, "start_s": round(start_s, 1),
                            "seconds": round(max(0.0, seconds), 1)})

    @contextlib.contextmanager
    def stage(self, stage: str, label: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(stage, label, start, self.now() - start)

    def from_wall(self, epoch: float | None) -> float | None:
        return None if epoch is None else epoch - self.wall0

    def as_list(self) -> list[dict[str, Any]]:
        return sorted(self.stages, key=lambda s: s["start_s"])
