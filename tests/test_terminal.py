"""The operator's terminal: ``--json`` prints one JSON document on stdout and nothing else; no ``HTTP Request:`` line
reaches either stream; logs are JSON for the journal and quiet for a person; the terminal's step lines (the demo's
closing output and its wiring are tested in ``test_demo_loop.py``).

The CLI cases run the installed ``pinsidecar`` console script as a real process against a real control server,
because a command that makes HTTP requests is what printed one httpx line per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

from pinsidecar import log
from pinsidecar.cli._terminal import Terminal
from pinsidecar.daemon.control import ControlServer

PINSIDECAR = str(Path(sys.executable).with_name("pinsidecar"))
TOKEN = "terminal-test-token-" + "b" * 20


class _Target:
    def __init__(self) -> None:
        self.reboots = 0

    def status(self) -> dict[str, Any]:
        return {"engine": {"state": "ready", "pid": 4242, "url": "http://127.0.0.1:1", "restarts_total": 0,
                           "failures_in_row": 0}, "maps": {"dir": "/tmp/maps", "entries": []},
                "daemon": {"pid": 1, "uptime_s": 3, "control": "x", "metrics": "y"}}

    async def drain_reboot(self, map_ref: str | None, timeout_s: float | None) -> dict[str, Any]:
        self.reboots += 1
        return {"ok": True, "seconds": 0.1, "drain_s": 0.0, "boot_s": 0.1, "hold_s": 0.0, "held_at_release": 0}


@contextmanager
def _control_server() -> Iterator[ControlServer]:
    """A real control server on a free loopback port, served from a side thread's event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="control-server", daemon=True)
    thread.start()
    server = ControlServer(_Target(), TOKEN)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _config(tmp_path: Path, port: int) -> Path:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cfg = tmp_path / "pinsidecar.toml"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path}"\n[control]\nport = {port}\ntoken_file = "{token}"\n')
    return cfg


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("INVOCATION_ID", "JOURNAL_STREAM")}
    return subprocess.run([PINSIDECAR, *args], capture_output=True, text=True, timeout=120, env=env)


def _one_json_document(text: str) -> Any:
    doc, end = json.JSONDecoder().raw_decode(text)
    assert text[end:].strip() == "", f"stdout holds more than one JSON document: {text[end:]!r}"
    return doc


@pytest.mark.parametrize("level", [[], ["--log-level", "debug"]], ids=["default", "debug"])
def test_json_stdout_is_one_document_and_no_http_request_lines(tmp_path: Path, level: list[str]) -> None:
    with _control_server() as server:
        cfg = _config(tmp_path, server.port)
        status = _run(*level, "status", "--config", str(cfg), "--json")
        reboot = _run(*level, "drain-reboot", "--config", str(cfg), "--json")
        human = _run(*level, "status", "--config", str(cfg))
    for proc in (status, reboot, human):
        assert proc.returncode == 0, proc.stderr
        assert "HTTP Request:" not in proc.stdout + proc.stderr
    assert _one_json_document(status.stdout)["engine"]["pid"] == 4242
    assert _one_json_document(reboot.stdout)["ok"] is True
    assert human.stdout.startswith("engine   ready") and not human.stdout.lstrip().startswith("{")
    if not level:  # a person's default: nothing on stderr when nothing is wrong
        assert status.stderr == "" and human.stderr == ""


def test_a_user_error_under_json_leaves_stdout_empty(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 1)  # nothing listens on port 1
    proc = _run("status", "--config", str(cfg), "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: no pinsidecar daemon answers")


