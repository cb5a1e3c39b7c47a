"""Supervisor faults that need no vLLM: an engine that never becomes ready, one that exits while booting, the
backoff and crash-loop limit, the cache-miss rule; and how the supervisor and the daemon feed the exporter (the
``BootObserver`` protocol, and the live inputs read at scrape time). (The engine killed from outside is tested
against the real vLLM engine in test_engine_faults.py.)

The failing "engines" are real processes started by the real :class:`~pinsidecar.engine.EngineProcess` with
``engine.python`` pointing at a small script, exactly how a broken interpreter or a hung vLLM looks to the daemon.
The wiring tests use an engine that is ready at once (:class:`InstantEngine`): they are about bookkeeping, not
about processes.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from pinsidecar.daemon.boots import BootRecord, compile_cache_evidence, geometry_key, is_cache_miss
from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.daemon.gate import Gate
from pinsidecar.daemon.peers import BootObserver
from pinsidecar.daemon.supervisor import EngineState, Supervisor
from pinsidecar.engine import EngineProcess, EngineSpec, Launcher
from pinsidecar.metrics import Exporter
from pinsidecar.testing.artifacts import make_map, write_map
from pinsidecar.testing.remap import InstantEngine

PORT = 8270


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fake-python"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def _supervisor(tmp_path: Path, script: Path, cfg: SupervisorConfig, states: list[tuple[str, str]],
                exporter: Exporter | None = None, ready_timeout_s: float = 2.0) -> Supervisor:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)

    def spec_for(map_path: Path | None) -> EngineSpec:
        return EngineSpec(model=model, port=PORT, python=str(script), log_path=tmp_path / "engine.log")

    return Supervisor(spec_for, EngineProcess, cfg, ready_timeout_s=ready_timeout_s, stop_timeout_s=5.0,
                      observer=exporter, on_state=lambda s, d: states.append((s, d)))


async def _until(cond: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"not reached within {limit_s} s: {what}")
        await asyncio.sleep(0.05)


def _procs_running(script: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if any(str(script) in c for c in cmd):
            out.append(p)
    return out


def test_engine_never_ready_bounded_wait_log_lines_failed_state(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "INFO loading weights: shard 1/1"\necho "INFO capturing graphs for batch 512"\n'
                               "exec sleep 600\n")
    states: list[tuple[str, str]] = []
    exporter = Exporter(nvml=None, process_metrics=False)
    cfg = SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1, backoff_max_s=0.2, crash_loop_limit=2)
    sup = _supervisor(tmp_path, script, cfg, states, exporter)

    async def scenario() -> None:
        task = asyncio.create_task(sup.run())
        await _until(lambda: sup.state == EngineState.FAILED, "failed state")
        # the daemon's supervisor stays up in the failed state and does not boot again
        await asyncio.sleep(0.5)
        assert len(sup.boots) == 2
        assert not task.done()
        await sup.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert [b.ok for b in sup.boots] == [False, False]
    assert [b.reason for b in sup.boots] == ["start", "retry"]
    first = sup.boots[0]
    assert "engine not ready after 2 s" in first.error
    assert 2.0 <= first.seconds < 10.0  # bounded: the wait stopped at the timeout (plus the stop)
    assert "INFO capturing graphs for batch 512" in first.log_tail
    assert "2 failures in a row" in sup.detail and "not restarting" in sup.detail
    text = exporter.render().decode()
    assert 'pinsidecar_engine_state{state="failed"} 1.0' in text
    assert sup.snapshot()["last_boot"]["log_tail"][-1] == "INFO capturing graphs for batch 512"
    assert _procs_running(script) == []  # every hung engine was stopped, its process group included


def _run_until_failed(tmp_path: Path, script: Path, linger_s: float = 0.0) -> tuple[Supervisor, list[tuple[str, str]]]:
    """Run a supervisor over ``script`` (fast backoff, crash-loop limit 4) until it is ``failed``, stay ``linger_s``
    longer (a retry would show), close it; returns it and the states it went through."""
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1, backoff_max_s=0.3, crash_loop_limit=4)
    sup = _supervisor(tmp_path, script, cfg, states)

    async def scenario() -> None:
        task = asyncio.create_task(sup.run())
        await _until(lambda: sup.state == EngineState.FAILED, "failed state")
        await asyncio.sleep(linger_s)
        await sup.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    return sup, states


def test_engine_exiting_at_boot_backs_off_exponentially_then_fails(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "Traceback (most recent call last):"\necho "RuntimeError: boom"\nexit 3\n')
    sup, states = _run_until_failed(tmp_path, script)
    assert len(sup.boots) == 4
    assert all("exited with code 3" in b.error for b in sup.boots)
    assert "RuntimeError: boom" in sup.boots[-1].log_tail
    waits = [d.rsplit("next boot in ", 1)[1] for s, d in states if s == EngineState.BACKOFF]
    assert waits == ["0.1 s", "0.2 s", "0.3 s"]  # doubled, capped at backoff_max_s
    assert states[-1][0] == EngineState.FAILED
    assert sup.boots[-1].log_tail == ("Traceback (most recent call last):", "RuntimeError: boom")  # this boot's log
    assert (tmp_path / "engine.log.1").exists()  # the previous boot's log, kept once


def test_a_pin_refusal_is_reported_at_once_not_retried(tmp_path: Path) -> None:
    """The hook's refusal line (an experts class no split backend supports, say) makes the first failed boot
    final, with the hook's reason in the state; no crash loop of identical refusals."""
    from pinsidecar_hook.contract.env import PIN_REFUSED_MARKER

    line = (PIN_REFUSED_MARKER + "map /m.json: no split backend for experts MarlinExperts (quant: weights int4) on "
            "cuda. Tried: marlin_experts: never picked by auto")
    script = _script(tmp_path, f'echo "INFO loading"\necho "{line}"\necho "Traceback (most recent call last):"\n'
                               'exit 1\n')
    sup, states = _run_until_failed(tmp_path, script, linger_s=0.5)
    assert len(sup.boots) == 1  # not retried
    assert "a retry cannot fix this" in sup.detail
    assert "pin mode refused to boot: map /m.json: no split backend for experts MarlinExperts" in sup.detail
    assert not any(s == EngineState.BACKOFF for s, _ in states)


