"""The daemon's control API: ``GET /status``, ``POST /drain-reboot``, ``POST /remap``; ``GET /openapi.json``
describes them (:mod:`pinsidecar.daemon.openapi`).

``POST /remap`` takes two kinds of body (told apart by shape, parsed in :mod:`pinsidecar.daemon.webhook`): a
request from ``pinsidecar remap`` (``{"dry_run", "map", "reason", "trigger"}``), and an Alertmanager webhook
delivery (firing remap alerts start one remap; resolved ones and repeats are acknowledged with no action). Both end
in the daemon's ``request_remap``, the one gate every trigger passes (one remap at a time, cooldown, daily cap):
202 when a remap started, 200 for a dry run's decision or a delivery that needed no action, 409/429 when the gate
refuses, 4xx with nothing done for a bad body.

HTTP on loopback by default (``control.host``/``control.port``) or a unix socket (``control.unix_socket``), served
by ``aiohttp.web`` inside the daemon's event loop. The rules, and why:

- **Mutating calls need ``Authorization: Bearer <token>``**, the token read from ``control.token_file``. The file
  must be mode 0600 (no group or other bits): a token anyone on the box can read protects nothing, so the daemon
  refuses to start otherwise. A missing or wrong token is answered 401 *before* anything is parsed or done.
  ``GET /status`` and ``GET /openapi.json`` are read-only and open on the loopback listener. Tokens are compared
  with :func:`hmac.compare_digest` (constant time: a wrong token's answer time says nothing about the right one).
- **Bodies are bounded** (``control.max_body_bytes``): a larger ``Content-Length`` (or a body that turns out larger)
  is 413 before anything is done.
- Errors are JSON ``{"error": "..."}`` (aiohttp's own 404/405 and an unexpected exception too) with a status that
  says whose fault it is (400 bad input, 409 busy, 422 an alert that does not start a remap, 429 cooldown or daily
  cap, 500/502 the operation failed, 503 still starting).

The daemon implements :class:`ControlTarget`; this module knows nothing about engines or gates.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Protocol

import structlog
from aiohttp import web

from pinsidecar.daemon.openapi import openapi_document
from pinsidecar.daemon.webhook import (
    DEFAULT_REMAP_ALERTS,
    AlertMemory,
    WebhookError,
    is_alertmanager_body,
    parse_alertmanager_body,
    parse_cli_body,
    plan_delivery,
    refuse_nulls,
)
from pinsidecar.errors import ControlError

__all__ = ["ControlError", "TokenFileError", "read_token"]

log = structlog.get_logger(__name__)


class TokenFileError(RuntimeError):
    """The token file is missing, empty or readable by others: the daemon refuses to start."""


class ControlTarget(Protocol):
    def status(self) -> dict[str, Any]: ...

    async def drain_reboot(self, map_ref: str | None, timeout_s: float | None) -> dict[str, Any]: ...

    async def request_remap(self, *, trigger: str, dry_run: bool = False, map_ref: str | None = None,
                            reason: str = "", detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """The one entry of every remap trigger; raises :class:`ControlError` (409 running, 429 cooldown or daily
        cap, 400 bad map, 503 starting). Returns ``{"accepted", "remap_id", "state", "reason", "decision", ...}``."""
        ...


def read_token(path: Path, create: bool = False) -> str:
    """The bearer token in ``path``. With ``create``, a missing file is created (random token, mode 0600)."""
    path = Path(path)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        log.info("control_token_created", path=str(path))
    try:
        st = path.stat()
    except FileNotFoundError:
        raise TokenFileError(f"control.token_file: {path} does not exist (create it with mode 0600)") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise TokenFileError(f"control.token_file: {path} has mode {mode:04o}; it must not be readable by group or "
                             f"others (chmod 600 {path})")
    token = path.read_text().strip()
    if len(token) < 16:
        raise TokenFileError(f"control.token_file: {path} holds {len(token)} characters; use at least 16 "
                             "(e.g. `openssl rand -hex 32`)")
    return token


def _no_constant(name: str) -> Any:
    """Python's json reads NaN and Infinity, which are not JSON and pass every ``<`` check (a NaN timeout)."""
    raise ValueError(f"{name} is not a JSON number")


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload, default=str) + "\n",
                        content_type="application/json")


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return _json({"error": message, **extra}, status)


