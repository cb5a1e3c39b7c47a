"""``pinsidecar check-config``: validate the daemon's config file without starting anything.

Why a command of its own: ``pinsidecar run`` validates the file too, but only by starting the daemon, and under
systemd its warnings land in the journal. Before a restart an operator wants to know, at the terminal, whether the
file loads, and everything that is wrong with it in one pass: every problem (not the first), every key still at its
old place (the tuning keys that moved to ``[section.advanced]``, the vLLM flags that moved to ``[engine.vllm]``)
with where it belongs now, and every vLLM flag the engine's vLLM does not take, found by that vLLM's own argument
parser (a typo there would otherwise surface only when the engine boots). ``--schema`` prints the file's JSON schema
for editors instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

__all__: list[str] = []  # nothing here is another package's business


def _flag_check(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The vLLM flags the file's ``[engine]`` writes beyond pinsidecar's own, checked against the parser of the
    vLLM that will run them: (the report, a message for each flag that vLLM does not take). The file as parsed is
    enough, so the check runs even when the rest of the file has problems."""
    from pinsidecar.engine.installed_vllm import cli_flags
    from pinsidecar.engine.spec import ENGINE_SECTION, written_vllm_flags
    from pinsidecar.engine.vllm_flags import unknown_flags

    engine = doc.get(ENGINE_SECTION)
    written = written_vllm_flags(engine)
    report: dict[str, Any] = {"flags": sorted(f"--{f}" for f in written), "checked": False, "unknown": []}
    if not written:
        return {**report, "skipped": "no vLLM flags beyond the ones pinsidecar reads itself"}, []
    engine = engine if isinstance(engine, dict) else {}
    if engine.get("launcher") == "container":
        image = (doc.get("container") or {}).get("image") if isinstance(doc.get("container"), dict) else None
        return {**report, "skipped": f"the engine runs its container image's vLLM ({image or 'container.image'}), "
                                     "not one this host can ask"}, []
    python = engine.get("python")  # the interpreter that will run the engine: engine.python, else this one
    known = cli_flags(python if isinstance(python, str) and python else sys.executable)
    report.update(known.as_dict())
    if known.skipped:
        return report, []
    unknown = unknown_flags(written, known.flags)
    report["unknown"] = [u.as_dict(known.vllm) for u in unknown]
    return report, [u.message(known.vllm) for u in unknown]


def _note(flags: dict[str, Any]) -> str | None:
    if flags.get("checked"):
        return f"note: vLLM flags checked against {flags['vllm']} ({flags['python']})"
    if flags["flags"]:
        return f"note: vLLM flags not checked: {flags['skipped']}"
    return None


def _human(report: dict[str, Any]) -> str:
    lines = [f"ok: {report['path']} loads"]
    lines += [f"warning: {d['message']}" for d in report["deprecations"]]
    lines += [f"warning: {report['path']}: {u['message']}" for u in report["vllm_flags"]["unknown"]]
    note = _note(report["vllm_flags"])
    if note:
        lines.append(note)
    if report["deprecations"]:
        lines.append(f"{len(report['deprecations'])} key(s) at an old place: they still work; move them "
                     "(docs/configuration.md)")
    return "\n".join(lines)


def register(main: click.Group) -> None:
    @main.command("check-config")
    @click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="Config file [default: /etc/pinsidecar/pinsidecar.toml].")
    @click.option("--no-check-paths", is_flag=True,
                  help="Skip 'does this file exist' checks (a file written for another host).")
    @click.option("--strict", is_flag=True,
                  help="Exit 1 when a key is at an old place (deprecated); an unknown vLLM flag is an error.")
    @click.option("--schema", is_flag=True,
                  help="Print the config file's JSON schema (for editors) and exit; reads no file.")
    @json_option
    @handle_errors
    def check_config_cmd(config_path: Path | None, no_check_paths: bool, strict: bool, schema: bool,
                         as_json: bool) -> None:
        """Validate the config file: every problem at once, every deprecated key with its new place, every vLLM
        flag the engine's vLLM does not take. Starts nothing."""
        from pinsidecar.daemon.config import DEFAULT_CONFIG_PATH, json_schema, load_config
        from pinsidecar.schema import ConfigError, read_toml

        if schema:  # JSON either way: a schema is a JSON document
            emit(json_schema(), True)
            return
        path = config_path or DEFAULT_CONFIG_PATH
        try:
            doc = read_toml(path)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        problems: list[str] = []
        deprecations: list[dict[str, str]] = []
        try:
            cfg = load_config(path, check_paths=not no_check_paths, warn=False)
            deprecations = [d.as_dict() for d in cfg.deprecations]
        except ConfigError as exc:
            problems += exc.problems
        flags, unknown = _flag_check(doc)
        if strict:
            problems += [f"{path}: {m}" for m in unknown]
        if problems:
            for line in [*(f"warning: {path}: {m}" for m in ([] if strict else unknown)), _note(flags)]:
                if line:
                    click.echo(line, err=True)
            raise UserError("\n".join(problems))
        report = {"path": str(path), "ok": True, "deprecations": deprecations, "vllm_flags": flags}
        emit(report, as_json, _human)
        if strict and deprecations:
            raise SystemExit(1)
