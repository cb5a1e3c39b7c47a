"""The sidecar SIGKILLed in the middle of a remap, then restarted: no half-written map, the engine serving, the
record closed, and no engine left over from the killed run.

A real ``pinsidecar run`` process (exactly what systemd starts) runs a fake engine: ``engine.python`` points at a
small script that answers like vLLM's API server (``/health``, ``/v1/models``, greedy ``/v1/completions`` with
logprobs) and, in pin mode, writes the hook's live stats file from the prompts it serves (a prompt containing
"prose" routes like domain 1, anything else like domain 0, the domain the boot map was built from). It boots in a
second, and it lives in its own process group like vLLM, so a SIGKILLed sidecar leaves it running and holding its
port, as it would leave vLLM. Prose traffic through the gate trips the drift detector; the remap is caught in a
state (a count boot whose fake count engine never answers the hook's reset, an apply the fake engine holds, a
verification waiting for traffic that never comes, or, for the states that pass in a moment, the daemon started as
``python -m pinsidecar.testing.paused_daemon --pause-at STATE``: ``pinsidecar run`` with remap tools that stop the
remap there; nothing on the live path reads such a switch), the sidecar is SIGKILLed, and a new one, a plain
``pinsidecar run``, is started on the same state folder. The fake engine answers the hook's
requests beside its stats file as the hook does (``apply`` swaps its map; ``FAKE_ENGINE_APPLY_STALL_S`` makes
it hold the apply first, like a stall injected into the hook), so the in-place deploy runs as in production.

Every state of :data:`pinsidecar.remap.STATES` is killed here, in a real process (test_remap_pipeline.py also
covers each in-process, from a record left open on disk); the states before ``rebooting`` other than
``count_boot`` run with ``source = "live"``, so ``building`` and ``evaluating`` have built and saved a candidate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pinsidecar_hook.contract import load_map

from pinsidecar.engine import free_port, port_in_use
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import counts_path_for
from pinsidecar.remap.record import PRE_REBOOT_STATES, STATES
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.wait import wait_until

PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")
LIMIT_S = 60.0

FAKE_ENGINE = r'''
import hashlib, json, os, secrets, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port, host = int(args[args.index("--port") + 1]), args[args.index("--host") + 1]
mode = os.environ.get("PINSIDECAR_HOOK_MODE", "off")
stats_path = os.environ.get("PINSIDECAR_STATS_PATH")
lock = threading.Lock()
state = {"seq": 0, "tokens": 0, "hist": None, "cold": None, "n": 0, "token": "", "meta": {}}
boot_id = secrets.token_hex(4)
emap = None
hot = None
if mode == "pin":
    import numpy as np
    from pinsidecar_hook.contract import StatsSnapshot, load_map
    from pinsidecar.testing.artifacts import make_counts
    emap = load_map(os.environ["PINSIDECAR_MAP_PATH"])
    hot = emap.hot_mask()
    state["hist"] = np.zeros((emap.num_layers, emap.num_experts), dtype=np.int64)
    state["cold"] = np.zeros(emap.num_layers, dtype=np.int64)

def write_stats():
    state["seq"] += 1
    StatsSnapshot(boot_id=boot_id, seq=state["seq"], layer_ids=list(emap.layer_ids), num_experts=emap.num_experts,
                  top_k=emap.top_k, selections=state["hist"].sum(axis=1).tolist(),
                  cold_selections=state["cold"].tolist(), tokens=state["tokens"], map_hash=emap.content_hash,
                  pid=os.getpid(), written_at=time.time(), histogram=state["hist"].tolist(),
                  flush_token=state["token"], meta=state["meta"]).save(stats_path)

def serve_requests():
    global emap, hot
    from pinsidecar_hook.contract import load_map as load
    from pinsidecar_hook.contract.requests import read_hook_request, request_path
    from pinsidecar_hook.contract.swap import ApplyResult, plan_swap
    while True:
        time.sleep(0.1)
        req = read_hook_request(stats_path)
        if req is None or req.token == state["token"]:
            continue
        if req.op == "apply":
            stall_s = float(os.environ.get("FAKE_ENGINE_APPLY_STALL_S", "0") or 0)
            if stall_s:
                open(stats_path + ".apply-stalled", "w").close()  # the test waits for this before it kills
            time.sleep(stall_s)
            new = load(req.args["map"])
            plan = plan_swap(emap, new)
            with lock:
                result = ApplyResult(req.token, "applied", map_hash=new.content_hash, from_hash=emap.content_hash,
                                     to_hash=new.content_hash, rows=plan.rows, bytes_moved=plan.bytes_moved,
                                     seconds=0.001, layers=new.num_layers)
                emap, hot = new, new.hot_mask()
                state["meta"] = {"apply": result.to_json()}
        with lock:
            state["token"] = req.token
            write_stats()
        try:
            os.unlink(request_path(stats_path))
        except OSError:
            pass

def route(prompt):
    if emap is None:
        return
    with lock:
        state["n"] += 1
        c = make_counts(emap.num_layers, emap.num_experts, emap.top_k, 100, seed=state["n"],
                        domain=1 if "prose" in prompt else 0)
        state["hist"] += c.counts
        state["cold"] += np.where(hot, 0, c.counts).sum(axis=1)  # under the map serving now
        state["tokens"] += 100
        write_stats()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            return self.send(200, {})
        if self.path == "/v1/models":
            return self.send(200, {"object": "list", "data": [{"id": "demo", "object": "model"}]})
        self.send(404, {"error": "not found"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        prompt = str(body.get("prompt", body.get("messages", "")))
        n = int(body.get("max_tokens", 4))
        h = hashlib.sha256(prompt.encode()).digest()
        ids = [h[i] for i in range(n)]
        route(prompt)
        self.send(200, {"id": "cmpl-fake", "object": "text_completion", "model": "demo",
                        "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length",
                                     "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                                  "token_logprobs": [-t / 256 for t in ids]}}],
                        "usage": {"prompt_tokens": 90, "completion_tokens": n}})

if emap is not None:
    write_stats()
    threading.Thread(target=serve_requests, daemon=True).start()
print(f"fake engine mode={mode} on {host}:{port}", flush=True)
ThreadingHTTPServer((host, port), H).serve_forever()
'''


class Sidecar:
    """One ``pinsidecar run`` process (or, with ``pause_at``, the same daemon stopping its remap in that state) and
    what the test reads from it."""

    def __init__(self, cfg: Path, tmp: Path, env: dict[str, str], n: int, pause_at: str | None = None) -> None:
        self.cfg, self.tmp = cfg, tmp
        self.ports = json.loads((tmp / "ports.json").read_text())
        self.log = tmp / f"daemon-{n}.log"
        argv = [PINSIDECAR, "run", "--config", str(cfg)] if pause_at is None else \
            [sys.executable, "-m", "pinsidecar.testing.paused_daemon", "--pause-at", pause_at, str(cfg)]
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.ports['control']}/status", timeout=10).json()

    def ok_status(self) -> dict[str, Any] | None:
        try:
            return self.status()
        except httpx.HTTPError:
            return None

    def complete(self, prompt: str) -> int:
        return httpx.post(f"http://127.0.0.1:{self.ports['gate']}/v1/completions", timeout=30,
                          json={"model": "demo", "prompt": prompt, "max_tokens": 4}).status_code

    def wait(self, cond: Callable[[dict[str, Any]], bool], what: str, limit_s: float = LIMIT_S) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            st = self.ok_status()
            return st if st is not None and cond(st) else None

        def gone() -> str | None:
            return None if self.proc.poll() is None else f"the sidecar exited ({self.proc.returncode})"

        return wait_until(reached, what, limit_s, step_s=0.1, gone=gone,
                          detail=lambda: self.log.read_text(errors="replace")[-3000:])

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # the sidecar alone; its engines live in their own groups
        self.proc.wait(10)


def _setup(tmp: Path, remap: str, engine_env: str = "") -> tuple[Path, Path]:
    script = tmp / "fake_vllm.py"
    script.write_text(FAKE_ENGINE)
    python = tmp / "fake-python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')  # drop "-m vllm.entrypoints..."
    python.chmod(0o755)
    model = tmp / "model"
    model.mkdir()
    counts = make_counts(tokens=4000, domain=0, seed=1, workload="code")
    boot_map = tmp / "boot" / "code.json"
    boot_map.parent.mkdir()
    counts.save(counts_path_for(boot_map))
    build_usage_map([counts], 48, label="code").save(boot_map)
    ports: list[int] = []
    for _ in range(5):
        ports.append(free_port(ports[-1] + 1) if ports else free_port())
    engine, gate, control, metrics, count = ports
    (tmp / "ports.json").write_text(json.dumps({"engine": engine, "gate": gate, "control": control,
                                                "count": count}))
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model}"
python = "{python}"
served_model_name = "demo"
port = {engine}
hook_mode = "pin"
map = "{boot_map}"
ready_timeout_s = 60
stop_timeout_s = 5
{engine_env}
[supervisor]
health_interval_s = 0.5
[gate]
port = {gate}
capture_dir = "{tmp}/capture"
[control]
port = {control}
token_file = "{tmp}/token"
create_token = true
drain_timeout_s = 5
[metrics]
port = {metrics}
nvml = false
[maps]
dir = "{tmp}/maps"
[daemon]
state_dir = "{tmp}/state"
[drift]
window_tokens = 400
min_tokens = 200
consecutive_windows = 1
cooldown_s = 0
[remap]
count_boot_port = {count}
min_requests = 4
watch_interval_s = 0.2
held_out_wait_s = 1
verify_tokens = 100000000
verify_timeout_s = 600
min_count_tokens = 200
{remap}
""")
    return cfg, boot_map


