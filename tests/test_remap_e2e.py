"""The adaptation loop end to end on vLLM CPU: drift detected, count boot, new map, hash-hit reboot, verified, and
the cold rate back down.

One ``pinsidecar run`` process (what systemd starts) serves the demo model in pin mode with a *code* map (built
from the demo model's recorded routing of the code training prompts, its counts beside it). Clients send *prose*
through the gate, which captures them. The drift watch trips within a few windows; the remap cuts the captured
prose into a workload, count-boots it on a second engine beside the serving one, builds a map with the code map's
geometry, judges it on a window that began after the capture was cut, drains, reboots (a compile-cache hit: same
geometry), checks the parity prompts token for token inside the hold, and verifies the live cold rate over
``remap.verify_tokens`` tokens, then commits. Clients are served all along.

The figure: the live cold rate after the remap is at most half the rate in the window that tripped. The timeline
(seconds per stage) is printed, and written to ``$PINSIDECAR_FIGURES_DIR/remap_e2e.json`` when that is set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from pinsidecar_hook.contract import CountsArtifact, ModelInfo, load_map

from pinsidecar.demo.model import fixture_path
from pinsidecar.engine import free_port
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import counts_path_for

pytestmark = pytest.mark.vllm

PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")
ROUTING = Path(__file__).parent / "data" / "drift" / "demo_routing.json"
BOOT_LIMIT_S = 900.0  # a loaded 2-core CI box can take minutes to boot vLLM
REMAP_LIMIT_S = 1200.0
CLIENTS = 3
# The count engine's cores: not the serving engine's (vLLM CPU binds both to core 0 by default, and the serving
# engine under traffic starves the other's boot). The last core of this machine.
COUNT_CORES = str(max(0, (os.cpu_count() or 1) - 1))


def _code_map(tmp: Path) -> Path:
    """The demo's code map (48 of 64 hot), from the recorded routing of the code training prompts."""
    doc = json.loads(ROUTING.read_text())
    reqs = doc["requests"]["code"]
    counts = CountsArtifact(layer_ids=doc["layer_ids"], num_experts=doc["num_experts"], top_k=doc["top_k"],
                            counts=np.sum([r["counts"] for r in reqs], axis=0, dtype=np.int64),
                            tokens=int(sum(r["tokens"] for r in reqs)), model=ModelInfo(name="pinsidecar-demo"),
                            workload="code")
    path = tmp / "boot" / "code.json"
    path.parent.mkdir(parents=True)
    counts.save(counts_path_for(path))
    build_usage_map([counts], 48, label="code").save(path)
    return path


def _prompts(*names: str) -> list[dict[str, Any]]:
    out = []
    for name in names:
        out += [json.loads(line) for line in fixture_path(name).read_text().splitlines() if line.strip()]
    return out


