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
- **Before the long boot, in this order:** a container left behind by a killed daemon (same name, or our label and
  state folder) is removed, so neither its name nor its port is in the way; then the host port is checked
  (:class:`~pinsidecar.engine.launcher.PortInUseError`, as the process launcher); then the image must be there or
  be pullable. A missing runtime or image raises :class:`~pinsidecar.engine.launcher.EngineSetupError`, which the
  supervisor does not retry; a runtime daemon that does not answer (docker's) is an ordinary, retried error.
- **Stop** is the runtime's ``stop --time``: the image's stop signal (SIGTERM) to the container's init (``--init``:
  catatonit/tini, which forwards it to vLLM, which drains for ``--shutdown-timeout``), SIGKILL after the timeout;
  then the container is removed, so none is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import structlog

from pinsidecar.engine.launcher import BOOT_LOG_LINES, EngineError, EngineSetupError, PortInUseError
from pinsidecar.engine.ports import port_in_use
from pinsidecar.engine.readiness import log_tail, probe_health, wait_until_ready
from pinsidecar.engine.spec import TRITON_CACHE_VAR, EngineSpec, default_dtype, triton_cache_dir
from pinsidecar.schema import ADVANCED, CHOICES

__all__ = ["ENGINE_LABEL", "ContainerConfig", "ContainerEngine", "container_path", "remove_leftover_containers"]

log = structlog.get_logger(__name__)

_CLI_TIMEOUT_S = 30.0
# A vendor vLLM image is ~10 GB: its first pull may take this long.
_PULL_TIMEOUT_S = 3600.0
# Every engine container carries these labels: what it is, and which daemon (state folder) started it.
ENGINE_LABEL = "org.pinsidecar.engine"
STATE_LABEL = "org.pinsidecar.state_dir"
# How docker and podman say "no such image" (anything else from `image inspect` means the runtime is in trouble).
_NO_IMAGE = re.compile(r"no such (image|object)|image not known|failed to find image|not found", re.IGNORECASE)
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
    # Where things appear inside the container: tuning ([container.advanced]), for an image whose layout needs it.
    model_mount: str = field(default="/model", metadata=ADVANCED)  # engine.model, mounted read-only
    hook_mount: str = field(default="/opt/pinsidecar/hook", metadata=ADVANCED)  # the hook package, on PYTHONPATH
    state_mount: str = field(default="/var/lib/pinsidecar", metadata=ADVANCED)  # maps (read-only), stats, counts
    cache_dir: Path | None = None  # host folder for compile/autotune caches; default <daemon.state_dir>/cache
    cache_mount: str = field(default="/root/.cache", metadata=ADVANCED)  # where cache_dir appears inside
    network: str = field(default="host", metadata={CHOICES: ("host", "bridge")})
    shm_size: str = field(default="16g", metadata=ADVANCED)  # /dev/shm when ipc_host is false
    ipc_host: bool = True
    extra_args: list[str] = field(default_factory=list)  # more `docker run` arguments, before the image
    mounts: list[str] = field(default_factory=list)  # more "host:container[:ro]" bind mounts


def _last_line(text: str, limit: int = 300) -> str:
    """The runtime's last message line (its error; the lines before it are progress), shortened."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][-limit:] if lines else "(no output)"


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
        raise EngineSetupError(f"{host_path} is outside the state folder {state_dir}; the container sees only that "
                               "folder (move the file under daemon.state_dir or add a mount)") from None
    return str(Path(state_mount) / rel)


def container_path(host_path: Path, cfg: ContainerConfig, state_dir: Path) -> str:
    """Where the engine in the container finds ``host_path``, a file under the state folder (a map the daemon
    asks the hook to apply in place). :class:`EngineSetupError` when the file is outside that folder."""
    return _container_path(host_path, state_dir, cfg.state_mount)


def container_env(spec: EngineSpec, cfg: ContainerConfig, state_dir: Path) -> dict[str, str]:
    """The environment inside the container: vLLM's offline defaults, the spec's env with hook paths rewritten
    to their container paths, and PYTHONPATH for the mounted hook."""
    from pinsidecar_hook.contract.env import ENV

    env = dict(_VLLM_DEFAULTS)
    env["VLLM_CACHE_ROOT"] = str(Path(cfg.cache_mount) / "vllm")
    env[TRITON_CACHE_VAR] = triton_cache_dir(env["VLLM_CACHE_ROOT"])  # on the cache volume: outlives the container
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
    # A dtype the config left to the engine is the image's vLLM's, which only the container's GPUs tell about.
    inner = dataclasses.replace(spec, model=Path(cfg.model_mount), host=host, python=cfg.python,
                                served_model_name=spec.served_model_name or str(spec.model),
                                dtype=spec.dtype or default_dtype(container_gpus=cfg.gpus)).argv()
    argv = [cfg.runtime, "run", "--detach", "--name", cfg.name, "--init",
            "--label", f"{ENGINE_LABEL}=1", "--label", f"{STATE_LABEL}={state_dir}",
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


def run_cli(runtime: str, *args: str, check: bool = True, timeout: float = _CLI_TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``runtime ARGS`` (never through a shell). A missing runtime is an :class:`EngineSetupError`; one that
    hangs, or fails when ``check``, an :class:`EngineError` with its message."""
    argv = [runtime, *args]
    full_env = {**os.environ, **(env or {})}
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise EngineSetupError(f"container runtime {runtime!r} not found on PATH (install it, e.g. "
                               f"`apt-get install {Path(runtime).name}`, or set container.runtime)") from None
    except subprocess.TimeoutExpired:
        raise EngineError(f"`{' '.join(argv[:3])}` did not answer in {timeout:.0f} s "
                          f"(is the {runtime} daemon healthy?)") from None
    if check and res.returncode != 0:
        raise EngineError(f"`{' '.join(argv[:3])}` failed ({res.returncode}): "
                          f"{(res.stderr or res.stdout).strip()[-500:]}")
    return res


