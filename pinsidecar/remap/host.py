"""What the remap pipeline needs from the process that runs it: :class:`RemapHost`, and nothing more.

The daemon implements it (:class:`~pinsidecar.daemon.remap_host.DaemonRemapHost`), but the pipeline never imports
the daemon: the remap room sits below the daemon's (the daemon starts remaps, a remap does not start daemons), and
a narrow host is what lets a test run a remap against anything that answers these few questions. Configuration
comes as :class:`RemapSettings`, the three tables a remap reads plus the maps folder, which the daemon's config
has as it is. Metrics come as :class:`RemapMetrics` (the exporter, or None without one).

What the host does *not* offer is deliberate: which map a reference names and whether a drain-reboot is running
are the daemon's to answer before it asks for a remap (:meth:`~pinsidecar.remap.pipeline.RemapPipeline.request`
takes the resolved map and the reason it may not start), and ``active-map.json`` is the remap's own commit point
(:mod:`~pinsidecar.remap.commit`), so the host is only told afterwards (:meth:`RemapHost.committed`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pinsidecar_hook.contract import ExpertMap

from pinsidecar.drift import DriftWatch
from pinsidecar.drift.config import DriftConfig
from pinsidecar.engine.spec import EngineConfig
from pinsidecar.remap.config import RemapConfig

__all__ = ["RebootHook"]

# A hook run inside a drain-reboot while the gate holds: returns None to go on, or why not.
RebootHook = Callable[[dict[str, Any]], Awaitable[str | None]]


class RemapSettings(Protocol):
    """The configuration a remap reads (the daemon's :class:`~pinsidecar.daemon.config.Config` is one)."""

    @property
    def engine(self) -> EngineConfig: ...  # hook_mode, the port (the count boot's default is next to it)

    @property
    def remap(self) -> RemapConfig: ...

    @property
    def drift(self) -> DriftConfig: ...  # the margin a candidate must beat, min_tokens

    @property
    def maps_dir(self) -> Path: ...  # where candidates are written


class RemapMetrics(Protocol):
    """The exporter's remap counters (:class:`~pinsidecar.metrics.Exporter` is one)."""

    def record_remap(self, outcome: str, seconds: float | None) -> None: ...

    def record_apply_request(self, result: str, *, seconds: float | None = None, rows: int = 0,
                             bytes_moved: int = 0) -> None: ...

    def record_apply_outcome(self, outcome: str) -> None: ...


class RemapHost(Protocol):
    """The daemon as the pipeline sees it."""

    @property
    def cfg(self) -> RemapSettings: ...  # read at every use: a test may swap it

    @property
    def state_dir(self) -> Path: ...  # remap records, the count engine's pid file, active-map.json

    @property
    def watch(self) -> DriftWatch | None: ...

    @property
    def exporter(self) -> RemapMetrics | None: ...

    @property
    def capture(self) -> Any: ...  # the gate's CaptureStore, or None

    def library_entries(self) -> Sequence[Any]: ...  # the maps library's entries (``.path``)

    # the engine serving now

    @property
    def served_map(self) -> tuple[Path | None, ExpertMap | None]: ...

    @property
    def engine_url(self) -> str | None: ...

    @property
    def model_name(self) -> str: ...

    @property
    def stats_path(self) -> Path | None: ...  # the hook's live stats file (the apply request goes beside it)

    # deploying

    def engine_map_path(self, path: Path) -> str: ...  # ``path`` as the engine sees it (a container's mount)

    def engine_alive_probe(self) -> Callable[[], bool]: ...  # thread-safe: the engine serving now still runs

    def applied_in_place(self, path: Path, emap: ExpertMap) -> None: ...  # the hook swapped the engine onto emap

    async def reboot_with(self, map_path: Path, *, reason: str, before_stop: RebootHook | None = None,
                          after_boot: RebootHook | None = None) -> dict[str, Any]: ...  # the one drain-reboot

    def committed(self, path: Path, map_hash: str) -> None: ...  # active-map.json names it now: restarts boot it
