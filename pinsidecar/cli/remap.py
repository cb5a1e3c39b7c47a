"""``pinsidecar remap``: ask the running daemon for a remap, or (``--dry-run``) for the decision one would take.

It posts ``{"dry_run", "map", "reason", "trigger"}`` to the daemon's ``POST /remap`` with the bearer token from
``control.token_file``, so it passes the same gate as every other trigger (the drift detector, the Alertmanager
webhook): one remap at a time, the ``[drift]`` cooldown and daily cap. The systemd timer
(``systemd/pinsidecar-remap.timer``) runs this command with ``--trigger timer`` for periodic re-counts.

Exit codes: 0 the remap started (or, with ``--wait``, committed; or the dry run answered), 1 a remap that ran and
did not commit (``--wait``), 2 bad input, 3 **refused by the gate** (a remap is running, the cooldown, the daily
cap). The timer's unit counts 3 as success: a re-count that the cooldown skips is not a failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option
from pinsidecar.cli.daemon import _control_token, _load, _request, config_option
from pinsidecar.remap.record import TERMINAL_STATES

__all__: list[str] = []  # nothing here is another package's business

# The gate said no (busy, cooldown, daily cap): not bad input (2), not a failed remap (1).
EXIT_REFUSED = 3
# How often --wait asks the daemon for the remap's state.
WAIT_POLL_S = 2.0


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.2%}"


def _pts(x: Any) -> str:
    return "-" if x is None else f"{100 * x:+.2f} pts"


def _short(h: str) -> str:
    return h.split(":", 1)[-1][:12] if h else "-"


def format_decision(d: dict[str, Any]) -> list[str]:
    """The decision's figures for a person: both cold rates on the held-out window, the margin, yes or no."""
    held = d.get("held_out") or {}
    where = ", ".join(f"{k} {held[k]}" for k in ("window", "tokens", "source") if held.get(k) not in (None, ""))
    return [
        f"decision   {'DEPLOY' if d.get('deploy') else 'do not deploy'} (source: {d.get('source', '-')})",
        f"candidate  {d.get('candidate_label') or '-'} ({_short(d.get('candidate_hash', ''))}): "
        f"{_pct(d.get('candidate_cold_rate'))} cold on the held-out window",
        f"active     {d.get('active_label') or '-'} ({_short(d.get('active_hash', ''))}): "
        f"{_pct(d.get('active_cold_rate'))} cold on the held-out window",
        f"gain       {_pts(d.get('gain'))}, margin {_pts(d.get('margin'))}",
        f"held out   {where or '-'}",
        f"why        {d.get('reason', '')}",
    ]


def format_result(r: dict[str, Any]) -> str:
    if r.get("dry_run"):
        lines = ["dry run: nothing was changed"]
        if r.get("decision"):
            lines += format_decision(r["decision"])
        if r.get("reason"):
            lines.append(f"note       {r['reason']}")
        return "\n".join(lines)
    rec = r.get("record")
    if rec:  # --wait
        head = f"remap {rec.get('id')} ({rec.get('trigger')}): {rec.get('state')}"
        lines = [head + (f": {rec['error']}" if rec.get("error") else "")]
        for step in rec.get("steps") or []:
            lines.append(f"  {step.get('state', ''):<18} {step.get('seconds', '')!s:>8} s  {step.get('detail') or ''}")
        if rec.get("decision"):
            lines += format_decision(rec["decision"])
        return "\n".join(lines)
    state = r.get("state", "")
    return (f"remap {r.get('remap_id')} started ({r.get('trigger')}, state {state})"
            + (f": {r['reason']}" if r.get("reason") else "")
            + "\nfollow it with `pinsidecar status` (or pass --wait)")


def _find(status: dict[str, Any], remap_id: str) -> dict[str, Any] | None:
    remap = status.get("remap") or {}
    for rec in (remap.get("current"), remap.get("last"), *(remap.get("history") or [])):
        if isinstance(rec, dict) and rec.get("id") == remap_id:
            return rec
    return None


def _wait(cfg: Any, remap_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        code, st = _request(cfg, "GET", "/status", timeout=10.0)
        rec = _find(st, remap_id) if code == 200 else None
        if rec is not None and rec.get("state") in TERMINAL_STATES:
            return rec
        if time.monotonic() > deadline:
            raise UserError(f"remap {remap_id} did not end within {timeout_s:.0f} s "
                            f"(last state: {rec.get('state') if rec else 'unknown'})",
                            "it keeps running in the daemon; follow it with `pinsidecar status`")
        time.sleep(WAIT_POLL_S)


def register(main: click.Group) -> None:
    @main.command("remap")
    @config_option
    @click.option("--dry-run", is_flag=True,
                  help="Show the decision and its figures (candidate and active cold rates on the held-out window, "
                       "margin, deploy or not and why); change nothing.")
    @click.option("--map", "map_ref", default=None,
                  help="Use this map instead of rebuilding: a file name, path or label in the maps folder, or a "
                       "hash prefix.")
    @click.option("--reason", default="", help="Why (recorded with the remap).")
    @click.option("--trigger", type=click.Choice(["manual", "timer"]), default="manual", show_default=True,
                  help="Who asks (the systemd timer passes `timer`).")
    @click.option("--wait", "wait_s", type=click.FloatRange(min=0, min_open=True), default=None,
                  metavar="SECONDS", help="Wait up to SECONDS for the remap to end and print its steps.")
    @json_option
    @handle_errors
    def remap_cmd(config_path: Path | None, dry_run: bool, map_ref: str | None, reason: str, trigger: str,
                  wait_s: float | None, as_json: bool) -> None:
        """Ask the running daemon for a remap, through the same cooldown and daily cap as every trigger."""
        cfg = _load(config_path, check_paths=False)
        token = _control_token(cfg)
        body: dict[str, Any] = {"dry_run": dry_run, "reason": reason, "trigger": trigger}
        if map_ref:
            p = Path(map_ref)
            body["map"] = str(p.resolve()) if p.exists() else map_ref
        # a dry run builds and judges a candidate in the daemon: seconds, not the remap's minutes
        code, payload = _request(cfg, "POST", "/remap", timeout=120.0, token=token, body=body)
        if code in (409, 429):
            click.echo(f"remap not started: {payload.get('error', payload)}", err=True)
            if as_json:
                emit({"accepted": False, "status": code, **payload}, True)
            sys.exit(EXIT_REFUSED)
        if code >= 400:
            raise UserError(f"remap refused (HTTP {code}): {payload.get('error', payload)}")
        if wait_s is not None and not dry_run and payload.get("remap_id"):
            payload = {**payload, "record": _wait(cfg, payload["remap_id"], wait_s)}
        emit(payload, as_json, format_result)
        record = payload.get("record")
        if record is not None and record.get("state") != "committed":
            sys.exit(1)
