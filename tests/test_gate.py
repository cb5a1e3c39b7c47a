"""The gate: transparent forwarding, unbuffered streaming, hold/release with bounded waits, 413, 502, drain counts,
requests the engine refused sent again, refusal when the engine failed, and a hung engine (504, error event).

Runs against :class:`pinsidecar.testing.upstream.UpstreamStub` (a local OpenAI-like server whose chunk timing the
test controls); the real engine behind the gate is the daemon's drain-reboot test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

from pinsidecar.daemon.gate import Gate
from pinsidecar.daemon.traffic_capture import CaptureStore
from pinsidecar.testing.upstream import UpstreamStub
from pinsidecar.testing.wait import wait_until_async


def run(test: Callable[[UpstreamStub], Awaitable[None]], **stub_kwargs: Any) -> None:
    async def main() -> None:
        stub = UpstreamStub(**stub_kwargs)
        await stub.start()
        try:
            await asyncio.wait_for(test(stub), 60)
        finally:
            await stub.stop()

    asyncio.run(main())


async def started(gate: Gate) -> Gate:
    await gate.start()
    return gate


def url(gate: Gate, path: str) -> str:
    return f"http://127.0.0.1:{gate.port}{path}"


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """The gate's state reached (it runs in this event loop: the wait must yield to it)."""
    await wait_until_async(cond, "the gate's state", timeout_s, step_s=0.01)


def test_forwards_method_path_query_headers_body_and_strips_hop_by_hop() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.put(URL(url(gate, "/echo/a%20b/c?x=1&y=%2F"), encoded=True), data=b"\x00payload\xff",
                                headers={"X-Custom": "kept", "Connection": "keep-alive, X-Drop-Me",
                                         "X-Drop-Me": "gone", "Proxy-Authorization": "Basic abc",
                                         "Authorization": "Bearer t"})
                assert r.status == 200
                assert r.headers["X-Stub"] == "echo"
                assert "X-Hop" not in r.headers  # named in the upstream's Connection header
                got = await r.json()
        finally:
            await gate.stop()
        headers = {k.lower(): v for k, v in got["headers"]}
        assert got["method"] == "PUT"
        assert got["path"] == "/echo/a b/c"
        assert got["raw_path"] == "/echo/a%20b/c?x=1&y=%2F"  # byte for byte, not re-encoded
        assert got["body"] == b"\x00payload\xff".decode("latin-1")
        assert headers["x-custom"] == "kept"
        assert headers["authorization"] == "Bearer t"
        assert "x-drop-me" not in headers
        assert "proxy-authorization" not in headers
        assert headers["x-forwarded-for"] == "127.0.0.1"
        assert gate.counters["proxied"] == 1

    run(body)


def test_streaming_chunks_pass_through_as_they_are_sent() -> None:
    """Each chunk must reach the client before the engine sends the next one: a buffering proxy would deliver
    them all at the end (the stub sends one every 0.3 s)."""

    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        arrivals: list[tuple[int, int]] = []  # (sent_ns, arrived_ns)
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"),
                                 json={"prompt": "hi", "max_tokens": 5, "stream": True, "chunk_interval_s": 0.3})
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                buf = b""
                async for data in r.content.iter_any():
                    now = asyncio.get_running_loop().time()
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        payload = event.removeprefix(b"data: ")
                        if payload != b"[DONE]":
                            arrivals.append((json.loads(payload)["sent_ns"], int(now * 1e9)))
        finally:
            await gate.stop()
        assert len(arrivals) == 5
        for (_, arrived), (next_sent, _) in itertools.pairwise(arrivals):
            assert arrived < next_sent, "a chunk was held back until the next one was sent"

    run(body)


def test_hold_queues_requests_until_release() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                gate.hold()
                tasks = [asyncio.create_task(s.post(url(gate, "/v1/completions"), json={"prompt": str(i),
                                                                                          "max_tokens": 2}))
                         for i in range(3)]
                await wait_until(lambda: gate.held == 3)
                assert stub.requests == 0, "a held request reached the engine"
                gate.release()
                responses = await asyncio.gather(*tasks)
                assert [r.status for r in responses] == [200, 200, 200]
                assert stub.requests == 3
                assert gate.held == 0
                assert gate.longest_hold_s > 0
        finally:
            await gate.stop()

    run(body)


