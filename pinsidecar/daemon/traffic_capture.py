"""Capture store: a bounded sample of the completion requests the gate saw, kept as replayable workload files.

A row map is a per-workload artifact (docs/design.md), so the best traffic for a count boot is the traffic the
engine actually serves. The gate offers every request body to :meth:`CaptureStore.offer`; the store keeps a random
sample of ``/v1/completions`` and ``/v1/chat/completions`` bodies, one JSON request per line, which is exactly the
workload format ``pinsidecar count-boot`` replays.

Bounded, and safe to read while it writes:

- lines go to an *active* file (``capture.active.jsonl``) with one ``write`` per line on an ``O_APPEND`` descriptor;
- when the active file would pass ``max_file_bytes`` it is fsynced and renamed (atomically) to
  ``capture-<UTC time>-<seq>.jsonl``; only those completed files are workload files (:meth:`CaptureStore.files`);
- at most ``max_files`` completed files are kept (the oldest are deleted), so the store never holds more than
  ``(max_files + 1) * max_file_bytes`` bytes;
- after a crash, a torn last line in the active file is cut off on the next start.

Opt-in: nothing is captured unless the daemon builds a store (``gate.capture_dir`` set; unset by default), because
request bodies are user data. For the same reason the folder is created 0700 and every file 0600 (the active file
is opened with that mode; a rotation renames it, keeping it), whatever the daemon's umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import structlog

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

CAPTURE_PATHS = ("/v1/completions", "/v1/chat/completions")
ACTIVE_NAME = "capture.active.jsonl"
_DONE_GLOB = "capture-*.jsonl"


class CaptureStore:
    """Samples request bodies into rotated JSONL files under ``directory``; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], *, sample_rate: float = 0.1,
                 max_file_bytes: int = 16 * 1024 * 1024, max_files: int = 8,
                 paths: Iterable[str] = CAPTURE_PATHS, rng: random.Random | None = None) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"capture sample_rate must be between 0 and 1, got {sample_rate}")
        if max_file_bytes < 1024:
            raise ValueError(f"capture max_file_bytes must be at least 1024, got {max_file_bytes}")
        if max_files < 1:
            raise ValueError(f"capture max_files must be at least 1, got {max_files}")
        self.directory = Path(directory)
        self.sample_rate = sample_rate
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.paths = frozenset(paths)
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._seq = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("offered", "written", "skipped_invalid", "skipped_too_large", "rotations", "write_errors"), 0)
        try:
            # 0700 / 0600: request bodies are user data, readable by the daemon's user alone
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"capture directory {self.directory}: cannot create it ({exc.strerror}); "
                             "pick a writable directory") from None
        self._active_path = self.directory / ACTIVE_NAME
        self._repair_active()
        self._fd: int | None = None
        self._size = self._active_path.stat().st_size if self._active_path.exists() else 0

    # ------------------------------------------------------------------------------------------------ reading
    def files(self) -> list[Path]:
        """Completed workload files, oldest first. The active file is never listed: call :meth:`rotate` first to
        include what was captured so far."""
        return sorted(self.directory.glob(_DONE_GLOB))

    @property
    def active_bytes(self) -> int:
        return self._size

    # ------------------------------------------------------------------------------------------------ writing
    def offer(self, path: str, body: bytes) -> bool:
        """Maybe keep ``body`` (a request to ``path``); True when it was written. Never raises on bad input."""
        if path not in self.paths:
            return False
        with self._lock:
            self.counters["offered"] += 1
            if self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
                return False
            try:
                request = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                self.counters["skipped_invalid"] += 1
                return False
            if not isinstance(request, dict):
                self.counters["skipped_invalid"] += 1
                return False
            line = (json.dumps(request, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
            if len(line) > self.max_file_bytes:
                self.counters["skipped_too_large"] += 1
                return False
            try:
                if self._size + len(line) > self.max_file_bytes:
                    self._rotate_locked()
                fd = self._open_locked()
                os.write(fd, line)
            except OSError as exc:
                self.counters["write_errors"] += 1
                if self.counters["write_errors"] == 1:
                    log.warning("capture write failed; requests are still served", path=str(self._active_path),
                                error=exc.strerror)
                return False
            self._size += len(line)
            self.counters["written"] += 1
            return True

    def rotate(self) -> Path | None:
        """Complete the active file now (if it has anything) and return the new workload file's path."""
        with self._lock:
            return self._rotate_locked()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open_locked(self) -> int:
        if self._fd is None:
            self._fd = os.open(self._active_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

    def _rotate_locked(self) -> Path | None:
        if self._size == 0:
            return None
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        done = self.directory / f"capture-{stamp}-{os.getpid()}-{self._seq:06d}.jsonl"
        os.replace(self._active_path, done)
        _fsync_dir(self.directory)
        self._size = 0
        self.counters["rotations"] += 1
        for old in self.files()[:-self.max_files]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return done

    def _repair_active(self) -> None:
        """Cut a torn last line (a crash mid-write) off the active file, so every line stays one valid request."""
        try:
            data = self._active_path.read_bytes()
        except FileNotFoundError:
            return
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(self._active_path, "r+b") as fh:
                fh.truncate(keep)
            log.info("capture: cut a torn last line from the active file", path=str(self._active_path),
                     dropped_bytes=len(data) - keep)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