def runtime_trouble(runtime: str, res: subprocess.CompletedProcess[str]) -> str:
    """What to tell the operator when the runtime answers a harmless query with an error (docker: no daemon)."""
    hint = ("is the docker daemon running? `systemctl start docker`, and the daemon's user in the `docker` group"
            if Path(runtime).name == "docker" else f"check `{runtime} info`")
    return (f"container runtime {runtime!r} does not answer ({res.returncode}): "
            f"{_last_line(res.stderr or res.stdout)} ({hint})")


def remove_leftover_containers(cfg: ContainerConfig, state_dir: Path) -> list[str]:
    """Remove engine containers a killed daemon left behind: the one holding ``cfg.name``, and any other with our
    label and ``state_dir``. They hold the name, the port and maybe the GPUs; their engine is not ours to adopt
    (its map and arguments are unknown), so it is removed, not reused. The daemon calls this when it starts
    (before it checks its ports) and every boot calls it before ``run``. Returns the ids removed."""
    found: set[str] = set()
    for filt in (f"name=^{re.escape(cfg.name)}$", f"label={STATE_LABEL}={Path(state_dir)}"):
        res = run_cli(cfg.runtime, "ps", "--all", "--quiet", "--no-trunc", "--filter", filt, check=False)
        if res.returncode == 0:
            found.update(line.strip() for line in res.stdout.splitlines() if line.strip())
        elif filt.startswith("name="):  # the runtime is in trouble: say so now, not after a failed `run`
            raise EngineError(runtime_trouble(cfg.runtime, res))
    for cid in sorted(found):
        log.warning("container_leftover_removed", container=cid[:12], name=cfg.name,
                    hint="an engine container from an earlier daemon run was still there; removed")
        run_cli(cfg.runtime, "rm", "--force", cid, check=False, timeout=120.0)
    return sorted(found)


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
        self._pid_started: float | None = None
        self._follower: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    # ------------------------------------------------------------------------------------------------ helpers

    def _cli(self, *args: str, check: bool = True, timeout: float = _CLI_TIMEOUT_S,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_cli(self.cfg.runtime, *args, check=check, timeout=timeout, env=env)

    def remove_leftovers(self) -> list[str]:
        """Remove engine containers a killed daemon left behind (:func:`remove_leftover_containers`)."""
        return remove_leftover_containers(self.cfg, self.state_dir)

    def ensure_image(self) -> None:
        """The image must be present or pullable before the boot. No image (and no pull) cannot be retried
        away: :class:`EngineSetupError`."""
        image = self.cfg.image
        res = self._cli("image", "inspect", "--format", "{{.Id}}", image, check=False)
        if res.returncode == 0:
            return
        if not _NO_IMAGE.search(res.stderr or res.stdout):
            raise EngineError(runtime_trouble(self.cfg.runtime, res))
        log.info("container_image_pull", image=image)
        pulled = self._cli("pull", image, check=False, timeout=_PULL_TIMEOUT_S)
        if pulled.returncode != 0:
            raise EngineSetupError(
                f"container image {image!r} is not on this host and cannot be pulled: "
                f"{_last_line(pulled.stderr or pulled.stdout)} (pull or load it first: `{self.cfg.runtime} "
                f"pull {image}` or `{self.cfg.runtime} load -i IMAGE.tar`, or fix container.image)")

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
        self.remove_leftovers()
        if port_in_use(self.spec.host, self.spec.port):
            raise PortInUseError(
                f"port {self.spec.port} on {self.spec.host} is already in use on the host; stop whatever listens "
                f"there (`ss -ltnp 'sport = :{self.spec.port}'`) or pick another engine.port")
        self.ensure_image()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        hook_overlay(self.hook_dir)
        argv, env = build_run_argv(self.spec, self.cfg, self.state_dir, self.hook_dir, self.cache_dir)
        log.info("container_start", argv=argv, log=str(self.log_path))
        res = self._cli(*argv[1:], env=env, timeout=120.0)
        self.container_id = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else self.cfg.name
        pid = self._inspect("{{.State.Pid}}")
        self._pid = int(pid) if pid and pid.isdigit() and int(pid) > 0 else None
        with contextlib.suppress(psutil.Error, TypeError):  # not visible here (a remote runtime): inspect only
            self._pid_started = psutil.Process(self._pid).create_time()  # type: ignore[arg-type]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path, "ab")  # noqa: SIM115 - handed to the follower process
        try:
            self._follower = subprocess.Popen([self.cfg.runtime, "logs", "--follow", self.container_id],
                                              stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT)
        finally:
            fh.close()

    def alive(self) -> bool:
        """The container runs. While its init process (``pid``, with the start time seen at ``start``) lives, that
        is the answer, without a runtime call: ``wait_ready`` asks twice a second, and a ``podman inspect`` each
        time costs a 2-core box a quarter of a core. Once it is gone the runtime confirms. A runtime that does not
        answer in time (a busy box, a restarting dockerd) says nothing about the engine: it counts as alive, and
        ``/health`` decides (the supervisor checks both)."""
        if self._pid is not None and self._pid_started is not None:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(self._pid)
                if abs(proc.create_time() - self._pid_started) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                    return True
        try:
            return self._inspect("{{.State.Running}}") == "true"
        except EngineError as exc:
            log.warning("container_inspect_failed", container=self.cfg.name, error=str(exc))
            return True

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
