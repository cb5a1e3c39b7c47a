"""``pinsidecar demo``: the demo loop on vLLM CPU with the tiny local MoE model (see :mod:`pinsidecar.demo`)."""

from __future__ import annotations

from pathlib import Path

import click

from pinsidecar.cli._common import UserError, emit, fail, handle_errors, json_option

__all__ = ["register"]


@click.command("demo")
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("demo"), show_default=True,
              help="Folder for the model, counts, maps and the summary.")
@click.option("--hot-rows", type=int, default=None, help="Hot experts per layer (default: 48 of 64).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port for the engines the demo starts.")
@click.option("--fresh", is_flag=True, help="Rebuild the model and redo every count boot.")
@json_option
@handle_errors
def demo_cmd(workdir: Path, hot_rows: int | None, port: int, fresh: bool, as_json: bool) -> None:
    """Run the demo loop: demo model -> count boots -> usage map vs positional baseline -> evaluation."""
    from pinsidecar.demo import loop as demo
    from pinsidecar.runs import count_boot as profile

    opts = demo.DemoOptions(workdir=workdir, port=port, rebuild_model=fresh, reuse_counts=not fresh)
    if hot_rows is not None:
        opts.hot_rows = hot_rows
    report = (lambda _msg: None) if as_json else click.echo
    try:
        summary = demo.run_demo(opts, report=report)
    except profile.USER_ERRORS as exc:
        raise UserError(str(exc)) from None
    except (*profile.RUN_ERRORS, RuntimeError, TimeoutError) as exc:
        fail(str(exc), code=1)
        return
    if as_json:
        emit(summary, True)


def register(main: click.Group) -> None:
    main.add_command(demo_cmd)
