"""``pinsidecar parity record|check``: the parity gate from the command line (see :mod:`pinsidecar.counts.parity`).

Exit codes: 0 every token and logprob matches (``check``) or the reference was written (``record``); 1 the check
ran and found a difference (each differing prompt's first difference is reported); 2 bad input (a missing or
corrupt reference, prompts that are not the reference's, a bad map).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

__all__: list[str] = []  # nothing here is another package's business

_MODES = ("pin", "count", "off")


def _engine_options(fn: Any) -> Any:
    for opt in reversed([
        click.option("--model", "model", required=True, type=click.Path(path_type=Path), help="Model folder to serve."),
        click.option("--map", "map_path", type=click.Path(path_type=Path), default=None,
                     help="Row map to serve in pin mode (implies --mode pin)."),
        click.option("--mode", type=click.Choice(_MODES), default=None,
                     help="Hook mode when no --map is given: count or off (default off)."),
        click.option("--prompts", required=True, type=click.Path(path_type=Path),
                     help="JSONL file of completion prompts ({\"prompt\": ..., \"max_tokens\": N})."),
        click.option("--port", type=int, default=None, help="Port for the engine (default: a free one)."),
        click.option("--base-url", default=None,
                     help="Use the engine already serving here instead of booting one (e.g. to verify a reboot)."),
        click.option("--engine-log", type=click.Path(path_type=Path), default=None,
                     help="Keep the engine's log here (default: a temp file)."),
        json_option,
    ]):
        fn = opt(fn)
    return fn


def _mode(map_path: Path | None, mode: str | None) -> str:
    if map_path is not None and mode not in (None, "pin"):
        raise UserError(f"--map serves a row map in pin mode; it cannot be combined with --mode {mode}",
                        "drop --mode, or drop --map")
    if mode == "pin" and map_path is None:
        raise UserError("--mode pin needs --map MAP (the row map to serve)")
    return "pin" if map_path is not None else (mode or "off")


def _errors(fn: Any) -> Any:
    from pinsidecar.counts.parity import ParityError
    from pinsidecar.counts.workload import WorkloadError

    wrapped = handle_errors(fn)

    def inner(*args: Any, **kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except (ParityError, WorkloadError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    inner.__name__ = fn.__name__
    inner.__doc__ = fn.__doc__
    return inner


@click.group("parity")
def parity() -> None:
    """Record greedy outputs of an engine over fixed prompts, and check another boot against them exactly."""


@parity.command("record")
@_engine_options
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Where to write the reference JSON.")
@_errors
def record_cmd(model: Path, map_path: Path | None, mode: str | None, prompts: Path, port: int | None,
               base_url: str | None, engine_log: Path | None, as_json: bool, out: Path) -> None:
    """Boot the engine, generate greedily (temperature 0, logprobs) for every prompt, write REF.json."""
    from pinsidecar.counts import parity as p

    hook_mode = _mode(map_path, mode)
    p.load_prompts(prompts)  # validate before the (slow) boot
    ref = p.record(model, prompts, mode=hook_mode, map_path=map_path, port=port, log_path=engine_log,
                   base_url=base_url)
    ref.save(out)
    summary = {"out": str(out), "mode": hook_mode, "map_hash": ref.map_hash, "prompts": len(ref.outputs),
               "tokens": sum(len(o.token_ids) for o in ref.outputs)}
    emit(summary, as_json, lambda s: f"wrote {s['out']}: {s['prompts']} prompts, {s['tokens']} tokens "
                                     f"(mode {s['mode']})")


@parity.command("check")
@_engine_options
@click.option("--ref", "ref_path", required=True, type=click.Path(path_type=Path),
              help="Reference written by `pinsidecar parity record`.")
@_errors
def check_cmd(model: Path, map_path: Path | None, mode: str | None, prompts: Path, port: int | None,
              base_url: str | None, engine_log: Path | None, as_json: bool, ref_path: Path) -> None:
    """Boot the engine, generate the same way, and compare with REF.json: exit 0 only if every token matches."""
    from pinsidecar.counts import parity as p

    hook_mode = _mode(map_path, mode)
    ref = p.load_ref(ref_path)
    requests = p.load_prompts(prompts)
    p.check_prompts_match(ref, requests, ref_path, prompts)
    with p.outputs_from(model, hook_mode, map_path, requests, base_url=base_url, port=port,
                        log_path=engine_log) as out:
        outputs = out
    report = p.compare(ref, outputs)
    payload = report.to_json() | {"ref": str(ref_path), "mode": hook_mode}

    def human(r: dict[str, Any]) -> str:
        if r["ok"]:
            return f"parity OK: {r['prompts']} prompts, {r['tokens']} tokens identical to {r['ref']}"
        return "\n".join([f"parity FAILED: {r['differing_prompts']} of {r['prompts']} prompts differ from {r['ref']}",
                          *("  " + d["message"] for d in r["diffs"])])

    emit(payload, as_json, human)
    if not report.ok:
        sys.exit(1)


def register(main: click.Group) -> None:
    main.add_command(parity)