def test_operator_reboot_clears_failed(tmp_path: Path) -> None:
    script = _script(tmp_path, "exit 1\n")
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1, backoff_max_s=0.1, crash_loop_limit=1)
    sup = _supervisor(tmp_path, script, cfg, states)

    async def scenario() -> None:
        task = asyncio.create_task(sup.run())
        await _until(lambda: sup.state == EngineState.FAILED, "failed state")
        assert sup.failures_in_row == 1
        async with sup.lock:
            with pytest.raises(Exception, match="exited with code 1"):
                await sup.reboot("drain-reboot")
            assert sup.failures_in_row == 0  # an operator's reboot starts a fresh count
        await sup.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert sup.boots[-1].reason == "drain-reboot"


def test_compile_cache_evidence_reads_vllms_own_log_lines(tmp_path: Path) -> None:
    """The engine's log decides when it says anything: vLLM logs a load on a hit and a compile on a miss."""
    log = tmp_path / "engine.log"
    assert compile_cache_evidence(log) is None  # no log
    log.write_text("INFO Starting vLLM API server\nINFO Capturing CUDA graphs 100%\n")
    assert compile_cache_evidence(log) is None  # eager, or nothing compiled: fall back to timing
    log.write_text("INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8192) from "
                   "the cache, took 1.2 s\n")
    assert compile_cache_evidence(log) is False
    log.write_text("INFO Directly load the compiled graph(s) for compile range (1, 8)\n"
                   "INFO [backends.py:399] Compiling a graph for compile range (9, 8192) takes 20.31 s\n")
    assert compile_cache_evidence(log) is True  # any compile is a miss, even when another range loaded


