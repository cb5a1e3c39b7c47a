"""What a long command shows a person while it works: one line per step, a live indicator for long waits.

``pinsidecar demo`` and ``pinsidecar profile`` spend most of their time waiting: for vLLM to boot (15-25 s on the
CPU lane, minutes for a large GPU model) and for a replay to finish. A terminal that sits silent for that long
looks hung, and one that scrolls a line per HTTP request hides the result. So:

- each step prints one short line on stdout (``==> counts``), and its results as indented lines under it;
- an engine boot shows a spinner with the elapsed time on stderr, which disappears when the engine answers;
- a replay shows a progress bar per request on stderr (:func:`pinsidecar.runs.workload.replay` draws it; ask
  :attr:`Terminal.bars` whether to);
- with ``--json`` (:meth:`Terminal.silent`) none of this is printed, so stdout carries only the JSON document.

Indicators are drawn only when stderr is a terminal: in CI logs and pipes a spinner is just noise.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import click

__all__ = ["Terminal"]

# How often the boot indicator asks the engine whether it is up: often enough that the spinner stops within a
# blink of the readiness probe, rarely enough to cost nothing.
_POLL_S = 0.5


class Terminal:
    """Step lines on stdout and live indicators on stderr, for a person; :meth:`silent` for ``--json``."""

    def __init__(self, enabled: bool = True, bars: bool | None = None) -> None:
        self.enabled = enabled
        self._bars = bars

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

    def step(self, title: str) -> None:
        """A new step starts: ``==> title``."""
        if self.enabled:
            click.echo(click.style(f"==> {title}", bold=True))

    def note(self, text: str) -> None:
        """One line of a step's result, indented under it."""
        if self.enabled:
            click.echo(f"    {text}")

    @contextmanager
    def waiting(self, what: str, until: Callable[[], bool] | None = None) -> Iterator[None]:
        """Show a spinner with the elapsed time while the block runs, or until ``until()`` returns True.

        ``until`` lets the indicator stop while the block goes on, e.g. when the engine answers in the middle of a
        count boot and the replay's own bar takes over. It is polled from a side thread every half second.
        """
        if not self.bars:
            yield
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        done = threading.Event()
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=Console(file=sys.stderr), transient=True, redirect_stdout=False,
                            redirect_stderr=False)
        progress.add_task(what, total=None)

        def watch() -> None:
            while not done.wait(_POLL_S):
                try:
                    if until is not None and until():
                        break
                except Exception:  # an indicator must never break the command it decorates
                    continue
            progress.stop()

        progress.start()
        watcher = threading.Thread(target=watch, name="terminal-wait", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join(timeout=5)

    def engine_boot(self, base_url: str, what: str = "engine booting") -> AbstractContextManager[None]:
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
