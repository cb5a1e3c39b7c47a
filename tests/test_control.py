"""The control API over real HTTP (TCP and unix socket): auth, body limits, the CLI's remap body, token-file rules.

(Alertmanager deliveries on ``/remap`` are in test_webhook.py.)

The target here records calls instead of rebooting an engine, so "nothing happens" on a refused call is checked
directly; the full path (real daemon, real engine) is in test_daemon_drain.py.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from pinsidecar.daemon.control import ControlServer, TokenFileError, read_token
from pinsidecar.testing.control import RecordingTarget

TOKEN = "t0k3n-" + "a" * 26
PORT = 8260


async def _with_server(fn: Any, target: RecordingTarget | None = None, **kwargs: Any) -> tuple[RecordingTarget, Any]:
    target = target if target is not None else RecordingTarget()
    server = ControlServer(target, TOKEN, max_body_bytes=1024, **kwargs)
    await server.start()
    try:
        if server.unix_socket is not None:
            client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(server.unix_socket)),
                                       base_url="http://control")
        else:
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}")
        async with client:
            result = await fn(client)
    finally:
        await server.stop()
    return target, result


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_status_is_open_and_drain_reboot_needs_the_token() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.get("/status"),
            await c.post("/drain-reboot", json={"map": "x.json"}),
            await c.post("/drain-reboot", json={"map": "x.json"}, headers=_auth("wrong-token-xxxxxxxx")),
            await c.post("/drain-reboot", json={"map": "x.json"}, headers={"Authorization": TOKEN}),  # no scheme
            await c.post("/drain-reboot", json={"map": "x.json", "timeout_s": 5}, headers=_auth()),
        ]

    target, (st, none, wrong, noscheme, ok) = asyncio.run(_with_server(scenario, port=PORT))
    assert st.status_code == 200 and st.json()["engine"]["state"] == "ready"
    for r in (none, wrong, noscheme):
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert ok.status_code == 200 and ok.json() == {"ok": True, "map": "x.json"}
    assert target.calls == [("x.json", 5.0)]  # the refused calls did nothing


def test_oversized_body_is_413_and_does_nothing() -> None:
    big = {"map": "m" * 4096}

    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        chunked = await c.post("/drain-reboot", headers=_auth(), content=_chunks(b'{"map": "' + b"m" * 4096 + b'"}'))
        return [await c.post("/drain-reboot", json=big, headers=_auth()), chunked]

    target, (sized, streamed) = asyncio.run(_with_server(scenario, port=PORT + 1))
    assert sized.status_code == 413 and "over the limit of 1024 bytes" in sized.json()["error"]
    assert streamed.status_code == 413  # no Content-Length: caught while reading
    assert target.calls == []


async def _chunks(data: bytes) -> Any:
    for i in range(0, len(data), 512):
        yield data[i:i + 512]


def test_remap_needs_auth_and_a_cli_body_reaches_the_one_gate() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.post("/remap", json={}),
            await c.post("/remap", json={"dry_run": True, "map": "prose", "reason": "try it"}, headers=_auth()),
            await c.post("/remap", json={}, headers=_auth()),
            await c.post("/remap", json={"trigger": "timer", "reason": "nightly"}, headers=_auth()),
        ]

    target, (unauth, dry, manual, timer) = asyncio.run(_with_server(scenario, port=PORT + 2))
    assert unauth.status_code == 401
    assert dry.status_code == 200 and dry.json()["decision"] == {"deploy": True, "reason": "fake"}
    assert manual.status_code == 202 and manual.json()["remap_id"] == "r1"
    assert timer.status_code == 202
    assert [(r["trigger"], r["dry_run"], r["map_ref"], r["reason"]) for r in target.remaps] == [
        ("manual", True, "prose", "try it"), ("manual", False, None, "manual request"),
        ("timer", False, None, "nightly")]


def test_bad_remap_bodies_are_400_and_gate_refusals_keep_their_status() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        out = [
            await c.post("/remap", content=b"{not json", headers=_auth()),
            await c.post("/remap", json={"dryrun": True}, headers=_auth()),
            await c.post("/remap", json={"dry_run": "yes"}, headers=_auth()),
            await c.post("/remap", json={"map": ""}, headers=_auth()),
            await c.post("/remap", json={"trigger": "alert"}, headers=_auth()),  # only Alertmanager's body is
            await c.post("/remap", json={"reason": 5}, headers=_auth()),
            await c.post("/remap", json={"map": None}, headers=_auth()),
        ]
        target.refuse = (429, "cooldown: 120 s left")
        out.append(await c.post("/remap", json={}, headers=_auth()))
        target.refuse = (409, "remap r7 (state count_boot, trigger drift) is already running")
        out.append(await c.post("/remap", json={}, headers=_auth()))
        return out

    target = RecordingTarget()
    _, rs = asyncio.run(_with_server(scenario, port=PORT + 4, target=target))
    assert [r.status_code for r in rs] == [400, 400, 400, 400, 400, 400, 400, 429, 409]
    assert "unknown field 'dryrun'" in rs[1].json()["error"]
    assert "dry_run" in rs[2].json()["error"] and "map" in rs[3].json()["error"]
    assert "trigger" in rs[4].json()["error"] and "reason" in rs[5].json()["error"]
    assert rs[6].json()["error"].startswith("map: null is not a value")
    assert "cooldown" in rs[7].json()["error"] and "remap r7" in rs[8].json()["error"]
    assert target.remaps == []


def test_bad_bodies_are_400_and_target_errors_keep_their_status() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.post("/drain-reboot", content=b"{not json", headers=_auth()),
            await c.post("/drain-reboot", json=[1, 2], headers=_auth()),
            await c.post("/drain-reboot", json={"mpa": "x"}, headers=_auth()),
            await c.post("/drain-reboot", json={"timeout_s": -1}, headers=_auth()),
            # null is not "left out" (the fuzzer's find: it used to reboot onto the active map), nor is a blank
            await c.post("/drain-reboot", json={"map": None}, headers=_auth()),
            await c.post("/drain-reboot", json={"timeout_s": None}, headers=_auth()),
            await c.post("/drain-reboot", json={"map": "  "}, headers=_auth()),
            await c.post("/drain-reboot", json={"map": "busy"}, headers=_auth()),
            await c.post("/drain-reboot", headers=_auth()),  # empty body: reboot with the current map
        ]

    target, rs = asyncio.run(_with_server(scenario, port=PORT + 3))
    assert [r.status_code for r in rs] == [400, 400, 400, 400, 400, 400, 400, 409, 200]
    assert "not JSON" in rs[0].json()["error"]
    assert "unknown field 'mpa'" in rs[2].json()["error"]
    assert "timeout_s" in rs[3].json()["error"]
    assert rs[4].json()["error"].startswith("map: null is not a value")
    assert rs[5].json()["error"].startswith("timeout_s: null is not a value")
    assert rs[6].json()["error"].startswith("map: expected a path")
    assert target.calls == [(None, None)]


def test_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "control.sock"

    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.get("/status"), await c.post("/drain-reboot", json={}, headers=_auth())]

    target, (st, ok) = asyncio.run(_with_server(scenario, unix_socket=sock))
    assert st.status_code == 200 and ok.status_code == 200
    assert target.calls == [(None, None)]


def test_token_file_rules(tmp_path: Path) -> None:
    p = tmp_path / "token"
    with pytest.raises(TokenFileError, match="does not exist"):
        read_token(p)
    p.write_text(TOKEN + "\n")
    os.chmod(p, 0o644)
    with pytest.raises(TokenFileError, match=r"mode 0644.*chmod 600"):
        read_token(p)
    os.chmod(p, 0o640)
    with pytest.raises(TokenFileError, match="mode 0640"):
        read_token(p)
    os.chmod(p, 0o600)
    assert read_token(p) == TOKEN
    p.write_text("short")
    with pytest.raises(TokenFileError, match="at least 16"):
        read_token(p)
    created = tmp_path / "sub" / "new.token"
    tok = read_token(created, create=True)
    assert len(tok) == 64
    assert stat.S_IMODE(created.stat().st_mode) == 0o600
    assert read_token(created, create=True) == tok  # not regenerated


# ------------------------------------------------------------------------------------------------ pinsidecar remap


class ServerThread:
    """The control API on its own event loop in a thread, so the (synchronous) CLI can talk to it."""

    def __init__(self, target: RecordingTarget) -> None:
        import threading

        self.target = target
        self.loop = asyncio.new_event_loop()
        self.server = ControlServer(target, TOKEN, port=0)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _cli_config(tmp_path: Path, port: int) -> Path:
    token = tmp_path / "control.token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    cfg = tmp_path / "pinsidecar.toml"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path / "model"}"\n[control]\ntoken_file = "{token}"\nport = {port}\n')
    return cfg


def test_remap_cli_dry_run_start_refusal_and_wait(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from pinsidecar.cli import main

    target = RecordingTarget()
    decision = {"deploy": False, "reason": "refused: candidate prose (abc) predicts 30.00% cold ...",
                "candidate_cold_rate": 0.30, "active_cold_rate": 0.31, "gain": 0.01, "margin": 0.05,
                "candidate_hash": "sha256:abcdef0123456789", "candidate_label": "prose",
                "active_hash": "sha256:0011223344556677", "active_label": "code",
                "held_out": {"window": 7, "tokens": 1024, "source": "live"}, "source": "rebuild"}

    async def dry_remap(**kw: Any) -> dict[str, Any]:
        target.remaps.append(kw)
        return {"accepted": False, "remap_id": None, "trigger": kw["trigger"], "dry_run": True, "state": "evaluating",
                "reason": "", "decision": decision}

    server = ServerThread(target)
    try:
        cfg = str(_cli_config(tmp_path, server.server.port))
        run = CliRunner().invoke
        target.request_remap, real = dry_remap, target.request_remap  # type: ignore[method-assign]
        dry = run(main, ["remap", "--config", cfg, "--dry-run", "--reason", "look"])
        assert dry.exit_code == 0, dry.output
        assert "dry run: nothing was changed" in dry.output and "do not deploy" in dry.output
        assert "30.00% cold" in dry.output and "31.00% cold" in dry.output and "margin +5.00 pts" in dry.output
        assert "window 7, tokens 1024" in dry.output
        target.request_remap = real  # type: ignore[method-assign]
        started = run(main, ["remap", "--config", cfg, "--trigger", "timer", "--map", "prose", "--json"])
        assert started.exit_code == 0, started.output
        assert json.loads(started.output)["remap_id"] == "r1"
        assert target.remaps[-1]["trigger"] == "timer" and target.remaps[-1]["map_ref"] == "prose"
        target.refuse = (429, "daily cap: 6 remaps in the last 24 h")
        refused = run(main, ["remap", "--config", cfg])
        assert refused.exit_code == 3 and "remap not started: daily cap" in refused.output
        target.refuse = None
        target.status = lambda: {"remap": {"current": None, "last": {  # type: ignore[method-assign]
            "id": "r2", "trigger": "manual", "state": "rolled_back", "error": "verify: parity mismatch",
            "steps": [{"state": "rebooting", "seconds": 12.5, "detail": "hash hit"}]}, "history": []}}
        waited = run(main, ["remap", "--config", cfg, "--wait", "30"])
        assert waited.exit_code == 1, waited.output
        assert "remap r2 (manual): rolled_back: verify: parity mismatch" in waited.output
        bad_token = tmp_path / "control.token"
        bad_token.write_text("wrong-token-0123456789\n")
        assert run(main, ["remap", "--config", cfg]).exit_code == 2
    finally:
        server.close()
    assert [r["trigger"] for r in target.remaps] == ["manual", "timer", "manual"]


def test_status_shows_the_drift_line_and_the_remaps() -> None:
    from pinsidecar.cli.daemon import _fmt_status

    st = {"engine": {"state": "ready"}, "maps": {"entries": [], "dir": "/m"}, "daemon": {},
          "drift": {"state": "drifted", "line": "no exploitable skew", "remaps_last_day": 2, "cooldown_left_s": 120.0},
          "remap": {"current": {"id": "r9", "trigger": "alert", "state": "rebooting", "reason": "alert X"},
                    "last": {"id": "r8", "trigger": "timer", "state": "refused", "error": None,
                             "reason": "periodic re-profile"}, "history": []}}
    text = _fmt_status(st)
    assert "drift    drifted: no exploitable skew (2 remaps in 24 h, cooldown 120 s)" in text
    assert "remap    current r9 (alert): rebooting  alert X" in text
    assert "remap    last r8 (timer): refused  periodic re-profile" in text
    assert "drift" not in _fmt_status({**st, "drift": None, "remap": None})


def test_status_says_when_the_split_backend_is_unverified() -> None:
    from pinsidecar.cli.daemon import _fmt_status

    st = {"engine": {"state": "ready"}, "maps": {"entries": [], "dir": "/m"}, "daemon": {},
          "pin": {"backend": "flashinfer_trtllm", "backend_verified": False, "expert_bytes": 18800640,
                  "selfcheck": {"layers": 40, "cases": 360, "equal": 358, "mismatch_count": 2}}}
    text = _fmt_status(st)
    assert "split    flashinfer_trtllm (UNVERIFIED: this backend has not run on hardware" in text
    assert "18800640 bytes per expert" in text
    assert "self-check 358/360 cases bitwise equal over 40 layers, 2 MISMATCHED" in text
    st["pin"] = {"backend": "triton_experts", "backend_verified": True, "selfcheck": None}
    assert "split    triton_experts (verified)" in _fmt_status(st)  # stats written before the guarantee was
    st["pin"]["backend_guarantee"] = "bitwise"
    assert "split    triton_experts (bitwise, verified)" in _fmt_status(st)
    st["pin"] = {"backend": "cpu", "backend_verified": True, "backend_guarantee": "placement-invariant"}
    assert "split    cpu (placement-invariant, verified)" in _fmt_status(st)
    assert "split" not in _fmt_status({**st, "pin": None})


def test_status_shows_the_tensor_parallel_ranks_and_the_lane_total() -> None:
    from pinsidecar.cli.daemon import _fmt_status

    tiers = {"hbm": 3 * 2**30, "host": 2**30}
    st = {"engine": {"state": "ready"}, "maps": {"entries": [], "dir": "/m"}, "daemon": {},
          "pin": {"backend": "triton_experts", "backend_verified": True, "expert_bytes": 4700160, "tp_size": 2,
                  "tier_bytes": tiers, "lane_tier_bytes": {k: 2 * v for k, v in tiers.items()}}}
    text = _fmt_status(st)
    assert "4700160 bytes per expert per rank" in text
    assert ("ranks    tensor parallel 2: each rank holds an equal shard; hbm 3.00 GiB per rank, 6.00 GiB in all, "
            "host 1.00 GiB per rank, 2.00 GiB in all") in text
    st["pin"]["tp_size"] = 1
    assert "ranks" not in _fmt_status(st) and "per rank" not in _fmt_status(st)
