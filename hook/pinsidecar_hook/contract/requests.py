"""Requests from the daemon to the hook: ``flush`` (write the counters now) and ``reset`` (zero them, then write).

The protocol, for both counts (count mode) and stats (pin mode):

1. The client drops ``<artifact>.request`` (:func:`request_path`) holding ``{"op": ..., "token": ...}``
   (:func:`write_hook_request`).
2. The hook's side thread looks for it every :data:`REQUEST_POLL_S`, serves it, and writes the artifact with the
   request's token in its top-level ``flush_token`` field. It keeps echoing that token in every later write until
   the next request, so a slow poller cannot miss it; then it removes the request file unless a newer request
   has replaced it meanwhile. A malformed request file is dropped, never fatal.
3. The client waits for an artifact whose ``flush_token`` is its token (:func:`request_and_wait`, the one
   client-side wait; every caller uses it).

A file rather than a signal or socket because the engine's worker may be a grandchild process, or live in a
container: the daemon can always reach the artifact's directory, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pinsidecar_hook.contract.io import atomic_write_json

__all__ = [
    "HOOK_OPS",
    "REQUEST_POLL_S",
    "HookRequestError",
    "read_hook_request",
    "request_and_wait",
    "request_path",
    "write_hook_request",
]

HOOK_OPS = ("flush", "reset")
# How often the hook's side thread looks for a request file, in both modes: short enough that commands waiting
# for their request feel immediate (a request is served within this plus one engine step), long enough that the
# stat() calls are noise.
REQUEST_POLL_S = 0.2

T = TypeVar("T")


class HookRequestError(RuntimeError):
    """A flush/reset request got no answer: not within the timeout, or the engine went away while waiting."""


def request_path(artifact_path: str | os.PathLike[str]) -> Path:
    """Where the daemon drops a request for the hook that writes ``artifact_path`` (counts or stats)."""
    p = Path(artifact_path)
    return p.with_name(p.name + ".request")


def write_hook_request(artifact_path: str | os.PathLike[str], op: str) -> str:
    """Ask the hook to ``flush`` (write its counters now) or ``reset`` (zero them, then write).

    Returns a token; the hook copies it into the artifact's ``flush_token``, which is how the caller knows its
    request was served. Most callers want :func:`request_and_wait`, which also waits for the answer.
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
    if op not in HOOK_OPS:
        with contextlib.suppress(OSError):
            p.unlink()
        return None
    return op, token


def request_and_wait(artifact_path: str | os.PathLike[str], op: str, load: Callable[[Path], T], *,
                     timeout_s: float = 60.0, alive: Callable[[], bool] | None = None, poll_s: float = 0.1) -> T:
    """Drop a ``flush``/``reset`` request beside ``artifact_path`` and return the first artifact
    (``load(artifact_path)``) whose ``flush_token`` is the request's token.

    ``load`` is the artifact's reader (``load_counts``, ``load_stats``); a missing, corrupt or half-written file
    means "not yet". Pass ``alive`` (e.g. the engine process's ``alive``) to fail at once when the engine exits
    instead of waiting out the timeout. Raises :class:`HookRequestError` in both cases; the timeout message names
    the file and how to check that the hook is loaded.
    """
    path = Path(artifact_path)
    token = write_hook_request(path, op)
    deadline = time.monotonic() + timeout_s
    last = "no file yet"
    while True:
        try:
            artifact = load(path)
        except (OSError, ValueError) as exc:  # ArtifactError is a ValueError: missing, corrupt, mid-replace
            last = str(exc)
        else:
            answered = getattr(artifact, "flush_token", None)
            if answered == token:
                return artifact
            last = f"its flush_token is {answered!r}"
        if alive is not None and not alive():
            raise HookRequestError(f"the engine exited while waiting for the hook to answer the {op} request "
                                   f"{token} ({path})")
        if time.monotonic() >= deadline:
            raise HookRequestError(
                f"the hook did not answer the {op} request {token} within {timeout_s:g} s ({path}: {last}). Check "
                "that the engine loads the pinsidecar hook: VLLM_PLUGINS unset or including 'pinsidecar_hook', "
                "the pinsidecar_hook entry point installed or the hook/ folder on PYTHONPATH, and "
                "PINSIDECAR_HOOK_MODE / PINSIDECAR_COUNTS_PATH / PINSIDECAR_STATS_PATH naming this file")
        time.sleep(poll_s)
