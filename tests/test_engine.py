"""The launcher: command line and environment, port-in-use refused before start, boot failure carries log lines,
stop takes the whole process group down. These run without vLLM (a stand-in interpreter plays the engine), so
they are cheap; booting the real engine is covered by test_count_mode and test_profile."""

from __future__ import annotations

import itertools
import os
import socket
import stat
import sys
import time
from pathlib import Path

import psutil
import pytest
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.engine import EngineBootError, EngineProcess, EngineSpec, Launcher, PortInUseError, port_in_use
from pinsidecar.testing.engine import free_port


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    return d


def test_argv_is_module_invocation_with_spec_values(tmp_path: Path) -> None:
    spec = EngineSpec(model=model_dir(tmp_path), port=8171, served_model_name="demo", extra_args=["--seed", "3"],
                      kv_cache_bytes=1 << 28, enforce_eager=False, enable_prefix_caching=False, shutdown_timeout_s=7)
    argv = spec.argv()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--model"] == str(tmp_path / "model") and pairs["--port"] == "8171"
    assert pairs["--served-model-name"] == "demo" and pairs["--kv-cache-memory-bytes"] == str(1 << 28)
    assert pairs["--shutdown-timeout"] == "7"
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" not in argv
    assert argv[-2:] == ["--seed", "3"]
    assert spec.model_name == "demo" and spec.base_url == "http://127.0.0.1:8171"


def test_env_defaults_strip_inherited_hook_vars_and_apply_spec_env(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINSIDECAR_HOOK_MODE", "pin")  # must not leak into an engine that did not ask for it
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    hook = HookConfig(mode="count", counts_path=tmp_path / "c.json")
    env = EngineSpec(model=model_dir(tmp_path), env={**hook.to_env(), "HF_HUB_OFFLINE": "0"}).full_env()
    assert env["PINSIDECAR_HOOK_MODE"] == "count" and env["PINSIDECAR_COUNTS_PATH"] == str(tmp_path / "c.json")
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_CACHE_ROOT"]
    assert env["HF_HUB_OFFLINE"] == "0"  # spec.env wins
    assert "PINSIDECAR_HOOK_MODE" not in EngineSpec(model=tmp_path).full_env()


def test_port_in_use_is_refused_before_starting(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert port_in_use("127.0.0.1", port)
        eng = EngineProcess(EngineSpec(model=model_dir(tmp_path), port=port, log_path=tmp_path / "e.log"))
        with pytest.raises(PortInUseError, match=f"port {port} .* already in use"):
            eng.start()
        assert eng.pid is None and not eng.alive()
    assert not port_in_use("127.0.0.1", port)


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for the engine's interpreter (it ignores the vLLM arguments)."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_boot_failure_carries_last_log_lines(tmp_path: Path) -> None:
    py = fake_python(tmp_path, "import sys\nfor i in range(50): print(f'line {i}')\n"
                               "print('ValueError: bogus model', file=sys.stderr)\nsys.exit(3)")
    eng = EngineProcess(EngineSpec(model=model_dir(tmp_path), port=free_port(), python=py,
                                   log_path=tmp_path / "e.log"))
    eng.start()
    with pytest.raises(EngineBootError) as err:
        eng.wait_ready(timeout_s=60)
    msg = str(err.value)
    assert "exited with code 3" in msg and "ValueError: bogus model" in msg and "line 49" in msg
    assert "line 5\n" not in msg + "\n"  # only the tail, not the whole log
    assert len(err.value.log_tail) == 30
    assert eng.stop() == 3


def test_stop_terminates_the_whole_process_group(tmp_path: Path) -> None:
    # The stand-in spawns a child that ignores nothing special, like vLLM's engine core, and then waits.
    py = fake_python(tmp_path, "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                               "print('serving', flush=True)\ntime.sleep(600)")
    with EngineProcess(EngineSpec(model=model_dir(tmp_path), port=free_port(), python=py)) as eng:
        assert isinstance(eng, Launcher)
        deadline = time.monotonic() + 30
        while not psutil.Process(eng.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        children = psutil.Process(eng.pid).children(recursive=True)
        assert children and eng.alive()
        code = eng.stop(timeout_s=10)
    assert code == -15  # died by our SIGTERM
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert "serving" in "\n".join(eng.last_log_lines())
    assert not os.path.exists(f"/proc/{eng.pid}")
