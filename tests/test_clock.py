"""Clock jumps: every interval of the drift watch and the remap pipeline runs on a monotonic clock, so a wall
clock stepped forward a day or back an hour (NTP, an operator, a VM resumed) changes no cooldown, no daily cap, no
window and no step's seconds. The detector and the windows take an injected clock; the wall clock is stepped by
patching ``time.time`` while the injected (or patched) monotonic clock runs on steadily.

Across a daemon restart only wall time exists (the remap records' start stamps): a record that seems to start in
the future, because the clock was set back since, still counts against the cooldown from now.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.detector import DAY_S, DriftDetector
from pinsidecar.drift.windows import LiveSample, LiveWindows
from pinsidecar.remap import admission
from pinsidecar.remap.record import RemapRecord, utc_stamp

WALL0 = 1_790_000_000.0  # a wall time in 2026


class Clocks:
    """A monotonic clock the test advances, and a wall clock the test steps (patched into ``time``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mono = 1000.0
        self.wall = WALL0
        monkeypatch.setattr(time, "time", lambda: self.wall)
        monkeypatch.setattr(time, "monotonic", lambda: self.mono)

    def advance(self, s: float) -> None:
        """Real time passes: both clocks move."""
        self.mono += s
        self.wall += s

    def step_wall(self, s: float) -> None:
        """The wall clock is stepped (forward or back); no time passes."""
        self.wall += s

    @property
    def monotonic(self) -> Callable[[], float]:
        return lambda: self.mono


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    return Clocks(monkeypatch)


@pytest.mark.parametrize("step", [DAY_S + 60, -3600.0])
def test_the_cooldown_and_the_daily_cap_ignore_a_wall_clock_step(clocks: Clocks, step: float) -> None:
    det = DriftDetector(DriftConfig(cooldown_s=300, max_remaps_per_day=2), clock=clocks.monotonic)
    det.remap_started()
    det.remap_finished(True)
    clocks.advance(100)
    clocks.step_wall(step)
    assert det.cooldown_left(clocks.mono) == pytest.approx(200)
    assert "cooldown: 200 s left" in (admission.blocked(det) or "")
    clocks.advance(200)
    assert admission.blocked(det) is None
    admission.note_started(det)  # a second remap (another trigger): the cap of 2 is reached
    det.remap_finished(True)
    clocks.advance(301)
    clocks.step_wall(step)
    assert "daily cap of 2 remaps reached (2 in the last 24 h" in (admission.blocked(det) or "")
    clocks.advance(DAY_S - 601)  # the first start is now exactly 24 h of monotonic time ago
    clocks.step_wall(-step)
    assert det.remaps_last_day(clocks.mono) == 1 and admission.blocked(det) is None


def _sample(tokens: int) -> LiveSample:
    return LiveSample(layer_ids=(0,), num_experts=4, top_k=1, tokens=tokens, selections=[tokens])


@pytest.mark.parametrize("step", [DAY_S, -3600.0])
def test_a_quiet_window_closes_after_max_window_s_of_monotonic_time_whatever_the_wall_clock_does(
        clocks: Clocks, step: float) -> None:
    windows = LiveWindows(window_tokens=1000, max_window_s=60, clock=clocks.monotonic)
    assert windows.feed(_sample(10)) == []
    clocks.step_wall(step)
    clocks.advance(59)
    assert windows.poll() == []  # a day "passed" on the wall clock: not on the window's
    clocks.advance(1)
    (w,) = windows.poll()
    assert w.closed_by == "time" and w.tokens == 10 and w.duration_s == pytest.approx(60)


def test_a_remaps_step_seconds_are_monotonic_when_the_wall_clock_steps_back(clocks: Clocks) -> None:
    rec = RemapRecord.new("manual")
    clocks.advance(5)
    clocks.step_wall(-3600)  # mid-remap, the clock is set back an hour
    rec.enter("library_check")
    clocks.advance(2)
    clocks.step_wall(DAY_S)
    rec.finish("aborted", reason="test")
    assert [s["seconds"] for s in rec.steps] == [5.0, 2.0]
    assert rec.seconds == 7.0  # not -3593 nor a day


@pytest.mark.parametrize(("age_s", "counted"), [(60.0, True), (-600.0, True), (DAY_S + 60, False)])
def test_a_remap_recorded_before_a_restart_keeps_its_cooldown_even_if_the_clock_was_set_back(
        clocks: Clocks, age_s: float, counted: bool) -> None:
    """age_s < 0: the record's start stamp is in the future (the clock was set back 10 min after the remap)."""
    rec = RemapRecord.new("manual", state="verifying")
    rec.started_at = utc_stamp(clocks.wall - age_s)
    rec.finish("committed")
    det = DriftDetector(DriftConfig(cooldown_s=300), clock=clocks.monotonic)
    assert admission.seed_from_history(det, [rec]) == int(counted)
    if counted:
        assert det.cooldown_left(clocks.mono) == pytest.approx(max(0.0, 300 - max(0.0, age_s)), abs=1)
        assert admission.blocked(det) is not None
    else:
        assert admission.blocked(det) is None


def test_the_daemons_uptime_is_monotonic(clocks: Clocks, tmp_path: Path) -> None:
    from pinsidecar.daemon.config import load_config
    from pinsidecar.daemon.service import Daemon

    (tmp_path / "model").mkdir()
    cfg = tmp_path / "pinsidecar.toml"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path / "model"}"\n[control]\ntoken_file = "{tmp_path / "token"}"\n'
                   f'create_token = true\n[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    daemon = Daemon(load_config(cfg))
    clocks.advance(10)
    clocks.step_wall(-3600)
    assert daemon.status()["daemon"]["uptime_s"] == 10.0