def test_cache_miss_rule_and_geometry_key() -> None:
    cfg = SupervisorConfig(cache_miss_factor=2.0, cache_miss_min_s=10.0)

    def rec(seconds: float, ok: bool = True) -> BootRecord:
        return BootRecord("start", "", ok, seconds, None, None, "none")

    assert not is_cache_miss(100.0, None, cfg)  # nothing to compare with
    assert is_cache_miss(45.0, rec(20.0), cfg)  # 2.25x and 25 s slower
    assert not is_cache_miss(39.0, rec(20.0), cfg)  # under 2x
    assert not is_cache_miss(7.0, rec(3.0), cfg)  # 2.3x but only 4 s: noise
    assert not is_cache_miss(45.0, rec(20.0, ok=False), cfg)
    a, b = make_map(seed=1), make_map(seed=2)
    assert geometry_key(a) == geometry_key(b)  # same geometry, different placement: a hash-hit reboot
    assert geometry_key(make_map(hot_rows=24)) != geometry_key(a)
    assert geometry_key(None) == "none"


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert os.environ.get("NOTIFY_SOCKET") is None


# ---------------------------------------------------------------------------------------------------- the exporter


def _render(exporter: Exporter) -> str:
    return exporter.render().decode()


def test_the_exporter_is_a_boot_observer_and_the_supervisor_drives_it(tmp_path: Path) -> None:
    assert isinstance(InstantEngine(EngineSpec(model=tmp_path)), Launcher)
    exporter = Exporter(nvml=None, process_metrics=False)
    assert isinstance(exporter, BootObserver)
    map_path = write_map(tmp_path / "map.json", label="served")
    sup = Supervisor(lambda mp: EngineSpec(model=tmp_path, port=PORT), InstantEngine, SupervisorConfig(),
                     ready_timeout_s=5.0, stop_timeout_s=5.0, map_path=map_path, observer=exporter)

    async def scenario() -> None:
        async with sup.lock:
            await sup.boot("start")
            text = _render(exporter)
            assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
            assert 'pinsidecar_engine_boots_total{reason="start"} 1.0' in text
            assert sup.map is not None
            assert f'pinsidecar_map_info{{hash="{sup.map.content_hash}",label="served"}} 1.0' in text
            sup._set_state(EngineState.UNHEALTHY)  # not an exported state: folded into "restarting"
            assert 'pinsidecar_engine_state{state="restarting"} 1.0' in _render(exporter)
            await sup.stop_engine()
        assert 'pinsidecar_engine_state{state="stopped"} 1.0' in _render(exporter)

    asyncio.run(scenario())


def test_the_exporters_observer_methods_have_the_protocols_signatures() -> None:
    """isinstance() checks only the names; a renamed or reordered parameter must fail here too, not only in a
    type checker."""
    for name in ("on_state", "on_boot", "on_map"):
        assert inspect.signature(getattr(Exporter, name)) == inspect.signature(getattr(BootObserver, name)), name


