"""The container lane for real: the daemon supervises vLLM CPU in a real podman container (the lane of
:mod:`pinsidecar.testing.container`: a local image, this venv's vLLM bind-mounted, the hook overlay exactly as
in production).

Engine boots are few and in sequence, so the module's tests run in file order and share them:

1. a count-mode container (the launcher alone): counts exactly; its counts make map A;
2. ``pinsidecar run`` with ``engine.launcher = "container"`` in pin mode on map A: serves, the hook's stats are
   read on the host, the exporter reads the container's cgroup memory;
3. a drain-reboot to map B under 8 streaming clients: 0 failed, 0 lost (the figure is printed, and written to
   ``$PINSIDECAR_FIGURES_DIR/container_drain_reboot.json`` when set);
4. ``podman kill`` from outside: noticed, restarted, status and metrics say so;
5. the sidecar SIGKILLed, then started again: the container it left is removed, one engine container remains;
6. SIGTERM to the daemon: drains, stops the container within its timeout, no container left.

Faults that need no engine (a missing image, a taken port, a permanent error not retried) run first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pinsidecar_hook.contract import load_map, load_stats
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.counts.count_boot import request_counts
from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.daemon.supervisor import EngineState, Supervisor
from pinsidecar.engine import EngineConfig, PortInUseError, free_port, hooked_spec
from pinsidecar.engine.container import ContainerEngine
from pinsidecar.engine.launcher import EngineSetupError
from pinsidecar.placement import build_usage_map
from pinsidecar.testing.artifacts import write_map
from pinsidecar.testing.container import PodmanLane
from pinsidecar.testing.daemon import DaemonUnderTest, drain_reboot_figure
from pinsidecar.testing.figures import record_figure
from pinsidecar.testing.streaming import load_during
from pinsidecar.testing.wait import wait_until, wait_until_async

BOOT_LIMIT_S = 900.0
STOP_TIMEOUT_S = 40.0
SHUTDOWN_TIMEOUT_S = 5
NAME = f"pinsidecar-test-{os.getpid()}"
ENGINE = free_port()  # the count-mode container's


def _conmons(container_id: str) -> list[psutil.Process]:
    """conmon processes still watching ``container_id`` (an orphan would show here)."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "conmon" and container_id in " ".join(p.info.get("cmdline") or []):
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------------- faults


def _lone_engine(lane: PodmanLane, model: Path, state: Path, port: int, **cfg: Any) -> ContainerEngine:
    spec = hooked_spec(EngineConfig(model=model, enforce_eager=True, served_model_name="demo"), None, port=port,
                       log_path=state / "engine.log")
    return ContainerEngine(spec, lane.container_config(f"{NAME}-fault", **cfg), state)


def test_missing_image_is_a_setup_error_naming_the_fix(podman_lane: PodmanLane, demo_model_dir: Path,
                                                       tmp_path: Path) -> None:
    eng = _lone_engine(podman_lane, demo_model_dir, tmp_path, free_port(), image="localhost/no-such-image:1")
    with pytest.raises(EngineSetupError, match=r"'localhost/no-such-image:1' is not on this host and cannot be "
                                               r"pulled.*podman pull localhost/no-such-image:1.*podman load"):
        eng.start()
    assert eng.container_id is None and podman_lane.containers(f"{NAME}-fault") == []


