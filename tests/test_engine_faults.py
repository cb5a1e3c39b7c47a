"""Engine faults against the real vLLM CPU engine behind the real daemon and gate: the engine SIGKILLed in service
under 8 streaming clients, killed while booting, hung (SIGSTOP), killed during a map switch's reboot, and killed
during a count boot.

One daemon process (``pinsidecar run``) in pin mode serves the module, so the engine boots five times in all
(start, the crash restart, the restart after the killed boot, the hang restart, the rollback after the killed
map switch; the killed boots die within seconds). A thread samples ``status`` and ``/metrics`` every 0.1 s while
the engine is down, so "never ready without a live engine" is checked, not assumed.

The crash figure: 8 clients stream completions through the gate in a loop and send the next request the moment
one ends (failed or not); the engine's process group is SIGKILLed; the supervisor restarts it. Only requests in
flight at the kill may fail (at most 8); everything sent after it is held at the gate and served by the restarted
engine. The counts and the longest stall are printed and written to ``$PINSIDECAR_FIGURES_DIR/engine_crash.json``
when that is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pinsidecar.testing.artifacts import model_geometry, write_map
from pinsidecar.testing.daemon import BOOT_LIMIT_S, DaemonUnderTest
from pinsidecar.testing.figures import record_figure
from pinsidecar.testing.streaming import load_during
from pinsidecar.testing.wait import wait_until

pytestmark = pytest.mark.vllm

CLIENTS = 8
IDLE_TIMEOUT_S = 20.0  # gate.upstream_idle_timeout_s: a hung engine's stream is cut after this
HEALTH = {"interval": 1.0, "timeout": 2.0, "failures": 3}
PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")
READY_LINE = 'pinsidecar_engine_state{state="ready"} 1.0'


def ready_with_new_pid(old_pid: int) -> Callable[[dict[str, Any]], bool]:
    """A status predicate: the engine serves again, on another process than ``old_pid``."""
    return lambda s: s["engine"]["state"] == "ready" and s["engine"]["pid"] not in (None, old_pid)


@dataclass
class Watcher:
    """Samples status and metrics every 0.1 s until stopped: (seconds since start at which the status request was
    sent, state, pid, metrics say ready)."""

    lane: DaemonUnderTest
    samples: list[tuple[float, str, int | None, bool]] = field(default_factory=list)
    t0: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watcher:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                sent = time.monotonic() - self.t0
                try:
                    # metrics first: a "ready" there is then older than the status read after it, so the moment
                    # the new engine becomes ready between the two reads is not mistaken for a lie
                    ready_metric = READY_LINE in c.get(self.lane.metrics_url).text
                    e = c.get(f"{self.lane.control_url}/status").json()["engine"]
                    self.samples.append((sent, e["state"], e["pid"], ready_metric))
                except httpx.HTTPError:
                    pass
                self._stop.wait(0.1)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> float:
        """Signal the engine's process group and wait until its leader has exited (a zombie with no thread left:
        a killed leader shows as a zombie while its other threads still die, and it has not exited until they
        have); returns when, in watcher time."""
        os.killpg(pid, sig)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if len(os.listdir(f"/proc/{pid}/task")) <= 1 and psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except (FileNotFoundError, psutil.NoSuchProcess):
                break
            time.sleep(0.01)
        return self.now()

    def ready_while_down(self, dead_pids: set[int], since: float) -> list[tuple[float, str, int | None, bool]]:
        """Samples sent once the engine was dead (``since``) that said ready (status or metrics) before a new engine
        served: every such sample up to the first one reporting ready on a pid that is not dead."""
        bad = []
        for s in self.samples:
            if s[0] < since:
                continue
            _, state, pid, ready_metric = s
            if state == "ready" and pid not in dead_pids:
                break  # the restarted engine serves
            if state == "ready" or ready_metric:
                bad.append(s)
        return bad

    def states(self) -> list[str]:
        return [s[1] for s in self.samples]


@pytest.fixture(scope="module")
def maps(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    maps_dir = tmp_path_factory.mktemp("faults") / "maps"
    maps_dir.mkdir()
    geometry = model_geometry(demo_model_dir)
    return {name: write_map(maps_dir / f"{name}.json", **geometry, hot_rows=40, seed=seed, label=name)
            for name, seed in (("A", 1), ("B", 2))}


@pytest.fixture(scope="module")
def lane(demo_model_dir: Path, maps: dict[str, Path]) -> Iterator[DaemonUnderTest]:
    overrides = {
        "supervisor": {"health_interval_s": HEALTH["interval"], "health_timeout_s": HEALTH["timeout"],
                       "health_failures": HEALTH["failures"], "backoff_max_s": 2,
                       # Several faults land here within stable_after_s of each other (a kill in service, a kill
                       # while booting, a hang): each one counts towards the crash loop, and the limit is not what
                       # these tests are about (tests/test_supervisor.py covers it), so it must not end the lane.
                       "crash_loop_limit": 50},
        "gate": {"upstream_idle_timeout_s": IDLE_TIMEOUT_S},
        "drift": {"auto_remap": False},  # the random map drifts at once; these tests are about the engine
    }
    with DaemonUnderTest(maps["A"].parent.parent, demo_model_dir, maps["A"], overrides=overrides) as d:
        yield d


def _gate(lane: DaemonUnderTest) -> dict[str, Any]:
    return lane.status()["gate"]


def test_engine_sigkilled_in_service_under_8_streams_fails_only_what_was_in_flight(lane: DaemonUnderTest) -> None:
    before = lane.status()
    pid = before["engine"]["pid"]
    counters0 = before["gate"]["counters"]
    timing: dict[str, float] = {}

    async def kill_and_wait_for_the_restart() -> None:
        t0 = time.monotonic()
        timing["dead_at"] = watcher.kill(pid)  # the whole engine, as an OOM kill or a segfault would
        timing["noticed_s"] = await asyncio.to_thread(lane.seconds_until_status,
                                                      lambda s: s["engine"]["state"] != "ready", "the kill noticed",
                                                      30.0)
        await asyncio.to_thread(lane.wait_status, ready_with_new_pid(pid), "the restart")
        timing["down_s"] = time.monotonic() - t0

    watcher = Watcher(lane)
    with watcher:
        result = asyncio.run(load_during(lane.gate_url, "demo", kill_and_wait_for_the_restart,
                                         clients=CLIENTS, max_tokens=32, limit_s=BOOT_LIMIT_S))
    after = lane.status()
    counters = {k: v - counters0.get(k, 0) for k, v in after["gate"]["counters"].items()}
    fig = {**result.figure(), "noticed_s": round(timing["noticed_s"], 2), "down_s": round(timing["down_s"], 1),
           "boot_s": after["engine"]["last_boot"]["seconds"], "gate_counters": counters,
           "unreachable_retries": after["gate"]["unreachable_retries"]}
    record_figure("engine_crash", fig)
    assert fig["lost"] == 0
    assert fig["failed"] <= CLIENTS, fig["errors"]  # only what was in flight at the kill
    assert fig["completed"] >= 4 * CLIENTS and fig["sent"] == fig["completed"] + fig["failed"]
    assert all("pinsidecar gate" in e or "Error" in e or "without [DONE]" in e for e in fig["errors"])
    assert counters.get("rejected_queue_full", 0) == counters.get("rejected_hold_timeout", 0) == 0
    assert counters.get("bad_gateway", 0) + counters.get("upstream_broken", 0) <= CLIENTS
    # the restart really happened, requests waited it out, and nothing said ready while no engine lived
    assert after["engine"]["last_boot"]["reason"] == "crash" and after["engine"]["state"] == "ready"
    assert after["engine"]["restarts_total"] >= 1 and "restarting" in lane.log_text()
    assert 'pinsidecar_engine_boots_total{reason="crash"}' in lane.metrics()
    assert fig["longest_stall_s"] >= 0.5 * fig["boot_s"]
    assert timing["noticed_s"] < 2.0
    assert "restarting" in watcher.states()
    assert watcher.ready_while_down({pid}, timing["dead_at"]) == []
    assert after["engine"]["map"]["label"] == "A"


def test_engine_killed_while_booting_is_booted_again_and_held_requests_are_served(lane: DaemonUnderTest) -> None:
    pid = lane.engine()["pid"]
    with Watcher(lane) as watcher:
        dead_at = watcher.kill(pid)
        lane.wait_status(lambda s: s["engine"]["state"] != "ready", "the kill noticed", 30.0)
        held = {}
        sender = threading.Thread(target=lambda: held.update(r=lane.complete("held across two boots")))
        sender.start()
        booting: dict[str, int] = {}

        def second_boot_started(s: dict[str, Any]) -> bool:
            e = s["engine"]
            if e["state"] == "starting" and e["pid"] not in (None, pid):
                booting["pid"] = e["pid"]
                return True
            return False

        lane.wait_status(second_boot_started, "the restart's boot", 120.0)
        time.sleep(3.0)  # well into the boot (vLLM loads for 10-60 s here)
        assert lane.engine()["state"] == "starting", "the boot finished too fast to be killed while booting"
        watcher.kill(booting["pid"])
        lane.wait_status(ready_with_new_pid(booting["pid"]), "the boot after the killed boot")
        sender.join(BOOT_LIMIT_S)
    st = lane.status()
    assert held["r"].status_code == 200, held["r"].text  # held across both boots, then served
    assert st["engine"]["state"] == "ready" and st["engine"]["last_boot"]["ok"]
    assert st["engine"]["last_boot"]["reason"] == "retry"  # the boot after a failed boot
    assert st["engine"]["restarts_total"] >= 2  # this crash and the killed boot
    assert "exited with code -9 while booting" in lane.log_text()
    assert watcher.ready_while_down({pid, booting["pid"]}, dead_at) == []
    assert st["gate"]["holding"] is False
    assert st["engine"]["map"]["label"] == "A"


def test_a_hung_engine_is_noticed_in_bounded_time_its_stream_cut_with_an_error_and_it_is_restarted(
        lane: DaemonUnderTest) -> None:
    """SIGSTOP of the engine's processes: a real hang (the kernel still accepts connections, nothing answers)."""
    pid = lane.engine()["pid"]
    counters0 = _gate(lane)["counters"]
    body = {"model": "demo", "prompt": "def f(", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    got: list[bytes] = []
    # The engine core (the API server's child processes) is stopped before the request is sent: the API server
    # still answers with the stream's headers, so the stream is open, and no token can be written before the hang.
    # (Stopping the whole group once the headers came raced the tiny demo model, which writes 2000 tokens in a few
    # seconds: on a loaded 2-core CI box the stream finished first.)
    core = psutil.Process(pid).children(recursive=True)
    assert core, "the engine has no core process to stop"
    for p in core:
        p.send_signal(signal.SIGSTOP)
    with Watcher(lane) as watcher, httpx.Client(timeout=BOOT_LIMIT_S) as c, \
            c.stream("POST", f"{lane.gate_url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200  # the stream is open: the API server sent its headers
        t0 = time.monotonic()
        os.killpg(pid, signal.SIGSTOP)  # now the API server too: health checks go unanswered, a real hang
        chunks = resp.iter_raw()
        try:
            for chunk in chunks:
                got.append(chunk)
        except httpx.HTTPError:
            pass  # the gate cut the connection after its error event
        cut_s = time.monotonic() - t0
        noticed_s = lane.seconds_until_status(lambda s: s["engine"]["state"] not in ("ready", "unhealthy"),
                                              "the hang noticed", 60.0) + cut_s
        lost_at = watcher.now()
        after_hold = {}
        sender = threading.Thread(target=lambda: after_hold.update(r=lane.complete("sent during the hang")))
        sender.start()
        lane.wait_status(ready_with_new_pid(pid), "the restart after the hang")
        sender.join(BOOT_LIMIT_S)
    text = b"".join(got).decode(errors="replace")
    assert "[DONE]" not in text
    # Whichever comes first ends the stream with an error event: the gate's idle timeout (504, "hung"), or the
    # supervisor's restart of the hung engine (it is SIGKILLed after the stop timeout: 502, "broke off").
    err = json.loads(text.strip().rsplit("\n\n", 1)[-1].removeprefix("data: "))["error"]
    assert (err["code"], "hung" in err["message"]) in ((504, True), (502, False)), err
    bound = HEALTH["interval"] + HEALTH["failures"] * (HEALTH["interval"] + HEALTH["timeout"])
    assert cut_s <= min(IDLE_TIMEOUT_S, bound + 5.0) + 10, f"stream cut after {cut_s:.1f} s"
    assert noticed_s <= bound + IDLE_TIMEOUT_S + 5, f"noticed after {noticed_s:.1f} s"
    assert after_hold["r"].status_code == 200, after_hold["r"].text
    st = lane.status()
    assert st["engine"]["last_boot"]["reason"] == "unhealthy"
    assert "unhealthy" in watcher.states() or "restarting" in watcher.states()
    assert watcher.ready_while_down({pid}, lost_at) == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    cut = {k: st["gate"]["counters"][k] - counters0.get(k, 0) for k in ("upstream_timeout", "upstream_broken")}
    assert sum(cut.values()) == 1, cut  # the one stream in flight, and nothing else
    assert 'pinsidecar_gate_requests_total{outcome="upstream_broken"}' in lane.metrics()
    assert st["engine"]["map"]["label"] == "A"


def test_engine_killed_during_a_map_switch_reboot_rolls_back_to_the_served_map(lane: DaemonUnderTest,
                                                                               maps: dict[str, Path]) -> None:
    """The reboot every remap makes (``Daemon.reboot_with`` and the control API's drain-reboot are one
    implementation): the engine booting map B is killed; the daemon boots map A again and says so."""
    before = lane.status()
    pid = before["engine"]["pid"]
    assert before["engine"]["map"]["label"] == "A"
    out: dict[str, Any] = {}

    def switch() -> None:
        res = lane.cli("drain-reboot", "--map", "B.json", "--json", "--timeout", "120", timeout=2 * BOOT_LIMIT_S)
        out.update(rc=res.returncode, stdout=res.stdout, stderr=res.stderr)

    with Watcher(lane) as watcher:
        runner = threading.Thread(target=switch)
        runner.start()
        booting: dict[str, int] = {}

        def b_booting(s: dict[str, Any]) -> bool:
            e = s["engine"]
            if e["state"] in ("starting", "draining") and e["pid"] not in (None, pid):
                booting["pid"] = e["pid"]
                return True
            return False

        lane.wait_status(b_booting, "the boot onto map B", 300.0)
        held = {}
        sender = threading.Thread(target=lambda: held.update(r=lane.complete("held across the switch")))
        sender.start()
        time.sleep(3.0)
        dead_at = watcher.kill(booting["pid"])
        runner.join(2 * BOOT_LIMIT_S)
        sender.join(BOOT_LIMIT_S)
    result = json.loads(out["stdout"]) if out["stdout"].strip().startswith("{") else {}
    assert result, (out["rc"], out["stdout"], out["stderr"])
    assert result["ok"] is False and result["rolled_back"] is True, result
    assert "exited" in result["error"] and "rolled back" in result["error"]
    st = lane.status()
    assert st["engine"]["state"] == "ready" and st["engine"]["map"]["label"] == "A"
    assert st["engine"]["last_boot"]["reason"] == "rollback"
    assert held["r"].status_code == 200, held["r"].text
    assert watcher.ready_while_down({pid, booting["pid"]}, dead_at) == []
    active = lane.state_dir / "active-map.json"
    assert not active.exists() or json.loads(active.read_text())["path"] == str(maps["A"])
    assert 'pinsidecar_map_info{hash="' in lane.metrics()
    assert 'label="A"' in next(ln for ln in lane.metrics().splitlines() if ln.startswith("pinsidecar_map_info"))


def test_engine_killed_during_a_count_boot_leaves_nothing_and_the_lane_serves_on(lane: DaemonUnderTest,
                                                                                  demo_model_dir: Path) -> None:
    served = lane.engine()
    out = lane.tmp / "counts" / "code.counts.json"
    out.parent.mkdir()
    workload = Path(__file__).resolve().parents[1] / "pinsidecar" / "demo" / "fixtures" / "code.jsonl"
    proc = subprocess.Popen([PINSIDECAR, "count-boot", "--model", str(demo_model_dir), "--workload", str(workload),
                             "--out", str(out), "--port", str(lane.ports.count), "--max-tokens", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def count_engine() -> psutil.Process | None:
        """The count boot's engine (vLLM's API server on the count port), once it runs."""
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            if "vllm.entrypoints.openai.api_server" in cmd and f"--port {lane.ports.count}" in cmd:
                return p
        return None

    try:
        engine = wait_until(count_engine, "the count engine started", 120.0,
                            gone=lambda: None if proc.poll() is None else f"profile exited ({proc.returncode})")
        time.sleep(3.0)  # into the boot
        os.killpg(engine.pid, signal.SIGKILL)
        _stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftover = count_engine()  # the profile's engine leads its own group: a failed test must not leave it
        if leftover is not None:
            os.killpg(leftover.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "exited with code -9" in stderr, stderr[-2000:]
    assert list(out.parent.iterdir()) == []  # no counts, no temp file beside --out
    after = lane.engine()
    assert after["state"] == "ready" and after["pid"] == served["pid"]  # the serving lane never noticed
    assert lane.complete().status_code == 200
