"""The hook's one side thread: write a mode's counters to its file now and then, and on request.

Both modes keep their counters on the device, filled inside the forward; this thread is their only reader, and
the only code in the hook that writes a file while the engine serves. It never blocks serving and never fails it.
A mode hands it a small *source* (:class:`FlushSource`): ``snapshot(info)`` turns the live counters into an
artifact (count mode: :class:`~pinsidecar_hook.contract.CountsArtifact`, pin mode:
:class:`~pinsidecar_hook.contract.StatsSnapshot`), ``reset()`` zeroes them. The flusher knows nothing else
about either mode:

- **periodic writes**: every ``interval_s`` (``PINSIDECAR_FLUSH_INTERVAL_S``), so a worker killed without notice
  (vLLM's front end may SIGKILL it) loses at most one interval;
- **requests** (:mod:`pinsidecar_hook.contract.requests`), looked for every
  :data:`~pinsidecar_hook.contract.REQUEST_POLL_S`: ``flush`` writes now, ``reset`` zeroes then writes,
  ``apply`` hands the request's arguments to the source's ``apply(args, token)`` (pin mode's in-place remap,
  :mod:`pinsidecar_hook.swap`; a source without one, count mode, answers ``refused``) and then writes. The
  request's token goes in the artifact's ``flush_token`` and stays there in every later write until the next
  request; the last apply's :class:`~pinsidecar_hook.contract.ApplyResult` goes in ``meta["apply"]`` and stays
  there until the next apply; the request file is removed afterwards unless a newer one replaced it meanwhile; a
  request already served (its file could not be removed) is not served twice; a request file that cannot be read
  is dropped;
- **write failures** never stop serving: each is counted in ``errors[<write_error_key>]`` (which the next
  artifact carries), logged once, and, when the mode has one, the artifact goes to a fallback path instead (pin
  mode: :func:`~pinsidecar_hook.contract.fallback_stats_path`, which the daemon's reader also looks at);
- **exit**: :meth:`Flusher.flush_at_exit` writes once more at interpreter exit and on SIGTERM (chaining any
  previous handler). That is a bonus, not the bound on loss: the periodic write is.

An exception anywhere in one round is counted in ``errors["flush_thread"]`` (logged the first time) and the
thread goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pinsidecar_hook.contract import REQUEST_POLL_S, ApplyResult, read_hook_request, request_path

__all__ = ["Artifact", "FlushSource", "Flusher", "WriteInfo"]

log = logging.getLogger("pinsidecar_hook")


class Artifact(Protocol):
    """What a source's snapshot must be: a contract artifact that saves itself atomically."""

    flush_token: str

    def save(self, path: str | os.PathLike[str]) -> None: ...


@dataclass
class WriteInfo:
    """What the flusher tells a source about the write it is snapshotting for."""

    seq: int  # 1 for the first write of this flusher, +1 per write (fallback writes included)
    flush_token: str  # the last request served ("" before the first), to echo in the artifact
    errors: dict[str, int] = field(default_factory=dict)  # the flusher's error counters, a copy
    apply: dict[str, Any] | None = None  # the last apply's answer (ApplyResult.to_json()), for meta["apply"]
    final: bool = False  # the exit write (flush_at_exit): a source's last chance to write what it held back


class FlushSource(Protocol):
    """A mode's counters, as the flusher sees them. A source may also have ``apply(args, token) ->
    ApplyResult`` (pin mode's in-place remap); the flusher looks for it when an ``apply`` request comes."""

    def snapshot(self, info: WriteInfo) -> Artifact:
        """Copy the live counters into an artifact (cheap: a few small device-to-host copies)."""
        ...

    def reset(self) -> None:
        """Zero the live counters."""
        ...


