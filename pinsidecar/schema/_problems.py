"""What a config reader says when a file cannot be used: every problem at once, each naming its key.

An operator who fixes one typo only to meet the next on the following restart has been told too little. So a
reader does not stop at the first problem: it adds each to a :class:`Problems` list and goes on (a refused value is
left at its default, and checks across keys skip it: :func:`~pinsidecar.schema.usable`), and at the end raises one
:class:`ConfigError` that holds them all, in the order of the file.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__: list[str] = []  # re-exported by the package


class ConfigError(ValueError):
    """The config cannot be used. :attr:`problems` lists every problem found, each naming the key (and the file,
    once the reader knows it) and saying how to fix it; ``str()`` is one problem a line."""

    def __init__(self, problems: str | Iterable[str]) -> None:
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        super().__init__("\n".join(self.problems))

    def within(self, source: object) -> ConfigError:
        """The same problems, each prefixed with ``source`` (the file)."""
        return ConfigError(f"{source}: {p}" for p in self.problems)


class Problems:
    """The problems one pass over a config has found so far, in the order found."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    def take(self, exc: ConfigError) -> None:
        """Add the problems of an error raised by a reader that does not collect."""
        self.messages.extend(exc.problems)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def raise_any(self) -> None:
        """End the pass: a :class:`ConfigError` holding every problem, if there is one."""
        if self.messages:
            raise ConfigError(self.messages)
