"""Drain-reboot with a map, against the real vLLM CPU engine in pin mode: a hash-hit switch, a map the engine refuses
(the daemon rolls back to the map it served and says so), and a corrupt map (refused before anything happens).

One daemon process (``pinsidecar run``) in pin mode serves the module: boots are start (map A), switch (map B),
the refused map, and the rollback (map B again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pinsidecar_hook.contract import load_map

from pinsidecar.testing.artifacts import model_geometry, write_map

pytestmark = pytest.mark.vllm

GATE, ENGINE, CONTROL, METRICS = 8275, 8276, 8277, 8278
BOOT_LIMIT_S = 900.0
PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")


def _map(path: Path, model_dir: Path, hot_rows: int, seed: int, label: str, num_experts: int | None = None) -> Path:
    """A random map for ``model_dir`` (or, with ``num_experts``, a valid map for some other model)."""
    geometry = {**model_geometry(model_dir), **({"num_experts": num_experts} if num_experts else {})}
    return write_map(path, **geometry, hot_rows=hot_rows, seed=seed, label=label)


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest) -> Path:
    """The demo model; ``$PINSIDECAR_TEST_MODEL_DIR`` names another model folder to serve instead."""
    if os.environ.get("PINSIDECAR_TEST_MODEL_DIR"):
        return Path(os.environ["PINSIDECAR_TEST_MODEL_DIR"])
    return request.getfixturevalue("demo_model_dir")


@pytest.fixture(scope="module")
def pinned(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pinned")
    maps = tmp / "maps"
    maps.mkdir()
    a = _map(maps / "a.json", model_dir, 40, 1, "A")
    b = _map(maps / "b.json", model_dir, 40, 2, "B")
    wrong = _map(maps / "wrong-model.json", model_dir, 80, 3, "wrong", num_experts=128)  # valid file, wrong model
    (maps / "corrupt.json").write_text('{"format": "pinsidecar.map"')
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model_dir}"
served_model_name = "demo"
port = {ENGINE}
enforce_eager = true
hook_mode = "pin"
map = "{a}"
ready_timeout_s = {BOOT_LIMIT_S}
[supervisor]
health_interval_s = 1
[gate]
port = {GATE}
max_hold_s = {BOOT_LIMIT_S}
[control]
port = {CONTROL}
token_file = "{tmp}/control.token"
create_token = true
[metrics]
port = {METRICS}
nvml = false
[maps]
dir = "{maps}"
[daemon]
state_dir = "{tmp}/state"
""")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    env.pop("NOTIFY_SOCKET", None)
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen([PINSIDECAR, "run", "--config", str(cfg)], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < BOOT_LIMIT_S, "engine not ready"
            try:
                if httpx.get(f"http://127.0.0.1:{CONTROL}/status", timeout=5).json()["engine"]["state"] == "ready":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield {"config": cfg, "a": a, "b": b, "wrong": wrong, "tmp": tmp, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for p in psutil.process_iter(["cmdline"]):
            if f"--port {ENGINE}" in " ".join(p.info.get("cmdline") or []):
                p.kill()


def _cli(pinned: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PINSIDECAR, *args, "--config", str(pinned["config"])], capture_output=True, text=True,
                          timeout=2 * BOOT_LIMIT_S + 120)


def _status() -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{CONTROL}/status", timeout=10).json()


def _generate() -> int:
    r = httpx.post(f"http://127.0.0.1:{GATE}/v1/completions",
                   json={"model": "demo", "prompt": "def f(", "max_tokens": 4}, timeout=120)
    return r.status_code


def test_boots_with_the_configured_map_and_lists_the_library(pinned: dict[str, Any]) -> None:
    st = _status()
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
    st = _status()
    assert st["engine"]["map"]["hash"] == b_hash and st["engine"]["last_boot"]["reason"] == "drain-reboot"
    record = json.loads((pinned["tmp"] / "state" / "active-map.json").read_text())
    assert record["hash"] == b_hash  # survives a daemon restart
    assert _generate() == 200


def test_refused_map_rolls_back_to_the_served_one(pinned: dict[str, Any]) -> None:
    b_hash = load_map(pinned["b"]).content_hash
    res = _cli(pinned, "drain-reboot", "--map", str(pinned["wrong"]))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "drain-reboot FAILED" in res.stdout and "rolled back" in res.stdout
    assert "another geometry (hot rows changed)" in res.stdout
    st = _status()
    assert st["last_drain_reboot"]["rolled_back"] is True
    assert st["engine"]["state"] == "ready"
    assert st["engine"]["map"]["hash"] == b_hash
    assert st["engine"]["last_boot"]["reason"] == "rollback"
    assert "drain_reboot_geometry_change" in pinned["log"].read_text()
    assert _generate() == 200


def test_corrupt_map_is_refused_before_anything_happens(pinned: dict[str, Any]) -> None:
    before = _status()["engine"]
    res = _cli(pinned, "drain-reboot", "--map", "corrupt.json")
    assert res.returncode == 2
    assert "map rejected" in res.stderr and "corrupt.json" in res.stderr
    res = _cli(pinned, "drain-reboot", "--map", "no-such-map")
    assert res.returncode == 2 and "no map 'no-such-map'" in res.stderr
    after = _status()["engine"]
    assert after["pid"] == before["pid"] and after["boots"] == before["boots"]
