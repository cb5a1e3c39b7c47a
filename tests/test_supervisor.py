"""Supervisor faults that need no vLLM: an engine that never becomes ready, one that exits while booting, the
backoff and crash-loop limit, the cache-miss rule. (The engine killed from outside is tested against the real
vLLM engine in test_daemon_drain.py, which shares that boot.)

The "engines" here are real processes started by the real :class:`~pinsidecar.engine.EngineProcess` with
``engine.python`` pointing at a small script, exactly how a broken interpreter or a hung vLLM looks to the daemon.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.daemon.supervisor import BootRecord, EngineState, Supervisor, geometry_key, is_cache_miss
from pinsidecar.engine import EngineProcess, EngineSpec
from pinsidecar.metrics import Exporter
from pinsidecar.testing.artifacts import make_map

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
                      exporter=exporter, on_state=lambda s, d: states.append((s, d)))


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
    exporter = Exporter(stats_path=None, engine_metrics_url=None, nvml=None, process_metrics=False)
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


def test_engine_exiting_at_boot_backs_off_exponentially_then_fails(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "Traceback (most recent call last):"\necho "RuntimeError: boom"\nexit 3\n')
    states: list[tuple[str, str]] = []
    cfg = SupervisorConfig(health_interval_s=0.2, backoff_initial_s=0.1, backoff_max_s=0.3, crash_loop_limit=4)
    sup = _supervisor(tmp_path, script, cfg, states)

    async def scenario() -> None:
        task = asyncio.create_task(sup.run())
        await _until(lambda: sup.state == EngineState.FAILED, "failed state")
        await sup.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert len(sup.boots) == 4
    assert all("exited with code 3" in b.error for b in sup.boots)
    assert "RuntimeError: boom" in sup.boots[-1].log_tail
    waits = [d.rsplit("next boot in ", 1)[1] for s, d in states if s == EngineState.BACKOFF]
    assert waits == ["0.1 s", "0.2 s", "0.3 s"]  # doubled, capped at backoff_max_s
    assert states[-1][0] == EngineState.FAILED
    assert sup.boots[-1].log_tail == ("Traceback (most recent call last):", "RuntimeError: boom")  # this boot's log
    assert (tmp_path / "engine.log.1").exists()  # the previous boot's log, kept once


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
