"""The container launcher without a container: the docker/podman argv built from config, the hook overlay's entry
point, and what the launcher does with the runtime's answers (a fake docker CLI: a missing runtime or image, a
docker daemon that is down, a container left behind). Docker cannot run on CI (no dockerd), so its path is covered
here; podman runs real containers in test_container_real.py."""

from __future__ import annotations

import importlib.metadata
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pinsidecar.engine import EngineBootError, EngineError, EngineSpec, Launcher, PortInUseError, free_port
from pinsidecar.engine.container import ContainerConfig, ContainerEngine, build_run_argv, hook_overlay
from pinsidecar.engine.launcher import EngineSetupError


@pytest.fixture
def state(tmp_path: Path) -> Path:
    s = tmp_path / "state"
    (s / "maps").mkdir(parents=True)
    return s


@pytest.fixture
def model(tmp_path: Path) -> Path:
    m = tmp_path / "models" / "flash"
    m.mkdir(parents=True)
    return m


def _spec(model: Path, state: Path, **env: str) -> EngineSpec:
    return EngineSpec(model=model, port=8000, served_model_name="flash", kv_cache_bytes=0, enforce_eager=False,
                      dtype="auto", extra_args=["--gpu-memory-utilization", "0.9"], shutdown_timeout_s=30,
                      env={"PINSIDECAR_HOOK_MODE": "pin", "PINSIDECAR_MAP_PATH": str(state / "maps" / "a.json"),
                           "PINSIDECAR_STATS_PATH": str(state / "stats.json"), **env})


def test_docker_argv(model: Path, state: Path) -> None:
    cfg = ContainerConfig(image="vllm/vllm-openai:v0.33.0", gpus="all", extra_args=["--ulimit", "memlock=-1"],
                          mounts=["/data:/data:ro"])
    argv, env = build_run_argv(_spec(model, state, SECRET="hunter2"), cfg, state, state / "hook", state / "cache")
    assert argv[:2] == ["docker", "run"]
    assert all(isinstance(a, str) for a in argv)
    joined = " ".join(argv)
    assert "--gpus all" in joined and "--network host" in joined and "--ipc host" in joined
    assert f"{model}:/model:ro" in argv
    assert f"{state / 'hook'}:/opt/pinsidecar/hook:ro" in argv
    assert f"{state}:/var/lib/pinsidecar" in argv
    assert f"{state / 'maps'}:/var/lib/pinsidecar/maps:ro" in argv
    assert f"{state / 'cache'}:/root/.cache" in argv
    assert "/data:/data:ro" in argv
    # environment by name only: values never on the command line
    env_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert "SECRET" in env_args and all("=" not in a for a in env_args)
    assert "hunter2" not in joined
    assert env["SECRET"] == "hunter2"
    assert env["PINSIDECAR_MAP_PATH"] == "/var/lib/pinsidecar/maps/a.json"  # host path -> container path
    assert env["PINSIDECAR_STATS_PATH"] == "/var/lib/pinsidecar/stats.json"
    assert env["PYTHONPATH"] == "/opt/pinsidecar/hook"
    assert env["VLLM_CACHE_ROOT"] == "/root/.cache/vllm"
    assert env["TRITON_CACHE_DIR"] == "/root/.cache/vllm/triton"  # on the cache volume: outlives the container
    # extra args before the image; the engine command after it
    image_at = argv.index(cfg.image)
    assert argv.index("--ulimit") < image_at
    assert argv[image_at - 2:image_at] == ["--entrypoint", "python3"]
    inner = argv[image_at + 1:]
    assert inner[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert inner[inner.index("--model") + 1] == "/model"
    assert inner[inner.index("--served-model-name") + 1] == "flash"
    assert "--kv-cache-memory-bytes" not in inner and "--enforce-eager" not in inner and "--dtype" not in inner
    assert inner[-2:] == ["--gpu-memory-utilization", "0.9"]


def test_podman_cdi_gpus_and_bridge_network(model: Path, state: Path) -> None:
    cfg = ContainerConfig(runtime="podman", image="img", gpus="0,1", network="bridge", ipc_host=False)
    argv, _ = build_run_argv(_spec(model, state), cfg, state, state / "hook", state / "cache")
    assert argv[0] == "podman"
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "--device"]
    assert devices == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert "--gpus" not in argv
    assert "127.0.0.1:8000:8000" in argv  # published on loopback only
    inner = argv[argv.index("img") + 1:]
    assert inner[inner.index("--host") + 1] == "0.0.0.0"  # inside the bridge
    assert "--shm-size" in argv


