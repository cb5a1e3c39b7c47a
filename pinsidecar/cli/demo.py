"""``pinsidecar demo``: the demo loop on vLLM CPU with the tiny local MoE model (see :mod:`pinsidecar.demo`).

On a terminal it prints one line per step, a spinner while an engine boots and a bar while a replay runs, then the
table of cold-selection rates. With ``--json`` stdout carries the summary document alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, fail, handle_errors, json_option
from pinsidecar.cli._terminal import Terminal

__all__ = ["format_summary", "register"]


def _pct(x: float) -> str:
    return f"{x:.2%}"


def format_summary(summary: dict[str, Any]) -> str:
    """The table the demo ends with: cold-selection rate of the usage map and of the positional baseline."""
    from pinsidecar.cli.maps import format_table

    label = summary.get("map_label") or "usage"
    rows = [[traffic, _pct(row["usage"]), _pct(row["positional"])] for traffic, row in summary["cold_rate"].items()]
    pin = summary["pin"]
    check = "equals" if pin["matches_offline_eval"] else "DIFFERS FROM"
    return "\n".join([
        "",
        "cold-selection rate: the share of expert selections that land on experts in host memory (lower is better)",
        f"{summary['hot_rows']} hot / {summary['cold_rows']} cold experts per layer in both placements",
        "",
        format_table(["held-out traffic", f"usage map ({label})", "positional (--cpu-offload-gb)"], rows),
        "",
        f"pin mode, live on {pin.get('traffic', 'held-out traffic')}: {_pct(pin['live_cold_rate'])} "
        f"({check} the offline evaluation)",
    ])


@click.command("demo")
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("demo"), show_default=True,
              help="Folder for the model, counts, maps and the summary.")
@click.option("--hot-rows", type=int, default=None, help="Hot experts per layer (default: 48 of 64).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port for the engines the demo starts.")
@click.option("--fresh", is_flag=True, help="Rebuild the model and redo every count boot.")
@json_option
@handle_errors
def demo_cmd(workdir: Path, hot_rows: int | None, port: int, fresh: bool, as_json: bool) -> None:
    """Run the demo loop: demo model -> count boots -> usage map vs positional baseline -> evaluation -> pin."""
    from pinsidecar.demo import loop as demo
    from pinsidecar.runs import count_boot as profile

    opts = demo.DemoOptions(workdir=workdir, port=port, rebuild_model=fresh, reuse_counts=not fresh)
    if hot_rows is not None:
        opts.hot_rows = hot_rows
    try:
        summary = demo.run_demo(opts, Terminal.silent() if as_json else Terminal())
    except profile.USER_ERRORS as exc:
        raise UserError(str(exc)) from None
    except (*profile.RUN_ERRORS, RuntimeError, TimeoutError) as exc:
        fail(str(exc), code=1)
        return
    emit(summary, as_json, format_summary)


def register(main: click.Group) -> None:
    main.add_command(demo_cmd)