class ControlServer:
    """The control API, bound to a :class:`ControlTarget`. ``await start()`` / ``await stop()``."""

    def __init__(self, target: ControlTarget, token: str, *, host: str = "127.0.0.1", port: int = 0,
                 unix_socket: Path | None = None, max_body_bytes: int = 64 * 1024,
                 remap_alerts: tuple[str, ...] | list[str] = DEFAULT_REMAP_ALERTS,
                 alert_memory: AlertMemory | None = None) -> None:
        self.target = target
        self.remap_alerts = tuple(remap_alerts)
        self.alerts = alert_memory if alert_memory is not None else AlertMemory()
        self._token = token.encode()
        self.host, self.port, self.unix_socket = host, port, unix_socket
        self.max_body_bytes = max_body_bytes
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._guard])
        self.app.router.add_get("/status", self._status)
        self.app.router.add_get("/openapi.json", self._openapi)
        self.app.router.add_post("/drain-reboot", self._drain_reboot)
        self.app.router.add_post("/remap", self._remap)

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        if self.unix_socket is not None:
            self.unix_socket.parent.mkdir(parents=True, exist_ok=True)
            if self.unix_socket.exists():
                self.unix_socket.unlink()
            site: web.BaseSite = web.UnixSite(self._runner, str(self.unix_socket))
            await site.start()
            os.chmod(self.unix_socket, 0o660)
        else:
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
            if self.port == 0:  # tests ask for any free port
                server = getattr(site, "_server", None)
                if server is not None and server.sockets:
                    self.port = server.sockets[0].getsockname()[1]
        log.info("control_listening", address=self.address)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------------------------------------ guard

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return _error(413, f"request body of {request.content_length} bytes is over the limit of "
                          f"{self.max_body_bytes} bytes")
        if request.method != "GET" and not self._authorized(request):
            log.warning("control_unauthorized", path=request.path, remote=request.remote)
            return web.Response(status=401, text=json.dumps({"error": "missing or wrong bearer token"}) + "\n",
                                content_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body is over the limit of {self.max_body_bytes} bytes")
        except ControlError as exc:
            return _error(exc.status, str(exc), **exc.payload)
        except web.HTTPException as exc:  # aiohttp's own 404/405: JSON like every other error, Allow kept
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            response = _error(exc.status, f"{exc.reason}: {request.method} {request.path} (see GET /openapi.json)")
            response.headers.update(headers)
            return response
        except Exception as exc:  # a bug: answer JSON and log it, rather than aiohttp's HTML 500
            log.exception("control_handler_failed", path=request.path)
            return _error(500, f"internal error ({type(exc).__name__}); see the daemon's log")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        raw = await request.read()  # bounded by client_max_size -> HTTPRequestEntityTooLarge
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            raise ControlError(400, "body is not usable JSON: nested too deeply") from None
        except ValueError as exc:
            raise ControlError(400, f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ControlError(400, "body must be a JSON object")
        return body

    # ------------------------------------------------------------------------------------------------ handlers

    async def _status(self, request: web.Request) -> web.Response:
        return _json(self.target.status())

    async def _openapi(self, request: web.Request) -> web.Response:
        return _json(openapi_document())

    async def _drain_reboot(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        unknown = sorted(set(body) - {"map", "timeout_s"})
        if unknown:
            raise ControlError(400, f"unknown field {unknown[0]!r} (allowed: map, timeout_s)")
        try:
            refuse_nulls(body)
        except WebhookError as exc:
            raise ControlError(exc.status, str(exc)) from None
        map_ref = body.get("map")
        if map_ref is not None and (not isinstance(map_ref, str) or not map_ref.strip()):
            raise ControlError(400, "map: expected a path, a file name in the maps folder, or a hash")
        map_ref = map_ref.strip() if map_ref else None
        timeout_s = body.get("timeout_s")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
                                      or timeout_s <= 0):
            raise ControlError(400, f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        result = await self.target.drain_reboot(map_ref, None if timeout_s is None else float(timeout_s))
        return _json(result, 200 if result.get("ok") else 500)

    async def _remap(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            if is_alertmanager_body(body):
                return await self._alert(body)
            req = parse_cli_body(body)
        except WebhookError as exc:
            log.warning("remap_request_refused", status=exc.status, error=str(exc))
            raise ControlError(exc.status, str(exc)) from None
        result = await self.target.request_remap(trigger=req.trigger, dry_run=req.dry_run, map_ref=req.map_ref,
                                                 reason=req.reason or f"{req.trigger} request")
        return _json(result, 202 if result.get("accepted") and not req.dry_run else 200)

    async def _alert(self, body: dict[str, Any]) -> web.Response:
        """An Alertmanager delivery: one remap for its new firing alerts, or an acknowledgement with no action."""
        delivery = parse_alertmanager_body(body, self.remap_alerts)
        plan = plan_delivery(delivery, self.alerts)
        log.info("remap_webhook", receiver=delivery.receiver, status=delivery.status, new=len(plan.new),
                 duplicates=len(plan.duplicates), resolved=len(plan.resolved))
        if not plan.remap:
            return _json({"accepted": False, "action": "none", "reason": plan.why_not, "alerts": plan.as_dict()})
        keys = [a.key for a in plan.new]
        self.alerts.remember(keys)  # before the await: a concurrent repeat is a duplicate, not a second remap
        try:
            result = await self.target.request_remap(
                trigger="alert", reason=plan.reason(),
                detail={"alerts": [a.as_dict() for a in plan.new], "receiver": delivery.receiver,
                        "group_key": delivery.group_key})
        except BaseException:
            self.alerts.forget(keys)  # refused (cooldown, running): Alertmanager's next repeat may try again
            raise
        if not result.get("accepted"):
            self.alerts.forget(keys)
        return _json({**result, "action": "remap" if result.get("accepted") else "none",
                      "alerts": plan.as_dict()}, 202 if result.get("accepted") else 200)
