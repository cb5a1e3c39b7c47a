"""Small real filesystems for fault tests: a tmpfs of a few KiB that fills up, or one remounted read-only.

A full disk or an unwritable folder cannot be imitated honestly with a mock: the error comes from the kernel at
``write``, ``fsync`` or ``rename``. Nor with file modes: the daemon often runs as root, and root writes into a
``chmod 0500`` folder. A tmpfs mount is real, needs no device, and holds exactly ``size`` bytes (in 4 KiB pages).
Mounting needs CAP_SYS_ADMIN (root on a plain machine or CI runner, not an unprivileged container): where it is
not permitted, :class:`MountNotPermitted` says why, and the tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__: list[str] = []  # nothing here is another package's business

PAGE = 4096  # tmpfs accounts its size in pages


class MountNotPermitted(RuntimeError):
    """``mount -t tmpfs`` was refused (not root, or a container without CAP_SYS_ADMIN)."""


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "64k") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (created) for the block; lazily unmounted after it."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "pinsidecar-test", str(path)],
                           capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise MountNotPermitted("no `mount` command on this machine") from None
    if r.returncode != 0:
        raise MountNotPermitted(f"`mount -t tmpfs` was refused ({r.stderr.strip() or r.returncode}): the fault "
                                "tests need root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def remount(path: Path, read_only: bool) -> None:
    """Make the tmpfs at ``path`` read-only (or writable again), as a failing disk or an operator would."""
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(path)], check=True,
                   capture_output=True, timeout=30)


def fill(path: Path) -> list[Path]:
    """Fill the filesystem of folder ``path`` with one-page files until it refuses one; returns them (delete a few
    with :func:`free_pages` to leave exactly that many pages free)."""
    out: list[Path] = []
    block = b"\0" * PAGE
    while True:
        p = path / f".filler-{len(out):05d}"
        try:
            with open(p, "wb") as fh:
                fh.write(block)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                p.unlink()
            if exc.errno != errno.ENOSPC:
                raise
            return out
        out.append(p)


def free_pages(fillers: list[Path], n: int) -> None:
    """Delete ``n`` of the files :func:`fill` wrote: exactly ``n`` pages become free."""
    for _ in range(n):
        fillers.pop().unlink()
