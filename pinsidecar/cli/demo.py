"""``pinsidecar demo``: the whole loop on vLLM CPU with the tiny local MoE model (see :mod:`pinsidecar.demo.loop`).

On a terminal it prints one line per step and the events of the loop as they happen (windows closing, the drift
trip, each remap state, the in-place apply), a spinner on stderr while it waits, and ends with the timeline, the
figures and one verdict line: ``demo: PASS <the figure that decided it>`` or ``demo: FAIL <why>``. With ``--json``
stdout carries the summary document alone (its ``verdict`` field is that line's text; a FAIL is also said on
stderr). It exits 1 when the loop does not complete, the figure misses (the cold rate after the remap must be at
most half the rate at the trip) or a request through the gate fails, and 130 on Ctrl-C; either way the daemon and
its engines are stopped first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import emit, handle_errors, json_option
from pinsidecar.cli._terminal import Terminal, format_elapsed

__all__: list[str] = []  # nothing here is another package's business


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_summary(summary: dict[str, Any]) -> str:
    """The timeline (m:ss per stage), the figures, and the verdict line the demo ends with."""
    stages = summary.get("timeline", [])
    lines: list[str] = []
    if stages:
        width = max([len(s["label"]) for s in stages] + [5])
        lines += ["", f"timeline (m:ss from the start; {format_elapsed(summary.get('seconds', 0))} in all)",
                  f"  {'start':>7}  {'stage':<{width}}  {'took':>7}"]
        lines += [f"  {format_elapsed(s['start_s']):>7}  {s['label']:<{width}}  {format_elapsed(s['seconds']):>7}"
                  for s in stages]
    a, b = (summary.get("domains") or {}).get("a", "A"), (summary.get("domains") or {}).get("b", "B")
    c = summary.get("cold_rate") or {}
    r = summary.get("remap") or {}
    q = summary.get("requests") or {}
    if c or r or q:
        lines += ["", "figures (cold rate: the share of expert selections that land on experts in host memory)"]
    if c:
        lines += [
            f"  {b} under the {a} map at the trip: {_pct(c.get('at_trip'))}; after the remap: {_pct(c.get('after'))} "
            f"(held-out {_pct(c.get('predicted'))})",
            f"  held-out {a} under the {a} map: {_pct(c.get('domain_a'))}; positional offload of the same budget: "
            f"{_pct(c.get('positional_domain_a'))}",
        ]
    if r:
        rb, par, ap = r.get("reboot") or {}, r.get("parity") or {}, r.get("apply") or {}
        parity = f"parity {'ok' if par.get('ok') else 'FAILED'}"
        if ap.get("outcome") == "applied":
            lines.append(f"  remap {r.get('id')}: {r.get('outcome')}; applied in place in "
                         f"{1000 * float(ap.get('seconds') or 0.0):.1f} ms ({ap.get('rows') or 0} rows, "
                         f"{(ap.get('bytes_moved') or 0) / 2**20:.2f} MiB), the gate never held; {parity}")
        else:
            hit = "hash hit" if rb.get("hash_hit") else "NOT a hash hit"
            miss = "cache MISS" if rb.get("cache_miss") else "no cache miss"
            fell = f" (not in place: {ap['reason']})" if ap.get("reason") else ""
            lines.append(f"  remap {r.get('id')}: {r.get('outcome')}; reboot {hit}, {miss}, gate held "
                         f"{rb.get('hold_s') or 0:.1f} s{fell}; {parity}")
    if q:
        lines.append(f"  requests through the gate: {q.get('sent')} sent, {q.get('completed')} completed, "
                     f"{q.get('failed')} failed")
    if summary.get("metrics_url"):
        lines.append(f"  metrics were live at {summary['metrics_url']}; summary {summary['workdir']}/demo-summary.json")
    if summary.get("verdict"):
        lines += ["", f"demo: {summary['verdict']}"]
    return "\n".join(lines)


@click.command("demo")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), default=Path("demo"),
              show_default=True, help="Folder for the model, the counts, and the daemon's files (run/).")
@click.option("--hot-rows", type=click.IntRange(min=1), default=None, help="Hot experts per layer (default: 48 of 64).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="The serving engine's port (the count engine takes port + 100).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=9108, show_default=True,
              help="The metrics exporter's port. A taken port is replaced by a free one (printed).")
@click.option("--clients", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Concurrent clients sending traffic through the gate.")
@click.option("--fresh", is_flag=True, help="Rebuild the model and redo the first count boot.")
@json_option
@handle_errors
def demo_cmd(workdir: Path, hot_rows: int | None, port: int, metrics_port: int, clients: int, fresh: bool,
             as_json: bool) -> None:
    """Run the whole loop: a count boot and a usage map, the daemon serving it, traffic that shifts domain, the
    drift trip, the remap (count boot, new map, apply in place, verification) and the cold rate back down."""
    from pinsidecar.demo import loop as demo
    from pinsidecar.demo.options import DemoOptions

    opts = DemoOptions(workdir=workdir, port=port, metrics_port=metrics_port, clients=clients,
                       rebuild_model=fresh, reuse_counts=not fresh)
    if hot_rows is not None:
        opts.hot_rows = hot_rows
    try:
        summary = demo.run_demo(opts, Terminal.silent() if as_json else Terminal())
    except demo.DemoFailed as exc:
        emit(exc.summary, as_json, format_summary)
        if as_json:  # stdout holds the document alone; a person running it still sees why
            click.echo(f"demo: {exc.summary.get('verdict') or f'FAIL {exc}'}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: the daemon and its engines are stopped; logs and state are under "
                   f"{workdir.absolute() / 'run'}", err=True)
        sys.exit(130)
    emit(summary, as_json, format_summary)


def register(main: click.Group) -> None:
    main.add_command(demo_cmd)
