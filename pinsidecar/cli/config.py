"""``pinsidecar check-config``: validate the daemon's config file without starting anything.

Why a command of its own: ``pinsidecar run`` validates the file too, but only by starting the daemon, and under
systemd its warnings land in the journal. Before a restart an operator wants to know, at the terminal, whether the
file loads, every problem in it (all of them, not the first), and what in it is out of date: every key still at its
old place (the tuning keys that moved to ``[section.advanced]``, the vLLM flags that moved to ``[engine.vllm]``) is
listed with where it belongs now. ``--schema`` prints the file's JSON schema for editors instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

__all__: list[str] = []  # nothing here is another package's business


def _human(report: dict[str, Any]) -> str:
    lines = [f"ok: {report['path']} loads"]
    for d in report["deprecations"]:
        lines.append(f"warning: {d['message']}")
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
    @click.option("--strict", is_flag=True, help="Exit 1 when a key is at an old place (deprecated).")
    @click.option("--schema", is_flag=True,
                  help="Print the config file's JSON schema (for editors) and exit; reads no file.")
    @json_option
    @handle_errors
    def check_config_cmd(config_path: Path | None, no_check_paths: bool, strict: bool, schema: bool,
                         as_json: bool) -> None:
        """Validate the config file: every problem at once, and every deprecated key with its new place. Starts
        nothing."""
        from pinsidecar.daemon.config import DEFAULT_CONFIG_PATH, ConfigError, json_schema, load_config

        if schema:  # JSON either way: a schema is a JSON document
            emit(json_schema(), True)
            return
        path = config_path or DEFAULT_CONFIG_PATH
        try:
            cfg = load_config(path, check_paths=not no_check_paths, warn=False)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        report = {"path": str(path), "ok": True, "deprecations": [d.as_dict() for d in cfg.deprecations]}
        emit(report, as_json, _human)
        if strict and cfg.deprecations:
            raise SystemExit(1)
