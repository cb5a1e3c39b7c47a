"""The one poll-and-wait loop of the tests and benchmarks: poll a condition until it holds, or fail saying what was
awaited, for how long, and what was seen last.

Tests against real processes (a daemon, an engine, Prometheus) wait for things that happen in another process,
so every such test polls. Written out in each module, the loops drifted apart: some swallowed the errors of a
server still starting, some did not; some failed at once when the process they waited on had died, others waited
out the whole limit and then said only "not reached". Here it is once:

- :func:`wait_until` polls ``pred`` every ``step_s`` and returns its first truthy value;
- :func:`seconds_until` is the same wait, returning how long it took (a figure some tests assert on);
- :func:`wait_until_async` polls from a coroutine (the daemon under test in this event loop must keep running);
- ``ignore`` names the exceptions that mean "not yet" (a server that does not answer yet), ``gone`` says when
  waiting is pointless (the process exited: fail at once, not after the limit), and ``detail`` adds what explains
  a failure (a log's tail, the last status), computed only when the wait fails.

A failure raises :class:`WaitTimeout` (an ``AssertionError``, so pytest reports it as a test failure with its
message). Imports without pytest.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__: list[str] = []  # nothing here is another package's business

T = TypeVar("T")

# Long enough not to load a shared 2-core box, short enough that a test does not sleep past the moment it waits for.
DEFAULT_STEP_S = 0.2


class WaitTimeout(AssertionError):
    """A wait that did not end as it should: the limit passed, or what it waited on is gone."""


def _message(head: str, last_exc: BaseException | None, detail: Callable[[], str] | None) -> str:
    parts = [head]
    if last_exc is not None:
        parts.append(f"last error: {type(last_exc).__name__}: {last_exc}")
    if detail is not None:
        try:
            extra = detail()
        except Exception as exc:  # the failure message must not hide the failure
            extra = f"(no detail: {type(exc).__name__}: {exc})"
        if extra:
            parts.append(extra)
    return "\n".join(parts)


class _Poll:
    """One wait's bookkeeping, shared by the sync and the async loop so that both fail alike."""

    def __init__(self, what: str, limit_s: float, ignore: tuple[type[BaseException], ...],
                 gone: Callable[[], str | None] | None, detail: Callable[[], str] | None) -> None:
        self.what, self.limit_s, self.ignore, self.gone, self.detail = what, limit_s, ignore, gone, detail
        self.t0 = time.monotonic()
        self.last_exc: BaseException | None = None

    def failed(self, exc: BaseException) -> None:
        if not isinstance(exc, self.ignore):
            raise exc
        self.last_exc = exc

    def check(self) -> None:
        """Raise when waiting on is pointless (``gone``) or the limit has passed."""
        if self.gone is not None:
            why = self.gone()
            if why:
                raise WaitTimeout(_message(f"{why} while waiting for {self.what}", self.last_exc, self.detail))
        if time.monotonic() - self.t0 > self.limit_s:
            raise WaitTimeout(_message(f"not within {self.limit_s:g} s: {self.what}", self.last_exc, self.detail))


def wait_until(pred: Callable[[], T], what: str, limit_s: float, *, step_s: float = DEFAULT_STEP_S,
               ignore: tuple[type[BaseException], ...] = (), gone: Callable[[], str | None] | None = None,
               detail: Callable[[], str] | None = None) -> T:
    """Poll ``pred()`` every ``step_s`` until it returns something truthy, and return that.

    ``what`` names the awaited thing in the failure ("the engine ready"). An exception of ``ignore`` from ``pred``
    counts as "not yet" (the last one is quoted on failure); any other propagates. ``gone()`` returning a reason
    ("the daemon exited (1)") ends the wait at once. ``detail()`` is appended to the failure message.
    """
    poll = _Poll(what, limit_s, ignore, gone, detail)
    while True:
        try:
            got = pred()
            if got:
                return got
        except BaseException as exc:
            poll.failed(exc)
        poll.check()
        time.sleep(step_s)


def seconds_until(pred: Callable[[], object], what: str, limit_s: float, *, step_s: float = DEFAULT_STEP_S,
                  ignore: tuple[type[BaseException], ...] = (), gone: Callable[[], str | None] | None = None,
                  detail: Callable[[], str] | None = None) -> float:
    """:func:`wait_until`, returning the seconds the wait took instead of ``pred``'s value (for figures such as
    "the kill was noticed within 2 s")."""
    t0 = time.monotonic()
    wait_until(pred, what, limit_s, step_s=step_s, ignore=ignore, gone=gone, detail=detail)
    return time.monotonic() - t0


async def wait_until_async(pred: Callable[[], T | Awaitable[T]], what: str, limit_s: float, *,
                           step_s: float = 0.05, ignore: tuple[type[BaseException], ...] = (),
                           gone: Callable[[], str | None] | None = None,
                           detail: Callable[[], str] | None = None) -> T:
    """:func:`wait_until` for a coroutine: sleeps with ``asyncio.sleep`` so the event loop (and whatever runs in
    it: a gate, a daemon under test) keeps running between polls. ``pred`` may be a coroutine function."""
    poll = _Poll(what, limit_s, ignore, gone, detail)
    while True:
        try:
            got = pred()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return got  # type: ignore[return-value]
        except BaseException as exc:
            poll.failed(exc)
        poll.check()
        await asyncio.sleep(step_s)
