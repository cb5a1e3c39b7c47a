"""Shared CLI plumbing: the ``--json`` option, output, and turning domain errors into clear exits."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click
from pinsidecar_hook.contract import ArtifactError

__all__: list[str] = []  # nothing here is another package's business

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


class UserError(Exception):
    """Bad input from the operator: the message says what is wrong and how to fix it. Exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message + (f" ({hint})" if hint else ""))


def emit(payload: Any, as_json: bool, human: Callable[[Any], str] | str | None = None) -> None:
    """Print ``payload`` as JSON, or the human rendering of it."""
    if as_json:
        click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))
    elif callable(human):
        click.echo(human(payload))
    elif isinstance(human, str):
        click.echo(human)
    else:
        click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` as ``error:`` lines on stderr (one a line: a config with three problems is three errors)
    and exit with ``code``."""
    for line in message.splitlines() or [message]:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the domain's user-facing errors into ``error: ...`` and exit code 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ArtifactError, UserError) as exc:
            fail(str(exc))

    return wrapper


def parse_cache_slots(raw: str) -> int | str:
    """``--cache-slots``: a number of cache slots per layer (0: none), or ``"auto"`` to choose the split on a
    trace. Checked before any file is read, so a typo costs nothing."""
    if raw.strip().lower() == "auto":
        return "auto"
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"--cache-slots must be a number of slots or 'auto', got {raw!r}",
                        "pass e.g. --cache-slots 8, or --cache-slots auto to choose the split on a trace") from None
    if value < 0:
        raise UserError(f"--cache-slots must be at least 0, got {value}", "pass --cache-slots 0 for no cache")
    return value
