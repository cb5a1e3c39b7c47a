"""The ``pinsidecar`` command line.

Each command group lives in its own module in this package and exposes ``register(main)``; modules are found by
name, so adding a command never touches this file. Conventions every command follows:

- ``--json`` prints one JSON document on stdout and nothing else there; the default output is for a person;
- a user error (bad file, bad value) prints ``error: <what> (<how to fix>)`` on stderr and exits 2, one line a
  problem; click's own refusals (an unknown option, a bad value, a missing argument) come out the same way
  (:class:`~pinsidecar.cli._common.ProjectGroup`); an operation that ran and failed exits 1;
- progress and logs go to stderr.
"""

from __future__ import annotations

import importlib
import pkgutil

import click

from pinsidecar import __version__
from pinsidecar.cli._common import ProjectGroup

__all__ = ["main"]


@click.group(cls=ProjectGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pinsidecar")
@click.option("--log-level", default=None, type=click.Choice(["debug", "info", "warning", "error"]),
              help="Log verbosity on stderr [default: warning; `run`: daemon.log_level from its config].")
@click.pass_context
def main(ctx: click.Context, log_level: str | None) -> None:
    """Usage-aware MoE expert placement for vLLM: count, map, pin, watch, remap."""
    from pinsidecar import log

    log.configure(log_level or log.COMMAND_LOG_LEVEL)
    ctx.ensure_object(dict)


for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_mod}").register(main)
