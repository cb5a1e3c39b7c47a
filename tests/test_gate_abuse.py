"""Gate abuse: slow-loris clients, clients that vanish mid-stream, bodies over the limit, garbage instead of HTTP, and
a flood past ``max_queue``. After each, the gate still serves at once, and it leaks no file descriptors.

Runs against :class:`~pinsidecar.testing.upstream.UpstreamStub` on loopback (the abuse is the client's, the engine
does not matter). The leak check runs the same abuse in rounds: the first round warms what may legitimately stay
open (the gate's keep-alive pool to the engine), and later rounds must not add a single descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import psutil

from pinsidecar.daemon.gate import Gate
from pinsidecar.testing.upstream import UpstreamStub

ROUNDS = 3


def run(test: Callable[[UpstreamStub], Awaitable[None]]) -> None:
    async def main() -> None:
        stub = UpstreamStub()
        await stub.start()
        try:
            await asyncio.wait_for(test(stub), 120)
        finally:
            await stub.stop()

    asyncio.run(main())


def fds() -> int:
    return psutil.Process().num_fds()


async def settled_fds(floor: int | None = None, timeout_s: float = 5.0) -> int:
    """The descriptor count once closing sockets have closed (down to ``floor`` if given, else stable)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    last = fds()
    while loop.time() < end:
        await asyncio.sleep(0.1)
        now = fds()
        if (floor is not None and now <= floor) or (floor is None and now == last):
            return now
        last = now
    return fds()


async def rounds_leak_nothing(abuse: Callable[[], Awaitable[None]]) -> list[int]:
    """Run ``abuse`` ROUNDS times; return the settled descriptor count after each. Rounds after the first must not
    grow it."""
    counts = []
    for _ in range(ROUNDS):
        await abuse()
        counts.append(await settled_fds(counts[0] if counts else None))
    assert all(c <= counts[0] for c in counts[1:]), f"descriptors grew round after round: {counts}"
    return counts


async def served_at_once(gate: Gate) -> None:
    """A well-behaved client is answered at once, whatever the others do."""
    async with aiohttp.ClientSession() as s:
        r = await asyncio.wait_for(s.post(f"http://127.0.0.1:{gate.port}/v1/completions",
                                          json={"prompt": "ok", "max_tokens": 1}), 2.0)
        assert r.status == 200
        await r.read()


def test_slow_loris_heads_and_bodies_are_cut_off_and_others_are_served() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = Gate("127.0.0.1", 0, stub.url, client_timeout_s=1.0)
        await gate.start()
        cut: list[float] = []

        async def loris(kind: str) -> None:
            loop = asyncio.get_running_loop()
            reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
            t0 = loop.time()
            try:
                if kind == "head":  # a header line every 0.3 s, never the blank line that ends the head
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    for i in range(30):
                        writer.write(f"X-Slow-{i}: y\r\n".encode())
                        await writer.drain()
                        if reader.at_eof():
                            break
                        await asyncio.sleep(0.3)
                    data = await asyncio.wait_for(reader.read(), 5)
                    assert data == b"" or b"408" in data or b"400" in data
                else:  # a complete head promising 1000 bytes, then 10 of them
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                                 + b"x" * 10)
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(), 5)
                    assert data.startswith(b"HTTP/1.1 408"), data[:200]
                    assert b"did not arrive within 1 s" in data
                cut.append(loop.time() - t0)
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

        async def abuse() -> None:
            tasks = [asyncio.create_task(loris("head" if i % 2 else "body")) for i in range(20)]
            await asyncio.sleep(0.2)
            await served_at_once(gate)  # while 20 slow clients hold connections
            await asyncio.gather(*tasks)

        try:
            await rounds_leak_nothing(abuse)
            await served_at_once(gate)
        finally:
            await gate.stop()
        assert len(cut) == 20 * ROUNDS
        assert max(cut) < 4.0, f"a slow client held its connection for {max(cut):.1f} s"
        assert gate.counters["client_timeout"] == 10 * ROUNDS
        assert stub.requests == ROUNDS + 1  # only the well-behaved requests reached the engine

    run(body)


