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
    click.echo(f"error: {message}", err=True)
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
