"""Streaming clients through the gate while something happens to the engine: the drain-reboot figure's load.

:func:`load_during` runs ``clients`` clients that each stream completions in a loop; once every client's traffic
flows it awaits ``action`` (a drain-reboot), then waits until every client has been served twice by the new
engine, and stops. Each request counts as completed (``[DONE]`` and a finish reason), failed (HTTP error, broken
stream, a stream without an end) or lost (sent, neither); the longest stall is the longest gap a client saw
before a response's first chunk or between two chunks (a request held by the gate across a reboot waits it out).
Every gap is also kept with its wall-clock start and end (``ClientStats.gaps``; a few hundred requests of 32 tokens
are a few thousand small records), so a figure can ask for the longest gap *during* an event
(:meth:`LoadResult.longest_gap`), e.g. an in-place apply, and tell gaps between two tokens of one stream from the
wait before a stream's first token. Every request is kept too (:class:`Request`: sent, ended, outcome), so a
figure can count requests per interval, and ``ClientStats.last_at`` says since when a client has waited.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__: list[str] = []  # nothing here is another package's business

PROMPTS = ("def parse(line):", "The river ran", "import os\nfor p in", "Once upon a time")
# Gaps at least this long are kept with their times (shorter ones only count towards longest_stall_s); 0: all, so
# the longest gap in any interval is exact.
GAP_RECORD_S = 0.0


@dataclass(frozen=True)
class Gap:
    """One wait a client saw: ``kind`` "token" (between two chunks of a stream) or "first" (from sending a request
    to its first chunk); ``start`` and ``end`` are wall-clock (time.time) seconds."""

    start: float
    end: float
    kind: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Request:
    """One request a client sent: wall-clock ``sent`` and ``ended`` (None while in flight, and for a lost one),
    ``outcome`` "completed" or "failed" once it ended; so a figure can count them per interval (a scenario's
    stages) rather than only over the whole run."""

    sent: float
    ended: float | None = None
    outcome: str | None = None


@dataclass
class ClientStats:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    longest_stall_s: float = 0.0
    tokens: int = 0
    completed_after: int = 0  # completed requests sent after the action returned
    gaps: list[Gap] = field(default_factory=list)  # every gap of GAP_RECORD_S or more, in order
    requests: list[Request] = field(default_factory=list)  # every request sent, in order
    last_at: float = 0.0  # wall clock of the last chunk received (or request sent): a wait in progress began here


@dataclass
class LoadResult:
    clients: list[ClientStats]
    action: Any  # what the action returned

    def figure(self) -> dict[str, Any]:
        sent = sum(s.sent for s in self.clients)
        completed = sum(s.completed for s in self.clients)
        failed = sum(s.failed for s in self.clients)
        return {"clients": len(self.clients), "sent": sent, "completed": completed, "failed": failed,
                "lost": sent - completed - failed,
                "longest_stall_s": round(max(s.longest_stall_s for s in self.clients), 3),
                "errors": [e for s in self.clients for e in s.errors][:10]}

    def longest_gap(self, start: float, end: float, kind: str | None = "token") -> float:
        """The longest recorded gap of ``kind`` (None: any) that overlaps the wall-clock interval [start, end]
        (0.0 when no client received anything then)."""
        return max((g.seconds for s in self.clients for g in s.gaps
                    if (kind is None or g.kind == kind) and g.end >= start and g.start <= end), default=0.0)

    def window_baseline(self, start: float, end: float, length: float, kind: str | None = "token"
                        ) -> dict[str, Any]:
        """The longest gap in each window of ``length`` seconds that fits in [start, end] (non-overlapping, from
        ``end`` back): what an event of that length would have met without the event. The longest of more gaps is
        longer, so an event's longest gap compares with windows of its own length, not with a whole stage.
        ``windows``, and in milliseconds the windows' ``median_ms`` and ``max_ms`` (None without a window)."""
        found = []
        b = end
        while length > 0 and b - length >= start:
            found.append(self.longest_gap(b - length, b, kind) * 1e3)
            b -= length
        found.sort()
        med = None if not found else (found[len(found) // 2] if len(found) % 2 else
                                      (found[len(found) // 2 - 1] + found[len(found) // 2]) / 2)
        return {"windows": len(found), "median_ms": None if med is None else round(med, 2),
                "max_ms": round(found[-1], 2) if found else None}


async def stream_client(base_url: str, model: str, i: int, stats: ClientStats, stop: asyncio.Event,
                        after: asyncio.Event, *, max_tokens: int = 32, timeout_s: float = 900.0,
                        prompts: Sequence[str] = PROMPTS) -> None:
    """One client: streamed completions (``ignore_eos``, so each streams ``max_tokens`` chunks) until ``stop``."""
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s)) as c:
        n = 0
        while not stop.is_set():
            body = {"model": model, "prompt": prompts[(i + n) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True}
            n += 1
            stats.sent += 1
            sent_after = after.is_set()
            last, last_wall = time.monotonic(), time.time()
            req = Request(last_wall)
            stats.requests.append(req)
            stats.last_at = last_wall
            kind = "first"
            done = finished = False
            try:
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        stats.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                        _failed(stats, req)
                        continue
                    async for line in resp.aiter_lines():
                        if not line:  # the blank line that ends an SSE event: not a token
                            continue
                        now, wall = time.monotonic(), time.time()
                        stats.longest_stall_s = max(stats.longest_stall_s, now - last)
                        if now - last >= GAP_RECORD_S:
                            stats.gaps.append(Gap(last_wall, wall, kind))
                        last, last_wall, kind = now, wall, "token"
                        stats.last_at = wall
                        if not line.startswith("data: "):
                            continue
                        if line[6:] == "[DONE]":
                            done = True
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:  # an error event (vLLM's, or the gate's when the engine broke off)
                            raise ValueError(f"error event: {chunk['error'].get('message')}")
                        stats.tokens += 1
                        if chunk["choices"][0].get("finish_reason"):
                            finished = True
            except (httpx.HTTPError, ValueError) as exc:  # ValueError: also a JSONDecodeError
                stats.errors.append(f"{type(exc).__name__}: {exc}")
                _failed(stats, req)
                continue
            if done and finished:
                stats.completed += 1
                stats.completed_after += int(sent_after)
                req.ended, req.outcome = time.time(), "completed"
            else:
                stats.errors.append(f"stream ended without [DONE]/finish_reason (done={done}, finished={finished})")
                _failed(stats, req)


def _failed(stats: ClientStats, req: Request) -> None:
    stats.failed += 1
    req.ended, req.outcome = time.time(), "failed"


async def load_during(base_url: str, model: str, action: Callable[[], Awaitable[Any]], *, clients: int = 8,
                      max_tokens: int = 32, limit_s: float = 600.0, prompts: Sequence[str] = PROMPTS,
                      stats: list[ClientStats] | None = None) -> LoadResult:
    """Run ``clients`` streaming clients, await ``action`` once all of them are served, then let each be served
    twice more and stop. Raises ``AssertionError`` when traffic never flows (before or after the action).
    ``stats``: the clients' records, given by a caller that reads them while the load runs (a sampler thread);
    ``clients`` of them, empty."""
    stats = stats if stats is not None else [ClientStats() for _ in range(clients)]
    if len(stats) != clients:
        raise ValueError(f"{len(stats)} ClientStats for {clients} clients")
    stop, after = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(stream_client(base_url, model, i, stats[i], stop, after, max_tokens=max_tokens,
                                               prompts=prompts))
             for i in range(clients)]
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        while min(s.completed for s in stats) < 2:
            if loop.time() - t0 > limit_s or any(s.failed for s in stats):
                raise AssertionError(f"traffic does not flow through {base_url}: {stats}")
            await asyncio.sleep(0.2)
        result = await action()
        after.set()
        t1 = loop.time()
        while min(s.completed_after for s in stats) < 2:
            if loop.time() - t1 > limit_s:
                raise AssertionError(f"clients not served after the action: {stats}")
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), limit_s)
    return LoadResult(stats, result)