def test_full_queue_and_hold_timeout_answer_503_with_retry_after() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url, max_queue=2, max_hold_s=30.0, retry_after_s=7))
        short = await started(Gate("127.0.0.1", 0, stub.url, max_hold_s=0.2))
        try:
            async with aiohttp.ClientSession() as s:
                gate.hold()
                waiting = [asyncio.create_task(s.get(url(gate, "/v1/models"))) for _ in range(2)]
                await wait_until(lambda: gate.held == 2)
                r = await s.get(url(gate, "/v1/models"))
                assert r.status == 503
                assert r.headers["Retry-After"] == "7"
                assert "queue is full" in (await r.json())["error"]["message"]
                assert gate.counters["rejected_queue_full"] == 1
                gate.release()
                assert [r.status for r in await asyncio.gather(*waiting)] == [200, 200]

                short.hold()
                r = await s.get(url(short, "/v1/models"))
                assert r.status == 503
                assert r.headers["Retry-After"] == "5"
                assert short.counters["rejected_hold_timeout"] == 1
        finally:
            await gate.stop()
            await short.stop()

    run(body)


def test_oversized_body_is_413_and_never_reaches_the_engine() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url, max_body_bytes=1024))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"), data=b"x" * 2000)
                assert r.status == 413
                assert "over the limit of 1024 bytes" in (await r.json())["error"]["message"]

                async def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
                    for _ in range(4):
                        yield b"y" * 600

                r = await s.post(url(gate, "/v1/completions"), data=chunked())
                assert r.status == 413
                r = await s.post(url(gate, "/v1/completions"), json={"prompt": "ok", "max_tokens": 1})
                assert r.status == 200
        finally:
            await gate.stop()
        assert stub.requests == 1
        assert gate.counters["too_large"] == 2

    run(body)


def test_engine_refusing_connections_for_max_hold_s_is_502_with_a_clear_body() -> None:
    async def body(stub: UpstreamStub) -> None:
        dead = UpstreamStub()
        await dead.start()
        dead_url = dead.url
        await dead.stop()  # nothing listens there now
        gate = await started(Gate("127.0.0.1", 0, dead_url, max_hold_s=0.6))
        try:
            async with aiohttp.ClientSession() as s:
                t0 = asyncio.get_running_loop().time()
                r = await s.post(url(gate, "/v1/completions"), json={"prompt": "x"})
                waited = asyncio.get_running_loop().time() - t0
                assert r.status == 502
                msg = (await r.json())["error"]["message"]
                assert dead_url in msg and "has not been reachable for 0.6 s" in msg
                assert 0.5 <= waited < 5.0  # retried within max_hold_s, then gave up
                assert gate.unreachable_retries >= 2
                gate.set_upstream(stub.url)
                r = await s.post(url(gate, "/v1/completions"), json={"prompt": "x", "max_tokens": 1})
                assert r.status == 200
        finally:
            await gate.stop()
        assert gate.counters["bad_gateway"] == 1


def test_a_request_the_engine_refused_is_sent_again_once_the_engine_is_back() -> None:
    """Connection refused means the engine never saw the request: it waits at the gate (retrying, then held when
    the supervisor holds) and is served by the engine that comes back, instead of a 502."""

    async def body(stub: UpstreamStub) -> None:
        port = stub.port
        await stub.stop()  # the engine "crashed": its port refuses connections
        gate = await started(Gate("127.0.0.1", 0, stub.url, max_hold_s=30.0))
        try:
            async with aiohttp.ClientSession() as s:
                early = asyncio.create_task(s.post(url(gate, "/v1/completions"), json={"prompt": "a",
                                                                                       "max_tokens": 2}))
                await wait_until(lambda: gate.unreachable_retries >= 1)
                gate.hold()  # the supervisor noticed the exit
                late = asyncio.create_task(s.post(url(gate, "/v1/completions"), json={"prompt": "b",
                                                                                      "max_tokens": 2}))
                await wait_until(lambda: gate.held == 2)
                stub.port = port
                await stub.start()  # the restarted engine
                gate.release()
                responses = await asyncio.gather(early, late)
                assert [r.status for r in responses] == [200, 200]
                assert [len((await r.json())["choices"]) for r in responses] == [1, 1]
        finally:
            await gate.stop()
        assert stub.requests == 2
        assert gate.counters["proxied"] == 2 and gate.counters["bad_gateway"] == 0

    run(body)


