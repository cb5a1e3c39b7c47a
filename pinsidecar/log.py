"""Logging set-up: JSON lines for the journal, a quiet readable console for a person at a terminal.

Call :func:`configure` once at the start of a command; modules just do ``log = structlog.get_logger(__name__)``.
Two audiences, two defaults:

- **the daemon under systemd** (or any stderr that is not a terminal, e.g. a container's log driver) writes one
  JSON object per line, so the journal and log shippers can filter by field. :func:`wants_json` decides, and the
  ``[daemon] json_logs = auto|yes|no`` config key overrides it;
- **a person running a command** (``pinsidecar demo``, ``profile``, ``map ...``) sees the command's own output on
  stdout and only warnings and errors on stderr, rendered for reading. The command line's ``--log-level`` lowers
  the threshold when someone wants the details.

Records from the standard library's ``logging`` (aiohttp, watchdog, httpx) go through the same renderer, so a JSON
journal never has a plain-text line in it. httpx and httpcore log every request at INFO ("HTTP Request: ...");
that is noise at any level we use (a replay sends hundreds, the supervisor probes every few seconds), so they are
held at WARNING whatever the level.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

__all__ = ["COMMAND_LOG_LEVEL", "configure", "reset"]

# What a command shows a person on stderr unless ``--log-level`` says otherwise: warnings and errors only. The
# steps and results are the command's own output; info records are for the journal.
COMMAND_LOG_LEVEL = "warning"

# Libraries that log at INFO once per request or connection; held at WARNING so their problems still show.
QUIET_LIBRARIES = ("httpx", "httpcore", "aiohttp.access", "urllib3")

_HANDLER_NAME = "pinsidecar"


def under_systemd() -> bool:
    """systemd sets INVOCATION_ID for every unit it starts, and JOURNAL_STREAM when stdout goes to the journal."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))


def wants_json(stream: TextIO | None = None) -> bool:
    """JSON lines under systemd or when ``stream`` (default: stderr) is not a terminal; readable text otherwise."""
    stream = sys.stderr if stream is None else stream
    return under_systemd() or not _isatty(stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (click's CliRunner and pytest swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.name = _HANDLER_NAME

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def configure(level: str = "info", json_logs: bool | None = None) -> None:
    """Send structlog and stdlib logging to stderr at ``level``, as JSON lines or as text (None: :func:`wants_json`).

    Safe to call again (a command that reads its level from a config file does): it replaces what it set before.
    """
    if json_logs is None:
        json_logs = wants_json()
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True) if json_logs
        else structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor
    if json_logs:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(sys.stderr))

    handler = _CurrentStderr()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.name == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(lvl, logging.WARNING))

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def reset() -> None:
    """Undo :func:`configure`: structlog back to its defaults, our stderr handler off the root logger (tests)."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.name == _HANDLER_NAME]:
        root.removeHandler(old)
