"""The lifecycle both real test servers share (Prometheus, Alertmanager): a temp dir, a loopback port, a log file,
a process in its own session, a ``/-/ready`` wait that reports the log tail when the binary exits, and a stop that
cleans up. Subclasses say only what is theirs: the binary, its config file and its command line."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from pinsidecar.engine.ports import free_port
from pinsidecar.testing.wait import WaitTimeout, wait_until

__all__: list[str] = []  # nothing here is another package's business

# The ports Prometheus, Alertmanager and their scrape targets take in tests (``free_port(*PORT_RANGE)``): a fixed
# range away from the engines' ports.
PORT_RANGE = (8300, 8349)


class LoopbackServer:
    """A throw-away server process on 127.0.0.1; use as a context manager."""

    name = "server"  # for messages, the temp dir prefix and the log file name
    install_hint = ""  # how to get the binary when it is missing

    def __init__(self, *, port: int | None = None, binary: str | None = None) -> None:
        self.port = port
        self.binary = binary
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------------------------------- subclass parts
    def write_config(self, directory: Path) -> Path:
        """Write the config file into ``directory``; return its path."""
        raise NotImplementedError

    def argv(self, config: Path, directory: Path) -> list[str]:
        """The command line (``self.binary`` first), listening on ``127.0.0.1:self.port``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------- shared
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """host:port, as Prometheus' static configs take it."""
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return self._dir / f"{self.name}.log"

    def start(self, timeout_s: float = 30.0) -> None:
        if self.binary is None:
            raise FileNotFoundError(f"{self.name} binary not found; {self.install_hint}")
        self._dir = Path(tempfile.mkdtemp(prefix=f"pinsidecar-{self.name}-"))
        if self.port is None:
            self.port = free_port(*PORT_RANGE)
        config = self.write_config(self._dir)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.argv(config, self._dir), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        proc = self._proc
        try:
            wait_until(lambda: httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200, f"{self.name} ready",
                       timeout_s, ignore=(httpx.HTTPError,),
                       gone=lambda: None if proc.poll() is None else f"{self.name} exited with {proc.returncode}",
                       detail=self.log_tail)
        except WaitTimeout:
            self.stop()
            raise

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AssertionError):
            return ""

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