def test_refuse_answers_held_and_new_requests_503_at_once() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url, max_hold_s=60.0))
        try:
            async with aiohttp.ClientSession() as s:
                gate.hold()
                held = asyncio.create_task(s.get(url(gate, "/v1/models")))
                await wait_until(lambda: gate.held == 1)
                gate.refuse("the engine failed 3 times in a row")
                r = await asyncio.wait_for(held, 5)
                assert r.status == 503 and r.headers["Retry-After"] == "5"
                assert "failed 3 times" in (await r.json())["error"]["message"]
                r = await s.get(url(gate, "/v1/models"))
                assert r.status == 503
                assert gate.snapshot()["refusing"] == "the engine failed 3 times in a row"
                gate.release()  # an operator's reboot brought it back
                assert (await s.get(url(gate, "/v1/models"))).status == 200
        finally:
            await gate.stop()
        assert gate.counters["rejected_engine_failed"] == 2

    run(body)


async def _silent_server(streams: list[asyncio.StreamWriter]) -> asyncio.Server:
    """A hung engine: accepts connections, reads what comes, never answers (the gate-only case)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams.append(writer)
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_an_engine_that_accepts_but_never_answers_is_504_within_the_idle_timeout() -> None:
    async def body(stub: UpstreamStub) -> None:
        streams: list[asyncio.StreamWriter] = []
        silent = await _silent_server(streams)
        port = silent.sockets[0].getsockname()[1]
        gate = await started(Gate("127.0.0.1", 0, f"http://127.0.0.1:{port}", upstream_idle_timeout_s=0.5))
        try:
            async with aiohttp.ClientSession() as s:
                t0 = asyncio.get_running_loop().time()
                r = await s.post(url(gate, "/v1/completions"), json={"prompt": "x"})
                waited = asyncio.get_running_loop().time() - t0
                assert r.status == 504
                msg = (await r.json())["error"]["message"]
                assert "did not answer within 0.5 s" in msg and "hung" in msg
                assert 0.4 <= waited < 5.0
                assert gate.in_flight == 0
        finally:
            await gate.stop()
            silent.close()
        assert streams, "the request never reached the silent engine"
        assert gate.counters["upstream_timeout"] == 1

    run(body)


def test_a_stream_that_stalls_mid_way_ends_with_an_error_event_and_a_cut_connection() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url, upstream_idle_timeout_s=0.4))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"),
                                 json={"prompt": "p", "max_tokens": 3, "stream": True, "chunk_interval_s": 2.0})
                assert r.status == 200
                got = b""
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for data in r.content.iter_any():
                        got += data
                assert b"[DONE]" not in got
                last = got.strip().split(b"\n\n")[-1].removeprefix(b"data: ")
                err = json.loads(last)["error"]
                assert err["code"] == 504 and "sent nothing for 0.4 s" in err["message"]
            await wait_until(lambda: gate.in_flight == 0 and stub.active == 0)
        finally:
            await gate.stop()
        assert gate.counters["upstream_timeout"] == 1

    run(body)

    run(body)


def test_drain_counts_requests_still_in_flight() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                slow = [asyncio.create_task(s.post(url(gate, "/v1/completions"),
                                                   json={"prompt": "p", "max_tokens": 1, "delay_s": 1.0}))
                        for _ in range(2)]
                await wait_until(lambda: stub.active == 2)
                gate.hold()
                assert gate.in_flight == 2
                assert await gate.drain(0.05) == 2
                assert await gate.drain(30.0) == 0
                assert [r.status for r in await asyncio.gather(*slow)] == [200, 200]
                assert await gate.drain(0.0) == 0
                gate.release()
        finally:
            await gate.stop()

    run(body)


def test_streaming_request_in_flight_until_its_last_chunk() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"),
                                 json={"prompt": "p", "max_tokens": 4, "stream": True, "chunk_interval_s": 0.2})
                assert r.status == 200
                assert gate.in_flight == 1  # headers arrived, the stream has not finished
                gate.hold()
                drained = asyncio.create_task(gate.drain(30.0))
                text = await r.text()
                assert text.endswith("data: [DONE]\n\n")
                assert await drained == 0
        finally:
            await gate.stop()

    run(body)


def test_client_disconnect_aborts_the_engine_request() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"),
                                 json={"prompt": "p", "max_tokens": 50, "stream": True, "chunk_interval_s": 0.05})
                await r.content.readline()
                r.close()  # the client goes away mid-stream
            await wait_until(lambda: gate.in_flight == 0 and stub.active == 0)
        finally:
            await gate.stop()
        assert stub.aborted == 1
        assert gate.counters["client_disconnected"] == 1

    run(body)


def test_capture_samples_completion_bodies_as_workload_lines(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "cap", sample_rate=1.0)

    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url, capture=store))
        try:
            async with aiohttp.ClientSession() as s:
                for i in range(3):
                    r = await s.post(url(gate, "/v1/completions"), json={"prompt": f"p{i}", "max_tokens": 2})
                    assert r.status == 200
                r = await s.post(url(gate, "/v1/chat/completions"),
                                 json={"messages": [{"role": "user", "content": "hé"}], "max_tokens": 2})
                assert r.status == 200
                r = await s.get(url(gate, "/v1/models"))
                assert r.status == 200
        finally:
            await gate.stop()

    run(body)
    done = store.rotate()
    assert done is not None
    lines = [json.loads(line) for line in done.read_text().splitlines()]
    assert [x.get("prompt") for x in lines[:3]] == ["p0", "p1", "p2"]
    assert lines[3]["messages"][0]["content"] == "hé"
    assert len(lines) == 4


def test_large_non_streaming_response_is_relayed_whole() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(url(gate, "/v1/completions"), json={"prompt": "p", "max_tokens": 400_000})
                assert r.status == 200
                assert int(r.headers["Content-Length"]) > 400_000  # relayed with its length, not re-chunked
                doc = await r.json()
        finally:
            await gate.stop()
        assert doc["choices"][0]["text"] == "x" * 400_000

    run(body)


def test_stop_answers_held_requests_503_and_each_hold_measures_its_own_stall() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = await started(Gate("127.0.0.1", 0, stub.url))
        async with aiohttp.ClientSession() as s:
            gate.hold()
            task = asyncio.create_task(s.get(url(gate, "/v1/models")))
            await wait_until(lambda: gate.held == 1)
            await asyncio.sleep(0.05)
            gate.release()
            assert (await task).status == 200
            assert gate.longest_hold_s >= 0.05
            gate.release()
            gate.hold()  # a new hold starts a new stall measurement
            assert gate.longest_hold_s == 0.0
            held = asyncio.create_task(s.get(url(gate, "/v1/models")))
            await wait_until(lambda: gate.held == 1)
            await gate.stop()
            r = await held
            assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        assert gate.counters["rejected_stopping"] == 1

    run(body)


async def _read_request(reader: asyncio.StreamReader) -> None:
    """Read one whole HTTP request (head and Content-Length body), as an engine does before it acts on it."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    await reader.readexactly(length)


