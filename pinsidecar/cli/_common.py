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


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:1].isupper() and not text[1:2].isupper() else text


def _usage_hint(exc: click.ClickException) -> str:
    """How to fix a refusal of click's own: its "did you mean", the file a path wants, and the command's help."""
    ctx = getattr(exc, "ctx", None)
    help_ = f"see '{ctx.command_path} --help'" if ctx is not None else ""
    near = sorted(getattr(exc, "possibilities", None) or [])
    if near:
        return f"did you mean {' or '.join(near)}? {help_}".strip()
    param = getattr(exc, "param", None)
    if (isinstance(exc, click.BadParameter) and param is not None and isinstance(param.type, click.Path)
            and not param.type.dir_okay and "is a directory" in exc.message):
        return ", ".join(filter(None, ["pass a file", help_]))
    return help_


def _click_message(exc: click.ClickException) -> str:
    """Click's sentence as a project message: the parameter first, no capital, no full stop, no "Did you mean"
    (the hint says it)."""
    param = getattr(exc, "param", None)
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter) and param is not None:
        name = exc.param_hint or param.get_error_hint(exc.ctx)  # type: ignore[arg-type]
        name = " / ".join(name) if isinstance(name, list | tuple) else str(name)
        text = f"{name.replace(chr(39), '')}: {_lower_first(exc.message)}"
    elif isinstance(exc, click.NoSuchOption | getattr(click.exceptions, "NoSuchCommand", click.NoSuchOption)):
        text = exc.message  # without click's "Did you mean": the hint says it
    else:
        text = exc.format_message()
    return _lower_first(text.rstrip("."))


class StyledClickError(click.ClickException):
    """A refusal of click's own (an unknown option or command, a bad or missing value), said as every other
    refusal is: ``error: <what> (<how to fix>)`` on stderr, with click's exit code (2 for usage)."""

    def __init__(self, exc: click.ClickException) -> None:
        hint = _usage_hint(exc)
        super().__init__(_click_message(exc) + (f" ({hint})" if hint else ""))
        self.exit_code = exc.exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", file=file, err=file is None)


class ProjectGroup(click.Group):
    """The root command group: every click refusal below it (parsing a sub-command's arguments happens inside
    the root's :meth:`invoke`) comes out in the project's error style (:class:`StyledClickError`)."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            raise exc if isinstance(exc, StyledClickError) else StyledClickError(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            raise exc if isinstance(exc, StyledClickError) else StyledClickError(exc) from None


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
