"""Drain-reboot with a map, against the real vLLM CPU engine in pin mode: a hash-hit switch, a map the engine refuses
(the daemon rolls back to the map it served and says so), and a corrupt map (refused before anything happens).

One daemon process (``pinsidecar run``) in pin mode serves the module: boots are start (map A), switch (map B),
the refused map, and the rollback (map B again).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pinsidecar_hook.contract import load_map

from pinsidecar.testing.artifacts import model_geometry, write_map
from pinsidecar.testing.daemon import BOOT_LIMIT_S, DaemonUnderTest

pytestmark = pytest.mark.vllm



def _map(path: Path, model_dir: Path, hot_rows: int, seed: int, label: str, num_experts: int | None = None) -> Path:
    """A random map for ``model_dir`` (or, with ``num_experts``, a valid map for some other model)."""
    geometry = {**model_geometry(model_dir), **({"num_experts": num_experts} if num_experts else {})}
    return write_map(path, **geometry, hot_rows=hot_rows, seed=seed, label=label)


@pytest.fixture(scope="module")
def pinned(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pinned")
    maps = tmp / "maps"
    maps.mkdir()
    a = _map(maps / "a.json", demo_model_dir, 40, 1, "A")
    b = _map(maps / "b.json", demo_model_dir, 40, 2, "B")
    wrong = _map(maps / "wrong-model.json", demo_model_dir, 80, 3, "wrong", num_experts=128)  # valid, wrong model
    (maps / "corrupt.json").write_text('{"format": "pinsidecar.map"')
    with DaemonUnderTest(tmp, demo_model_dir, a) as d:
        yield {"daemon": d, "a": a, "b": b, "wrong": wrong, "tmp": tmp}


def _cli(pinned: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return pinned["daemon"].cli(*args, timeout=2 * BOOT_LIMIT_S + 120)


def test_boots_with_the_configured_map_and_lists_the_library(pinned: dict[str, Any]) -> None:
    st = pinned["daemon"].status()
    assert st["engine"]["map"]["hash"] == load_map(pinned["a"]).content_hash
    entries = {Path(e["path"]).name: e for e in st["maps"]["entries"]}
    assert entries["b.json"]["valid"] and entries["wrong-model.json"]["valid"]
    assert not entries["corrupt.json"]["valid"] and "corrupt.json" in entries["corrupt.json"]["error"]
    human = _cli(pinned, "status").stdout
    assert "BAD    corrupt.json" in human and "ok     b.json" in human


def test_hash_hit_switch_to_another_map(pinned: dict[str, Any]) -> None:
    res = _cli(pinned, "drain-reboot", "--map", "b.json", "--json")  # a name in the maps folder
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] and out["hash_hit"] is True and not out["rolled_back"]
    b_hash = load_map(pinned["b"]).content_hash
    assert out["map_hash"] == b_hash
    st = pinned["daemon"].status()
    assert st["engine"]["map"]["hash"] == b_hash and st["engine"]["last_boot"]["reason"] == "drain-reboot"
    record = json.loads((pinned["tmp"] / "state" / "active-map.json").read_text())
    assert record["hash"] == b_hash  # survives a daemon restart
    assert pinned["daemon"].complete(timeout=120).status_code == 200


def test_refused_map_rolls_back_to_the_served_one(pinned: dict[str, Any]) -> None:
    b_hash = load_map(pinned["b"]).content_hash
    res = _cli(pinned, "drain-reboot", "--map", str(pinned["wrong"]))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "drain-reboot FAILED" in res.stdout and "rolled back" in res.stdout
    assert "another geometry (hot rows changed)" in res.stdout
    st = pinned["daemon"].status()
    assert st["last_drain_reboot"]["rolled_back"] is True
    assert st["engine"]["state"] == "ready"
    assert st["engine"]["map"]["hash"] == b_hash
    assert st["engine"]["last_boot"]["reason"] == "rollback"
    assert "drain_reboot_geometry_change" in pinned["daemon"].log_text()
    assert pinned["daemon"].complete(timeout=120).status_code == 200


def test_corrupt_map_is_refused_before_anything_happens(pinned: dict[str, Any]) -> None:
    before = pinned["daemon"].engine()
    res = _cli(pinned, "drain-reboot", "--map", "corrupt.json")
    assert res.returncode == 2
    assert "map rejected" in res.stderr and "corrupt.json" in res.stderr
    res = _cli(pinned, "drain-reboot", "--map", "no-such-map")
    assert res.returncode == 2 and "no map 'no-such-map'" in res.stderr
    after = pinned["daemon"].engine()
    assert after["pid"] == before["pid"] and after["boots"] == before["boots"]
