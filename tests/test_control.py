"""The control API over real HTTP (TCP and unix socket): auth, body limits, remap placeholder, token-file rules.

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

from pinsidecar.daemon.control import REMAP_NOT_AVAILABLE, ControlError, ControlServer, TokenFileError, read_token

TOKEN = "t0k3n-" + "a" * 26
PORT = 8260


class RecordingTarget:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, float | None]] = []

    def status(self) -> dict[str, Any]:
        return {"engine": {"state": "ready"}}

    async def drain_reboot(self, map_ref: str | None, timeout_s: float | None) -> dict[str, Any]:
        if map_ref == "busy":
            raise ControlError(409, "a drain-reboot is already running")
        self.calls.append((map_ref, timeout_s))
        return {"ok": True, "map": map_ref}


async def _with_server(fn: Any, **kwargs: Any) -> tuple[RecordingTarget, Any]:
    target = RecordingTarget()
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


def test_remap_is_not_available_yet_but_still_needs_auth() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/remap", json={}), await c.post("/remap", json={}, headers=_auth())]

    _, (unauth, auth) = asyncio.run(_with_server(scenario, port=PORT + 2))
    assert unauth.status_code == 401
    assert auth.status_code == 501 and auth.json()["error"] == REMAP_NOT_AVAILABLE


def test_bad_bodies_are_400_and_target_errors_keep_their_status() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.post("/drain-reboot", content=b"{not json", headers=_auth()),
            await c.post("/drain-reboot", json=[1, 2], headers=_auth()),
            await c.post("/drain-reboot", json={"mpa": "x"}, headers=_auth()),
            await c.post("/drain-reboot", json={"timeout_s": -1}, headers=_auth()),
            await c.post("/drain-reboot", json={"map": "busy"}, headers=_auth()),
            await c.post("/drain-reboot", headers=_auth()),  # empty body: reboot with the current map
        ]

    target, rs = asyncio.run(_with_server(scenario, port=PORT + 3))
    assert [r.status_code for r in rs] == [400, 400, 400, 400, 409, 200]
    assert "not JSON" in rs[0].json()["error"]
    assert "unknown field 'mpa'" in rs[2].json()["error"]
    assert "timeout_s" in rs[3].json()["error"]
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