def test_a_request_sent_after_the_engine_died_is_not_sent_on_its_old_connection() -> None:
    """An engine that dies keeps nothing: a request sent after its death (before the supervisor noticed) must not
    go out on a kept-alive connection of the dead process, which would look like a request the engine had taken
    (a 502), but get a refused connect, wait at the gate and be served by the engine that comes back. The "engine"
    here answers one request, then stops listening and drops any later request on an open connection unanswered,
    as a process killed between two requests would."""

    async def body(stub: UpstreamStub) -> None:
        port = stub.port
        await stub.stop()
        answered = asyncio.Event()
        open_conns: list[asyncio.StreamWriter] = []

        async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            open_conns.append(writer)
            await _read_request(reader)
            if answered.is_set():  # a request after the "death": dropped unanswered
                writer.close()
                return
            payload = b'{"choices": [{"text": "x"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + payload)
            await writer.drain()
            answered.set()
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await once(reader, writer)  # keep the connection open for a second request

        dying = await asyncio.start_server(once, "127.0.0.1", port)
        gate = await started(Gate("127.0.0.1", 0, f"http://127.0.0.1:{port}", max_hold_s=30.0))
        try:
            async with aiohttp.ClientSession() as s:
                first = await s.post(url(gate, "/v1/completions"), json={"prompt": "a", "max_tokens": 1})
                assert first.status == 200
                dying.close()  # the process is gone: its port refuses connections from now on
                second = asyncio.create_task(s.post(url(gate, "/v1/completions"), json={"prompt": "b",
                                                                                        "max_tokens": 1}))
                await wait_until(lambda: gate.unreachable_retries >= 1)
                stub.port = port
                await stub.start()  # the restarted engine
                resp = await second
                assert resp.status == 200, await resp.text()
        finally:
            await gate.stop()
            for w in open_conns:
                w.close()
        assert gate.counters["bad_gateway"] == 0 and stub.requests == 1

    run(body)


