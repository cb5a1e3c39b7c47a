"""The maps library with a real watchdog observer: new, changed, invalid and removed maps, and map references."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pinsidecar.daemon.map_library import MapEntry, MapLibrary, MapNotFound
from pinsidecar.testing.artifacts import make_map, write_map


async def _until(cond: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"not seen within {limit_s} s: {what}")
        await asyncio.sleep(0.05)


def _by_name(lib: MapLibrary) -> dict[str, MapEntry]:
    return {e.path.name: e for e in lib.entries()}


def test_scan_and_watch(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    first = write_map(maps / "first.json", label="first", seed=1)
    (maps / ".first.json.abc.tmp").write_text("partial")  # an atomic writer's temp file: ignored
    changes: list[tuple[bool | None, str]] = []

    async def scenario() -> None:
        lib = MapLibrary(maps, on_change=lambda e, p: changes.append((None if e is None else e.valid, p.name)))
        await lib.start()
        try:
            assert list(_by_name(lib)) == ["first.json"] and _by_name(lib)["first.json"].valid
            # a new valid map, written atomically (temp file + rename)
            second = make_map(seed=2, label="second")
            second.save(maps / "second.json")
            await _until(lambda: "second.json" in _by_name(lib), "second.json listed")
            e = _by_name(lib)["second.json"]
            assert e.valid and e.hash == second.content_hash and e.label == "second"
            assert e.geometry["hot_rows"] == 16
            # an invalid one: listed with the reason
            (maps / "broken.json").write_text('{"format": "pinsidecar.map", "version": 1')
            await _until(lambda: "broken.json" in _by_name(lib), "broken.json listed")
            bad = _by_name(lib)["broken.json"]
            assert not bad.valid and "broken.json" in bad.error
            # an edited map whose stated hash no longer matches: invalid, says so
            doc = json.loads(first.read_text())
            doc["layers"][0]["hot"], doc["layers"][0]["cold"] = doc["layers"][0]["cold"][:16], (
                doc["layers"][0]["hot"] + doc["layers"][0]["cold"][16:])
            first.write_text(json.dumps(doc))
            await _until(lambda: not _by_name(lib)["first.json"].valid, "first.json turned invalid")
            assert "hash mismatch" in _by_name(lib)["first.json"].error
            # removal
            (maps / "broken.json").unlink()
            await _until(lambda: "broken.json" not in _by_name(lib), "broken.json removed")
            # nothing was activated: the library only lists
            assert {n for _, n in changes} >= {"second.json", "broken.json", "first.json"}
            assert (None, "broken.json") in changes
        finally:
            await lib.stop()

    asyncio.run(scenario())


def test_resolve_by_path_name_and_hash(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    a = write_map(maps / "a.json", seed=1)
    outside = write_map(tmp_path / "outside.json", seed=3)
    (maps / "bad.json").write_text("nope")

    async def scenario() -> None:
        lib = MapLibrary(maps, watch=False)
        await lib.start()
        ha = _by_name(lib)["a.json"].hash
        assert lib.resolve("a.json") == a
        assert lib.resolve(str(a)) == a.resolve()  # an absolute path inside the maps folder
        with pytest.raises(MapNotFound, match="outside the maps folder"):  # tests/test_security.py: the rest
            lib.resolve(str(outside))
        assert lib.resolve(ha) == a
        assert lib.resolve(ha.split(":", 1)[1][:10]) == a
        with pytest.raises(MapNotFound, match="no map 'zzz'"):
            lib.resolve("zzz")
        with pytest.raises(MapNotFound):
            lib.resolve("deadbeefdeadbeef")
        await lib.stop()

    asyncio.run(scenario())
