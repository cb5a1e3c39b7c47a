"""Requests from the daemon to the hook: ``flush`` (write the counters now) and ``reset`` (zero them, then write).

A file rather than a signal or socket because the engine's worker may be a grandchild process, or live in a
container: the daemon can always reach the artifact's directory, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from pinsidecar_hook.contract.io import atomic_write_json

__all__ = ["HOOK_OPS", "read_hook_request", "request_path", "write_hook_request"]


def request_path(artifact_path: str | os.PathLike[str]) -> Path:
    """Where the daemon drops a request for the hook that writes ``artifact_path`` (counts or stats).

    A file rather than a signal or socket because the engine's worker may be a grandchild process, or live in a
    container: the daemon can always reach the artifact's directory, and nothing else.
    """
    p = Path(artifact_path)
    return p.with_name(p.name + ".request")


HOOK_OPS = ("flush", "reset")


def write_hook_request(artifact_path: str | os.PathLike[str], op: str) -> str:
    """Ask the hook to ``flush`` (write its counters now) or ``reset`` (zero them, then write).

    Returns a token; the hook copies it into the next artifact it writes (``flush_token``), which is how the
    caller knows its request was served.
    """
    if op not in HOOK_OPS:
        raise ValueError(f"unknown hook request {op!r}; expected one of {HOOK_OPS}")
    token = f"{op}-{os.getpid()}-{time.time_ns()}"
    atomic_write_json(request_path(artifact_path), {"op": op, "token": token})
    return token


def read_hook_request(artifact_path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The pending (op, token), or None. A malformed request is ignored (and removed) rather than fatal: the
    hook runs inside the serving engine and must never fail because of a stray file."""
    p = request_path(artifact_path)
    try:
        doc = json.loads(p.read_bytes())
        op, token = str(doc["op"]), str(doc["token"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            p.unlink()
        return None
    return (op, token) if op in HOOK_OPS else None
