"""State machines as data: a table of which state may follow which, and the one check every change goes through.

Two things in the daemon change state over minutes and are trusted by others while they do: a remap's record
(:mod:`pinsidecar.remap.record`: recovery and the operator read it) and the engine the supervisor runs
(:mod:`pinsidecar.daemon.engine_state`: status, metrics, systemd and the gate follow it). Each writes its states
down as a ``TRANSITIONS`` table (state -> the states that may follow it) and checks every change against it here,
so "can this happen?" is answered by reading a table, not by reading every caller. What a refused change does is
the owner's choice: the remap record refuses it (a record that says a step happened that did not is worse than a
remap that stops); the supervisor logs it loudly and raises under tests.

It lives at the top of the package, below both owners, so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["IllegalTransition", "check_transition"]

Transitions = Mapping[str, frozenset[str]]


class IllegalTransition(ValueError):
    """A state change the owner's table does not allow (a bug in whoever asked for it). ``frm`` and ``to`` name it."""

    def __init__(self, owner: str, table: Transitions, frm: str, to: str) -> None:
        allowed = ", ".join(sorted(table.get(frm, ()))) or "none: it is terminal"
        super().__init__(f"{owner}: illegal transition {frm!r} -> {to!r} (allowed after {frm!r}: {allowed})")
        self.frm, self.to = frm, to


def check_transition(table: Transitions, owner: str, frm: str, to: str) -> None:
    """Raise :class:`IllegalTransition` (naming ``owner``, e.g. ``remap <id>``) unless ``to`` may follow ``frm``."""
    if to not in table.get(frm, frozenset()):
        raise IllegalTransition(owner, table, frm, to)