def _listener(port: int) -> socket.socket:
    """A listening socket nobody accepts from: connects complete in the kernel's accept queue, as on an engine
    killed a moment ago whose port the kernel has not closed yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    return sock


def test_a_request_reset_unread_by_a_dying_engine_is_sent_again() -> None:
    """SIGKILL of an engine with gigabytes mapped: its listening socket stays open while the kernel frees the memory,
    so a request sent just after the kill connects, sits unread in the accept queue, and is reset when the socket
    closes. The engine never read it, so the gate holds it and the restarted engine serves it (seen on CI as two
    failures past the two requests in flight at the kill)."""

    async def body(stub: UpstreamStub) -> None:
        port = stub.port
        await stub.stop()
        dying = _listener(port)
        gate = await started(Gate("127.0.0.1", 0, f"http://127.0.0.1:{port}", max_hold_s=30.0))
        try:
            async with aiohttp.ClientSession() as s:
                sent = asyncio.create_task(s.post(url(gate, "/v1/completions"), json={"prompt": "a",
                                                                                      "max_tokens": 1}))
                await wait_until(lambda: gate.in_flight == 1)
                await asyncio.sleep(0.2)  # the request is in the accept queue, unread
                dying.close()  # the kernel resets the queued connection
                await wait_until(lambda: gate.unreachable_retries >= 1)
                stub.port = port
                await stub.start()  # the restarted engine
                resp = await sent
                assert resp.status == 200, await resp.text()
        finally:
            await gate.stop()
            dying.close()
        assert stub.requests == 1 and gate.counters["bad_gateway"] == 0

    run(body)


def test_a_request_the_engine_read_before_it_died_is_502_not_replayed() -> None:
    """The other half of the rule: an engine that read the whole request and then died closes the connection in
    order (no reset). It may have been working on the request, and a request that crashed an engine would crash the
    restarted one too, so the client gets a 502 that says so and the request is not sent again."""

    async def body(stub: UpstreamStub) -> None:
        port = stub.port
        await stub.stop()

        async def read_then_die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.close()

        dying = await asyncio.start_server(read_then_die, "127.0.0.1", port)
        gate = await started(Gate("127.0.0.1", 0, f"http://127.0.0.1:{port}", max_hold_s=30.0))
        try:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(url(gate, "/v1/completions"), json={"prompt": "a", "max_tokens": 1})
                assert resp.status == 502
                assert "closed the connection before answering" in (await resp.json())["error"]["message"]
        finally:
            await gate.stop()
            dying.close()
        assert gate.unreachable_retries == 0 and gate.counters["bad_gateway"] == 1

    run(body)