def test_an_observer_that_raises_does_not_stop_the_supervisor(tmp_path: Path) -> None:
    class Broken:
        def on_state(self, state: str) -> None:
            raise RuntimeError("observer bug")

        def on_boot(self, *, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
            raise RuntimeError("observer bug")

        def on_map(self, emap: object) -> None:
            raise RuntimeError("observer bug")

    sup = Supervisor(lambda mp: EngineSpec(model=tmp_path, port=PORT), InstantEngine, SupervisorConfig(),
                     ready_timeout_s=5.0, stop_timeout_s=5.0, observer=Broken())

    async def scenario() -> None:
        async with sup.lock:
            rec = await sup.boot("start")
            assert rec.ok and sup.state == EngineState.READY
            await sup.stop_engine()

    asyncio.run(scenario())


def test_the_daemon_hands_the_exporter_the_running_engine(tmp_path: Path) -> None:
    """The daemon's exporter reads the supervisor's engine at scrape time: its pid while it runs, none after;
    the gate's counters; the configured URL when no engine runs (reported down, not off)."""
    from pinsidecar.daemon.config import load_config
    from pinsidecar.daemon.service import Daemon
    from pinsidecar.engine.ports import free_port
    from pinsidecar.testing._loopback_server import PORT_RANGE

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ports: list[int] = []
    for _ in range(4):  # four distinct free ports
        ports.append(free_port(ports[-1] + 1 if ports else PORT_RANGE[0]))
    engine_port, gate, control, metrics = ports
    cfg_path = tmp_path / "pinsidecar.toml"
    cfg_path.write_text(f'''[engine]
model = "{model}"
port = {engine_port}
[gate]
port = {gate}
[control]
port = {control}
token_file = "{tmp_path}/token"
create_token = true
[metrics]
port = {metrics}
nvml = false
[daemon]
state_dir = "{tmp_path}/state"
''')
    daemon = Daemon(load_config(cfg_path), launcher_factory=InstantEngine)

    async def scenario() -> None:
        await daemon.start()
        try:
            await _until(lambda: daemon.supervisor is not None and daemon.supervisor.state == EngineState.READY,
                         "engine ready")
            exporter = daemon.exporter
            assert exporter is not None
            assert exporter.cgroup.pid() == os.getpid() and exporter.cgroup.container_id() is None
            assert exporter.engine.url() == f"http://127.0.0.1:{engine_port}"
            text = _render(exporter)
            assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
            assert "pinsidecar_gate_holding 0.0" in text
            assert 'pinsidecar_exporter_source_up{source="engine"} 0.0' in text  # nothing serves /metrics there
            assert daemon.supervisor is not None
            async with daemon.supervisor.lock:
                await daemon.supervisor.stop_engine()
            assert exporter.cgroup.pid() is None
            assert exporter.engine.url() == f"http://127.0.0.1:{engine_port}"
        finally:
            await daemon.shutdown()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------- the gate

def _stub_engine(tmp_path: Path) -> Path:
    """An "engine" that serves like vLLM's API server (the gate tests' UpstreamStub, on the spec's --port) in a real
    process of its own, so it can be SIGKILLed and SIGSTOPped like one."""
    code = ("import asyncio, sys\n"
            "from pinsidecar.testing.upstream import UpstreamStub\n"
            "async def main():\n"
            "    await UpstreamStub(port=int(sys.argv[sys.argv.index(\"--port\") + 1])).start()\n"
            "    await asyncio.Event().wait()\n"
            "asyncio.run(main())\n")
    return _script(tmp_path, f"exec {sys.executable} -c '{code}' \"$@\"\n")


async def _gated(tmp_path: Path, script: Path, cfg: SupervisorConfig, states: list[tuple[str, str]],
                 **gate_kwargs: Any) -> tuple[Supervisor, Gate]:
    gate = Gate("127.0.0.1", 0, f"http://127.0.0.1:{PORT}", **gate_kwargs)
    gate.hold()  # as the daemon starts it: held until the engine first serves
    await gate.start()
    sup = _supervisor(tmp_path, script, cfg, states, ready_timeout_s=60.0)  # the stub imports for ~2 s
    sup.gate = gate
    return sup, gate


def test_an_engine_crash_in_service_is_noticed_at_once_and_the_gate_holds_until_the_restart(tmp_path: Path) -> None:
    """The liveness poll is every 30 s here, so only the exit watch can notice the SIGKILL in under a second; the
    request sent while the engine is down is held and served by the restarted one."""
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=30.0, backoff_initial_s=0.3, backoff_max_s=0.3, crash_loop_limit=3)

    async def scenario() -> None:
        sup, gate = await _gated(tmp_path, _stub_engine(tmp_path), cfg, states, max_hold_s=60.0)
        task = asyncio.create_task(sup.run())
        try:
            await _until(lambda: sup.state == EngineState.READY, "first boot")
            assert not gate.holding and gate.upstream_url == f"http://127.0.0.1:{PORT}"
            async with aiohttp.ClientSession() as s:
                assert (await s.get(f"http://127.0.0.1:{gate.port}/v1/models")).status == 200
                pid = sup.launcher.pid if sup.launcher else None
                assert pid is not None
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                os.killpg(pid, signal.SIGKILL)
                await _until(lambda: sup.state != EngineState.READY, "the crash noticed", 5.0)
                noticed = loop.time() - t0
                assert noticed < 1.0, f"noticed after {noticed:.2f} s: the poll, not the exit watch"
                assert gate.holding
                snap = sup.snapshot()
                assert snap["state"] == "restarting" and snap["pid"] is None, snap
                during = asyncio.create_task(s.post(f"http://127.0.0.1:{gate.port}/v1/completions",
                                                    json={"prompt": "x", "max_tokens": 2}))
                await _until(lambda: sup.state == EngineState.READY and sup.launcher is not None
                             and sup.launcher.pid != pid, "the restart")
                r = await asyncio.wait_for(during, 30)
                assert r.status == 200
            assert not gate.holding
            assert sup.boots[-1].reason == "crash" and sup.restarts_total == 1
        finally:
            await sup.close()
            await asyncio.wait_for(task, 10)
            await gate.stop()
        assert gate.counters["bad_gateway"] == 0

    asyncio.run(scenario())
    assert any(s == EngineState.BACKOFF and "engine process exited" in d for s, d in states)


