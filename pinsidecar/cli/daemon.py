"""``pinsidecar run``, ``pinsidecar status`` and ``pinsidecar drain-reboot``: the daemon and its clients.

``run`` is the daemon itself (what the systemd unit starts). ``status`` and ``drain-reboot`` (and ``remap``, in
:mod:`pinsidecar.cli.remap`) talk to a running daemon's control API; they read the same config file
(``--config``, default ``/etc/pinsidecar/pinsidecar.toml``) to find it (``control.host``/``control.port`` or
``control.unix_socket``) and, for the mutating calls, the bearer token (``control.token_file``, which the operator
must be able to read).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import httpx

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

__all__: list[str] = []  # nothing here is another package's business

config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Config file [default: /etc/pinsidecar/pinsidecar.toml].")


def _load(config_path: Path | None, overrides: dict[str, Any] | None = None, check_paths: bool = True) -> Any:
    from pinsidecar.daemon.config import ConfigError, load_config

    try:
        return load_config(config_path, overrides, check_paths=check_paths)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _control_token(cfg: Any) -> str:
    """The bearer token mutating control calls need, read from ``control.token_file`` (a user error if not)."""
    from pinsidecar.daemon.control import TokenFileError, read_token

    try:
        return read_token(cfg.control.token_file)
    except TokenFileError as exc:
        raise UserError(str(exc)) from None
    except PermissionError:
        raise UserError(f"cannot read control.token_file {cfg.control.token_file}",
                        "run as the daemon's user or root") from None


def _client(cfg: Any, timeout: float) -> httpx.Client:
    c = cfg.control
    if c.unix_socket is not None:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(c.unix_socket)), base_url="http://pinsidecar",
                            timeout=timeout)
    host = f"[{c.host}]" if ":" in c.host else c.host
    return httpx.Client(base_url=f"http://{host}:{c.port}", timeout=timeout)


def _where(cfg: Any) -> str:
    c = cfg.control
    return f"unix socket {c.unix_socket}" if c.unix_socket else f"{c.host}:{c.port}"


def _request(cfg: Any, method: str, path: str, *, timeout: float, token: str | None = None,
             body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with _client(cfg, timeout) as client:
            resp = client.request(method, path, json=body, headers=headers)
    except httpx.ConnectError:
        raise UserError(f"no pinsidecar daemon answers on {_where(cfg)}",
                        "start it with `pinsidecar run --config ...` or check control.* in the config") from None
    except httpx.TimeoutException:
        raise UserError(f"the daemon on {_where(cfg)} did not answer in {timeout:.0f} s") from None
    try:
        payload = resp.json()
    except ValueError:
        payload = {"error": resp.text.strip()}
    if resp.status_code == 401:
        raise UserError("the daemon refused the token (401)", "check control.token_file")
    return resp.status_code, payload


def _fmt_status(st: dict[str, Any]) -> str:
    eng = st.get("engine") or {}
    lines = []
    state = eng.get("state", "?")
    extra = f": {eng['detail']}" if eng.get("detail") else ""
    lines.append(f"engine   {state}{extra}")
    if eng.get("pid"):
        ready = f", ready for {eng['ready_for_s']} s" if eng.get("ready_for_s") is not None else ""
        lines.append(f"         pid {eng['pid']} at {eng.get('url')}{ready}")
    lines.append(f"         restarts {eng.get('restarts_total', 0)}, failures in a row {eng.get('failures_in_row', 0)}")
    m = eng.get("map")
    if m:
        g = m.get("geometry", {})
        lines.append(f"map      {m['hash'][:19]}  {m.get('label') or ''}  hot {g.get('hot_rows')} / cold "
                     f"{g.get('cold_rows')} rows per layer  ({m['path']})")
    else:
        lines.append("map      none")
    b = eng.get("last_boot")
    if b:
        lines.append(f"boot     {b['reason']}: {'ok' if b['ok'] else 'FAILED'} in {b['seconds']} s"
                     + ("  (compile-cache miss)" if b.get("cache_miss") else "")
                     + (f"  {b['error']}" if b.get("error") else ""))
    p = st.get("pin")
    if p and p.get("backend"):
        verified = "verified" if p.get("backend_verified") else (
            "UNVERIFIED: this backend has not run on hardware against vLLM's unsplit kernel")
        guarantee = f"{p['backend_guarantee']}, " if p.get("backend_guarantee") else ""
        lines.append(f"split    {p['backend']} ({guarantee}{verified})"
                     + (f", {p['expert_bytes']} bytes per expert" if p.get("expert_bytes") else "")
                     + (" per rank" if p.get("expert_bytes") and (p.get("tp_size") or 1) > 1 else ""))
        if (p.get("tp_size") or 1) > 1:
            per, lane = p.get("tier_bytes") or {}, p.get("lane_tier_bytes") or {}
            lines.append(f"ranks    tensor parallel {p['tp_size']}: each rank holds an equal shard; "
                         + ", ".join(f"{tier} {per[tier] / 2**30:.2f} GiB per rank, {lane.get(tier, 0) / 2**30:.2f}"
                                     " GiB in all" for tier in sorted(per)))
        sc = p.get("selfcheck")
        if sc:
            lines.append("         self-check " +
                         f"{sc.get('equal')}/{sc.get('cases')} cases bitwise equal over {sc.get('layers')} layers"
                         + (f", {sc.get('mismatch_count')} MISMATCHED" if sc.get("mismatch_count")
                            and sc.get("expected_equal", True) else "")
                         + ("" if sc.get("expected_equal", True) else " (placement-invariant backend)"))
    cache = (p or {}).get("cache")
    if cache:
        lines.append(_fmt_cache(cache))
    g = st.get("gate")
    if g:
        lines.append(f"gate     upstream {g['upstream']}, in flight {g['in_flight']}, held {g['held']}"
                     + (" (holding)" if g.get("holding") else ""))
    d = st.get("last_drain_reboot")
    if d:
        lines.append(f"drain    last drain-reboot {'ok' if d.get('ok') else 'FAILED'} in {d.get('seconds')} s"
                     + (" (rolled back)" if d.get("rolled_back") else "") + (f": {d['error']}" if d.get("error")
                                                                              else ""))
    lines += _fmt_drift_and_remap(st)
    maps = (st.get("maps") or {}).get("entries", [])
    valid = [e for e in maps if e["valid"]]
    maps_dir = (st.get("maps") or {}).get("dir")
    lines.append(f"maps     {len(valid)} valid, {len(maps) - len(valid)} invalid in {maps_dir}")
    for e in maps:
        name = Path(e["path"]).name
        if e["valid"]:
            lines.append(f"  ok     {name}  {e['hash'][:19]}  {e.get('label') or ''}")
        else:
            lines.append(f"  BAD    {name}  {e['error']}")
    dmn = st.get("daemon") or {}
    lines.append(f"daemon   pid {dmn.get('pid')}, up {dmn.get('uptime_s')} s, control {dmn.get('control')}, "
                 f"metrics {dmn.get('metrics')}")
    return "\n".join(lines)


def _fmt_cache(c: dict[str, Any]) -> str:
    """The cache tier in one line: slots, policy, and the slots' hit rate since the engine booted."""
    head = f"cache    {c.get('slots')} slots per layer, {c.get('policy')}"
    hits, misses = c.get("hits") or 0, c.get("misses") or 0
    if c.get("hit_ratio") is None:
        return head + ": no selection has reached a slot or host memory since boot"
    return (head + f": hit rate {100 * float(c['hit_ratio']):.1f} % since boot ({hits} hits, {misses} misses; "
            f"{c.get('fills') or 0} fills, {c.get('evictions') or 0} evictions)")


