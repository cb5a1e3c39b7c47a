"""What a long command shows a person while it works: one line per step, a live indicator for long waits.

``pinsidecar demo`` and ``pinsidecar count-boot`` spend most of their time waiting: for vLLM to boot (15-25 s on the
CPU lane, minutes for a large GPU model), for a replay to finish, for a remap to go through its states. A terminal
that sits silent for that long looks hung, and one that scrolls a line per HTTP request hides the result. So:

- each step prints one short line on stdout (``==> counts``), and its results as indented lines under it;
- a wait shows a spinner with what it waits for and the elapsed time on stderr (:meth:`Terminal.waiting`); the
  text can change while it spins (the remap's current state), and it disappears when the wait ends;
- lines printed while a spinner spins land above it: the spinner's line is cleared first and redrawn after, so
  the demo can report windows and remap steps as they happen without garbling the indicator;
- a replay shows a progress bar per request on stderr (:func:`pinsidecar.counts.workload.replay` draws it; ask
  :attr:`Terminal.bars` whether to);
- with ``--json`` (:meth:`Terminal.silent`) none of this is printed, so stdout carries only the JSON document.

Indicators are drawn only when stderr is a terminal: in CI logs and pipes a spinner is just noise.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import click

__all__: list[str] = []  # nothing here is another package's business

# How often the indicator redraws and asks ``until()``: often enough that the spinner looks alive and stops
# within a blink of the engine answering, rarely enough to cost nothing.
_TICK_S = 0.25
# How often ``until()`` is asked (it may be an HTTP request): every other tick.
_POLL_EVERY = 2
_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_CLEAR = "\r\x1b[2K"


def format_elapsed(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` past an hour): how the demo's timeline and the indicators show durations."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class _Spinner:
    """One indicator line on stderr, redrawn by a side thread; :meth:`clear` makes room for a line of output."""

    def __init__(self, text: str, until: Callable[[], bool] | None) -> None:
        self.text = text
        self.until = until
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.visible = False
        self.thread = threading.Thread(target=self._run, name="terminal-wait", daemon=True)

    def _draw(self, frame: int) -> None:
        line = f"{_FRAMES[frame % len(_FRAMES)]} {self.text}  {format_elapsed(time.monotonic() - self.t0)}"
        sys.stderr.write(_CLEAR + line)
        sys.stderr.flush()
        self.visible = True

    def _run(self) -> None:
        frame = 0
        while not self.done.wait(_TICK_S):
            if self.until is not None and frame % _POLL_EVERY == 0:
                try:
                    if self.until():
                        break
                except Exception:  # an indicator must never break the command it decorates
                    pass
            with self.lock:
                if not self.done.is_set():
                    self._draw(frame)
            frame += 1
        with self.lock:
            self.clear()

    def clear(self) -> None:
        """Erase the indicator's line (the caller holds :attr:`lock`)."""
        if self.visible:
            sys.stderr.write(_CLEAR)
            sys.stderr.flush()
            self.visible = False

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


class Terminal:
    """Step lines on stdout and live indicators on stderr, for a person; :meth:`silent` for ``--json``."""

    def __init__(self, enabled: bool = True, bars: bool | None = None) -> None:
        self.enabled = enabled
        self._bars = bars
        self._spinner: _Spinner | None = None

    @classmethod
    def silent(cls) -> Terminal:
        """Prints nothing and draws nothing (``--json``: stdout is the JSON document alone)."""
        return cls(enabled=False, bars=False)

    @property
    def bars(self) -> bool:
        """Whether live indicators (spinner, replay bar) should be drawn: enabled and stderr is a terminal."""
        if not self.enabled:
            return False
        if self._bars is not None:
            return self._bars
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):
            return False

    def _echo(self, text: str) -> None:
        spinner = self._spinner
        if spinner is None:
            click.echo(text)
            return
        with spinner.lock:  # the line goes above the indicator, which redraws on its next tick
            spinner.clear()
            click.echo(text)

    def step(self, title: str) -> None:
        """A new step starts: ``==> title``."""
        if self.enabled:
            self._echo(click.style(f"==> {title}", bold=True))

    def note(self, text: str) -> None:
        """One line of a step's result, indented under it."""
        if self.enabled:
            self._echo(f"    {text}")

    @contextmanager
    def waiting(self, what: str, until: Callable[[], bool] | None = None) -> Iterator[Callable[[str], None]]:
        """Show a spinner with ``what`` and the elapsed time while the block runs, or until ``until()`` is True.

        ``until`` lets the indicator stop while the block goes on, e.g. when the engine answers in the middle of a
        count boot and the replay's own bar takes over; it is polled from the side thread every half second. The
        block gets a function that replaces the indicator's text (a wait that moves through stages). One indicator
        at a time: a nested wait only changes the text.
        """
        if not self.bars or self._spinner is not None:
            outer = self._spinner
            before = outer.text if outer is not None else ""

            def retitle(text: str) -> None:
                if outer is not None:
                    outer.text = text

            retitle(what)
            try:
                yield retitle
            finally:
                retitle(before)
            return
        spinner = _Spinner(what, until)

        def update(text: str) -> None:
            spinner.text = text

        self._spinner = spinner
        spinner.thread.start()
        try:
            yield update
        finally:
            spinner.stop()
            self._spinner = None

    def engine_boot(self, base_url: str, what: str = "engine booting") -> AbstractContextManager[Callable[[str], None]]:
        """:meth:`waiting` until the engine at ``base_url`` lists its model (``GET /v1/models``).

        Deliberately not the launchers' readiness probe: that one runs a generation, which a count boot would
        count. Listing the model routes nothing."""
        return self.waiting(what, until=lambda: _lists_models(base_url))


def _lists_models(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
