"""The engine tests' own helpers, without an engine: the one poll-and-wait loop (:mod:`pinsidecar.testing.wait`)
and the daemon under test (:mod:`pinsidecar.testing.daemon`): its config is one the daemon loads, overrides land
where they say, and a daemon that cannot start fails the wait at once, with its log, rather than after the boot
bound."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from pinsidecar.daemon.config import load_config
from pinsidecar.testing.daemon import TEST_CHANGES, DaemonUnderTest, daemon_logs_for_report
from pinsidecar.testing.wait import WaitTimeout, seconds_until, wait_until, wait_until_async


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "done", "three polls", 5.0, step_s=0.001) == "done"
    assert seconds_until(lambda: True, "at once", 5.0) < 1.0


def test_a_timeout_names_what_was_awaited_the_last_error_and_the_detail() -> None:
    def flaky() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(WaitTimeout, match=r"(?s)not within 0\.05 s: the server up.*ConnectionError: refused.*log"):
        wait_until(flaky, "the server up", 0.05, step_s=0.01, ignore=(ConnectionError,), detail=lambda: "log tail")
    with pytest.raises(KeyError):  # an error not named in ``ignore`` is the test's own bug: it propagates
        wait_until(lambda: {}["x"], "a key", 1.0, ignore=(ConnectionError,))


def test_gone_ends_the_wait_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match="the process exited while waiting for the engine"):
        wait_until(lambda: False, "the engine", 60.0, gone=lambda: "the process exited")
    assert time.monotonic() - t0 < 5.0


def test_the_async_wait_lets_the_event_loop_run() -> None:
    async def body() -> str:
        state = {"done": False}

        async def later() -> None:
            await asyncio.sleep(0.05)
            state["done"] = True

        task = asyncio.create_task(later())
        got = await wait_until_async(lambda: state["done"] and "seen", "the task's flag", 5.0, step_s=0.01)
        await task
        return got

    assert asyncio.run(body()) == "seen"
    with pytest.raises(WaitTimeout, match="not within"):
        asyncio.run(wait_until_async(lambda: False, "never", 0.05))


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def test_the_config_loads_and_overrides_land_where_they_say(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "a.json").write_text("{}")
    d = DaemonUnderTest(tmp_path / "run", _model(tmp_path), maps / "a.json",
                        overrides={"gate": {"max_queue": 8, "max_hold_s": None}, "drift": {"auto_remap": False}})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "control.token").write_text("x" * 32)
    cfg = load_config(d.write_config())
    assert cfg.engine.hook_mode == "pin" and cfg.engine.map == maps / "a.json" and cfg.maps.dir == maps
    assert cfg.gate.port == d.ports.gate and cfg.control.port == d.ports.control
    assert cfg.gate.max_queue == 8 and cfg.gate.max_hold_s == type(cfg.gate)().max_hold_s  # None: the default
    assert cfg.drift.auto_remap is False
    assert cfg.deprecations == ()  # the written file is in today's layout, overrides included
    assert cfg.supervisor.health_interval_s == TEST_CHANGES["supervisor"]["health_interval_s"]
    assert d.state_dir == tmp_path / "run" / "state" and cfg.daemon.state_dir == d.state_dir
    assert len({d.ports.engine, d.ports.gate, d.ports.control, d.ports.metrics, d.ports.count}) == 5


def test_the_demo_base_is_the_demos_config(tmp_path: Path) -> None:
    d = DaemonUnderTest(tmp_path, _model(tmp_path), tmp_path / "code.json", base="demo",
                        overrides={"remap": {"source": "live"}})
    doc = d.doc()
    assert doc["remap"]["source"] == "live" and doc["gate"]["capture_dir"] == str(tmp_path / "capture")
    assert "supervisor" not in doc  # the demo runs the daemon's defaults
    with pytest.raises(ValueError, match="map_path"):
        DaemonUnderTest(tmp_path, _model(tmp_path / "x"), base="demo").doc()


def test_a_daemon_that_cannot_start_fails_the_wait_at_once_with_its_log(tmp_path: Path) -> None:
    """No model folder: ``pinsidecar run`` refuses its config and exits; the wait says so without waiting out the
    boot bound, and the daemon's own words are in the failure (and in a failed test's report)."""
    since = time.time()
    t0 = time.monotonic()
    d = DaemonUnderTest(tmp_path / "run", tmp_path / "no-such-model")
    with pytest.raises(WaitTimeout, match=r"the daemon exited \(\d+\) while waiting for the engine ready") as exc, d:
        pass
    assert time.monotonic() - t0 < 120
    assert "no-such-model" in str(exc.value)
    assert not d.alive()
    [(_title, tail)] = [r for r in daemon_logs_for_report(since) if str(d.log_path) in r[0]]
    assert "no-such-model" in tail


def test_a_written_config_is_laid_out_and_a_key_set_both_ways_is_refused() -> None:
    from pinsidecar.daemon.config import ConfigError, laid_out

    doc = {"drift": {"window_tokens": 512, "cooldown_s": 60}, "engine": {"enforce_eager": False, "env": {"A": "1"}}}
    assert laid_out(doc) == {"drift": {"cooldown_s": 60, "advanced": {"window_tokens": 512}},
                             "engine": {"env": {"A": "1"}, "vllm": {"enforce-eager": False}}}
    assert doc["drift"] == {"window_tokens": 512, "cooldown_s": 60}  # not changed
    with pytest.raises(ConfigError, match=r"engine\.enforce_eager and engine\.vllm\.enforce-eager"):
        laid_out({"engine": {"enforce_eager": True, "vllm": {"enforce-eager": False}}})