@pytest.mark.parametrize(("args", "line"), [
    (["nosuch"], "error: no such command 'nosuch' (see 'pinsidecar --help')"),
    (["map", "shw"], "error: no such command 'shw' (did you mean show? see 'pinsidecar map --help')"),
    (["map", "show", "--bogus", "m.json"],
     "error: no such option '--bogus' (did you mean --counts? see 'pinsidecar map show --help')"),
    (["map", "show"], "error: missing argument 'MAP' (see 'pinsidecar map show --help')"),
    (["map", "show", "{tmp}"], "error: MAP: file '{tmp}' is a directory (pass a file, see 'pinsidecar map show "
                               "--help')"),
    (["check-config", "--config", "{tmp}", "--json"],
     "error: --config: file '{tmp}' is a directory (pass a file, see 'pinsidecar check-config --help')"),
    (["map", "build", "c.json", "--hot-rows", "many", "--out", "m.json"],
     "error: --hot-rows: 'many' is not a valid integer (see 'pinsidecar map build --help')"),
    (["--log-level", "loud", "status"],
     "error: --log-level: 'loud' is not one of 'debug', 'info', 'warning', 'error' (see 'pinsidecar --help')"),
], ids=["command", "subcommand", "option", "missing", "directory", "directory-json", "integer", "choice"])
def test_clicks_own_refusals_come_out_in_the_project_style(tmp_path: Path, args: list[str], line: str) -> None:
    """A usage error is a user error like any other: one `error: <what> (<how to fix>)` line on stderr, exit 2,
    nothing on stdout (--json included), never click's `Usage: ... Error: Invalid value` block."""
    proc = _run(*(a.format(tmp=tmp_path) for a in args))
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line.format(tmp=tmp_path) + "\n")


def test_help_and_version_are_not_refusals() -> None:
    assert _run("--version").stdout.startswith("pinsidecar, version ")
    helped = _run("map", "show", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: pinsidecar map show")


# ---------------------------------------------------------------------------------------------------- log.py


@pytest.fixture()
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def test_json_logs_put_stdlib_and_structlog_records_on_one_line_each(
        capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    log.configure("info", json_logs=True)
    log.configure("info", json_logs=True)  # configuring twice must not print twice
    structlog.get_logger("pinsidecar.test").info("engine_ready", port=8000)
    logging.getLogger("aiohttp.server").warning("a library's %s", "record")
    logging.getLogger("httpx").info("HTTP Request: GET http://x/health 200 OK")
    lines = capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["engine_ready", "a library's record"]
    assert records[0]["port"] == 8000 and records[0]["level"] == "info" and records[0]["logger"] == "pinsidecar.test"
    assert records[1]["level"] == "warning" and "timestamp" in records[1]


def test_console_logs_for_a_person_show_warnings_only(capsys: pytest.CaptureFixture[str],
                                                      restore_logging: None) -> None:
    log.configure(log.COMMAND_LOG_LEVEL, json_logs=False)
    structlog.get_logger("pinsidecar.test").info("engine_ready", port=8000)
    structlog.get_logger("pinsidecar.test").warning("token_mismatch", counted=3)
    logging.getLogger("httpx").warning("HTTP Request: kept, because it is a warning")
    err = capsys.readouterr().err
    assert "engine_ready" not in err and "token_mismatch" in err and "counted=3" in err
    assert "{" not in err.splitlines()[0]


def test_json_is_chosen_under_systemd_or_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert not log.wants_json(Tty())  # type: ignore[arg-type]
    assert log.wants_json(open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    assert log.under_systemd() and log.wants_json(Tty())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- demo output


def test_silent_terminal_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    term = Terminal.silent()
    term.step("counts")
    term.note("x")
    with term.engine_boot("http://127.0.0.1:1"):
        pass
    assert not term.bars and capsys.readouterr() == ("", "")


def test_terminal_prints_steps_and_notes(capsys: pytest.CaptureFixture[str]) -> None:
    term = Terminal(bars=False)
    term.step("counts: 3 count boots")
    term.note("code_train: reusing x.json")
    with term.waiting("booting", until=lambda: True):
        pass
    assert capsys.readouterr().out == "==> counts: 3 count boots\n    code_train: reusing x.json\n"
