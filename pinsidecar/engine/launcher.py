"""What every launcher promises: the :class:`Launcher` protocol and the errors a launcher raises.

The daemon's supervisor, the count boot and parity hold "an engine" without caring whether it is a local process
(:class:`~pinsidecar.engine.process.EngineProcess`) or a container
(:class:`~pinsidecar.engine.container.ContainerEngine`); this is the contract between them. Both take the same
:class:`~pinsidecar.engine.spec.EngineSpec` and wait for readiness the same way
(:mod:`~pinsidecar.engine.readiness`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from pinsidecar.engine.spec import EngineSpec

__all__: list[str] = []  # nothing here is another package's business

# How many log lines an EngineBootError carries: enough for a Python traceback and the line that caused it.
BOOT_LOG_LINES = 30


class EngineError(RuntimeError):
    """The engine could not be started or stopped as asked. The message says what and what to do."""


class EngineSetupError(EngineError):
    """The engine cannot start until an operator fixes the set-up (the container runtime or the image is missing).
    Retrying cannot help, so the supervisor goes to ``failed`` at once instead of backing off and retrying."""

    permanent = True


class PortInUseError(EngineError):
    """The port the engine should listen on is taken; raised before anything is started."""


class EngineBootError(EngineError):
    """The engine exited, or never became ready, while booting. ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, log_tail: list[str] | None = None, log_path: Path | None = None) -> None:
        self.log_tail = list(log_tail or [])
        self.log_path = log_path
        text = message
        if log_path is not None:
            text += f"\nengine log: {log_path}"
        if self.log_tail:
            text += "\nlast engine log lines:\n" + "\n".join("  | " + line for line in self.log_tail)
        super().__init__(text)


@runtime_checkable
class Launcher(Protocol):
    """What the daemon, the count boot and the parity tool need from anything that runs an engine.

    ``start`` refuses a taken port before anything runs (:class:`PortInUseError`); ``wait_ready`` returns the
    seconds it waited and raises :class:`EngineBootError` (with the last log lines) when the engine dies or times
    out; ``stop`` returns the exit code.
    """

    spec: EngineSpec

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str: ...

    def start(self) -> None: ...

    def wait_ready(self, timeout_s: float = 300.0) -> float: ...

    def alive(self) -> bool: ...

    def health(self) -> bool: ...

    def stop(self, timeout_s: float = 60.0) -> int | None: ...

    def last_log_lines(self, n: int = BOOT_LOG_LINES) -> list[str]: ...
