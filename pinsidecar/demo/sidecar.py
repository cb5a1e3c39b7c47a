"""The demo's sidecar: a daemon config written for the demo, ``pinsidecar run`` as a child process, and its stop.

The demo runs the daemon exactly as systemd would (``pinsidecar run --config FILE``, a process of its own, JSON
logs to a file), not an in-process imitation, so what the demo shows is what a deployment does. This module owns
that process from start to stop:

- :func:`demo_config` writes the daemon's TOML for the demo: the vLLM CPU engine on the demo model in pin mode with
  the demo's first map, the gate capturing requests (the remap's count boot replays them), small drift windows, the
  count engine on a core of its own. Every number in it is a named constant below, with where it comes from. It is
  :func:`demo_tables` written out, which is :func:`daemon_tables` (the tables any daemon on the CPU lane needs,
  which the tests' daemons start from too: :mod:`pinsidecar.testing.daemon`) plus the demo's own;
- :class:`DemoPorts` picks the five ports (engine, gate, control, metrics, count engine): the usual ones, or a
  free one where the usual one is taken (:meth:`DemoPorts.free`: five free ones);
- :class:`Sidecar` starts the process and reads ``GET /status``; :meth:`Sidecar.stop` always leaves nothing
  running: SIGTERM (the daemon drains and stops its engine), SIGKILL after a bound, then the engines recorded in
  the state folder's pid files (:func:`~pinsidecar.engine.process.stop_recorded_engine`, the daemon's own crash
  cleanup: by recorded pid and start time, never by name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pinsidecar.daemon.config import laid_out
from pinsidecar.engine import free_port, port_in_use
from pinsidecar.engine.spec import VLLM_TABLE
from pinsidecar.schema import ADVANCED_TABLE, toml_value

__all__ = ["DemoPorts", "Sidecar", "daemon_tables", "demo_tables", "dump_toml", "merge_tables",
           "pinsidecar_argv"]

SERVED_MODEL_NAME = "demo"
# A CPU engine boot takes 15-25 s on an idle 2-core box; a box shared with other work (CI, other users) was seen
# to take several minutes. A boot slower than this is a failure.
BOOT_TIMEOUT_S = 900.0
# Drift windows: 512 routed tokens is ~9 prose or ~7 code requests of the demo, so a window closes every few
# seconds under the demo's clients; at 512 a window still places the demo's hot set well enough for the out-of-
# sample gain to stay under the trip level on stationary traffic (pinsidecar.drift.config; the default 1024 only
# makes the demo slower). Half of it is the least a window needs to be judged.
WINDOW_TOKENS = 512
MIN_TOKENS = 256
# The captured requests a remap counts: the newest ones. Fewer than the prose requests sent between the shift and
# the trip (at least ~2 windows of prose, ~18 requests, more at the demo's throughput), so the count boot counts
# the new traffic only and never a blend with the old.
CAPTURE_REQUESTS = 24
# One remap in the demo: a cooldown longer than the demo keeps a second trip from starting another.
COOLDOWN_S = 3600
# After the reboot the live cold rate is verified over this many routed tokens (about one window).
VERIFY_TOKENS = 512
VERIFY_TIMEOUT_S = 600.0
# How long a held request may wait in the gate: longer than a drain plus a reboot on a loaded box.
MAX_HOLD_S = BOOT_TIMEOUT_S
# How long the daemon gets to stop on SIGTERM (drain, stop the engine) before it is killed.
STOP_TIMEOUT_S = 120.0
# The usual ports (pinsidecar/examples/cpu-demo.toml); the count engine: engine port + 100.
USUAL_PORTS = {"engine": 8000, "gate": 8080, "control": 8090, "metrics": 9108}
COUNT_PORT_OFFSET = 100


@dataclass(frozen=True)
class DemoPorts:
    engine: int
    gate: int
    control: int
    metrics: int
    count: int

    @classmethod
    def pick(cls, engine: int = USUAL_PORTS["engine"], metrics: int = USUAL_PORTS["metrics"],
             host: str = "127.0.0.1") -> tuple[DemoPorts, list[str]]:
        """The ports to use, and a note for each one that had to move because it was taken."""
        wanted = {"engine": engine, "gate": USUAL_PORTS["gate"], "control": USUAL_PORTS["control"],
                  "metrics": metrics, "count": engine + COUNT_PORT_OFFSET}
        taken: set[int] = set()
        chosen: dict[str, int] = {}
        notes: list[str] = []
        for name, port in wanted.items():
            got = port
            if got in taken or port_in_use(host, got):
                got = _another_port(host, taken)
                notes.append(f"port {port} ({name}) is taken: using {got}")
            taken.add(got)
            chosen[name] = got
        return cls(**chosen), notes

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> DemoPorts:
        """Five free ports, none of them the usual ones unless free (tests and benchmarks: a daemon beside any
        other; in ``$PINSIDECAR_TEST_PORTS`` when that is set). Each is searched from the one after the last, so
        the five differ even though none is bound until the daemon starts."""
        taken = [free_port(host=host)]
        for _ in range(4):
            taken.append(free_port(taken[-1] + 1, host=host))
        return cls(*taken)


def _another_port(host: str, taken: set[int]) -> int:
    port = free_port(host=host)  # inside $PINSIDECAR_TEST_PORTS when that is set: the first free one there
    while port in taken:  # ... which this demo may hold already
        port = free_port(port + 1, host=host)
    return port


def count_engine_cores() -> str:
    """The count engine's cores: the last one. vLLM CPU binds every engine's OpenMP threads to the first cores by
    default, so the two engines' compute would share core 0; on a single core there is no choice."""
    return str(max(0, (os.cpu_count() or 1) - 1))