def _fake_engines(tmp: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(tmp / "fake_vllm.py") == c for c in (p.info.get("cmdline") or [])):
            out.append(p)
    return out


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(s.proc.pid, signal.SIGKILL)
    for p in _fake_engines(tmp_path):  # only the engines this test's sidecars started
        p.kill()


@pytest.mark.parametrize("state", STATES)
def test_sigkill_in_a_remap_state_then_restart_serves_and_closes_the_record(tmp_path: Path, sidecars: list[Sidecar],
                                                                             state: str) -> None:
    remap = 'source = "capture"' if state == "count_boot" else 'source = "live"'
    if state == "rebooting":  # the in-place deploy would apply it: rebooting is the fallback or in_place = false
        remap += "\nin_place = false"
    # applying: the fake engine holds the apply (the sidecar dies with its request pending, the engine mid-apply)
    engine_env = 'env = { FAKE_ENGINE_APPLY_STALL_S = "600" }' if state == "applying" else ""
    cfg, boot_map = _setup(tmp_path, remap, engine_env)
    code_hash = load_map(boot_map).content_hash
    # count_boot waits on its count engine, applying on the engine and verifying on traffic by themselves; the
    # others pause where the paused daemon's remap tools say
    waits = ("count_boot", "applying", "verifying")
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    first = Sidecar(cfg, tmp_path, env, 1, pause_at=None if state in waits else state)
    sidecars.append(first)
    first.wait(lambda st: st["engine"]["state"] == "ready", "the engine ready")
    st = first.status()
    assert st["drift"] is not None and st["engine"]["map"]["hash"] == code_hash
    # prose traffic through the gate until the detector trips and a remap starts
    end = time.monotonic() + LIMIT_S
    while not (first.status()["remap"]["current"] or first.status()["remap"]["last"]):
        assert first.complete("a prose story about the sea") == 200
        assert time.monotonic() < end, first.log.read_text()[-3000:]
    st = first.wait(lambda s: (s["remap"]["current"] or {}).get("state") == state, f"the remap in {state}")
    remap_id = st["remap"]["current"]["id"]
    assert st["remap"]["current"]["trigger"] == "drift"
    old_engine = psutil.Process(st["engine"]["pid"])
    count_engine = None
    if state == "count_boot":  # the count engine is up beside the serving one, holding its port
        count_pid = tmp_path / "state" / "count-engine.pid"
        wait_until(lambda: count_pid.exists() and port_in_use("127.0.0.1", first.ports["count"]),
                   "the count engine started", LIMIT_S, step_s=0.1)
        count_engine = psutil.Process(json.loads(count_pid.read_text())["pid"])
    request = tmp_path / "state" / "stats.json.request"
    if state == "applying":  # the apply request is out, the engine holds it
        wait_until(request.exists, "the apply request sent", LIMIT_S, step_s=0.05)
        stalled = tmp_path / "state" / "stats.json.apply-stalled"
        wait_until(stalled.exists, "the fake engine stalled in the apply", LIMIT_S, step_s=0.05)
    if state == "verifying":  # applied in place: the old engine serves the candidate now
        assert st["remap"]["current"]["apply"]["outcome"] is None
        assert st["remap"]["current"]["apply"]["requests"][0]["result"] == "applied"
        assert st["engine"]["map"]["hash"] != code_hash and st["engine"]["restart_map"]["hash"] == code_hash

    first.kill()
    assert old_engine.is_running()  # orphaned, as a killed sidecar leaves vLLM
    assert port_in_use("127.0.0.1", first.ports["engine"])

    second = Sidecar(cfg, tmp_path, env, 2)  # pinsidecar run: nothing pauses
    sidecars.append(second)
    st = second.wait(lambda s: s["engine"]["state"] == "ready", "the engine ready after the restart")
    # the leftover engines were stopped (the one whose start time matched), the new one serves the old map
    assert not old_engine.is_running() or old_engine.status() == psutil.STATUS_ZOMBIE
    assert st["engine"]["pid"] != old_engine.pid
    assert st["engine"]["map"]["hash"] == code_hash
    if count_engine is not None:
        assert not count_engine.is_running() or count_engine.status() == psutil.STATUS_ZOMBIE
        assert not port_in_use("127.0.0.1", second.ports["count"])
    assert second.complete("def f(x):") == 200
    assert not request.exists()  # a leftover apply request was withdrawn before the new engine could see it
    stats = json.loads((tmp_path / "state" / "stats.json").read_text())
    assert stats["map_hash"] == code_hash  # the new engine serves the committed map, never the candidate
    rec = json.loads((tmp_path / "state" / "remaps" / f"{remap_id}.json").read_text())
    want = "aborted" if state in PRE_REBOOT_STATES else "rolled_back"
    assert rec["state"] == rec["outcome"] == want and f"during {state}" in rec["error"]
    assert st["remap"]["last"]["id"] == remap_id and st["remap"]["current"] is None
    # no half-written map: every file in the library is a whole, valid map or the counts beside one
    for p in (tmp_path / "maps").iterdir():
        assert not p.name.startswith(".")
        if not p.name.endswith(".counts.json"):
            load_map(p)
    assert not (tmp_path / "state" / "active-map.json").exists()  # written only at a commit
    assert len(_fake_engines(tmp_path)) == 1  # the new serving engine only


