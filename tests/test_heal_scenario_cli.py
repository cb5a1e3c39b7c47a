"""bench/heal_scenario.py's command line keeps what a cut run measured: a document at every stage, and SIGTERM (a
device call's deadline) unwinds the run, so the daemon is stopped and the document says how far it got.

The scenario itself is replaced by a stand-in here (named as one: :class:`StandInScenario`), since what is checked
is the command line around it; tests/test_heal_scenario.py runs the real one on vLLM CPU.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import pytest


def _cli() -> Any:
    from bench import heal_scenario

    return heal_scenario


class StandInScenario:
    """Enters two stages, then is sent SIGTERM; records that its clean-up ran (the real one stops the daemon)."""

    instances: ClassVar[list[StandInScenario]] = []

    def __init__(self, work: Path, model: Path, maps: dict[str, Any], opts: Any) -> None:
        self.on_stage: Any = None
        self.stages: list[str] = []
        self.cleaned_up = False
        self.out: Path | None = None
        self.seen_partial: dict[str, Any] | None = None
        StandInScenario.instances.append(self)

    def run(self) -> None:
        try:
            for stage in ("boot", "code"):
                self.stages.append(stage)
                self.on_stage(stage)
            assert self.out is not None
            self.seen_partial = json.loads(self.out.read_text())  # written at the stage, before the end
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not unwind the run")
        finally:
            self.cleaned_up = True

    def document(self) -> dict[str, Any]:
        return {"stage_order": list(self.stages), "checks": {"ran": False}}


def test_a_run_cut_by_sigterm_keeps_its_document_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    cli = _cli()
    monkeypatch.setattr(cli, "HealScenario", StandInScenario)
    monkeypatch.setattr(cli, "load_lane_maps", lambda path: {})
    monkeypatch.setattr(cli, "draw_timeline", lambda doc, png: png.write_bytes(b"png"))
    (tmp_path / "maps").mkdir()
    (tmp_path / "model").mkdir()
    out = tmp_path / "heal.json"
    previous = signal.getsignal(signal.SIGTERM)
    real_init = StandInScenario.__init__

    def init(self: StandInScenario, *a: Any) -> None:
        real_init(self, *a)
        self.out = out

    monkeypatch.setattr(StandInScenario, "__init__", init)
    try:
        with pytest.raises(SystemExit, match="the scenario failed: signal"):
            cli.main(["--short", "--maps", str(tmp_path / "maps"), "--model", str(tmp_path / "model"),
                      "--work", str(tmp_path / "work"), "--out", str(out), "--png", str(tmp_path / "heal.png")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    scenario = StandInScenario.instances[-1]
    assert scenario.cleaned_up
    assert scenario.seen_partial is not None and scenario.seen_partial["partial"] is True
    assert scenario.seen_partial["stage_order"] == ["boot", "code"]
    final = json.loads(out.read_text())
    assert final["partial"] is True and final["stage_order"] == ["boot", "code"]
    assert final["command"].startswith("python bench/heal_scenario.py --short")
