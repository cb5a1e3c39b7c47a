"""The error every operator request can end in: what the control API answers when it cannot do what was asked.

It lives below both the daemon and the remap pipeline (the control API calls into the daemon, the daemon into
the pipeline, and any of them may refuse), so that the pipeline never imports the daemon.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ControlError"]


class ControlError(Exception):
    """A request refused or failed, with the HTTP ``status`` the control API answers and a message for a person
    (what is wrong and how to fix it); ``payload`` adds fields to the JSON answer (e.g. the running remap)."""

    def __init__(self, status: int, message: str, payload: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.payload = payload or {}
