"""The heal scenario's sampler keeps one sample per tick whatever the daemon does: a status call that fails or
hangs must not delay the ticks, drop seconds, or label them with a later stage (CI runs twice lost the whole 8-s
prose stage from the samples while the sampler itself waited for the daemon's status). The daemon here is a
stand-in object with a status method: what is under test is the sampler's own loop, not the daemon."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.scenario.sampler import Sampler
from pinsidecar.testing.streaming import ClientStats


class _SlowStatus:
    """A status that blocks the sampler until released, then answers: the tick's stage must still be recorded."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def status(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        self.calls += 1
        if self.calls == 2:
            self.release.wait(5)
        return {"engine": {"state": "ready"}}


class _FailingStatus:
    def status(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        raise RuntimeError("status exploded")


def _sampler(tmp_path: Path, sidecar: Any, stage: list[str]) -> Sampler:
    lane = SimpleNamespace(state_dir=tmp_path, sidecar=sidecar)
    return Sampler(lane, [ClientStats()], lambda: stage[0], time.time(), period_s=0.05)  # type: ignore[arg-type]


def test_a_status_call_that_hangs_delays_no_sample(tmp_path: Path) -> None:
    side, stage = _SlowStatus(), ["prose"]
    s = _sampler(tmp_path, side, stage)
    s.start()
    try:
        deadline = time.time() + 5
        while side.calls < 2 and time.time() < deadline:  # the second call hangs until released
            time.sleep(0.01)
        n = len(s.samples)
        while len(s.samples) < n + 5 and time.time() < deadline:
            time.sleep(0.01)
        stage[0] = "reboot"  # the stage changes while the status call still hangs
        while len(s.samples) < n + 10 and time.time() < deadline:
            time.sleep(0.01)
        hung = side.calls == 2 and not side.release.is_set()
    finally:
        side.release.set()
        s.stop_event.set()
        s.join(5)
    assert hung and len(s.samples) >= n + 10, (len(s.samples), n)  # ticks went on while the call hung
    assert {x["stage"] for x in s.samples[n:]} == {"prose", "reboot"}, s.samples
    assert all(x["took_s"] < 0.5 for x in s.samples), s.samples


def test_a_failing_status_still_leaves_a_sample_that_says_why(tmp_path: Path) -> None:
    s = _sampler(tmp_path, _FailingStatus(), ["code"])
    s.start()
    try:
        deadline = time.time() + 5
        while len(s.samples) < 3 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        s.stop_event.set()
        s.join(5)
    assert len(s.samples) >= 3 and all(x["stage"] == "code" and x["status"] is False for x in s.samples), s.samples
    assert any("status exploded" in x.get("status_error", "") for x in s.samples), s.samples