def test_port_taken_on_the_host_fails_before_anything_runs(podman_lane: PodmanLane, demo_model_dir: Path,
                                                           tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        eng = _lone_engine(podman_lane, demo_model_dir, tmp_path, port)
        t0 = time.monotonic()
        with pytest.raises(PortInUseError, match=rf"port {port} on 127.0.0.1 is already in use.*ss -ltnp"):
            eng.start()
        assert time.monotonic() - t0 < 15  # before the long boot
    assert podman_lane.containers(f"{NAME}-fault") == []


def test_a_setup_error_fails_at_once_without_retrying(podman_lane: PodmanLane, demo_model_dir: Path,
                                                      tmp_path: Path) -> None:
    """The daemon's supervisor with a container whose image is missing: one boot, state failed, no crash loop."""
    made: list[ContainerEngine] = []

    def make(spec: Any) -> ContainerEngine:
        made.append(ContainerEngine(spec, podman_lane.container_config(f"{NAME}-fault",
                                                                       image="localhost/no-such-image:1"), tmp_path))
        return made[-1]

    spec = hooked_spec(EngineConfig(model=demo_model_dir), None, port=free_port())
    sup = Supervisor(lambda _: spec, make, SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1,
                                                            crash_loop_limit=5), ready_timeout_s=60, stop_timeout_s=5)

    seen: dict[str, str] = {}

    async def scenario() -> None:
        task = asyncio.create_task(sup.run())
        await wait_until_async(lambda: sup.state == EngineState.FAILED, "the supervisor giving up", 60.0, step_s=0.1)
        await asyncio.sleep(1.0)  # a retry (backoff 0.1 s) would have happened by now
        seen.update(state=sup.state, detail=sup.detail)
        await sup.close()
        await task

    asyncio.run(scenario())
    assert seen["state"] == EngineState.FAILED and "a retry cannot fix this" in seen["detail"]
    assert len(made) == 1 and len(sup.boots) == 1 and not sup.boots[0].ok
    assert "podman pull" in sup.boots[0].error
    assert sup.failures_in_row == 1


# ---------------------------------------------------------------------------------------------------- count mode


