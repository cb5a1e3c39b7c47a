"""The gate: a small reverse proxy in front of the engine, so a drain-reboot loses no request.

Clients talk to the gate, never to the engine. Normally it is a transparent pass-through: method, path, query,
headers (minus hop-by-hop ones) and body go to the engine, and the engine's response comes back chunk by chunk as
it arrives (server-sent events are never buffered), so the client cannot tell it is there. During a drain-reboot
the daemon calls :meth:`Gate.hold` (new requests wait at the gate instead of reaching an engine that is going
away), :meth:`Gate.drain` (wait, bounded, for requests already at the engine to finish), reboots the engine,
points the gate at it (:meth:`Gate.set_upstream` if its address changed) and calls :meth:`Gate.release`, which
lets the held requests through in arrival order.

The same hold covers an engine that crashed: the supervisor holds the gate the moment the engine exits and
releases it once the restarted engine serves, and a request the engine never read (the connection was refused, or
reset with the request unread: a dying engine's listening socket accepts connections for a moment after SIGKILL) is
held and sent again rather than answered ``502``. Only requests the engine had already taken when it died fail,
each with a body that says so (in an event stream, a last ``data:`` event with an ``error`` before the connection
is cut). When the supervisor gives up (crash loop) it calls
:meth:`Gate.refuse`, and requests get ``503`` at once instead of waiting for a restart that will not come.

Every wait is bounded: at most ``max_queue`` requests are held, and each waits at the gate (held, or retrying an
engine that refuses connections) at most ``max_hold_s`` in all; beyond either the client gets ``503`` with
``Retry-After`` (``502`` when the engine stayed unreachable with the gate open). A body over ``max_body_bytes`` gets
``413`` (before anything reaches the engine). Clients get ``client_timeout_s`` to send their request head (aiohttp's
keep-alive timer also covers an unfinished head) and their body (``408``), so slow-loris clients cannot hold
connections for ever. An engine that sends nothing for ``upstream_idle_timeout_s`` (hung: accepts connections but
never answers, or stalls mid-stream) gets the request answered ``504``, or its stream ended with an error event.

The gate can also sample request bodies into a
:class:`~pinsidecar.daemon.traffic_capture.CaptureStore` (opt-in), which later count boots replay.

Threading: all methods must be called from the event loop the gate runs on (use
``loop.call_soon_threadsafe`` from another thread). Counters (:attr:`Gate.counters`) may be read from anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from pinsidecar.daemon.traffic_capture import CaptureStore

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# OpenAI-style requests are small (a long prompt is tens of KiB); 4 MiB leaves room for long contexts and still
# bounds what a held queue can pin in memory (max_queue x max_body_bytes).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# RFC 9110 section 7.6.1 hop-by-hop headers, plus the obsolete Proxy-Connection; headers named in Connection are
# stripped too.
HOP_BY_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade",
})
GATE_OUTCOMES = ("proxied", "rejected_queue_full", "rejected_hold_timeout", "rejected_stopping",
                 "rejected_engine_failed", "too_large", "client_timeout", "bad_gateway", "upstream_timeout",
                 "upstream_broken", "client_disconnected")
_STRIP_REQUEST = frozenset({"host", "content-length"})  # the client session sets both for the upstream
_STRIP_SMALL_RESPONSE = frozenset({"content-length"})  # web.Response sets it from the body
# Responses with a Content-Length up to this size (and not an event stream) are read whole and sent in one write;
# anything larger, or without a length (streams), is relayed chunk by chunk as it arrives.
SMALL_RESPONSE_BYTES = 256 * 1024
# Between two tries of an engine that refuses connections while the gate is open (the supervisor holds the gate
# within moments of a crash; this covers that moment and an engine nobody supervises).
RETRY_S = 0.25
# A client that has not sent its whole request (head and body) in this long is cut off: slow-loris bound.
DEFAULT_CLIENT_TIMEOUT_S = 60.0
# An engine that sends nothing (no header, no chunk) for this long is hung. Generous: a non-streaming completion
# sends nothing until it is done, and a long one on a loaded GPU takes minutes.
DEFAULT_UPSTREAM_IDLE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class _NotSent:
    """The engine never read the request (connect refused, or the connection reset unread): safe to send again."""

    upstream: str
    error: str


def _filter_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str], extra: frozenset[str] = frozenset()
                    ) -> CIMultiDict[str]:
    named = {h.strip().lower() for v in headers.getall("Connection", []) for h in v.split(",")}
    drop = HOP_BY_HOP_HEADERS | named | extra
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


class Gate:
    """Reverse proxy with hold / release / drain; see the module docstring for when the daemon calls what."""

    def __init__(self, listen_host: str, listen_port: int, upstream_url: str, *, max_queue: int = 64,
                 max_hold_s: float = 120.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 capture: CaptureStore | None = None, retry_after_s: int = 5, connect_timeout_s: float = 5.0,
                 shutdown_timeout_s: float = 5.0, client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
                 upstream_idle_timeout_s: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT_S) -> None:
        if max_queue < 0 or max_hold_s < 0 or max_body_bytes < 1 or client_timeout_s <= 0 \
                or upstream_idle_timeout_s <= 0:
            raise ValueError(f"gate limits must be non-negative (max_queue={max_queue}, max_hold_s={max_hold_s}, "
                             f"max_body_bytes={max_body_bytes}) and the timeouts positive (client_timeout_s="
                             f"{client_timeout_s}, upstream_idle_timeout_s={upstream_idle_timeout_s})")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.max_queue = max_queue
        self.max_hold_s = max_hold_s
        self.max_body_bytes = max_body_bytes
        self.capture = capture
        self.retry_after_s = retry_after_s
        self.connect_timeout_s = connect_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.client_timeout_s = client_timeout_s
        self.upstream_idle_timeout_s = upstream_idle_timeout_s
        self.unreachable_retries = 0  # tries that found the engine refusing connections (each one sent again)
        self.counters: dict[str, int] = dict.fromkeys(GATE_OUTCOMES, 0)
        self.longest_hold_s = 0.0  # the longest any request waited during the latest hold (the reboot stall)
        self._upstream = upstream_url.rstrip("/")
        self._in_flight = 0
        self._held = 0
        self._stopping = False
        self._open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._holding = False
        self._refusing: str | None = None  # why requests get 503 at once (the engine failed for good)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # ------------------------------------------------------------------------------------------------ state
    @property
    def in_flight(self) -> int:
        """Requests passed to the engine whose response has not finished."""
        return self._in_flight

    @property
    def held(self) -> int:
        """Requests waiting at the gate for :meth:`release`."""
        return self._held

    @property
    def holding(self) -> bool:
        return self._holding

    @property
    def refusing(self) -> str | None:
        """Why the gate answers 503 at once (the engine failed for good), or None."""
        return self._refusing

    @property
    def upstream_url(self) -> str:
        return self._upstream

    @property
    def port(self) -> int:
        """The port actually listened on (useful with ``listen_port=0``)."""
        if self._site is not None and self._site._server is not None:  # aiohttp keeps the server private
            sockets = getattr(self._site._server, "sockets", None) or []
            if sockets:
                return int(sockets[0].getsockname()[1])
        return self.listen_port

    def set_upstream(self, url: str) -> None:
        """Send requests that pass the gate from now on to ``url`` (an engine restarted on another port)."""
        self._upstream = url.rstrip("/")
        log.info("gate upstream changed", upstream=self._upstream)

    # ------------------------------------------------------------------------------------------------ control
    async def start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        if self._holding:
            self._open.clear()
        # A new connection to the engine per request, never a pooled one: a request sent just after the engine
        # died would otherwise go out on a kept-alive socket of the dead process and fail as if the engine had
        # taken it (502), where a fresh connect() is refused, which the gate holds and retries (seen once in four
        # heal scenarios: a request sent 12 ms after a SIGKILL). A loopback connect costs tens of microseconds.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                          sock_read=self.upstream_idle_timeout_s),
            auto_decompress=False,  # pass compressed bodies through byte for byte
        )
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # keepalive_timeout also bounds a connection whose request head is unfinished (aiohttp >= 3.10)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=self.client_timeout_s)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.listen_host, self.listen_port,
                                 shutdown_timeout=self.shutdown_timeout_s)
        await self._site.start()
        log.info("gate listening", host=self.listen_host, port=self.port, upstream=self._upstream)

    async def stop(self) -> None:
        """Stop listening. Held requests get 503; in-flight ones get up to ``shutdown_timeout_s`` to finish."""
        self._stopping = True
        if self._open is not None:
            self._open.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self._site = None, None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._stopping = False

    def hold(self) -> None:
        """From now on, new requests wait at the gate (bounded) instead of reaching the engine."""
        if not self._holding:
            self.longest_hold_s = 0.0
        self._holding = True
        self._refusing = None
        if self._open is not None:
            self._open.clear()
        log.info("gate holding new requests", in_flight=self._in_flight)

    def refuse(self, why: str) -> None:
        """From now on answer every request, and every held one, ``503`` at once with ``why`` (the engine failed
        for good, so waiting for a restart is pointless). :meth:`release` or :meth:`hold` end it."""
        self._refusing = why
        if self._open is not None:
            self._open.set()  # wake the held requests, which see _refusing and answer 503
        log.warning("gate refusing requests", why=why, held=self._held)

    def release(self) -> None:
        """Let held and new requests through again."""
        self._holding = False
        self._refusing = None
        if self._open is not None:
            self._open.set()
        log.info("gate released", held=self._held)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the requests already at the engine to finish; return how many still are.

        Call :meth:`hold` first, or new requests keep arriving and the count may never reach zero.
        """
        assert self._idle is not None, "gate not started"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._in_flight:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._idle.wait(), remaining)
            except TimeoutError:
                break
        if self._in_flight:
            log.warning("drain timed out with requests still in flight", in_flight=self._in_flight,
                        timeout_s=timeout_s)
        return self._in_flight

    # ------------------------------------------------------------------------------------------------ proxy
    def _count(self, outcome: str) -> None:
        self.counters[outcome] = self.counters.get(outcome, 0) + 1

    def _unavailable(self, why: str, outcome: str) -> web.Response:
        self._count(outcome)
        return _error(503, f"pinsidecar gate: {why}; retry after {self.retry_after_s} s", "service_unavailable",
                      {"Retry-After": str(self.retry_after_s)})

    async def _wait_open(self, deadline: float) -> web.Response | None:
        """Wait (bounded by the request's ``deadline``) until the gate is open; None, or the answer to give."""
        assert self._open is not None
        if self._refusing is not None:
            return self._unavailable(self._refusing, "rejected_engine_failed")
        if self._open.is_set():
            return None
        if self._held >= self.max_queue:
            return self._unavailable(f"the engine is restarting and the hold queue is full ({self.max_queue})",
                                     "rejected_queue_full")
        self._held += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._open.wait(), max(0.0, deadline - started))
        except TimeoutError:
            return self._unavailable(f"the engine is restarting and the request waited {self.max_hold_s:g} s",
                                     "rejected_hold_timeout")
        finally:
            self._held -= 1
            self.longest_hold_s = max(self.longest_hold_s, time.monotonic() - started)
        if self._refusing is not None:  # the restart being waited for gave up
            return self._unavailable(self._refusing, "rejected_engine_failed")
        return None

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The whole request body, within ``max_body_bytes`` and ``client_timeout_s`` (a slow-loris body gets
        408, not a file descriptor and a buffer held for ever)."""
        try:
            return await asyncio.wait_for(request.read(), self.client_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            self._count("too_large")
            return _error(413, f"pinsidecar gate: request body is over the limit of {self.max_body_bytes} bytes",
                          "request_too_large")
        except TimeoutError:
            self._count("client_timeout")
            resp = _error(408, f"pinsidecar gate: the request body did not arrive within {self.client_timeout_s:g} s",
                          "request_timeout", {"Connection": "close"})
            # answer and hang up now: aiohttp would otherwise linger, reading the rest of the body, for 10 s more
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.prepare(request)
                await resp.write_eof()
            if request.transport is not None:
                request.transport.close()
            return resp

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self._stopping:
            return self._unavailable("the sidecar is shutting down", "rejected_stopping")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            self._count("too_large")
            return _error(413, f"pinsidecar gate: request body of {request.content_length} bytes is over the "
                          f"limit of {self.max_body_bytes} bytes", "request_too_large")
        body = await self._read_body(request)
        if isinstance(body, web.StreamResponse):
            return body
        if self.capture is not None and body and request.method == "POST":
            self.capture.offer(request.path, body)
        headers = _filter_headers(request.headers, _STRIP_REQUEST)
        if request.remote:
            prior = request.headers.get("X-Forwarded-For")
            headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else request.remote
        deadline = time.monotonic() + self.max_hold_s
        while True:
            refused = await self._wait_open(deadline)
            if refused is not None:
                return refused
            if self._stopping:
                return self._unavailable("the sidecar is shutting down", "rejected_stopping")
            assert self._idle is not None
            self._in_flight += 1
            self._idle.clear()
            try:
                answer = await self._forward(request, body, headers)
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()
            if not isinstance(answer, _NotSent):
                return answer
            # The engine never read the request (refused, or reset unread), so it is safe to send it again once
            # the engine is back. The supervisor notices a dead engine and holds the gate; until then (or when
            # nothing supervises it), retry every RETRY_S, all of it within the request's max_hold_s.
            self.unreachable_retries += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._count("bad_gateway")
                return _error(502, f"pinsidecar gate: the engine at {answer.upstream} has not been reachable for "
                              f"{self.max_hold_s:g} s ({answer.error}); it may be down: check `pinsidecar status`",
                              "bad_gateway")
            await asyncio.sleep(min(RETRY_S, remaining))

    async def _forward(self, request: web.Request, body: bytes, headers: CIMultiDict[str]
                       ) -> web.StreamResponse | _NotSent:
        """Send the request to the engine once and relay its answer; :class:`_NotSent` when the engine never read
        it (no connection, or one reset unread)."""
        upstream = self._upstream
        assert self._session is not None
        try:
            up = await self._session.request(
                request.method, URL(upstream + request.raw_path, encoded=True), headers=headers, data=body or None,
                allow_redirects=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        except aiohttp.ClientConnectorError as exc:  # connect() failed: nothing was sent
            return _NotSent(upstream, f"{type(exc).__name__}: {exc.os_error.strerror or exc}")
        except aiohttp.ConnectionTimeoutError as exc:  # connect() did not finish: nothing was sent either
            return _NotSent(upstream, f"{type(exc).__name__}: no connection within {self.connect_timeout_s:g} s")
        except (aiohttp.ServerTimeoutError, TimeoutError):
            self._count("upstream_timeout")
            return _error(504, f"pinsidecar gate: the engine at {upstream} did not answer within "
                          f"{self.upstream_idle_timeout_s:g} s (it may be hung); the request may not have completed",
                          "gateway_timeout")
        except aiohttp.ClientOSError as exc:
            if exc.errno != errno.ECONNRESET:
                return self._lost_before_answer(upstream, exc)
            # A reset, not an orderly close: the kernel resets a connection whose received bytes nobody read, which
            # is a connection still in a dying engine's accept queue (its listening socket outlives SIGKILL while
            # the kernel tears down gigabytes of memory) or one accepted and never read. The engine never had the
            # whole request, so it cannot have acted on it: send it again like a refused connect.
            return _NotSent(upstream, f"the engine reset the connection without reading the request ({exc})")
        except (aiohttp.ClientError, OSError) as exc:
            return self._lost_before_answer(upstream, exc)
        async with up:
            length = up.content_length
            if length is not None and length <= SMALL_RESPONSE_BYTES and "event-stream" not in up.content_type:
                # a small complete body (non-streaming completion, /v1/models, /health): one read, one write
                try:
                    data = await up.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self._count("bad_gateway")
                    return _error(502, f"pinsidecar gate: the engine at {upstream} broke off its response "
                                  f"({type(exc).__name__}: {exc})", "bad_gateway")
                self._count("proxied")
                return web.Response(status=up.status, reason=up.reason, body=data,
                                    headers=_filter_headers(up.headers, _STRIP_SMALL_RESPONSE))
            return await self._relay(request, up, upstream)

    def _lost_before_answer(self, upstream: str, exc: BaseException) -> web.Response:
        """Connected, then closed in order before any answer: the engine read the request (it was in flight when
        the engine crashed), so it is not replayed behind the client's back (a request that crashed the engine would
        crash the restarted one too)."""
        self._count("bad_gateway")
        return _error(502, f"pinsidecar gate: the engine at {upstream} closed the connection before answering "
                      f"({type(exc).__name__}: {exc}); it crashed or was restarted while this request was in "
                      "flight; the request did not complete, send it again", "bad_gateway")

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse, upstream: str) -> web.StreamResponse:
        """Relay a streamed (or large) response chunk by chunk as it arrives."""
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=_filter_headers(up.headers))
        try:
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionResetError:
            # the client went away: closing the upstream response makes the engine abort the request
            self._count("client_disconnected")
            up.close()
            return resp
        except (aiohttp.ClientError, TimeoutError) as exc:
            # the engine died or stalled mid-response: say so in the stream, then cut the client's connection so
            # it sees a broken response, never a clean end of a truncated one
            hung = isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError)
            self._count("upstream_timeout" if hung else "upstream_broken")
            why = (f"the engine sent nothing for {self.upstream_idle_timeout_s:g} s (hung)" if hung
                   else f"the engine broke off its response ({type(exc).__name__}: {exc})")
            log.warning("engine response broke off mid-stream", path=request.path, error=why)
            up.close()
            if "event-stream" in up.content_type:
                event = {"error": {"message": f"pinsidecar gate: {why}; the response is incomplete",
                                   "type": "upstream_error", "code": 504 if hung else 502}}
                with contextlib.suppress(ConnectionResetError, RuntimeError):
                    await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if request.transport is not None:
                request.transport.close()
            return resp
        self._count("proxied")
        return resp

    def snapshot(self) -> dict[str, Any]:
        """The gate's state for ``pinsidecar status``."""
        return {"upstream": self._upstream, "holding": self._holding, "held": self._held,
                "in_flight": self._in_flight, "longest_hold_s": round(self.longest_hold_s, 3),
                "refusing": self._refusing, "unreachable_retries": self.unreachable_retries,
                "counters": dict(self.counters)}
