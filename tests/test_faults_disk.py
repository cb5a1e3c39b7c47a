"""A full disk or a read-only folder while a map or counts are written: on a real tmpfs of 64 KiB that the test
mounts (root or CAP_SYS_ADMIN; skipped with the reason where mounting is refused), never a mock.

What must hold: the write fails with an error that names the folder and the cause, the map that serves is untouched,
and no half-written file (no temp file, no counts without their map) is left. The remap pipeline end to end on a
full or read-only maps folder is in test_remap_pipeline.py (the remap aborts, the old map serves, the next remap
after the disk is freed commits).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from pinsidecar_hook.contract import HookConfig, ModelInfo, load_counts, load_map
from pinsidecar_hook.count import CountState
from pinsidecar_hook.flusher import Flusher

from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import counts_path_for, save_candidate
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.fs import PAGE, fill, free_pages, remount

HOT_ROWS = 48


def _serving(maps: Path) -> tuple[Path, bytes]:
    """The map that serves, in the library beside its counts; returns its path and its bytes."""
    counts = make_counts(tokens=4000, domain=0, seed=1, workload="code")
    path = maps / "code.json"
    counts.save(counts_path_for(path))
    build_usage_map([counts], HOT_ROWS, label="code").save(path)
    return path, path.read_bytes()


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".filler-"))


def _pages(n_bytes: int) -> int:
    return -(-n_bytes // PAGE)


@pytest.mark.parametrize("room", ["none", "counts_only"])
def test_a_full_maps_folder_refuses_the_candidate_whole_and_the_serving_map_is_untouched(tmpfs: Path, tmp_path: Path,
                                                                                         room: str) -> None:
    serving, before = _serving(tmpfs)
    counts = make_counts(tokens=3000, domain=1, seed=2, workload="prose")
    cand = build_usage_map([counts], HOT_ROWS, label="prose")
    fillers = fill(tmpfs)
    if room == "counts_only":  # exactly the pages of the counts file: the counts land, the map after them does not
        sized = tmp_path / "sized.counts.json"
        counts.save(sized)
        free_pages(fillers, _pages(sized.stat().st_size))
    listed = _listing(tmpfs)
    with pytest.raises(OSError) as err:
        save_candidate(tmpfs, cand, counts, [(serving, load_map(serving))])
    assert err.value.errno == errno.ENOSPC
    msg = str(err.value)
    assert f"cannot write candidate map prose-{cand.short_hash}.json into {tmpfs}" in msg
    assert "No space left on device" in msg and "set maps.dir" in msg
    assert _listing(tmpfs) == listed  # nothing of the candidate: no temp file, no counts without their map
    assert serving.read_bytes() == before and load_map(serving).label == "code"
    # room again: the same call lands the candidate whole
    free_pages(fillers, len(fillers))
    path = save_candidate(tmpfs, cand, counts, [(serving, load_map(serving))])
    assert load_map(path).content_hash == cand.content_hash and load_counts(counts_path_for(path)).tokens == 3000


def test_a_read_only_maps_folder_refuses_the_candidate_and_says_so(tmpfs: Path) -> None:
    serving, before = _serving(tmpfs)
    counts = make_counts(tokens=3000, domain=1, seed=2, workload="prose")
    remount(tmpfs, read_only=True)
    try:
        with pytest.raises(OSError) as err:
            save_candidate(tmpfs, build_usage_map([counts], HOT_ROWS, label="prose"), counts)
        assert err.value.errno == errno.EROFS and "Read-only file system" in str(err.value)
        assert _listing(tmpfs) == ["code.counts.json", "code.json"] and serving.read_bytes() == before
    finally:
        remount(tmpfs, read_only=False)


def _count_flusher(path: Path) -> tuple[CountState, Flusher]:
    cfg = HookConfig(mode="count", counts_path=path, flush_interval_s=60.0, workload="w")
    state = CountState([0, 1], cfg, 8, 2, torch.device("cpu"), writer=True, meta={}, model_info=ModelInfo(path="/m"))
    for i in range(2):
        state.capture_fn(i, None)(torch.tensor([[0, 7]] * 5))
    return state, Flusher(state, path, interval_s=60.0, name="count", what="counts", write_error_key="counts_write")


@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_the_hooks_counts_on_a_full_or_read_only_disk_are_counted_as_errors_and_written_once_it_frees(
        tmpfs: Path, fault: str) -> None:
    """A count boot's counts file (written by the hook's flusher inside the engine) on a disk that refuses it:
    serving goes on, the failures are counted, no temp file is left, and the next write after the disk frees is
    whole and carries the count of failed writes."""
    path = tmpfs / "counts.json"
    _, flusher = _count_flusher(path)
    fillers = fill(tmpfs) if fault == "full" else []
    if fault == "read_only":
        remount(tmpfs, read_only=True)
    assert flusher.flush() is None and flusher.flush() is None
    assert flusher.errors == {"counts_write": 2}
    assert _listing(tmpfs) == []
    if fault == "full":
        free_pages(fillers, len(fillers))
    else:
        remount(tmpfs, read_only=False)
    assert flusher.flush() == path
    counts = load_counts(path)
    assert counts.tokens == 5 and counts.meta["write_errors"] == 2
    assert _listing(tmpfs) == ["counts.json"]