def test_a_hung_engine_is_noticed_within_the_health_bound_and_restarted(tmp_path: Path) -> None:
    """SIGSTOP: the process lives and accepts connections, but answers nothing. The supervisor restarts it after
    ``health_failures`` timed-out checks; the request in flight at the engine gets the gate's 504."""
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=0.3, health_timeout_s=0.5, health_failures=2, backoff_initial_s=0.1,
                           backoff_max_s=0.1, crash_loop_limit=3)
    bound = cfg.health_failures * (cfg.health_interval_s + cfg.health_timeout_s) + cfg.health_interval_s

    async def scenario() -> None:
        sup, gate = await _gated(tmp_path, _stub_engine(tmp_path), cfg, states, max_hold_s=60.0,
                                 upstream_idle_timeout_s=1.0)
        task = asyncio.create_task(sup.run())
        stopped: psutil.Process | None = None
        try:
            await _until(lambda: sup.state == EngineState.READY, "first boot")
            pid = sup.launcher.pid if sup.launcher else None
            assert pid is not None
            stopped = psutil.Process(pid)
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as s:
                t0 = loop.time()
                os.killpg(pid, signal.SIGSTOP)
                stuck = asyncio.create_task(s.post(f"http://127.0.0.1:{gate.port}/v1/completions",
                                                   json={"prompt": "x", "max_tokens": 2}))
                await _until(lambda: gate.holding, "the hang noticed", 10.0)
                noticed = loop.time() - t0
                assert noticed <= bound + 0.5, f"hang noticed after {noticed:.2f} s (bound {bound:.1f} s)"
                r = await asyncio.wait_for(stuck, 30)
                assert r.status == 504 and "hung" in (await r.json())["error"]["message"]
                held = asyncio.create_task(s.post(f"http://127.0.0.1:{gate.port}/v1/completions",
                                                  json={"prompt": "y", "max_tokens": 2}))
                await _until(lambda: sup.state == EngineState.READY and sup.launcher is not None
                             and sup.launcher.pid != pid, "the restart")
                assert (await asyncio.wait_for(held, 30)).status == 200
            assert sup.boots[-1].reason == "unhealthy"
        finally:
            await sup.close()
            await asyncio.wait_for(task, 10)
            await gate.stop()
        assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE  # the hung one was killed
        assert gate.counters["upstream_timeout"] == 1

    asyncio.run(scenario())
    assert any(s == EngineState.BACKOFF and "engine hung" in d for s, d in states)


def test_a_supervisor_that_gives_up_makes_the_gate_refuse_at_once(tmp_path: Path) -> None:
    script = _script(tmp_path, "exit 1\n")
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1, backoff_max_s=0.1, crash_loop_limit=2)

    async def scenario() -> None:
        sup, gate = await _gated(tmp_path, script, cfg, states, max_hold_s=60.0)
        task = asyncio.create_task(sup.run())
        try:
            async with aiohttp.ClientSession() as s:
                held = asyncio.create_task(s.get(f"http://127.0.0.1:{gate.port}/v1/models"))
                await _until(lambda: sup.state == EngineState.FAILED, "failed state")
                r = await asyncio.wait_for(held, 5)  # not left to wait out max_hold_s
                assert r.status == 503 and "Retry-After" in r.headers
                assert "2 failures in a row" in (await r.json())["error"]["message"]
        finally:
            await sup.close()
            await asyncio.wait_for(task, 10)
            await gate.stop()
        assert gate.refusing is not None

    asyncio.run(scenario())