class Flusher:
    """Writes ``source``'s snapshots to ``path`` periodically and on request, from one daemon thread.

    ``name`` ("count", "pin") prefixes log lines and names the thread; ``what`` ("counts", "stats") names the
    file in them. Call :meth:`flush` once when the engine is ready, then :meth:`start`.
    """

    def __init__(self, source: FlushSource, path: str | os.PathLike[str], *, interval_s: float, name: str,
                 what: str, write_error_key: str, fallback_path: str | os.PathLike[str] | None = None) -> None:
        self.source = source
        self.path = Path(path)
        self.fallback_path = None if fallback_path is None else Path(fallback_path)
        self.interval_s = interval_s
        self.name = name
        self.what = what
        self.write_error_key = write_error_key
        self.seq = 0
        self.flush_token = ""
        self.last_apply: dict[str, Any] | None = None
        self.errors: dict[str, int] = {}
        self.last_written: Path | None = None
        self._logged: set[str] = set()
        self._saved_seq = 0
        self._stop = threading.Event()
        # Re-entrant: the SIGTERM handler runs on the main thread and may interrupt it while it holds either.
        self._state_lock = threading.RLock()  # seq, flush_token, last_apply, errors
        self._write_lock = threading.RLock()  # one save at a time, in seq order
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------ writes

    def _count(self, key: str) -> int:
        self.errors[key] = self.errors.get(key, 0) + 1
        return self.errors[key]

    def _info(self, final: bool = False) -> WriteInfo:
        return WriteInfo(seq=self.seq, flush_token=self.flush_token, errors=dict(self.errors),
                         apply=self.last_apply, final=final)

    def flush(self, token: str | None = None, *, final: bool = False) -> Path | None:
        """Write a snapshot now; ``token``, when given, becomes the echoed ``flush_token``; ``final``: the exit
        write. Returns the path written (``path``, or the fallback), or None when nothing was written."""
        with self._state_lock:
            if token is not None:
                self.flush_token = token
            self.seq += 1
            info = self._info(final)
        # The snapshot may wait for the step lock (count mode), so no lock of ours is held while taking it: the
        # SIGTERM handler runs on the main thread, which may be mid-step holding that lock.
        artifact = self.source.snapshot(info)
        with self._write_lock:
            if info.seq < self._saved_seq:
                return None  # a newer snapshot was saved meanwhile; a reader must never see seq go backwards
            self._saved_seq = info.seq
            try:
                artifact.save(self.path)
            except OSError as exc:  # a full disk or a read-only mount must not take the engine down
                error = exc
            else:
                self.last_written = self.path
                return self.path
        return self._write_failed(error, info.seq)

    def _write_failed(self, exc: OSError, seq: int) -> Path | None:
        with self._state_lock:
            self._count(self.write_error_key)
            info = WriteInfo(seq=seq, flush_token=self.flush_token, errors=dict(self.errors),
                             apply=self.last_apply)
        fallback = self.fallback_path
        if self.write_error_key not in self._logged:
            self._logged.add(self.write_error_key)
            where = f"{self.what} go to {fallback}" if fallback else "the next write tries again"
            log.error("pinsidecar %s: cannot write %s to %s (%s); serving goes on, %s (errors counted in "
                      "errors.%s, logged once)", self.name, self.what, self.path, exc, where, self.write_error_key)
        if fallback is None:
            return None
        artifact = self.source.snapshot(info)  # again, so that the fallback file carries the error just counted
        with self._write_lock:
            if seq < self._saved_seq:
                return None
            try:
                artifact.save(fallback)
            except OSError:
                return None
            self.last_written = fallback
            return fallback

    def apply(self, args: Mapping[str, Any], token: str) -> ApplyResult:
        """Hand an ``apply`` request to the source; a source without ``apply`` (count mode) refuses. The source's
        own apply never raises (it answers ``failed``); anything that still escapes is answered ``failed`` here,
        so the client gets an answer rather than a timeout."""
        apply = getattr(self.source, "apply", None)
        if apply is None:
            return ApplyResult(token=token, outcome="refused", reason=f"{self.name} mode has no map to apply")
        try:
            result: ApplyResult = apply(args, token)
        except Exception as exc:  # the side thread must survive, and the client must hear back
            log.exception("pinsidecar %s: apply %s raised", self.name, token)
            return ApplyResult(token=token, outcome="failed", reason=f"{type(exc).__name__}: {exc}")
        return result

    def serve_request(self) -> bool:
        """Serve a pending flush/reset/apply request, if any; True when one was served."""
        req = read_hook_request(self.path)
        if req is None:
            return False
        op, token, args = req
        served = token != self.flush_token  # equal: served already, but its file could not be removed
        if served:
            if op == "reset":
                self.source.reset()
            elif op == "apply":
                answer = self.apply(args, token).to_json()
                with self._state_lock:
                    self.last_apply = answer
            self.flush(token)
            log.info("pinsidecar %s: served %s request %s", self.name, op, token)
        if read_hook_request(self.path) == req:  # not replaced by a newer request meanwhile
            with contextlib.suppress(OSError):
                request_path(self.path).unlink()
        return served

    # ------------------------------------------------------------------------------------------------ thread

    def poll_once(self, now: float, next_flush: float) -> float:
        """One round of the thread: serve a request, or write when the interval is up. Returns the next
        periodic write time. Never raises."""
        try:
            if self.serve_request():
                return now + self.interval_s
            if now >= next_flush:
                self.flush()
                return now + self.interval_s
        except Exception:  # the thread must outlive any one bad round
            with self._state_lock:
                first = self._count("flush_thread") == 1
            if first:
                log.exception("pinsidecar %s: flush thread error (further ones are only counted)", self.name)
        return next_flush

    def _run(self) -> None:
        next_flush = time.monotonic() + self.interval_s
        while not self._stop.wait(REQUEST_POLL_S):
            next_flush = self.poll_once(time.monotonic(), next_flush)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"pinsidecar-{self.name}-flush", daemon=True)
        self._thread.start()

    def stop(self, final_flush: bool = False, timeout_s: float = 5.0) -> None:
        """Stop the thread (and wait for it), writing once more when ``final_flush``."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if final_flush:
            self.flush()

    def flush_at_exit(self) -> None:
        """Write once more at interpreter exit and on SIGTERM, then let SIGTERM do what it did before."""

        def final_flush() -> None:
            self._stop.set()
            with contextlib.suppress(Exception):
                self.flush(final=True)

        atexit.register(final_flush)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit and the periodic write remain
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            final_flush()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # default action: die by SIGTERM, as without us
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, on_sigterm)