# ---------------------------------------------------------------------------------------------------- pid files


def _sleeper_engine(tmp: Path, pid_file: Path, child: bool = True) -> Any:
    from pinsidecar.engine import EngineProcess, EngineSpec

    script = tmp / "sleeper"
    # a leader and a child, like vLLM's API server and engine core
    script.write_text("#!/bin/sh\n" + ("sleep 600 &\n" if child else "") + "exec sleep 600\n")
    script.chmod(0o755)
    (tmp / "model").mkdir(exist_ok=True)
    eng = EngineProcess(EngineSpec(model=tmp / "model", port=free_port(), python=str(script),
                                   log_path=tmp / "sleeper.log"), pid_file=pid_file)
    eng.start()
    return eng


def test_a_leftover_engine_group_is_stopped_and_its_pid_file_removed(tmp_path: Path) -> None:
    from pinsidecar.engine.process import read_pid_file, stop_recorded_engine

    pid_file = tmp_path / "engine.pid"
    eng = _sleeper_engine(tmp_path, pid_file)
    rec = read_pid_file(pid_file)
    assert rec is not None and rec["pid"] == rec["pgid"] == eng.pid

    def started() -> list[psutil.Process] | None:
        """The group's processes once the leader has started its child (a third one would fail the assert)."""
        members = [p for p in psutil.process_iter() if os.getpgid(p.pid) == rec["pgid"]]
        return members if len(members) >= 2 else None

    group = wait_until(started, "the sleeper's child started", 30.0, ignore=(ProcessLookupError,))
    assert len(group) == 2
    found = stop_recorded_engine(pid_file)  # as the next daemon does, the parent having "died"
    assert found is not None and found["stopped"] and found["members"] == 2 and not found["reused"]
    psutil.wait_procs(group, timeout=5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group)
    assert not pid_file.exists()
    eng.stop(1)  # reaps the leader; nothing left to signal
    assert stop_recorded_engine(pid_file) is None


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    from pinsidecar.engine.process import stop_recorded_engine

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        created = psutil.Process(other.pid).create_time()
        pid_file = tmp_path / "engine.pid"
        # the recorded engine started 100 s before the process that has its pid now
        pid_file.write_text(json.dumps({"pid": other.pid, "pgid": other.pid, "create_time": created - 100.0}))
        found = stop_recorded_engine(pid_file)
        assert found is not None and found["reused"] and not found["stopped"]
        assert other.poll() is None  # still running
        assert not pid_file.exists()
    finally:
        other.kill()
        other.wait()


def test_a_stopped_engine_removes_its_pid_file(tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    eng = _sleeper_engine(tmp_path, pid_file, child=False)
    assert pid_file.exists()
    eng.stop(5)
    assert not pid_file.exists()
