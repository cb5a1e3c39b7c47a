"""``pinsidecar count-boot``: the count boot from the command line (see :mod:`pinsidecar.counts.count_boot`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, fail, handle_errors, json_option

__all__: list[str] = []  # nothing here is another package's business


def _human(summary: dict[str, Any]) -> str:
    s = summary
    check = "exact" if s["exact"] else "NOT exact"
    return (f"wrote {s['out']} (label {s['label']!r})\n"
            f"  {s['requests']} requests, {s['prompt_tokens']} prompt + {s['completion_tokens']} completion tokens "
            f"in {s['wall_s']:.1f} s (engine boot {s['boot_s']:.1f} s)\n"
            f"  {s['num_layers']} MoE layers x {s['num_experts']} experts, top-{s['top_k']}: {s['tokens']} tokens, "
            f"{s['selections']} selections ({check}: layers x tokens x top_k = "
            f"{s['num_layers'] * s['tokens'] * s['top_k']}, tokens processed per usage = {s['tokens_processed']})"
            + _trace_line(s.get("trace")))


def _trace_line(trace: dict[str, Any] | None) -> str:
    if trace is None:
        return ""
    held = "its counts are the counts" if trace["matches_counts"] else (
        f"the first {trace['tokens']} tokens (its bound, --trace-tokens)" if trace["full"] else "NOT the counts")
    return f"\n  routing trace {trace['out']}: {trace['tokens']} tokens x {trace['layers']} layers; {held}"


@click.command("count-boot")
@click.option("--model", "model", type=click.Path(path_type=Path), default=None,
              help="Model folder to serve (overrides engine.model of --config; one of the two is required).")
@click.option("--workload", "workloads", required=True, multiple=True, type=click.Path(path_type=Path),
              help="JSONL file of completion ({\"prompt\"}) or chat ({\"messages\"}) requests; repeatable.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Where to write the counts artifact.")
@click.option("--concurrency", default=4, show_default=True, type=int, help="Requests in flight at once.")
@click.option("--max-tokens", type=int, default=None, help="Override every request's max_tokens.")
@click.option("--port", default=None, type=int,
              help="Port for the count engine (overrides engine.port of --config; default 8000).")
@click.option("--label", default=None, help="Workload label stored in the counts (default: the workload file names).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="Config file whose [engine] table describes the engine (the daemon's config as is; other "
                   "tables are not read). The count boot runs eager unless the table sets enforce_eager.")
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Also record the routing trace (every token's experts, in order) and write it here, an .npz for "
                   "`pinsidecar placement simulate`.")
@click.option("--trace-tokens", type=int, default=None,
              help="The trace's bound in tokens (default 65536); a longer replay records its first tokens.")
@click.option("--engine-log", type=click.Path(path_type=Path), default=None,
              help="Keep the engine's log here (default: a temp file).")
@json_option
@handle_errors
def count_boot_cmd(model: Path | None, workloads: tuple[Path, ...], out: Path, concurrency: int,
                max_tokens: int | None, port: int | None, label: str | None, config_path: Path | None,
                trace: Path | None, trace_tokens: int | None, engine_log: Path | None, as_json: bool) -> None:
    """Count boot: start vLLM with the hook counting, replay the workload, write the counts to OUT.

    The engine is the [engine] table of --config (the daemon's config file as is), with --model and --port over
    it. Nothing is written to OUT unless the whole boot succeeds.
    """
    from pinsidecar.cli._terminal import Terminal
    from pinsidecar.counts import count_boot

    term = Terminal.silent() if as_json else Terminal()
    try:
        engine = count_boot.count_boot_config(config_path, model=model, port=port)
        with term.engine_boot(f"http://127.0.0.1:{engine.port}", "count engine booting"):
            result = count_boot.run_count_boot(None, list(workloads), out, concurrency=concurrency,
                                            max_tokens=max_tokens, label=label, engine=engine,
                                            engine_log=engine_log, progress=term.bars, trace=trace,
                                            trace_tokens=trace_tokens)
    except count_boot.USER_ERRORS as exc:
        raise UserError(str(exc)) from None
    except count_boot.RUN_ERRORS as exc:
        fail(str(exc), code=1)
        return
    except KeyboardInterrupt:
        click.echo("interrupted; the engine was stopped and nothing was written", err=True)
        sys.exit(130)
    emit(result.summary(), as_json, _human)


@click.command("profile", hidden=True, add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def profile_cmd(ctx: click.Context) -> None:
    """The count boot's old name: says so, then runs ``count-boot`` with the same arguments (scripts keep working)."""
    click.echo("pinsidecar profile is now `pinsidecar count-boot` (same options); running that", err=True)
    count_boot_cmd.main(list(ctx.args), prog_name="pinsidecar count-boot", standalone_mode=True)


def register(main: click.Group) -> None:
    main.add_command(count_boot_cmd)
    main.add_command(profile_cmd)