def _fmt_drift_and_remap(st: dict[str, Any]) -> list[str]:
    """The drift watch's one line and the remaps (current, last): what `status` shows of the loop."""
    lines = []
    drift = st.get("drift")
    if drift:
        extra = f", cooldown {drift['cooldown_left_s']:.0f} s" if drift.get("cooldown_left_s") else ""
        lines.append(f"drift    {drift.get('state', '?')}: {drift.get('line') or drift.get('status', '')}"
                     f" ({drift.get('remaps_last_day', 0)} remaps in 24 h{extra})")
        stats = drift.get("stats") or {}
        if stats.get("error"):
            lines.append(f"stats    unreadable, the drift watch is blind: {stats['error']}")
        elif stats.get("stale"):
            lines.append(f"stats    no new write for {stats['unchanged_s']:.0f} s, the drift watch is blind")
    remap = st.get("remap") or {}
    for key in ("current", "last"):
        rec = remap.get(key)
        if rec:
            lines.append(f"remap    {key} {rec.get('id')} ({rec.get('trigger')}): {rec.get('state')}"
                         + (f": {rec['error']}" if rec.get("error") else "")
                         + (f"  {rec['reason']}" if rec.get("reason") and not rec.get("error") else ""))
    apply = remap.get("last_apply")
    if apply:
        lines.append(_fmt_apply(apply))
    return lines