def test_clients_vanishing_mid_stream_abort_their_engine_requests_and_leak_nothing() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = Gate("127.0.0.1", 0, stub.url)
        await gate.start()

        async def vanish() -> None:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"http://127.0.0.1:{gate.port}/v1/completions",
                                 json={"prompt": "p", "max_tokens": 500, "stream": True, "chunk_interval_s": 0.02})
                await r.content.readline()
                r.close()  # gone, mid-stream

        async def abuse() -> None:
            await asyncio.gather(*(vanish() for _ in range(25)))
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while gate.in_flight or stub.active:
                assert loop.time() < end, (gate.in_flight, stub.active)
                await asyncio.sleep(0.05)
            await served_at_once(gate)

        try:
            await rounds_leak_nothing(abuse)
        finally:
            await gate.stop()
        assert gate.counters["client_disconnected"] == 25 * ROUNDS
        assert stub.aborted == 25 * ROUNDS  # the engine stopped generating for every one of them

    run(body)


def test_bodies_over_the_limit_and_garbage_are_refused_and_leak_nothing() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = Gate("127.0.0.1", 0, stub.url, max_body_bytes=4096)
        await gate.start()
        answers: dict[str, list[int]] = {"declared": [], "chunked": [], "garbage": []}

        async def chunks() -> Any:
            for _ in range(10):
                yield b"y" * 1024

        async def garbage() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
            writer.write(b"\x16\x03\x01\x02\x00garbage that is not HTTP\r\n\r\n")
            data = await asyncio.wait_for(reader.read(), 5)
            answers["garbage"].append(int(data.split()[1]) if data.startswith(b"HTTP/1.1") else 0)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

        async def abuse() -> None:
            async with aiohttp.ClientSession() as s:
                for _ in range(10):
                    r = await s.post(f"http://127.0.0.1:{gate.port}/v1/completions", data=b"x" * 100_000)
                    answers["declared"].append(r.status)
                    await r.read()
                    r = await s.post(f"http://127.0.0.1:{gate.port}/v1/completions", data=chunks())
                    answers["chunked"].append(r.status)
                    await r.read()
            await asyncio.gather(*(garbage() for _ in range(10)))
            await served_at_once(gate)

        try:
            await rounds_leak_nothing(abuse)
        finally:
            await gate.stop()
        assert set(answers["declared"]) == {413} and set(answers["chunked"]) == {413}
        assert len(answers["garbage"]) == 10 * ROUNDS and set(answers["garbage"]) <= {0, 400}  # 400, or hung up
        assert gate.counters["too_large"] == 20 * ROUNDS
        assert stub.requests == ROUNDS  # nothing oversized reached the engine

    run(body)


def test_a_flood_past_max_queue_gets_503_with_retry_after_and_the_held_are_served() -> None:
    async def body(stub: UpstreamStub) -> None:
        gate = Gate("127.0.0.1", 0, stub.url, max_queue=8, max_hold_s=30.0, retry_after_s=3)
        await gate.start()
        statuses: list[int] = []
        retry_after: set[str] = set()

        async def one(s: aiohttp.ClientSession) -> None:
            r = await s.post(f"http://127.0.0.1:{gate.port}/v1/completions", json={"prompt": "f", "max_tokens": 1})
            statuses.append(r.status)
            if r.status == 503:
                retry_after.add(r.headers.get("Retry-After", ""))
            await r.read()

        async def abuse() -> None:
            gate.hold()  # a restart in progress
            before = len(statuses)  # answers of earlier rounds
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                flood = [asyncio.create_task(one(s)) for _ in range(200)]
                loop = asyncio.get_running_loop()
                end = loop.time() + 20
                # every request past the 8 held must have been refused before the release, or a late one would
                # find the gate open and be served
                while len(statuses) - before < 192:
                    assert loop.time() < end, f"{len(statuses)} answered"
                    await asyncio.sleep(0.05)
                assert gate.held == 8
                gate.release()
                await asyncio.gather(*flood)
            await served_at_once(gate)

        try:
            counts = await rounds_leak_nothing(abuse)
        finally:
            await gate.stop()
        assert statuses.count(503) == 192 * ROUNDS and statuses.count(200) == 8 * ROUNDS
        assert retry_after == {"3"}
        assert gate.counters["rejected_queue_full"] == 192 * ROUNDS
        assert len(counts) == ROUNDS

    run(body)