@pytest.fixture(scope="module")
def counted(podman_lane: PodmanLane, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Any]:
    """A count-mode engine in a container (the launcher alone): exact counts, then map A from them."""
    tmp = tmp_path_factory.mktemp("container-count")
    state = tmp / "state"
    state.mkdir()
    hook = HookConfig(mode="count", counts_path=state / "counts.json", flush_interval_s=1.0, workload="test")
    spec = hooked_spec(EngineConfig(model=demo_model_dir, enforce_eager=True, served_model_name="demo"), hook,
                       port=ENGINE, log_path=tmp / "count-engine.log")
    eng = ContainerEngine(spec, podman_lane.container_config(f"{NAME}-count"), state)
    eng.start()
    try:
        boot_s = eng.wait_ready(BOOT_LIMIT_S)
        request_counts(hook.counts_path, "reset", eng)
        processed = 0
        for i, prompt in enumerate(["def parse(line):", "The river ran into the sea", "import os"]):
            r = httpx.post(f"{eng.base_url}/v1/completions", timeout=300, json={
                "model": "demo", "prompt": prompt, "max_tokens": 3 + 2 * i, "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            usage = r.json()["usage"]
            processed += usage["prompt_tokens"] + usage["completion_tokens"] - 1
        counts = request_counts(hook.counts_path, "flush", eng)
        container_id, pid = eng.container_id, eng.pid
    finally:
        code = eng.stop(STOP_TIMEOUT_S)
    maps = tmp / "daemon-state" / "maps"  # under the state folder: the container sees only that
    maps.mkdir(parents=True)
    a = maps / "a.json"
    build_usage_map([counts], counts.num_experts // 2, label="A").save(a)
    b = write_map(maps / "b.json", num_layers=counts.num_layers, num_experts=counts.num_experts, top_k=counts.top_k,
                  hot_rows=counts.num_experts // 2, seed=2, label="B", layer_ids=list(counts.layer_ids))
    return {"counts": counts, "processed": processed, "boot_s": boot_s, "id": container_id, "pid": pid,
            "code": code, "maps": maps, "a": a, "b": b, "tmp": tmp}


@pytest.mark.vllm
def test_count_mode_in_a_container_counts_exactly(counted: dict[str, Any], podman_lane: PodmanLane) -> None:
    counts, processed = counted["counts"], counted["processed"]
    assert counts.counts.sum(axis=1).tolist() == [processed * counts.top_k] * counts.num_layers
    assert counts.selections == counts.num_layers * processed * counts.top_k
    assert counted["pid"] and counted["id"]
    # stopped and removed: no container, no conmon left
    assert podman_lane.containers(f"{NAME}-count") == [] and _conmons(counted["id"]) == []
    assert counted["code"] is not None


# ---------------------------------------------------------------------------------------------------- the daemon


@dataclass
class Lane:
    """The daemon under test with its podman lane, and the count boot's maps."""

    d: DaemonUnderTest
    lane: PodmanLane
    counted: dict[str, Any]

    @property
    def state(self) -> Path:
        return self.d.state_dir

    def container(self) -> dict[str, Any]:
        found = self.lane.containers(NAME)
        assert len(found) == 1, found
        return found[0]


@pytest.fixture(scope="module")
def daemon(counted: dict[str, Any], podman_lane: PodmanLane, demo_model_dir: Path) -> Iterator[Lane]:
    tmp = counted["tmp"]
    overrides = {
        "engine": {"launcher": "container", "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
                   "stop_timeout_s": STOP_TIMEOUT_S},
        "container": podman_lane.config_table(NAME),
        "daemon": {"state_dir": str(tmp / "daemon-state")},  # the maps are under it: the container sees only that
    }
    d = DaemonUnderTest(tmp, demo_model_dir, counted["a"], overrides=overrides, env=podman_lane.env,
                        own_compile_cache=False)  # the engine runs in the container: no host cache folder there
    try:
        d.start(wait=False)
        d.wait_ready("the daemon's first container boot")
        yield Lane(d, podman_lane, counted)
    finally:
        d.stop()
        podman_lane.podman("rm", "--force", "--time", "0", NAME, check=False)


def _cgroup(text: str) -> tuple[dict[str, str], int]:
    """(labels of pinsidecar_engine_cgroup_info, memory.current) from a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    info: dict[str, str] = {}
    current = -1
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pinsidecar_engine_cgroup_info":
                info = dict(s.labels)
            elif s.name == "pinsidecar_engine_cgroup_memory_current_bytes":
                current = int(s.value)
    return info, current


@pytest.mark.vllm
def test_daemon_serves_pin_mode_from_a_container(daemon: Lane) -> None:
    st = daemon.d.engine()
    box = daemon.container()
    assert box["State"] == "running" and box["Labels"]["org.pinsidecar.state_dir"] == str(daemon.state)
    assert st["state"] == "ready" and st["last_boot"]["reason"] == "start"
    assert st["pid"] == box["Pid"]  # the container's init pid, as the host sees it
    emap = load_map(daemon.counted["a"])
    assert st["map"]["hash"] == emap.content_hash
    assert daemon.d.complete("def f(x):", timeout=300).status_code == 200
    # the hook's live stats, written inside the container, read from the host side
    stats_path = daemon.state / "stats.json"
    wait_until(lambda: load_stats(stats_path).tokens > 0, "the hook's periodic stats write after a request", 60.0,
               ignore=(FileNotFoundError,))
    assert load_stats(stats_path).map_hash == emap.content_hash
    # the hook was loaded from the overlay mounted into the container
    assert (daemon.state / "hook" / "pinsidecar_hook-0.1.0.dist-info" / "entry_points.txt").is_file()


@pytest.mark.vllm
def test_exporter_reads_the_container_cgroup_memory(daemon: Lane) -> None:
    box = daemon.container()
    info, before = _cgroup(daemon.d.metrics())
    assert info["container_id"] == box["Id"]
    assert box["Id"] in info["path"]  # v1: /libpod_parent/libpod-<id>; v2: .../libpod-<id>.scope
    assert before > 50 * 2**20  # an engine with a model loaded, not an empty cgroup
    # something in the engine's container allocates 256 MiB, held until its stdin closes: the exported value follows
    alloc = subprocess.Popen(["podman", "exec", "-i", NAME, daemon.lane.python, "-c",
                              "import sys; b = bytearray(256 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('held', flush=True); sys.stdin.read()"],
                             env={**os.environ, **daemon.lane.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert alloc.stdout is not None and alloc.stdout.readline().strip() == "held"
        _, during = _cgroup(daemon.d.metrics())
    finally:
        assert alloc.stdin is not None
        alloc.stdin.close()
        alloc.wait(30)
    assert during - before > 200 * 2**20, (before, during)
    wait_until(lambda: _cgroup(daemon.d.metrics())[1] < during - 200 * 2**20, "memory released", 30.0)


@pytest.mark.vllm
def test_drain_reboot_to_another_map_under_8_streaming_clients(daemon: Lane) -> None:
    before = daemon.d.engine()
    old_id = daemon.container()["Id"]

    async def reboot() -> dict[str, Any]:
        return await daemon.d.drain_reboot_cli("--map", str(daemon.counted["b"]))

    res = asyncio.run(load_during(daemon.d.gate_url, "demo", reboot, clients=8))
    result = res.action
    figure = {**res.figure(), "max_tokens": 32, "launcher": "container (podman)",
              "drain_reboot": drain_reboot_figure(result)}
    record_figure("container_drain_reboot", figure)
    assert result["ok"] is True and result["in_flight_cut"] == 0 and not result["rolled_back"]
    assert figure["failed"] == 0, figure["errors"]
    assert figure["lost"] == 0 and figure["completed"] >= 32
    after = daemon.d.engine()
    assert after["last_boot"]["reason"] == "drain-reboot" and after["pid"] != before["pid"]
    assert daemon.container()["Id"] != old_id  # a new container, the old one removed
    b_hash = load_map(daemon.counted["b"]).content_hash
    assert after["map"]["hash"] == b_hash
    assert daemon.d.complete("def f(x):", timeout=300).status_code == 200
    stats_path = daemon.state / "stats.json"  # the new engine's stats, on the host
    wait_until(lambda: load_stats(stats_path).map_hash == b_hash and load_stats(stats_path).tokens > 0,
               "the new engine's stats", 60.0, ignore=(FileNotFoundError,))
    assert result["held_at_release"] > 0


@pytest.mark.vllm
def test_podman_kill_is_noticed_and_restarted(daemon: Lane) -> None:
    sidecar = daemon.d
    old = daemon.container()
    daemon.lane.podman("kill", NAME)
    noticed = sidecar.seconds_until_status(lambda s: s["engine"]["state"] != "ready", "the daemon noticing the kill",
                                           20.0)
    print(f"\npodman kill noticed after {noticed:.2f} s")
    sidecar.wait_ready("the restart after podman kill")
    after = sidecar.engine()
    assert after["last_boot"]["reason"] == "crash" and after["restarts_total"] >= 1
    new = daemon.container()
    assert new["Id"] != old["Id"] and new["State"] == "running"
    assert daemon.d.complete("def f(x):", timeout=300).status_code == 200
    text = sidecar.metrics()
    assert 'pinsidecar_engine_boots_total{reason="crash"} 1.0' in text
    assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
    assert _cgroup(text)[0]["container_id"] == new["Id"]  # the exporter follows the new container


@pytest.mark.vllm
def test_sidecar_sigkilled_then_restarted_removes_the_container_left_behind(daemon: Lane) -> None:
    left = daemon.container()
    daemon.d.kill()  # the sidecar alone; conmon and the container live on
    assert daemon.container()["Id"] == left["Id"] and daemon.container()["State"] == "running"
    daemon.d.start(wait=False)  # the same config, a new process and log
    daemon.d.wait_ready("the restarted sidecar's boot")
    second = daemon.d
    now = daemon.container()  # exactly one engine container: no name conflict, no orphan
    assert now["Id"] != left["Id"]
    assert _conmons(left["Id"]) == []
    assert "container_leftover_removed" in second.log_text() and left["Id"][:12] in second.log_text()
    assert daemon.d.complete("def f(x):", timeout=300).status_code == 200


@pytest.mark.vllm
def test_sigterm_drains_then_stops_the_container_within_its_timeout(daemon: Lane) -> None:
    sidecar = daemon.d
    box = daemon.container()
    t0 = time.monotonic()
    sidecar.proc.send_signal(signal.SIGTERM)
    assert sidecar.proc.wait(STOP_TIMEOUT_S + 60) == 0
    took = time.monotonic() - t0
    print(f"\nSIGTERM to exit: {took:.1f} s")
    assert took < STOP_TIMEOUT_S + 30
    assert daemon.lane.containers(NAME) == []  # stopped and removed
    assert _conmons(box["Id"]) == []
    text = sidecar.log_text()
    assert "engine_state" in text and "stopping" in text
