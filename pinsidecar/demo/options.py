"""What a demo run is given: its options, and the display it tells a person through.

Both the loop's outline (:mod:`pinsidecar.demo.loop`) and its stages (:mod:`pinsidecar.demo.stages`) need these,
so they live below both: the outline imports the stages, and the stages never import the outline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["DemoOptions"]

# 48 of 64 experts hot per layer: 25 % of the experts in host memory, close to the reference system's split
# (295 hot / 89 cold of 384 experts per layer, 23 % cold; docs/design.md).
DEFAULT_HOT_ROWS = 48
# Concurrent clients: enough to keep the CPU engine batching, few enough to leave the count engine a core.
CLIENTS = 3


@dataclass
class DemoOptions:
    workdir: Path
    hot_rows: int = DEFAULT_HOT_ROWS
    domain_a: str = "code"
    domain_b: str = "prose"
    port: int = 8000  # the serving engine's; gate, control and count engine take the usual ports or free ones
    metrics_port: int = 9108
    clients: int = CLIENTS
    rebuild_model: bool = False
    reuse_counts: bool = True


class Display(Protocol):
    """What the loop tells a person as it goes. The CLI passes its terminal (:class:`pinsidecar.cli._terminal
    .Terminal`); ``None`` (tests, ``--json``) shows nothing."""

    @property
    def bars(self) -> bool:
        """Whether replays should draw their progress bar."""

    def step(self, title: str) -> None:
        """A step starts."""

    def note(self, text: str) -> None:
        """One line of the current step's result."""

    def waiting(self, what: str, until: Callable[[], bool] | None = ...) -> AbstractContextManager[
            Callable[[str], None]]:
        """Something is being waited for during this block; the block may change the text as it goes."""

    def engine_boot(self, base_url: str, what: str = ...) -> AbstractContextManager[Callable[[str], None]]:
        """The engine at ``base_url`` is booting during this block (show that it is, until it answers)."""


class Silent:
    """The display that shows nothing (tests, ``--json``)."""

    bars = False

    def step(self, title: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    @contextlib.contextmanager
    def waiting(self, what: str, until: Callable[[], bool] | None = None) -> Iterator[Callable[[str], None]]:
        yield lambda text: None

    def engine_boot(self, base_url: str, what: str = "") -> AbstractContextManager[Callable[[str], None]]:
        return self.waiting(what)
