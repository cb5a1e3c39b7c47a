"""The remap record's table of allowed transitions, walked pair by pair: each allowed one passes, every other
raises naming both states.

A record is what recovery and the operator trust about the engine, so a state change the pipeline never meant
(``choosing_workload`` -> ``committed``, anything after a terminal state) must stop there, not be written down.
"""

from __future__ import annotations

import itertools

import pytest

from pinsidecar.remap.record import (
    PRE_REBOOT_STATES,
    STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    RemapRecord,
)
from pinsidecar.transitions import IllegalTransition

ALL = STATES + TERMINAL_STATES


def _step(rec: RemapRecord, to: str) -> None:
    if to in TERMINAL_STATES:
        rec.finish(to, reason="test")
    else:
        rec.enter(to)


def test_the_table_names_every_state_and_only_states() -> None:
    assert set(TRANSITIONS) == set(ALL)
    assert all(nxt <= set(ALL) for nxt in TRANSITIONS.values())
    assert all(not TRANSITIONS[t] for t in TERMINAL_STATES)


@pytest.mark.parametrize(("frm", "to"), list(itertools.product(ALL, ALL)))
def test_every_pair_is_allowed_by_the_table_or_refused_naming_both(frm: str, to: str) -> None:
    rec = RemapRecord.new("manual", state=frm)
    if to in TRANSITIONS[frm]:
        _step(rec, to)
        assert rec.state == to and rec.steps[-1]["state"] == frm
        assert rec.outcome == (to if to in TERMINAL_STATES else None)
    else:
        with pytest.raises(IllegalTransition) as err:
            _step(rec, to)
        assert f"{frm!r} -> {to!r}" in str(err.value) and rec.id in str(err.value)
        assert err.value.frm == frm and err.value.to == to
        assert rec.state == frm and rec.steps == []  # nothing recorded


def test_the_paths_the_pipeline_takes_are_allowed() -> None:
    paths = [
        ["choosing_workload", "library_check", "count_boot", "building", "evaluating", "rebooting", "verifying",
         "committed"],
        ["choosing_workload", "library_check", "building", "evaluating", "applying", "verifying", "commit_failed"],
        ["choosing_workload", "library_check", "evaluating", "applying", "rebooting", "verifying", "rolled_back"],
        ["evaluating", "refused"],
        ["evaluating", "applying", "rolled_back"],  # parity after the apply, or the engine died
        ["evaluating", "rebooting", "aborted"],  # the parity fixture could not be recorded: nothing rebooted
    ]
    for path in paths:
        rec = RemapRecord.new("manual", state=path[0])
        for to in path[1:]:
            _step(rec, to)
        assert rec.terminal and [s["state"] for s in rec.steps] == path[:-1]


def test_recovery_closes_every_open_state_legally() -> None:
    """What a restart does with a record left open (remap.recovery): aborted before the deploy, else committed
    or rolled back, from every state."""
    for frm in STATES:
        outs = ["aborted"] if frm in PRE_REBOOT_STATES else ["committed", "rolled_back"]
        for to in outs:
            assert to in TRANSITIONS[frm], (frm, to)


def test_an_unknown_state_is_still_refused_as_unknown() -> None:
    rec = RemapRecord.new("manual")
    with pytest.raises(ValueError, match="unknown remap state 'cooking'"):
        rec.enter("cooking")
    with pytest.raises(ValueError, match="not a terminal remap state"):
        rec.finish("cooking")
