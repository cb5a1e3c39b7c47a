"""Logging set-up: structlog, JSON lines under systemd (or any non-terminal), readable console on a terminal.

Call :func:`configure` once at the start of a command; modules just do ``log = structlog.get_logger(__name__)``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure", "under_systemd"]


def under_systemd() -> bool:
    """systemd sets INVOCATION_ID for every unit it starts, and JOURNAL_STREAM when stdout goes to the journal."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))


def configure(level: str = "info", json_logs: bool | None = None) -> None:
    if json_logs is None:
        json_logs = under_systemd() or not sys.stderr.isatty()
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json_logs:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
