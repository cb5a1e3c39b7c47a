"""``pinsidecar profile``: the count boot from the command line (see :mod:`pinsidecar.runs.count_boot`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, fail, handle_errors, json_option

__all__ = ["register"]


def _human(summary: dict[str, Any]) -> str:
    s = summary
    check = "exact" if s["exact"] else "NOT exact"
    return (f"wrote {s['out']} (label {s['label']!r})\n"
            f"  {s['requests']} requests, {s['prompt_tokens']} prompt + {s['completion_tokens']} completion tokens "
            f"in {s['wall_s']:.1f} s (engine boot {s['boot_s']:.1f} s)\n"
            f"  {s['num_layers']} MoE layers x {s['num_experts']} experts, top-{s['top_k']}: {s['tokens']} tokens, "
            f"{s['selections']} selections ({check}: layers x tokens x top_k = "
            f"{s['num_layers'] * s['tokens'] * s['top_k']}, tokens processed per usage = {s['tokens_processed']})")


@click.command("profile")
@click.option("--model", "model", required=True, type=click.Path(path_type=Path), help="Model folder to serve.")
@click.option("--workload", "workloads", required=True, multiple=True, type=click.Path(path_type=Path),
              help="JSONL file of completion ({\"prompt\"}) or chat ({\"messages\"}) requests; repeatable.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Where to write the counts artifact.")
@click.option("--concurrency", default=4, show_default=True, type=int, help="Requests in flight at once.")
@click.option("--max-tokens", type=int, default=None, help="Override every request's max_tokens.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port for the count engine.")
@click.option("--label", default=None, help="Workload label stored in the counts (default: the workload file names).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="TOML file whose [engine] table sets extra_args, env, kv_cache_bytes, enforce_eager, ...")
@click.option("--engine-log", type=click.Path(path_type=Path), default=None,
              help="Keep the engine's log here (default: a temp file).")
@json_option
@handle_errors
def profile_cmd(model: Path, workloads: tuple[Path, ...], out: Path, concurrency: int, max_tokens: int | None,
                port: int, label: str | None, config_path: Path | None, engine_log: Path | None,
                as_json: bool) -> None:
    """Count boot: start vLLM with the hook counting, replay the workload, write the counts to OUT.

    Nothing is written to OUT unless the whole boot succeeds.
    """
    import logging

    from pinsidecar.runs import count_boot as profile

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per replayed request is noise
    try:
        opts = profile.load_engine_options(config_path)
        result = profile.run_profile(model, list(workloads), out, concurrency=concurrency, max_tokens=max_tokens,
                                     port=port, label=label, engine=opts, engine_log=engine_log)
    except profile.USER_ERRORS as exc:
        raise UserError(str(exc)) from None
    except profile.RUN_ERRORS as exc:
        fail(str(exc), code=1)
        return
    except KeyboardInterrupt:
        click.echo("interrupted; the engine was stopped and nothing was written", err=True)
        sys.exit(130)
    emit(result.summary(), as_json, _human)


def register(main: click.Group) -> None:
    main.add_command(profile_cmd)