def _fmt_apply(a: dict[str, Any]) -> str:
    """The last in-place deploy in one line: how it ended, and what the hook did (how long serving stood still)."""
    outcome = a.get("outcome") or f"in progress ({a.get('remap_state')})"
    head = f"apply    last (remap {a.get('remap')}): {outcome}"
    if a.get("result") == "applied":
        moved = a.get("bytes_moved") or 0
        head += (f"; the hook swapped {a.get('rows') or 0} rows ({moved / 2**20:.1f} MiB) in "
                 f"{float(a.get('seconds') or 0.0) * 1000:.1f} ms")
    elif a.get("result"):
        head += f"; the hook's answer: {a['result']}"
    if a.get("reason") and a.get("outcome") != "applied":
        head += f"  ({a['reason']})"
    return head


def _fmt_drain(res: dict[str, Any]) -> str:
    if res.get("ok"):
        held = f"{res.get('held_at_release', 0)} request(s) held for {res.get('hold_s')} s"
        head = (f"drain-reboot done in {res.get('seconds')} s "
                f"(drain {res.get('drain_s')} s, boot {res.get('boot_s')} s, {held})")
    else:
        head = f"drain-reboot FAILED after {res.get('seconds')} s: {res.get('error')}"
    lines = [head]
    if res.get("map"):
        lines.append(f"map      {res['map']} ({res.get('map_hash', '')[:19]})"
                     + ("" if res.get("hash_hit", True) else "  another geometry (hot rows changed)"))
    if res.get("in_flight_cut"):
        lines.append(f"warning  {res['in_flight_cut']} request(s) were still in flight when the drain timed out")
    if res.get("rolled_back"):
        lines.append("rollback the engine was booted again with the previous map")
    if res.get("cache_miss"):
        lines.append("warning  the boot was much slower than the last one with this geometry (compile-cache miss)")
    for line in res.get("engine_log") or []:
        lines.append(f"  | {line}")
    return "\n".join(lines)


def register(main: click.Group) -> None:
    @main.command("run")
    @config_option
    @click.option("--model", "model", type=click.Path(path_type=Path), default=None,
                  help="Serve this model folder (overrides engine.model).")
    @json_option
    @handle_errors
    def run_cmd(config_path: Path | None, model: Path | None, as_json: bool) -> None:
        """Run the daemon: supervise the engine, front it with the gate, serve metrics and the control API.

        Logs go to stderr at daemon.log_level (or --log-level), as JSON lines under systemd or when stderr is not a
        terminal (daemon.json_logs = auto); --json forces JSON lines."""
        from pinsidecar import log as pslog
        from pinsidecar.daemon.control import TokenFileError
        from pinsidecar.daemon.service import run_daemon

        overrides = {"engine.model": str(model.resolve())} if model is not None else None
        cfg = _load(config_path, overrides)
        json_logs = True if as_json or cfg.daemon.json_logs == "yes" else (
            False if cfg.daemon.json_logs == "no" else None)
        level = click.get_current_context().find_root().params.get("log_level") or cfg.daemon.log_level
        pslog.configure(level, json_logs=json_logs)
        try:
            code = run_daemon(cfg)
        except TokenFileError as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:  # a port in use, a folder that cannot be created
            raise UserError(f"cannot start: {exc}") from None
        sys.exit(code)

    @main.command("status")
    @config_option
    @json_option
    @handle_errors
    def status_cmd(config_path: Path | None, as_json: bool) -> None:
        """Show the running daemon's engine state, map, last boot, cache tier, gate and maps library."""
        cfg = _load(config_path, check_paths=False)
        code, payload = _request(cfg, "GET", "/status", timeout=10.0)
        if code != 200:
            raise UserError(f"status failed (HTTP {code}): {payload.get('error', payload)}")
        emit(payload, as_json, _fmt_status)

    @main.command("drain-reboot")
    @config_option
    @click.option("--map", "map_ref", default=None,
                  help="Boot with this map: a file name or a path in the maps folder, or a hash prefix.")
    @click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
                  help="Seconds in-flight requests get to finish [default: control.drain_timeout_s].")
    @json_option
    @handle_errors
    def drain_reboot_cmd(config_path: Path | None, map_ref: str | None, timeout_s: float | None,
                         as_json: bool) -> None:
        """Hold new requests, drain in-flight ones, reboot the engine (optionally with a new map), release."""
        cfg = _load(config_path, check_paths=False)
        token = _control_token(cfg)
        body: dict[str, Any] = {}
        if map_ref:
            p = Path(map_ref)
            body["map"] = str(p.resolve()) if p.exists() else map_ref
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        wait = (timeout_s or cfg.control.drain_timeout_s) + cfg.engine.ready_timeout_s * 2 + 60
        code, payload = _request(cfg, "POST", "/drain-reboot", timeout=wait, token=token, body=body)
        if code in (400, 409, 413, 503):
            raise UserError(str(payload.get("error", payload)))
        emit(payload, as_json, _fmt_drain)
        if not payload.get("ok"):
            sys.exit(1)
