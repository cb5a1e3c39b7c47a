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
import dataclasses
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pinsidecar.engine.launcher import BOOT_LOG_LINES, EngineError
from pinsidecar.engine.readiness import log_tail, probe_health, wait_until_ready
from pinsidecar.engine.spec import EngineSpec
from pinsidecar.schema import CHOICES

__all__ = ["ContainerConfig", "ContainerEngine", "build_run_argv", "container_env", "hook_overlay"]

log = structlog.get_logger(__name__)

_CLI_TIMEOUT_S = 30.0
# Variables from the engine environment that a container needs; the host's own PATH, HOME etc. stay outside.
_VLLM_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                  "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class ContainerConfig:
    """The ``[container]`` table (with ``engine.launcher = "container"``): docker or podman, driven through its
    CLI. Validated by :mod:`pinsidecar.schema` like every table."""

    runtime: str = field(default="docker", metadata={CHOICES: ("docker", "podman")})
    image: str = ""  # e.g. "vllm/vllm-openai:v0.33.0" (required for the container launcher)
    name: str = "pinsidecar-engine"
    gpus: str = "all"  # "all", "0", "0,1" (docker --gpus / podman CDI nvidia.com/gpu=...); "" = no GPU
    python: str = "python3"  # the interpreter inside the image
    model_mount: str = "/model"  # where engine.model is mounted (read-only) inside the container
    hook_mount: str = "/opt/pinsidecar/hook"  # where the hook package is mounted and put on PYTHONPATH
    state_mount: str = "/var/lib/pinsidecar"  # maps (read-only), stats and counts live under here
    cache_dir: Path | None = None  # host folder for compile/autotune caches; default <daemon.state_dir>/cache
    cache_mount: str = "/root/.cache"
    network: str = field(default="host", metadata={CHOICES: ("host", "bridge")})
    shm_size: str = "16g"
    ipc_host: bool = True
    extra_args: list[str] = field(default_factory=list)  # more `docker run` arguments, before the image
    mounts: list[str] = field(default_factory=list)  # more "host:container[:ro]" bind mounts


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
    # The same engine, as seen from inside: the model at its mount, the image's interpreter, and the host model
    # path as the served name (so clients use the same name under either launcher).
    inner = dataclasses.replace(spec, model=Path(cfg.model_mount), host=host, python=cfg.python,
                                served_model_name=spec.served_model_name or str(spec.model)).argv()
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
        """Block until the container's engine serves a real generation; return the seconds waited."""
        if self.container_id is None:
            raise EngineError("wait_ready() before start()")

        def exited() -> str | None:
            if self.alive():
                return None
            code = self._inspect("{{.State.ExitCode}}")
            self.returncode = int(code) if code and code.lstrip("-").isdigit() else None
            return f"container {self.cfg.name} exited with code {code} while booting"

        return wait_until_ready(self.base_url, self.spec.model_name, timeout_s, exited=exited,
                                log_path=self.log_path, what="container")

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
        return log_tail(self.log_path, n)

    def __repr__(self) -> str:
        return f"ContainerEngine(image={self.cfg.image}, name={self.cfg.name}, url={self.base_url})"
