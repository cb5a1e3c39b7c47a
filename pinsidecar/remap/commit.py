"""A remap's commit point: ``<state_dir>/active-map.json``, on disk and fsync'd before the record says committed.

``active-map.json`` is what the daemon boots from (the supervisor's restarts too, once a map applied in place is
committed) and what recovery compares an open record's candidate with after a crash
(:mod:`~pinsidecar.remap.recovery`). So this file *is* the commit: a record that said ``committed`` while the file
still named the old map would be a lie the next restart acts on (it boots the old map, and recovery finds nothing
open to reconcile). The order is therefore fixed: verify, write this file (a temp file, fsync, rename, fsync the
folder: :func:`~pinsidecar_hook.contract.atomic_write_bytes`), and only then the record's ``committed``.

A write that fails (a full or read-only state folder) raises :class:`OSError`; the pipeline puts the old map back
(a candidate that a restart would not boot must not stay serving) and ends the remap ``commit_failed`` with what
:func:`commit_failure` says: the errno's message and what to do about it. When the rename went through but the
folder's fsync failed, the new name may not survive a power cut although a reader sees it now: the previous file
is put back (best effort), so that the file and the record agree that nothing was committed.

:func:`committed_map` is the other side: the map a starting daemon boots, the one this file names while that map
still loads and still has the recorded hash (a map file edited since is not silently served under the old name).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import structlog
from pinsidecar_hook.contract import ArtifactError, atomic_write_bytes, load_map, utc_now

__all__ = ["active_map_path", "committed_map", "write_active_map"]

log = structlog.get_logger(__name__)

ACTIVE_MAP_FILE = "active-map.json"
# errnos that say "no room" and "not writable": the advice differs
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def active_map_path(state_dir: Path) -> Path:
    return Path(state_dir) / ACTIVE_MAP_FILE


def _encode(map_path: Path, map_hash: str | None) -> bytes:
    doc = {"path": str(map_path), "hash": map_hash, "activated_at": utc_now()}
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def write_active_map(file: Path, map_path: Path, map_hash: str | None) -> None:
    """Make ``file`` name ``map_path`` (content hash ``map_hash``) durably, or raise :class:`OSError` with the file
    as it was before."""
    file = Path(file)
    try:
        previous: bytes | None = file.read_bytes()
    except FileNotFoundError:
        previous = None
    data = _encode(map_path, map_hash)
    try:
        atomic_write_bytes(file, data)
    except OSError:
        with contextlib.suppress(OSError):  # renamed, then the folder's fsync failed: take the new name back
            if file.read_bytes() == data:
                if previous is None:
                    os.unlink(file)
                else:
                    atomic_write_bytes(file, previous)
        raise


def commit_failure(exc: OSError, file: Path) -> tuple[str, str]:
    """What went wrong writing ``file`` (with the errno's message), and what the operator should do about it."""
    what = f"commit failed: cannot write {file}: [Errno {exc.errno}] {exc.strerror or exc}"
    folder = Path(file).parent
    if exc.errno in _NO_SPACE:
        todo = f"free space on {folder} and run `pinsidecar remap` again"
    elif exc.errno in _NOT_WRITABLE:
        todo = f"make {folder} writable and run `pinsidecar remap` again"
    else:
        todo = f"check {folder} (see the error) and run `pinsidecar remap` again"
    return what, todo


def committed_map(state_dir: Path, configured: Path | None) -> Path | None:
    """The map to boot: the one ``active-map.json`` names while it validates and has the recorded hash, else
    ``configured`` (``engine.map``)."""
    try:
        doc = json.loads(active_map_path(state_dir).read_text())
        path, want = Path(doc["path"]), doc["hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return configured
    try:
        emap = load_map(path)
    except (ArtifactError, OSError) as exc:
        log.warning("active_map_unusable", path=str(path), reason=str(exc), using=str(configured))
        return configured
    if emap.content_hash != want:
        log.warning("active_map_changed", path=str(path), recorded=want, now=emap.content_hash, using=str(configured))
        return configured
    if path != configured:
        log.info("active_map_from_state", path=str(path), hash=want, configured=str(configured))
    return path
