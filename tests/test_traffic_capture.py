"""Capture store: sampling, only completion endpoints, size-capped atomic rotation, torn-line repair, bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pinsidecar.daemon.traffic_capture import ACTIVE_NAME, CaptureStore


def body(i: int, pad: int = 0) -> bytes:
    return json.dumps({"prompt": f"p{i}" + "x" * pad, "max_tokens": 8}).encode()


def test_only_completion_endpoints_and_json_objects_are_kept(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, sample_rate=1.0)
    assert store.offer("/v1/completions", body(0))
    assert store.offer("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode())
    assert not store.offer("/v1/models", body(1))
    assert not store.offer("/v1/embeddings", body(2))
    assert not store.offer("/v1/completions", b"{not json")
    assert not store.offer("/v1/completions", b"[1, 2]")
    assert not store.offer("/v1/completions", b"\xff\xfe")
    assert store.counters["skipped_invalid"] == 3
    assert store.files() == []  # nothing is a workload file until rotation
    done = store.rotate()
    assert done is not None and store.files() == [done]
    lines = done.read_text().splitlines()
    assert json.loads(lines[0]) == {"prompt": "p0", "max_tokens": 8}
    assert "messages" in json.loads(lines[1])
    assert len(lines) == 2
    assert store.rotate() is None  # nothing new


def test_sample_rate_keeps_about_that_fraction(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, sample_rate=0.25, rng=random.Random(7))
    kept = sum(store.offer("/v1/completions", body(i)) for i in range(2000))
    assert 400 < kept < 600
    none = CaptureStore(tmp_path / "zero", sample_rate=0.0)
    assert not any(none.offer("/v1/completions", body(i)) for i in range(50))


def test_rotation_caps_file_size_and_file_count(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, sample_rate=1.0, max_file_bytes=2048, max_files=3)
    written = [i for i in range(200) if store.offer("/v1/completions", body(i, pad=100))]
    store.rotate()
    files = store.files()
    assert len(files) == 3, "old files beyond max_files must be deleted"
    assert all(f.stat().st_size <= 2048 for f in files)
    kept = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    # what survives is the newest, in order, and every line is a whole request
    assert [r["prompt"][:5].rstrip("x") for r in kept] == [f"p{i}" for i in written[-len(kept):]]
    assert store.counters["rotations"] >= 3
    assert not (tmp_path / ACTIVE_NAME).exists()


def test_a_request_larger_than_a_file_is_skipped(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, sample_rate=1.0, max_file_bytes=1024)
    assert not store.offer("/v1/completions", body(0, pad=2000))
    assert store.counters["skipped_too_large"] == 1


def test_torn_last_line_is_cut_on_restart(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, sample_rate=1.0)
    store.offer("/v1/completions", body(0))
    store.close()
    with open(tmp_path / ACTIVE_NAME, "ab") as fh:
        fh.write(b'{"prompt": "torn')  # a crash mid-write
    again = CaptureStore(tmp_path, sample_rate=1.0)
    again.offer("/v1/completions", body(1))
    done = again.rotate()
    assert done is not None
    assert [json.loads(line)["prompt"] for line in done.read_text().splitlines()] == ["p0", "p1"]


@pytest.mark.parametrize("kwargs, word", [({"sample_rate": 1.5}, "sample_rate"), ({"max_file_bytes": 10},
                                          "max_file_bytes"), ({"max_files": 0}, "max_files")])
def test_bad_settings_name_the_setting(tmp_path: Path, kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        CaptureStore(tmp_path, **kwargs)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="capture directory"):
        CaptureStore(blocker / "sub")
