"""The engine's table of allowed transitions, walked pair by pair, and the supervisor's ``draining()``.

The engine's state is what status, the exporter, systemd and the gate follow, so which state may follow which is
data (:data:`pinsidecar.daemon.engine_state.TRANSITIONS`), checked at every change the supervisor makes: an
illegal one raises under tests (this process runs under pytest) and is logged loudly in service, where the state
is still set. The drain-reboot changes the state only through :meth:`Supervisor.draining`, never through the
supervisor's private setter.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.daemon.engine_state import STRICT_ENV, TRANSITIONS, EngineState
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.engine import EngineSpec
from pinsidecar.testing.remap import InstantEngine
from pinsidecar.transitions import IllegalTransition

ROOT = Path(__file__).resolve().parent.parent
S = EngineState


def _supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(lambda mp: EngineSpec(model=tmp_path, port=8271), InstantEngine, SupervisorConfig(),
                      ready_timeout_s=5.0, stop_timeout_s=5.0)


def test_the_table_names_every_state_and_every_state_has_a_way_on() -> None:
    assert set(TRANSITIONS) == set(S.ALL)
    assert all(nxt <= set(S.ALL) and nxt for nxt in TRANSITIONS.values())
    assert TRANSITIONS[S.FAILED] == {S.DRAINING}  # an operator's drain-reboot is the one way out of failed
    assert S.STARTING not in TRANSITIONS[S.READY]  # a boot needs the engine stopped first


@pytest.mark.parametrize(("frm", "to"), list(itertools.product(S.ALL, S.ALL)))
def test_every_pair_is_allowed_by_the_table_or_raises_naming_both(tmp_path: Path, frm: str, to: str) -> None:
    sup = _supervisor(tmp_path)
    sup.state = frm
    if frm == to or to in TRANSITIONS[frm]:
        sup._set_state(to, "test")
        assert (sup.state, sup.detail) == (to, "test")
        return
    with capture_logs() as logs, pytest.raises(IllegalTransition) as err:
        sup._set_state(to, "test")
    assert f"{frm!r} -> {to!r}" in str(err.value) and (err.value.frm, err.value.to) == (frm, to)
    assert sup.state == frm  # under tests nothing is set
    assert [e["event"] for e in logs] == ["engine_illegal_transition"] and logs[0]["log_level"] == "error"


def test_in_service_an_illegal_transition_is_logged_and_the_state_still_set(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "0")
    sup = _supervisor(tmp_path)
    sup.state = S.FAILED
    with capture_logs() as logs:
        sup._set_state(S.READY)
    assert sup.state == S.READY  # the supervisor goes on: the engine is where its owner says
    bad = [e for e in logs if e["event"] == "engine_illegal_transition"]
    assert len(bad) == 1 and (bad[0]["frm"], bad[0]["to"]) == (S.FAILED, S.READY)


def test_the_paths_the_supervisor_takes_are_allowed() -> None:
    paths = [
        [S.STOPPED, S.STARTING, S.READY, S.UNHEALTHY, S.READY, S.BACKOFF, S.STARTING, S.READY],  # a hang, a restart
        [S.STOPPED, S.STARTING, S.BACKOFF, S.STARTING, S.FAILED, S.DRAINING, S.STARTING, S.READY],  # crash loop
        [S.READY, S.DRAINING, S.STARTING, S.READY],  # a drain-reboot
        [S.READY, S.DRAINING, S.STARTING, S.READY, S.DRAINING, S.STARTING, S.READY],  # parity failed: rolled back
        [S.READY, S.DRAINING, S.STARTING, S.BACKOFF],  # the reboot's boot failed, no map to roll back to
        [S.READY, S.DRAINING, S.READY],  # nothing rebooted (a remap's check before the stop said no)
        [S.READY, S.STOPPING, S.STOPPED],  # the daemon stops
    ]
    for path in paths:
        for frm, to in itertools.pairwise(path):
            assert to in TRANSITIONS[frm], (path, frm, to)


def test_draining_gives_back_the_state_it_interrupted_when_nothing_was_rebooted(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    seen: list[str] = []
    sup.on_state = lambda state, detail: seen.append(state)

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="lock"), sup.draining("no lock"):
            pass
        async with sup.lock:
            await sup.boot("start")
            sup._set_state(S.UNHEALTHY, "/health failed 1 time(s) in a row")
            with sup.draining("holding"):
                assert (sup.state, sup.detail) == (S.DRAINING, "holding")
            assert (sup.state, sup.detail) == (S.UNHEALTHY, "/health failed 1 time(s) in a row")
            with sup.draining("holding"):
                await sup.reboot("drain-reboot")
            assert sup.state == S.READY and sup.serving  # rebooted: the boot's state stands
            with pytest.raises(OSError), sup.draining("holding"):  # a failure inside, engine untouched
                raise OSError("gate")
            assert sup.state == S.READY
            with sup.draining("holding"):
                await sup.stop_engine(S.DRAINING)
            assert sup.state == S.DRAINING and not sup.serving  # stopped and not booted: the loop boots it
            await sup.boot("retry")
            await sup.stop_engine()

    asyncio.run(scenario())
    # (stop_engine inside a drain says "draining" again: the same state, its detail cleared)
    assert seen == [S.STARTING, S.READY, S.UNHEALTHY, S.DRAINING, S.UNHEALTHY, S.DRAINING, S.DRAINING, S.STARTING,
                    S.READY, S.DRAINING, S.READY, S.DRAINING, S.DRAINING, S.STARTING, S.READY, S.STOPPING, S.STOPPED]


def test_only_the_supervisor_sets_the_engines_state() -> None:
    """The drain-reboot once called the supervisor's private setter; every other module goes through its methods."""
    offenders = []
    for path in sorted((ROOT / "pinsidecar").rglob("*.py")):
        if path.name == "supervisor.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_set_state":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