# The sub-tables a section may have: written as [section.sub] tables, not inline.
SUB_TABLES = (ADVANCED_TABLE, VLLM_TABLE)


def dump_toml(doc: dict[str, Any]) -> str:
    """``doc`` (tables of plain keys: strings, numbers, booleans, lists, flat dicts) as TOML, laid out as the
    loader reads it today (:func:`~pinsidecar.daemon.config.laid_out`: tuning keys under ``[section.advanced]``,
    vLLM flags under ``[engine.vllm]``), without a TOML writer dependency. Strings are written with JSON's
    escapes (a subset of TOML's basic strings: :func:`~pinsidecar.schema.toml_value`)."""
    lines: list[str] = []
    for table, keys in laid_out(doc).items():
        subs = {k: v for k, v in keys.items() if k in SUB_TABLES and isinstance(v, dict)}
        lines += [f"[{table}]", *(f"{k} = {toml_value(v)}" for k, v in keys.items() if k not in subs), ""]
        for sub, sub_keys in subs.items():
            lines += [f"[{table}.{sub}]", *(f"{k} = {toml_value(v)}" for k, v in sub_keys.items()), ""]
    return "\n".join(lines)


def merge_tables(doc: dict[str, dict[str, Any]], changes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``doc`` with ``changes`` over it, table by table (a new table is added; a key set to None is removed, for a
    change that wants the daemon's default back). ``doc`` itself is not changed."""
    out = {table: dict(keys) for table, keys in doc.items()}
    for table, keys in changes.items():
        merged = out.setdefault(table, {})
        for key, val in keys.items():
            if val is None:
                merged.pop(key, None)
            else:
                merged[key] = val
    return out


def daemon_tables(*, model_dir: Path, run_dir: Path, ports: DemoPorts,
                  map_path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The tables of a daemon on the vLLM CPU lane, everything under ``run_dir``: the engine on ``model_dir`` (in
    pin mode on ``map_path``, whose folder is the maps library, when given; else with the hook off and the
    library in ``run_dir/maps``), the gate, the control API with a token it creates, the exporter without NVML,
    the state folder. The demo's config and the tests' daemons (:mod:`pinsidecar.testing.daemon`) start here, so
    a key the daemon comes to require is added once."""
    engine: dict[str, Any] = {
        "model": str(model_dir), "served_model_name": SERVED_MODEL_NAME, "port": ports.engine,
        "enforce_eager": True, "shutdown_timeout_s": 5, "ready_timeout_s": int(BOOT_TIMEOUT_S), "stop_timeout_s": 30}
    if map_path is not None:
        engine.update(hook_mode="pin", map=str(map_path))
    return {
        "engine": engine,
        "gate": {"port": ports.gate, "max_hold_s": int(MAX_HOLD_S)},
        "control": {"port": ports.control, "token_file": str(run_dir / "control.token"), "create_token": True,
                    "drain_timeout_s": 120},
        "metrics": {"port": ports.metrics, "nvml": False},
        "maps": {"dir": str(map_path.parent if map_path is not None else run_dir / "maps")},
        "daemon": {"state_dir": str(run_dir / "state"), "log_level": "info"},
    }


def demo_tables(*, model_dir: Path, map_path: Path, run_dir: Path, ports: DemoPorts) -> dict[str, dict[str, Any]]:
    """The demo's daemon config as tables: :func:`daemon_tables` in pin mode on the demo's first map (the code
    map; ``code.counts.json`` beside it is the drift reference), the gate capturing requests (the remap's count
    boot replays what it captured), small drift windows, the count engine on a core of its own."""
    doc = daemon_tables(model_dir=model_dir, run_dir=run_dir, ports=ports, map_path=map_path)
    doc["gate"]["capture_dir"] = str(run_dir / "capture")
    doc["drift"] = {"window_tokens": WINDOW_TOKENS, "min_tokens": MIN_TOKENS, "consecutive_windows": 2,
                    "cooldown_s": COOLDOWN_S}
    doc["remap"] = {"source": "capture", "capture_requests": CAPTURE_REQUESTS, "count_boot_port": ports.count,
                    "count_boot_env": {"VLLM_CPU_OMP_THREADS_BIND": count_engine_cores()},
                    "verify_tokens": VERIFY_TOKENS, "verify_timeout_s": int(VERIFY_TIMEOUT_S),
                    "watch_interval_s": 1}
    return doc


def demo_config(path: Path, *, model_dir: Path, map_path: Path, run_dir: Path, ports: DemoPorts) -> Path:
    """Write the daemon config for the demo at ``path`` (everything under ``run_dir``) and return it."""
    doc = demo_tables(model_dir=model_dir, map_path=map_path, run_dir=run_dir, ports=ports)
    text = ("# Written by `pinsidecar demo`: the daemon of the demo loop (see pinsidecar/examples/cpu-demo.toml).\n"
            "# engine.map is the code map (code.counts.json beside it is the drift reference); the gate captures\n"
            "# requests into gate.capture_dir, which the remap's count boot replays.\n\n" + dump_toml(doc))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def pinsidecar_argv() -> list[str]:
    """How to run this installation's ``pinsidecar``: the script beside this interpreter, else on PATH, else the
    package through this interpreter."""
    beside = Path(sys.executable).parent / "pinsidecar"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("pinsidecar")
    if found:
        return [found]
    return [sys.executable, "-c", "from pinsidecar.cli import main; main()"]


class Sidecar:
    """``pinsidecar run --config FILE`` as a child process in its own session (a Ctrl-C at the terminal reaches
    the demo, which stops the daemon in order, not the daemon directly)."""

    def __init__(self, config: Path, *, state_dir: Path, control_port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.state_dir = state_dir
        self.log_path = log_path
        self.status_url = f"http://127.0.0.1:{control_port}/status"
        self.env = dict(env or {})  # over this process's environment (a test's systemd socket, its podman lane)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # the demo's daemon is not systemd's (a
            env.pop(key, None)  # test that plays systemd sets them in ``env``)
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen([*pinsidecar_argv(), "run", "--config", str(self.config)], env=env,
                                         stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def status(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The daemon's ``GET /status``, or None while it does not answer."""
        try:
            r = httpx.get(self.status_url, timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """Stop the daemon and anything it left running; returns what happened (for the summary)."""
        from pinsidecar.daemon.service import ENGINE_PID_FILE
        from pinsidecar.engine.process import stop_recorded_engine
        from pinsidecar.remap.pipeline import COUNT_ENGINE_PID_FILE

        out: dict[str, Any] = {"exit_code": None, "killed": False, "leftover_engines": []}
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
                    out["killed"] = True
            out["exit_code"] = proc.returncode
        # The daemon stops its engines itself; a killed one (or one stopped mid count boot) leaves them recorded.
        for name in (ENGINE_PID_FILE, COUNT_ENGINE_PID_FILE):
            found = stop_recorded_engine(self.state_dir / name)
            if found is not None and found.get("stopped"):
                out["leftover_engines"].append({"file": name, "pid": found.get("pid"), "port": found.get("port")})
        return out
