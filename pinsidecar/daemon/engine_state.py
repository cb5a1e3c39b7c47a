"""The engine's states as data: what each means, which may follow which (:data:`TRANSITIONS`), and what a change
the table does not allow does.

The supervisor (:mod:`pinsidecar.daemon.supervisor`) is the only writer, and every change goes through
:func:`check_engine_transition` (the same check the remap record's changes go through,
:func:`pinsidecar.transitions.check_transition`). Status, the exporter (``pinsidecar_engine_state``), systemd's
``READY=1`` and the gate all follow the state, so the table is the answer to "can the engine go from here to
there?". A change of the detail alone (a new backoff figure, one more missed health check) is not a transition.

The table, read by rows:

- ``stopped`` (before the first boot, after the daemon stops) -> ``starting``; ``restarting``/``failed`` when a boot
  fails before the engine is started (its map unreadable); ``draining`` when an operator's drain-reboot comes first;
- ``starting`` -> ``ready``; ``restarting``/``failed`` (the boot failed); ``draining`` (a drain-reboot took the lock
  right after a failed boot); ``stopping``;
- ``ready`` and ``unhealthy`` -> each other (health checks); ``restarting`` (the engine was lost: exited or hung);
  ``draining``; ``stopping``;
- ``restarting`` -> ``starting`` (the next boot); ``failed`` (the crash-loop limit); ``draining``; ``stopping``;
- ``draining`` -> ``starting`` (the reboot), ``restarting``/``failed`` (its boot failed before starting), or back to
  the state it interrupted when nothing was rebooted (:meth:`~pinsidecar.daemon.supervisor.Supervisor.draining`);
- ``stopping`` -> ``stopped``;
- ``failed`` -> ``draining`` only: an operator's drain-reboot is the way out (or a new daemon).

**An illegal transition is a bug** in the supervisor, not an engine fault. In service it is logged as an error
(``engine_illegal_transition``) and the state is set anyway: the engine really is where its owner says, and a
supervisor that stopped over its own bookkeeping would leave the engine unsupervised. Under tests it raises
(:data:`STRICT_ENV`), so the bug fails the test that found it.
"""

from __future__ import annotations

import os
from typing import ClassVar

import structlog

from pinsidecar.transitions import IllegalTransition, check_transition

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# "1": an illegal transition raises; "0": it is only logged. Unset: it raises under pytest (which sets
# PYTEST_CURRENT_TEST, and a daemon a test starts inherits it), and is only logged in service.
STRICT_ENV = "PINSIDECAR_STRICT_STATES"


class EngineState:
    """The engine's states, as exported (``pinsidecar_engine_state``) and shown in status."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"  # live but failing /health; restarted after health_failures checks
    BACKOFF = "restarting"  # waiting (backoff) before the next boot after a crash or failed boot
    DRAINING = "draining"  # drain-reboot in progress (the gate holds new requests)
    STOPPING = "stopping"
    FAILED = "failed"  # crash-loop limit reached: no more restarts until an operator asks

    ALL = (STOPPED, STARTING, READY, UNHEALTHY, BACKOFF, DRAINING, STOPPING, FAILED)
    # An engine that runs and takes requests through the gate (an unhealthy one is still live until restarted).
    LIVE = (READY, UNHEALTHY)
    # The exporter's state set (pinsidecar.metrics.ENGINE_STATES) has no separate unhealthy/stopping: an
    # unhealthy engine is about to be restarted, a stopping one is about to be stopped.
    EXPORTED: ClassVar[dict[str, str]] = {UNHEALTHY: BACKOFF, STOPPING: STOPPED}


_S = EngineState
# state -> the states that may follow it (see the module docstring for why each is there).
TRANSITIONS: dict[str, frozenset[str]] = {
    _S.STOPPED: frozenset({_S.STARTING, _S.BACKOFF, _S.FAILED, _S.DRAINING}),
    _S.STARTING: frozenset({_S.READY, _S.BACKOFF, _S.FAILED, _S.DRAINING, _S.STOPPING}),
    _S.READY: frozenset({_S.UNHEALTHY, _S.BACKOFF, _S.DRAINING, _S.STOPPING}),
    _S.UNHEALTHY: frozenset({_S.READY, _S.BACKOFF, _S.DRAINING, _S.STOPPING}),
    _S.BACKOFF: frozenset({_S.STARTING, _S.FAILED, _S.DRAINING, _S.STOPPING}),
    _S.DRAINING: frozenset({_S.STARTING, _S.BACKOFF, _S.FAILED, _S.STOPPED, _S.READY, _S.UNHEALTHY}),
    _S.STOPPING: frozenset({_S.STOPPED}),
    _S.FAILED: frozenset({_S.DRAINING}),
}


def strict() -> bool:
    """Whether an illegal transition raises (:data:`STRICT_ENV`; by default under pytest only)."""
    default = "1" if "PYTEST_CURRENT_TEST" in os.environ else "0"
    return os.environ.get(STRICT_ENV, default) == "1"


def check_engine_transition(frm: str, to: str, detail: str = "") -> None:
    """Let ``frm`` -> ``to`` through when :data:`TRANSITIONS` allows it (or the state does not change); otherwise
    log it as the bug it is and, when :func:`strict`, raise :class:`~pinsidecar.transitions.IllegalTransition`."""
    if frm == to:
        return
    try:
        check_transition(TRANSITIONS, "engine", frm, to)
    except IllegalTransition as exc:
        log.error("engine_illegal_transition", frm=frm, to=to, detail=detail or None, error=str(exc),
                  hint="a bug in the supervisor (the state is set anyway); report it with this line")
        if strict():
            raise
