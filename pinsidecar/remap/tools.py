"""The remap pipeline's blocking actions, one object a test can replace: :class:`RemapTools`.

Everything a remap does that takes an engine or a disk is a call through this object: the count boot, the greedy
parity outputs of an engine, the live cold-rate probe, the hook's apply request and the commit's write of
``active-map.json``. The state machine around them is bookkeeping, files and order, so a test drives it in a
second with fakes (:mod:`pinsidecar.testing.remap`), and a fault (a full disk at the commit) is one replaced call.

``pause_at`` is the one knob no production caller sets: the states in which a remap stops (forever, until the
process is killed or stopped) right after it has entered and recorded them, so a test can SIGKILL the sidecar in
a given state (:mod:`pinsidecar.testing.paused_daemon`). It is a field of the object the daemon is built with,
not an environment variable, so nothing on the live ``pinsidecar run`` path reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import CountsArtifact

from pinsidecar.counts.parity import PromptOutput
from pinsidecar.counts.workload import WorkloadRequest
from pinsidecar.engine.spec import EngineConfig
from pinsidecar.remap.apply import ApplyClient, request_apply
from pinsidecar.remap.commit import write_active_map
from pinsidecar.remap.config import RemapConfig
from pinsidecar.remap.verify import ColdRateProbe, parity_outputs

__all__ = ["RemapTools"]


def run_count_boot(workloads: Sequence[Path], out: Path, *, engine: EngineConfig, remap: RemapConfig, port: int,
                   label: str, engine_log: Path, pid_file: Path) -> tuple[CountsArtifact, dict[str, Any]]:
    """The count boot of a remap: the serving engine's ``[engine]`` table, eager (counts do not depend on compiled
    graphs, and an eager boot is about twice as fast on CPU), on its own port, with ``remap.count_boot_env`` over
    its environment (its own CPU cores on the CPU lane). Blocking: run it in a thread."""
    from pinsidecar.counts.count_boot import run_count_boot

    spec = dataclasses.replace(engine, enforce_eager=True, env={**engine.env, **remap.count_boot_env})
    res = run_count_boot(None, list(workloads), out, concurrency=remap.count_boot_concurrency, port=port,
                      label=label, engine=spec, progress=False, engine_log=engine_log, pid_file=pid_file)
    return res.counts, res.summary()


@dataclass
class RemapTools:
    """``count_boot`` (see :func:`run_count_boot`), ``parity`` (greedy outputs of an engine), ``cold_probe`` (a
    poller of the live cold rate under a map), ``apply`` (the hook's apply request,
    :func:`~pinsidecar.remap.apply.request_apply`), ``write_active_map`` (the commit,
    :func:`~pinsidecar.remap.commit.write_active_map`) and ``pause_at`` (see the module docstring)."""

    count_boot: Callable[..., tuple[CountsArtifact, dict[str, Any]]] = run_count_boot
    parity: Callable[[str, str, Sequence[WorkloadRequest]], list[PromptOutput]] = parity_outputs
    cold_probe: Callable[[Path, str], Any] = ColdRateProbe
    apply: ApplyClient = request_apply
    write_active_map: Callable[[Path, Path, str | None], None] = write_active_map
    pause_at: frozenset[str] = field(default_factory=frozenset)
