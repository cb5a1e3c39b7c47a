"""A stand-in for the daemon behind the control API: records what the API asked for, refuses on request.

The control API's rules (auth, body limits, the webhook's dedup and refusals) are checked against it, so "nothing
was done" is a plain assertion on :attr:`RecordingTarget.remaps` / :attr:`RecordingTarget.drains`; the real daemon
behind the same API is exercised in the daemon and alert-chain tests.
"""

from __future__ import annotations

import itertools
from typing import Any

from pinsidecar.daemon.control import ControlError

__all__: list[str] = []  # nothing here is another package's business


class RecordingTarget:
    """Implements :class:`~pinsidecar.daemon.control.ControlTarget`. ``refuse`` (a status and message) makes the
    next ``request_remap`` calls raise :class:`ControlError` the way the daemon's gate does (409 running, 429
    cooldown), without recording them; a ``map`` of ``"busy"`` makes ``drain_reboot`` answer 409."""

    def __init__(self) -> None:
        self.drains: list[tuple[str | None, float | None]] = []
        self.remaps: list[dict[str, Any]] = []
        self.refuse: tuple[int, str] | None = None
        self._ids = itertools.count(1)

    @property
    def calls(self) -> list[tuple[str | None, float | None]]:
        return self.drains

    def status(self) -> dict[str, Any]:
        return {"engine": {"state": "ready"}, "remap": {"history": list(self.remaps)}}

    async def drain_reboot(self, map_ref: str | None, timeout_s: float | None) -> dict[str, Any]:
        if map_ref == "busy":
            raise ControlError(409, "a drain-reboot is already running")
        self.drains.append((map_ref, timeout_s))
        return {"ok": True, "map": map_ref}

    async def request_remap(self, *, trigger: str, dry_run: bool = False, map_ref: str | None = None,
                            reason: str = "", detail: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.refuse is not None:
            raise ControlError(*self.refuse)
        remap_id = None if dry_run else f"r{next(self._ids)}"
        self.remaps.append({"trigger": trigger, "dry_run": dry_run, "map_ref": map_ref, "reason": reason,
                            "detail": detail, "id": remap_id})
        return {"accepted": not dry_run, "remap_id": remap_id, "trigger": trigger, "dry_run": dry_run,
                "state": "evaluating" if dry_run else "choosing_workload", "reason": reason,
                "decision": {"deploy": True, "reason": "fake"} if dry_run else None}