@pytest.fixture
def daemon_cfg(demo_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    boot_map = _code_map(tmp_path)
    ports: list[int] = []
    for _ in range(5):
        ports.append(free_port(ports[-1] + 1) if ports else free_port())
    p = dict(zip(("engine", "gate", "control", "metrics", "count"), ports, strict=True))
    cfg = tmp_path / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{demo_model_dir}"
served_model_name = "demo"
port = {p['engine']}
enforce_eager = true
shutdown_timeout_s = 5
hook_mode = "pin"
map = "{boot_map}"
ready_timeout_s = {BOOT_LIMIT_S}
stop_timeout_s = 30
[gate]
port = {p['gate']}
max_hold_s = {BOOT_LIMIT_S}
capture_dir = "{tmp_path}/capture"
[control]
port = {p['control']}
token_file = "{tmp_path}/control.token"
create_token = true
drain_timeout_s = 120
[metrics]
port = {p['metrics']}
nvml = false
[maps]
dir = "{tmp_path}/maps"
[daemon]
state_dir = "{tmp_path}/state"
[drift]
window_tokens = 512
min_tokens = 256
consecutive_windows = 2
cooldown_s = 3600
[remap]
source = "capture"
capture_requests = 32
count_boot_port = {p['count']}
count_boot_env = {{ VLLM_CPU_OMP_THREADS_BIND = "{COUNT_CORES}" }}
held_out_wait_s = 300
verify_tokens = 512
verify_timeout_s = 600
watch_interval_s = 1
""")
    yield cfg, p


class Clients:
    """``CLIENTS`` threads sending prompts through the gate in a loop until stopped; counts what happened."""

    def __init__(self, gate: int, prompts: list[dict[str, Any]]) -> None:
        self.url = f"http://127.0.0.1:{gate}/v1/completions"
        self.prompts = prompts
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        n = i
        with httpx.Client(timeout=BOOT_LIMIT_S) as client:
            while not self._stop.is_set():
                body = {**self.prompts[n % len(self.prompts)], "model": "demo", "temperature": 0.0}
                n += CLIENTS
                with self._lock:
                    self.sent += 1
                try:
                    r = client.post(self.url, json=body)
                    ok = r.status_code == 200
                    err = "" if ok else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, err = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.ok += ok
                    if err:
                        self.errors.append(err)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(BOOT_LIMIT_S)


def _status(ports: dict[str, int]) -> dict[str, Any] | None:
    try:
        return httpx.get(f"http://127.0.0.1:{ports['control']}/status", timeout=10).json()
    except httpx.HTTPError:
        return None


def test_drift_to_committed_remap_on_vllm_cpu(daemon_cfg: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    cfg, ports = daemon_cfg
    log_path = tmp_path / "daemon.log"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env.pop("NOTIFY_SOCKET", None)
    t0 = time.monotonic()
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen([PINSIDECAR, "run", "--config", str(cfg)], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    clients: Clients | None = None
    marks: dict[str, float] = {}

    def wait(pred: Any, what: str, limit: float) -> dict[str, Any]:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            assert proc.poll() is None, f"daemon exited waiting for {what}:\n{log_path.read_text()[-4000:]}"
            st = _status(ports)
            if st is not None and pred(st):
                return st
            time.sleep(0.5)
        raise AssertionError(f"not reached within {limit} s: {what}\n{log_path.read_text()[-4000:]}")

    try:
        st = wait(lambda s: s["engine"]["state"] == "ready", "the engine ready", BOOT_LIMIT_S)
        marks["engine_ready"] = time.monotonic() - t0
        boot_s = st["engine"]["last_boot"]["seconds"]
        code_hash = st["engine"]["map"]["hash"]
        clients = Clients(ports["gate"], _prompts("prose_heldout", "prose"))
        traffic_t0 = time.monotonic()
        st = wait(lambda s: s["remap"]["current"] or s["remap"]["last"], "a drift trip", REMAP_LIMIT_S)
        marks["trip_after_traffic_s"] = time.monotonic() - traffic_t0
        remap_id = (st["remap"]["current"] or st["remap"]["last"])["id"]
        st = wait(lambda s: s["remap"]["current"] is None and (s["remap"]["last"] or {}).get("id") == remap_id,
                  "the remap to end", REMAP_LIMIT_S)
        marks["remap_end"] = time.monotonic() - t0
        rec = json.loads((tmp_path / "state" / "remaps" / f"{remap_id}.json").read_text())
        clients.stop()
        served = (clients.sent, clients.ok, list(clients.errors))
        clients = None
    finally:
        if clients is not None:
            clients.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for p in psutil.process_iter(["cmdline"]):  # engines of this test only (their ports are ours)
            cmd = " ".join(p.info.get("cmdline") or [])
            if "vllm.entrypoints.openai.api_server" in cmd and any(f"--port {ports[k]}" in cmd
                                                                   for k in ("engine", "count")):
                p.kill()

    trip_rate = rec["detail"]["signals"]["cold_rate"]
    after = (rec["verify"] or {}).get("cold_rate", {}).get("live_cold_rate")
    timeline = {s["state"]: s["seconds"] for s in rec["steps"]}
    figure = {
        "outcome": rec["outcome"], "error": rec["error"], "engine_boot_s": boot_s,
        "engine_ready_s": round(marks["engine_ready"], 1),
        "trip_after_traffic_s": round(marks["trip_after_traffic_s"], 1),
        "remap_s": rec["seconds"], "timeline_s": timeline,
        "cold_rate_at_trip": trip_rate, "cold_rate_after": after,
        "predicted_after": (rec["decision"] or {}).get("candidate_cold_rate"),
        "held_out_active_rate": (rec["decision"] or {}).get("active_cold_rate"),
        "reboot": (rec["verify"] or {}).get("reboot"), "parity": (rec["verify"] or {}).get("parity"),
        "count_boot": next((s["detail"] for s in rec["steps"] if s["state"] == "count_boot"), None),
        "candidate": next((s["detail"] for s in rec["steps"] if s["state"] == "building"), None),
        "requests": {"sent": served[0], "ok": served[1], "errors": served[2][:5]},
    }
    print("\nREMAP E2E FIGURE:", json.dumps(figure, indent=1))
    if os.environ.get("PINSIDECAR_FIGURES_DIR"):
        out = Path(os.environ["PINSIDECAR_FIGURES_DIR"]) / "remap_e2e.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figure, indent=1) + "\n")

    assert rec["outcome"] == "committed", figure
    assert rec["trigger"] == "drift"
    assert [s["state"] for s in rec["steps"]] == ["choosing_workload", "library_check", "count_boot", "building",
                                                  "evaluating", "rebooting", "verifying"]
    assert rec["decision"]["deploy"] and rec["decision"]["after_capture_cut"] is True
    assert rec["verify"]["reboot"]["hash_hit"] is True and rec["verify"]["reboot"]["cache_miss"] is False
    assert rec["verify"]["parity"]["ok"] is True and rec["verify"]["parity"]["tokens"] > 0
    assert rec["verify"]["cold_rate"]["status"] == "verified"
    assert after is not None and after <= trip_rate / 2, figure
    cand = Path(rec["candidate"]["path"])
    assert load_map(cand).same_geometry(load_map(tmp_path / "boot" / "code.json"))
    assert counts_path_for(cand).is_file()
    assert st["engine"]["map"]["hash"] == rec["candidate"]["hash"] != code_hash
    assert json.loads((tmp_path / "state" / "active-map.json").read_text())["hash"] == rec["candidate"]["hash"]
    assert served[1] == served[0] and not served[2]  # every client request was served, through the reboot