def test_hook_file_outside_state_dir_is_refused(model: Path, state: Path, tmp_path: Path) -> None:
    spec = _spec(model, state)
    spec.env["PINSIDECAR_MAP_PATH"] = str(tmp_path / "elsewhere.json")
    with pytest.raises(EngineError, match=r"outside the state folder"):
        build_run_argv(spec, ContainerConfig(image="img"), state, state / "hook", state / "cache")


def test_hook_overlay_registers_the_vllm_plugin(tmp_path: Path) -> None:
    overlay = hook_overlay(tmp_path / "hook")
    assert (overlay / "pinsidecar_hook" / "plugin.py").is_file()
    assert not list(overlay.rglob("__pycache__"))
    dists = list(importlib.metadata.distributions(path=[str(overlay)]))
    assert len(dists) == 1
    eps = [ep for ep in dists[0].entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [("pinsidecar_hook", "pinsidecar_hook.plugin:register")]
    hook_overlay(overlay)  # idempotent: rewriting over an existing overlay works


def test_container_engine_is_a_launcher_and_reports_runtime_problems(model: Path, state: Path) -> None:
    eng = ContainerEngine(_spec(model, state), ContainerConfig(runtime="/nonexistent/podman", image="img"), state)
    assert isinstance(eng, Launcher)
    with pytest.raises(EngineSetupError, match=r"container runtime '/nonexistent/podman' not found on PATH "
                                               r"\(install it, e.g. `apt-get install podman`"):
        eng.start()
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker CLI not installed")
    eng = ContainerEngine(_spec(model, state), ContainerConfig(runtime="docker", image="img"), state)
    try:
        eng.start()
    except EngineSetupError as exc:  # a real docker daemon: the bogus image is not there and cannot be pulled
        assert "docker pull img" in str(exc)
    except EngineError as exc:  # the usual case on CI: the real docker CLI, no daemon
        assert "container runtime 'docker' does not answer" in str(exc) and "systemctl start docker" in str(exc)
    else:
        eng.stop(5)
        pytest.fail("a container started from image 'img'")


# A stand-in for the docker CLI (its pid, 4194399, is above any pid_max: no live process has it, so liveness asks
# `inspect`): `run` prints an id, `logs --follow` writes the engine's log and marks it written,
# `inspect` says the container runs until then and exited with code 3 after.
_FAKE_RUNTIME = """
import pathlib, sys
here = pathlib.Path(sys.argv[0]).parent
args = sys.argv[1:]
if args[0] == "run":
    print("c0ffee")
elif args[0] == "logs":
    for i in range(40):
        print(f"engine line {i}")
    print("RuntimeError: CUDA out of memory", flush=True)
    (here / "logged").touch()
elif args[0] == "inspect":
    fmt = args[2]
    if "Pid" in fmt:
        print(4194399)
    elif "Running" in fmt:
        print("false" if (here / "logged").exists() else "true")
    else:
        print(3)
"""


def test_container_dying_while_booting_gives_the_log_tail(model: Path, state: Path, tmp_path: Path) -> None:
    runtime = tmp_path / "bin" / "fake-docker"
    runtime.parent.mkdir()
    runtime.write_text(f"#!{sys.executable}\n{_FAKE_RUNTIME}")
    runtime.chmod(runtime.stat().st_mode | stat.S_IEXEC)
    spec = EngineSpec(model=model, port=free_port(), log_path=tmp_path / "container.log")
    eng = ContainerEngine(spec, ContainerConfig(runtime=str(runtime), image="img"), state)
    eng.start()
    assert eng.container_id == "c0ffee" and eng.pid == 4194399
    with pytest.raises(EngineBootError) as err:
        eng.wait_ready(timeout_s=60)
    assert "container pinsidecar-engine exited with code 3 while booting" in str(err.value)
    assert err.value.log_tail[-1] == "RuntimeError: CUDA out of memory" and len(err.value.log_tail) == 30
    assert eng.returncode == 3
    eng.stop(1)


# A stand-in for the docker CLI that records its calls (calls.txt) and answers as MODE says: "down" (the docker
# daemon is not running), "noimage" (no such image, and the pull fails), "leftover" (a container of ours is there).
_SCRIPTED_DOCKER = """
import os, pathlib, sys
here = pathlib.Path(sys.argv[0]).parent
mode = (here / "MODE").read_text().strip()
args = sys.argv[1:]
with open(here / "calls.txt", "a") as fh:
    fh.write(" ".join(args[:2]) + "\\n")
if mode == "down":
    print("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
          file=sys.stderr)
    sys.exit(1)
if args[0] == "ps":
    print("deadbeef" * 8 if mode == "leftover" else "")
elif args[:2] == ["image", "inspect"]:
    if mode == "noimage":
        print("Error response from daemon: No such image: img:1", file=sys.stderr)
        sys.exit(1)
    print("sha256:1")
elif args[0] == "pull":
    print("Error response from daemon: pull access denied for img, repository does not exist", file=sys.stderr)
    sys.exit(1)
elif args[0] == "run":
    print("c0ffee")
elif args[0] == "inspect":
    print("true" if "Running" in args[2] else 4194399)
"""


@pytest.fixture
def docker(tmp_path: Path) -> Callable[[str], Path]:
    runtime = tmp_path / "bin" / "docker"
    runtime.parent.mkdir()
    runtime.write_text(f"#!{sys.executable}\n{_SCRIPTED_DOCKER}")
    runtime.chmod(runtime.stat().st_mode | stat.S_IEXEC)

    def mode(m: str) -> Path:
        (runtime.parent / "MODE").write_text(m)
        return runtime

    return mode


def _calls(runtime: Path) -> list[str]:
    path = runtime.parent / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_docker_daemon_down_is_a_clear_retryable_error(docker: Callable[[str], Path], model: Path, state: Path,
                                                       tmp_path: Path) -> None:
    runtime = docker("down")
    spec = EngineSpec(model=model, port=free_port(), log_path=tmp_path / "c.log")
    eng = ContainerEngine(spec, ContainerConfig(runtime=str(runtime), image="img:1"), state)
    with pytest.raises(EngineError, match=r"does not answer.*Cannot connect to the Docker daemon.*"
                                          r"systemctl start docker") as err:
        eng.start()
    assert not isinstance(err.value, EngineSetupError)  # dockerd may come back: the supervisor retries, bounded
    assert not any(c.startswith("run") for c in _calls(runtime))


def test_missing_image_that_cannot_be_pulled_is_a_setup_error(docker: Callable[[str], Path], model: Path,
                                                              state: Path, tmp_path: Path) -> None:
    runtime = docker("noimage")
    spec = EngineSpec(model=model, port=free_port(), log_path=tmp_path / "c.log")
    eng = ContainerEngine(spec, ContainerConfig(runtime=str(runtime), image="img:1"), state)
    with pytest.raises(EngineSetupError, match=r"'img:1' is not on this host and cannot be pulled: .*pull access "
                                               r"denied.*`.*docker pull img:1` or `.*docker load -i IMAGE.tar`"):
        eng.start()
    assert [c for c in _calls(runtime) if not c.startswith("ps")] == ["image inspect", "pull img:1"]


def test_a_leftover_container_is_removed_before_the_port_check_and_run(docker: Callable[[str], Path], model: Path,
                                                                       state: Path, tmp_path: Path) -> None:
    runtime = docker("leftover")
    spec = EngineSpec(model=model, port=free_port(), log_path=tmp_path / "c.log")
    eng = ContainerEngine(spec, ContainerConfig(runtime=str(runtime), image="img:1"), state)
    eng.start()
    calls = _calls(runtime)
    assert calls.index("rm --force") < calls.index("run --detach")
    assert calls.count("rm --force") == 1  # found by name and by label: removed once
    assert eng.container_id == "c0ffee" and eng.pid == 4194399
    eng.stop(1)


def test_port_taken_is_refused_before_the_container_runs(docker: Callable[[str], Path], model: Path, state: Path,
                                                         tmp_path: Path) -> None:
    import socket

    runtime = docker("ok")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        spec = EngineSpec(model=model, port=sock.getsockname()[1], log_path=tmp_path / "c.log")
        eng = ContainerEngine(spec, ContainerConfig(runtime=str(runtime), image="img:1"), state)
        with pytest.raises(PortInUseError, match="already in use on the host"):
            eng.start()
    assert not any(c.startswith("run") for c in _calls(runtime))
