"""A real ``pinsidecar run`` daemon for the engine tests: its config built from one base with overrides, the
process started and stopped, its status polled, and its log where a failure can be read.

Every engine test that needs the daemon needs the same things: a config for the CPU lane (engine, gate, control,
metrics, maps, state folder) with a few keys changed for what the test is about, the daemon as systemd runs it
(its own process and session, its log in a file), a wait for its engine to serve, and a stop that leaves nothing
running. Written out in each module they drifted (one waited on systemd's READY, one on the status, one swallowed
a dead daemon until its limit passed); here they are once, on the demo's own pieces:

- the config is :func:`~pinsidecar.demo.sidecar.daemon_tables` (or, with ``base="demo"``, the demo's whole config,
  :func:`~pinsidecar.demo.sidecar.demo_tables`) with :data:`TEST_CHANGES` over it (a supervisor that notices and
  restarts within seconds), then the test's ``overrides`` (table -> keys; a key set to None gets the daemon's
  default back);
- the process is :class:`~pinsidecar.demo.sidecar.Sidecar`: started with ``env`` over this one's, stopped with
  SIGTERM, SIGKILL after a bound, then the engines the daemon recorded (by pid and start time);
- :meth:`DaemonUnderTest.wait_status` polls ``GET /status`` (:func:`~pinsidecar.testing.wait.wait_until`) until a
  predicate holds, failing at once when the daemon exits or its engine has failed for good, and saying on failure
  what it waited for, the last status and the tail of the daemon's log.

The pytest plugin :mod:`pinsidecar.testing.fixtures` attaches the log of every daemon started here that ran during
a failed test to that test's report (:func:`daemon_logs_for_report`). Imports without pytest.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from pinsidecar.demo.sidecar import (
    BOOT_TIMEOUT_S,
    SERVED_MODEL_NAME,
    STOP_TIMEOUT_S,
    DemoPorts,
    Sidecar,
    daemon_tables,
    demo_tables,
    dump_toml,
    merge_tables,
    pinsidecar_argv,
)
from pinsidecar.testing.wait import wait_until

__all__: list[str] = []  # nothing here is another package's business

# A boot on a loaded 2-core CI box can take minutes (the demo's bound, pinsidecar.demo.sidecar.BOOT_TIMEOUT_S).
BOOT_LIMIT_S = BOOT_TIMEOUT_S
# The tests' changes to the base tables: a supervisor that notices a dead or hung engine and restarts it within
# seconds (the defaults take up to a minute between restarts), a crash-loop limit a fault test can still reach,
# and a gate queue small enough that a test overrunning it would show.
TEST_CHANGES: dict[str, dict[str, Any]] = {
    "supervisor": {"health_interval_s": 1, "health_failures": 3, "backoff_initial_s": 1, "backoff_max_s": 5,
                   "crash_loop_limit": 3},
    "gate": {"max_queue": 64},
}
# What a drain-reboot's answer says that its figure reports.
DRAIN_REBOOT_FIGURES = ("seconds", "drain_s", "boot_s", "in_flight_cut", "hold_s", "held_at_release", "hash_hit")
LOG_TAIL_LINES = 40
STATUS_CHARS = 3000  # of the last status, in a failure message: enough to see the engine and remap state

_started: weakref.WeakSet[DaemonUnderTest] = weakref.WeakSet()


@dataclass(eq=False)
class DaemonUnderTest:
    """One daemon, in ``tmp`` (config ``pinsidecar.toml``, state folder ``state/``, one log per start). ``map_path``
    boots pin mode on that map (its folder is the maps library); ``overrides`` change the config (see the module
    docstring); ``env`` goes over this process's environment for the daemon. Unless ``own_compile_cache`` is off,
    the engine compiles into ``tmp/vllm-cache`` (never a user's cache; the module's reboots onto the same geometry
    still hit it). Start it again after :meth:`stop` or :meth:`kill`: the config is written anew, from the
    current ``overrides``, and the log is a new file."""

    tmp: Path
    model_dir: Path
    map_path: Path | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    ports: DemoPorts = field(default_factory=DemoPorts.free)
    base: Literal["test", "demo"] = "test"
    own_compile_cache: bool = True
    limit_s: float = BOOT_LIMIT_S
    sidecar: Sidecar | None = field(default=None, init=False)
    starts: int = field(default=0, init=False)
    started_at: float = field(default=0.0, init=False)  # time.monotonic() at the last start
    stopped_at: float | None = field(default=None, init=False)  # time.time() at the last stop (for the report)

    # ------------------------------------------------------------------------------------------------ config
    def doc(self) -> dict[str, dict[str, Any]]:
        """The config as tables: the base, :data:`TEST_CHANGES` (not over the demo's), then ``overrides``."""
        if self.base == "demo":
            if self.map_path is None:
                raise ValueError("the demo's config serves a map: give map_path")
            return merge_tables(demo_tables(model_dir=self.model_dir, map_path=self.map_path, run_dir=self.tmp,
                                            ports=self.ports), self.overrides)
        doc = daemon_tables(model_dir=self.model_dir, run_dir=self.tmp, ports=self.ports, map_path=self.map_path)
        return merge_tables(merge_tables(doc, TEST_CHANGES), self.overrides)

    @property
    def config_path(self) -> Path:
        return self.tmp / "pinsidecar.toml"

    def write_config(self) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(dump_toml(self.doc()), encoding="utf-8")
        return self.config_path

    @property
    def state_dir(self) -> Path:
        return Path(self.doc()["daemon"]["state_dir"])

    @property
    def token_file(self) -> Path:
        return Path(self.doc()["control"]["token_file"])

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def gate_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gate}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.control}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    # ------------------------------------------------------------------------------------------------ process
    def start(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Write the config, start ``pinsidecar run`` and (unless ``wait`` is off) wait until its engine serves;
        returns that status."""
        config = self.write_config()
        env = dict(self.env)
        if self.own_compile_cache:
            env.setdefault("VLLM_CACHE_ROOT", str(self.tmp / "vllm-cache"))
        self.starts += 1
        self.sidecar = Sidecar(config, state_dir=self.state_dir, control_port=self.ports.control,
                               log_path=self.tmp / f"daemon-{self.starts}.log", env=env)
        self.started_at, self.stopped_at = time.monotonic(), None
        _started.add(self)
        self.sidecar.start()
        return self.wait_ready() if wait else None

    def __enter__(self) -> DaemonUnderTest:
        """Started and serving; stopped on the way out (and if the start fails)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.sidecar is not None and self.sidecar.proc is not None, "the daemon was never started"
        return self.sidecar.proc

    def alive(self) -> bool:
        return self.sidecar is not None and self.sidecar.alive()

    def exited(self) -> str | None:
        """Why waiting on this daemon is pointless (it exited, with its code), or None while it runs."""
        if self.sidecar is None:
            return "the daemon was never started"
        return None if self.sidecar.alive() else f"the daemon exited ({self.sidecar.exit_code})"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """SIGTERM (the daemon drains and stops its engine), SIGKILL after ``timeout_s``, then any engine it
        recorded and left; what happened (:meth:`Sidecar.stop`). Safe to call twice."""
        if self.sidecar is None:
            return {}
        out = self.sidecar.stop(timeout_s)
        self.stopped_at = time.time()
        return out

    def kill(self) -> None:
        """SIGKILL the daemon alone, as the OOM killer would: its engines (their own process groups) live on."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.stopped_at = time.time()

    @property
    def log_path(self) -> Path:
        assert self.sidecar is not None, "the daemon was never started"
        return self.sidecar.log_path

    def log_text(self) -> str:
        """The log of the current start (each start writes its own)."""
        return self.log_path.read_text(errors="replace") if self.sidecar is not None else ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.sidecar.log_tail(lines)) if self.sidecar is not None else ""

    # ------------------------------------------------------------------------------------------------ reading
    def status_or_none(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """``GET /status``, or None while the daemon does not answer."""
        return self.sidecar.status(timeout_s) if self.sidecar is not None else None

    def status(self) -> dict[str, Any]:
        """``GET /status``; a daemon that does not answer is a failure, with its log's tail."""
        st = self.status_or_none()
        if st is None:
            raise AssertionError(f"the daemon does not answer /status ({self.exited() or 'running'}):\n"
                                 + self.log_tail())
        return st

    def engine(self) -> dict[str, Any]:
        return self.status()["engine"]

    def wait_status(self, pred: Callable[[dict[str, Any]], Any], what: str, limit_s: float | None = None, *,
                    step_s: float = 0.2) -> dict[str, Any]:
        """Poll the status until ``pred(status)`` holds, and return that status. Fails at once when the daemon
        exits or reports its engine ``failed`` (the supervisor gave up: nothing will change), and after
        ``limit_s`` (default: a boot's bound); the failure says ``what``, the last status and the log's tail."""
        seen: dict[str, Any] = {}

        def holds() -> dict[str, Any] | None:
            st = self.status_or_none()
            if st is None:
                return None
            seen["status"] = st
            return st if pred(st) else None

        def gone() -> str | None:
            engine = (seen.get("status") or {}).get("engine") or {}
            if engine.get("state") == "failed":
                return f"the engine failed ({engine.get('detail')})"
            return self.exited()

        def detail() -> str:
            last = json.dumps(seen.get("status"), default=str)
            if len(last) > STATUS_CHARS:
                last = last[:STATUS_CHARS] + " ..."
            return f"last status: {last}\ndaemon log {self.log_path} ends:\n{self.log_tail()}"

        return wait_until(holds, what, self.limit_s if limit_s is None else limit_s, step_s=step_s,
                          ignore=(KeyError, TypeError), gone=gone, detail=detail)

    def seconds_until_status(self, pred: Callable[[dict[str, Any]], Any], what: str,
                             limit_s: float | None = None) -> float:
        """:meth:`wait_status`, returning how long it took (a test's figure: "the kill was noticed in 1.2 s")."""
        t0 = time.monotonic()
        self.wait_status(pred, what, limit_s)
        return time.monotonic() - t0

    def wait_for(self, pred: Callable[[], Any], what: str, limit_s: float | None = None, *,
                 step_s: float = 0.2) -> Any:
        """Poll any other condition (a Prometheus alert, systemd's READY, a file) while the daemon runs: a daemon
        that exits ends the wait at once, and the failure carries its log's tail. Returns ``pred``'s value."""
        return wait_until(pred, what, self.limit_s if limit_s is None else limit_s, step_s=step_s, gone=self.exited,
                          detail=lambda: f"daemon log {self.log_path} ends:\n{self.log_tail()}")

    def wait_ready(self, what: str = "the engine ready behind the daemon",
                   limit_s: float | None = None) -> dict[str, Any]:
        return self.wait_status(lambda s: s["engine"]["state"] == "ready", what, limit_s)

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=30).text

    # ------------------------------------------------------------------------------------------------ acting
    def control(self, timeout_s: float | None = None) -> httpx.Client:
        """A client of the control API with the daemon's bearer token (close it, or use it in ``with``)."""
        return httpx.Client(base_url=self.control_url, timeout=self.limit_s if timeout_s is None else timeout_s,
                            headers={"Authorization": f"Bearer {self.token}"})

    def cli(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """``pinsidecar ARGS --config <this daemon's config>``, as an operator would run it."""
        return subprocess.run([*pinsidecar_argv(), *args, "--config", str(self.config_path)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, **self.env})

    async def drain_reboot_cli(self, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """``pinsidecar drain-reboot --json ARGS`` through the real CLI, from a coroutine (so that clients keep
        streaming meanwhile, :func:`~pinsidecar.testing.streaming.load_during`); its JSON answer, or a failure
        with its output when it exits non-zero."""
        proc = await asyncio.create_subprocess_exec(
            *pinsidecar_argv(), "drain-reboot", "--config", str(self.config_path), "--timeout", f"{timeout_s:g}",
            "--json", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, (out.decode(), err.decode())
        doc: dict[str, Any] = json.loads(out)
        return doc

    def complete(self, prompt: str = "def f(", max_tokens: int = 4, timeout: float | None = None) -> httpx.Response:
        """One completion through the gate (a held request waits out a reboot: the timeout is a boot's bound)."""
        return httpx.post(f"{self.gate_url}/v1/completions", timeout=self.limit_s if timeout is None else timeout,
                          json={"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens})


def drain_reboot_figure(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of a drain-reboot's answer that a test reports (how long, how long held, how many cut)."""
    return {k: result.get(k) for k in DRAIN_REBOOT_FIGURES}


def daemon_logs_for_report(since: float, lines: int = 60) -> list[tuple[str, str]]:
    """``(title, log tail)`` of every daemon started here that ran at some point since ``since`` (``time.time()``):
    what a failed test's report shows of the daemons it used."""
    out = []
    for d in list(_started):
        if d.sidecar is None or (d.stopped_at is not None and d.stopped_at < since):
            continue
        out.append((f"daemon log {d.log_path} (last {lines} lines)", d.log_tail(lines)))
    return out
