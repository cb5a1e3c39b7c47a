"""The commit point, ``active-map.json``: written durably or not at all, on a real full disk.

The pipeline end to end (a remap verified, then a disk full at its commit: ``commit_failed``, the old map put back)
is in test_remap_pipeline.py. Here the writer itself, on a real tmpfs of 64 KiB the test mounts (root or
CAP_SYS_ADMIN; skipped with the reason where mounting is refused): the kernel's ENOSPC comes back as it is, the
previous file is untouched, no temp file is left; and a rename that went through before the folder's fsync failed
is taken back.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

import pinsidecar.remap.commit as commit
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.commit import ACTIVE_MAP_FILE, commit_failure, committed_map, write_active_map
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.fs import fill


def test_it_names_the_map_and_its_hash(tmp_path: Path) -> None:
    file = tmp_path / ACTIVE_MAP_FILE
    write_active_map(file, tmp_path / "maps" / "prose.json", "sha256:ab")
    doc = json.loads(file.read_text())
    assert doc["path"] == str(tmp_path / "maps" / "prose.json") and doc["hash"] == "sha256:ab"
    assert doc["activated_at"].endswith("Z")
    assert [p.name for p in tmp_path.iterdir()] == [ACTIVE_MAP_FILE]


def test_a_full_disk_raises_enospc_and_leaves_the_previous_file_whole(tmpfs: Path) -> None:
    file = tmpfs / ACTIVE_MAP_FILE
    write_active_map(file, Path("/maps/code.json"), "sha256:old")
    before = file.read_bytes()
    fillers = fill(tmpfs)
    with pytest.raises(OSError) as err:
        write_active_map(file, Path("/maps/prose.json"), "sha256:new")
    assert err.value.errno == errno.ENOSPC
    assert file.read_bytes() == before
    assert sorted(p.name for p in tmpfs.iterdir() if not p.name.startswith(".filler-")) == [ACTIVE_MAP_FILE]
    what, todo = commit_failure(err.value, file)
    assert what == f"commit failed: cannot write {file}: [Errno {errno.ENOSPC}] No space left on device"
    assert todo == f"free space on {tmpfs} and run `pinsidecar remap` again"
    assert fillers  # the disk really was full


def test_a_rename_whose_folder_fsync_failed_is_taken_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new name is visible but not durable: put the previous file back (or none, if there was none)."""
    real = commit.atomic_write_bytes
    calls = []

    def rename_then_fail(path: Path, data: bytes) -> None:
        calls.append(data)
        real(path, data)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(commit, "atomic_write_bytes", rename_then_fail)
    file = tmp_path / ACTIVE_MAP_FILE
    with pytest.raises(OSError):
        write_active_map(file, Path("/maps/prose.json"), "sha256:new")
    assert not file.exists()  # there was none before
    calls.clear()
    real(file, b'{"hash":"sha256:old","path":"/maps/code.json"}\n')
    with pytest.raises(OSError) as err:
        write_active_map(file, Path("/maps/prose.json"), "sha256:new")
    assert json.loads(file.read_text())["hash"] == "sha256:old"
    assert commit_failure(err.value, file)[1] == f"check {tmp_path} (see the error) and run `pinsidecar remap` again"


def test_a_read_only_folder_says_make_it_writable(tmp_path: Path) -> None:
    what, todo = commit_failure(OSError(errno.EROFS, "Read-only file system"), tmp_path / ACTIVE_MAP_FILE)
    assert "[Errno 30] Read-only file system" in what and todo.startswith(f"make {tmp_path} writable")


def test_a_start_boots_the_committed_map_while_it_validates(tmp_path: Path) -> None:
    configured, cand = tmp_path / "code.json", tmp_path / "prose.json"
    for path, domain in ((configured, 0), (cand, 1)):
        build_usage_map([make_counts(tokens=2000, domain=domain, seed=3)], 48, label=path.stem).save(path)
    assert committed_map(tmp_path, configured) == configured  # no active-map.json yet
    emap = build_usage_map([make_counts(tokens=2000, domain=1, seed=3)], 48, label="prose")
    write_active_map(tmp_path / ACTIVE_MAP_FILE, cand, emap.content_hash)
    assert committed_map(tmp_path, configured) == cand
    write_active_map(tmp_path / ACTIVE_MAP_FILE, cand, "sha256:" + "0" * 64)  # the file changed since
    assert committed_map(tmp_path, configured) == configured
    (tmp_path / ACTIVE_MAP_FILE).write_text("{")
    assert committed_map(tmp_path, configured) == configured
