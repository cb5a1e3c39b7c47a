"""The container launcher: the same :class:`~pinsidecar.engine.EngineSpec`, run by docker or podman.

A GPU box usually serves from a vendor image that cannot be rebuilt, so the hook is bind-mounted into it and put
on ``PYTHONPATH`` with a tiny ``dist-info`` folder next to it whose ``entry_points.txt`` registers the
``vllm.general_plugins`` entry point (``importlib.metadata`` finds distributions on any ``sys.path`` entry, so
vLLM's ``load_general_plugins`` loads the hook exactly as it would from an installed wheel).

What it guarantees, mirroring :class:`~pinsidecar.engine.EngineProcess`:

- **Argument lists, never a shell.** Every ``docker run`` argument comes from config as a list element.
- **Environment by name only.** Variables are passed as ``-e NAME`` (no value on the command line, so nothing
  shows in ``ps``); the value comes from the CLI's own environment, which we set. Only the spec's environment and
  vLLM's offline defaults go in, never the daemon's whole environment.
- **Mounts:** the model (read-only), the hook (read-only), the state folder (maps, stats, counts) and a cache folder
  for the compile / autotune caches, so a reboot with a new map of the same geometry hits them.
- **GPU flags** per runtime: docker ``--gpus``, podman CDI ``--device nvidia.com/gpu=...``.
- The container runs detached under a fixed name; its logs are followed into ``spec.log_path``; ``pid`` is the
  container's init pid on the host (what the metrics use to find its cgroup).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx
import structlog

from pinsidecar.daemon.config import ContainerConfig
from pinsidecar.engine.process import (
    BOOT_LOG_LINES,
    EngineBootError,
    EngineError,
    EngineSpec,
    probe_health,
    probe_ready,
)

__all__ = ["ContainerEngine", "build_run_argv", "hook_overlay"]

log = structlog.get_logger(__name__)

_CLI_TIMEOUT_S = 30.0
_POLL_S = 0.5
# Variables from the engine environment that a container needs; the host's own PATH, HOME etc. stay outside.
_VLLM_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                  "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


def hook_overlay(dest: Path) -> Path:
    """Write the folder that is bind-mounted into the container: a copy of ``pinsidecar_hook/`` (a copy, not a
    symlink, because a symlink would point outside the mount) plus ``pinsidecar_hook-<v>.dist-info/`` with the
    entry point. Returns ``dest``."""
    import shutil

    import pinsidecar_hook

    src = Path(pinsidecar_hook.__file__).parent
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "pinsidecar_hook"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    info = dest / "pinsidecar_hook-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pinsidecar-hook\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\npinsidecar_hook = pinsidecar_hook.plugin:register\n")
    return dest


def _container_path(host_path: Path, state_dir: Path, state_mount: str) -> str:
    """Where a host path under the state folder appears inside the container."""
    try:
        rel = Path(host_path).resolve().relative_to(state_dir.resolve())
    except ValueError:
        raise EngineError(f"{host_path} is outside the state folder {state_dir}; the container sees only that "
                          "folder (move the file under daemon.state_dir or add a mount)") from None
    return str(Path(state_mount) / rel)


def container_env(spec: EngineSpec, cfg: ContainerConfig, state_dir: Path) -> dict[str, str]:
    """The environment inside the container: vLLM's offline defaults, the spec's env with hook paths rewritten
    to their container paths, and PYTHONPATH for the mounted hook."""
    from pinsidecar_hook.contract.env import ENV

    env = dict(_VLLM_DEFAULTS)
    env["VLLM_CACHE_ROOT"] = str(Path(cfg.cache_mount) / "vllm")
    path_vars = {ENV["counts_path"], ENV["map_path"], ENV["stats_path"]}
    for k, v in spec.env.items():
        env[k] = _container_path(Path(v), state_dir, cfg.state_mount) if k in path_vars else v
    env["PYTHONPATH"] = cfg.hook_mount + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def build_run_argv(spec: EngineSpec, cfg: ContainerConfig, state_dir: Path, hook_dir: Path,
                   cache_dir: Path) -> tuple[list[str], dict[str, str]]:
    """``docker run`` / ``podman run`` argv for ``spec`` and the environment the CLI must run with (values of
    the ``-e NAME`` variables). Pure: no runtime is called."""
    env = container_env(spec, cfg, state_dir)
    host = "0.0.0.0" if cfg.network == "bridge" else spec.host  # inside a bridge, loopback is unreachable
    inner = EngineSpec(
        model=Path(cfg.model_mount), host=host, port=spec.port, served_model_name=spec.served_model_name
        or str(spec.model), extra_args=spec.extra_args, python=cfg.python, kv_cache_bytes=spec.kv_cache_bytes,
        enforce_eager=spec.enforce_eager, max_model_len=spec.max_model_len,
        enable_prefix_caching=spec.enable_prefix_caching, shutdown_timeout_s=spec.shutdown_timeout_s,
        dtype=spec.dtype,
    ).argv()
    argv = [cfg.runtime, "run", "--detach", "--name", cfg.name, "--init",
            "--label", "org.pinsidecar.engine=1",
            "--stop-timeout", str(max(1, int(spec.shutdown_timeout_s) + 10))]
    if cfg.gpus:
        if cfg.runtime == "docker":
            argv += ["--gpus", cfg.gpus if cfg.gpus == "all" else f"device={cfg.gpus}"]
        else:
            for dev in (["all"] if cfg.gpus == "all" else cfg.gpus.split(",")):
                argv += ["--device", f"nvidia.com/gpu={dev.strip()}"]
    if cfg.network == "host":
        argv += ["--network", "host"]
    else:
        bind = "127.0.0.1" if spec.host in ("127.0.0.1", "localhost") else spec.host
        argv += ["--publish", f"{bind}:{spec.port}:{spec.port}"]
    if cfg.ipc_host:
        argv += ["--ipc", "host"]
    elif cfg.shm_size:
        argv += ["--shm-size", cfg.shm_size]
    argv += [
        "--volume", f"{Path(spec.model).resolve()}:{cfg.model_mount}:ro",
        "--volume", f"{hook_dir}:{cfg.hook_mount}:ro",
        "--volume", f"{state_dir}:{cfg.state_mount}",
        "--volume", f"{cache_dir}:{cfg.cache_mount}",
    ]
    maps_dir = state_dir / "maps"
    if maps_dir.is_dir():  # maps are read-only to the engine even though the state folder is not
        argv += ["--volume", f"{maps_dir}:{cfg.state_mount}/maps:ro"]
    for m in cfg.mounts:
        argv += ["--volume", m]
    for k in sorted(env):
        argv += ["--env", k]
    argv += list(cfg.extra_args)
    argv += ["--entrypoint", inner[0], cfg.image, *inner[1:]]
    return argv, env


class ContainerEngine:
    """One vLLM server in a container; implements :class:`~pinsidecar.engine.Launcher`."""

    def __init__(self, spec: EngineSpec, cfg: ContainerConfig, state_dir: Path) -> None:
        self.spec = spec
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.cache_dir = cfg.cache_dir or self.state_dir / "cache"
        self.hook_dir = self.state_dir / "hook"
        self.log_path: Path = spec.log_path or Path(
            tempfile.mkstemp(prefix=f"pinsidecar-container-{spec.port}-", suffix=".log")[1])
        self.container_id: str | None = None
        self._pid: int | None = None
        self._follower: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    # ------------------------------------------------------------------------------------------------ helpers

    def _cli(self, *args: str, check: bool = True, timeout: float = _CLI_TIMEOUT_S,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        argv = [self.cfg.runtime, *args]
        full_env = {**os.environ, **(env or {})}
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env,
                                 stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise EngineError(f"container runtime {self.cfg.runtime!r} not found on PATH "
                              "(install it or set container.runtime)") from None
        except subprocess.TimeoutExpired:
            raise EngineError(f"`{' '.join(argv[:3])}` did not answer in {timeout:.0f} s "
                              f"(is the {self.cfg.runtime} daemon healthy?)") from None
        if check and res.returncode != 0:
            raise EngineError(f"`{' '.join(argv[:3])}` failed ({res.returncode}): "
                              f"{(res.stderr or res.stdout).strip()[-500:]}")
        return res

    def _inspect(self, fmt: str) -> str | None:
        ref = self.container_id or self.cfg.name
        res = self._cli("inspect", "--format", fmt, ref, check=False)
        return res.stdout.strip() if res.returncode == 0 else None

    # ------------------------------------------------------------------------------------------------ protocol

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def start(self) -> None:
        if self.container_id is not None:
            raise EngineError(f"container {self.cfg.name} was already started ({self.container_id[:12]})")
        if not Path(self.spec.model).exists():
            raise EngineError(f"model directory {self.spec.model} does not exist (pass a model folder)")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        hook_overlay(self.hook_dir)
        # A container left over from a crashed daemon holds the name (and maybe the GPU): remove it first.
        self._cli("rm", "--force", self.cfg.name, check=False)
        argv, env = build_run_argv(self.spec, self.cfg, self.state_dir, self.hook_dir, self.cache_dir)
        log.info("container_start", argv=argv, log=str(self.log_path))
        res = self._cli(*argv[1:], env=env, timeout=300.0)  # the first run may pull the image
        self.container_id = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else self.cfg.name
        pid = self._inspect("{{.State.Pid}}")
        self._pid = int(pid) if pid and pid.isdigit() and int(pid) > 0 else None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path, "ab")  # noqa: SIM115 - handed to the follower process
        try:
            self._follower = subprocess.Popen([self.cfg.runtime, "logs", "--follow", self.container_id],
                                              stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT)
        finally:
            fh.close()

    def alive(self) -> bool:
        return self._inspect("{{.State.Running}}") == "true"

    def health(self) -> bool:
        return probe_health(self.base_url)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        if self.container_id is None:
            raise EngineError("wait_ready() before start()")
        t0 = time.monotonic()
        last_problem = "no answer yet"
        with httpx.Client(timeout=30.0) as client:
            while True:
                if not self.alive():
                    code = self._inspect("{{.State.ExitCode}}")
                    self.returncode = int(code) if code and code.lstrip("-").isdigit() else None
                    raise EngineBootError(f"container {self.cfg.name} exited with code {code} while booting",
                                          self.last_log_lines(BOOT_LOG_LINES), self.log_path)
                ok, last_problem = probe_ready(client, self.base_url, self.spec.model_name)
                if ok:
                    return time.monotonic() - t0
                if time.monotonic() - t0 >= timeout_s:
                    raise EngineBootError(f"container not ready after {timeout_s:.0f} s ({last_problem})",
                                          self.last_log_lines(BOOT_LOG_LINES), self.log_path)
                time.sleep(_POLL_S)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.container_id is None:
            return None
        self._cli("stop", "--time", str(max(1, int(timeout_s))), self.container_id, check=False,
                  timeout=timeout_s + _CLI_TIMEOUT_S)
        code = self._inspect("{{.State.ExitCode}}")
        self.returncode = int(code) if code and code.lstrip("-").isdigit() else None
        self._cli("rm", "--force", self.container_id, check=False)
        if self._follower is not None:
            with contextlib.suppress(OSError):
                self._follower.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._follower.wait(timeout=5)
            self._follower = None
        return self.returncode

    def last_log_lines(self, n: int = BOOT_LOG_LINES) -> list[str]:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                tail = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        lines: deque[str] = deque(maxlen=n)
        for line in tail.splitlines():
            if line.strip():
                lines.append(line.rstrip())
        return list(lines)

    def __repr__(self) -> str:
        return f"ContainerEngine(image={self.cfg.image}, name={self.cfg.name}, url={self.base_url})"
