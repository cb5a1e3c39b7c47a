"""A small local stand-in for an OpenAI-compatible engine, for testing and benchmarking the gate.

The gate's contract is about HTTP, not about models: forward everything, stream chunk by chunk, count what is in
flight. Testing that against vLLM would make every gate test a 20-second engine boot, and it could not control
chunk timing. :class:`UpstreamStub` answers like vLLM's API server does (``/v1/completions`` with and without
``stream``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, a ``vllm:``-style ``/metrics``) with chunks at
times the test chooses, and stamps each streamed chunk with the monotonic time it was sent, so a client can tell
whether the gate delivered it at once or buffered it. ``/echo`` returns what arrived (method, path, query,
headers, body), for forwarding tests. The gate's tests and ``bench/bench_gate.py`` use it; the real engine is
exercised by the daemon's drain-reboot test.

Request fields it understands beyond OpenAI's: ``chunk_interval_s`` (seconds between streamed chunks) and
``delay_s`` (wait before answering).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

__all__: list[str] = []  # nothing here is another package's business


class UpstreamStub:
    """aiohttp server mimicking the engine's OpenAI endpoints; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, chunk_interval_s: float = 0.0,
                 generation_tokens: int = 0) -> None:
        self.host = host
        self.port = port
        self.chunk_interval_s = chunk_interval_s
        self.generation_tokens = generation_tokens
        self.requests = 0
        self.active = 0
        self.aborted = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/echo{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=1.0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="stub"}} {float(self.generation_tokens)}\n'
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="stub"}} {float(self.active)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({
            "method": request.method, "path": request.path, "raw_path": request.raw_path,
            "headers": [[k, v] for k, v in request.headers.items()], "body": body.decode("latin-1"),
        }, headers={"X-Stub": "echo", "Connection": "keep-alive, X-Hop", "X-Hop": "must-not-pass"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req: dict[str, Any] = await request.json()
        self.requests += 1
        self.active += 1
        try:
            if req.get("delay_s"):
                await asyncio.sleep(float(req["delay_s"]))
            n = int(req.get("max_tokens", 16))
            interval = float(req.get("chunk_interval_s", self.chunk_interval_s))
            chat = request.path.endswith("/chat/completions")
            if not req.get("stream"):
                await asyncio.sleep(interval * n)
                self.generation_tokens += n
                text = "x" * n
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                          "choices": [choice],
                                          "usage": {"prompt_tokens": 1, "completion_tokens": n}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                for i in range(n):
                    if i and interval:
                        await asyncio.sleep(interval)
                    self.generation_tokens += 1
                    chunk = {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "index": i,
                             "sent_ns": time.monotonic_ns(), "choices": [{"index": 0, "text": "x"}]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except (ConnectionResetError, asyncio.CancelledError):
                self.aborted += 1
                raise
            return resp
        finally:
            self.active -= 1


@contextmanager
def running_upstream(**kwargs: Any) -> Iterator[UpstreamStub]:
    """Run an :class:`UpstreamStub` on its own event loop in a background thread (for synchronous callers)."""
    stub = UpstreamStub(**kwargs)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(stub.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="upstream-stub", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("upstream stub did not start within 10 s")
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
