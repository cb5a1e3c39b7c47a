"""What one engine boot leaves behind: its record, and what its engine log says about it.

The supervisor records every boot (:class:`BootRecord`: reason, seconds from start to ready, the map hash and its
geometry, whether the compile cache missed) and, when a boot fails, reads the engine's log for the reason. These
are pure functions of a log file and a boot history, kept apart from the supervisor's event loop so that they can
be tested, and reused by the benchmarks, without an engine. Why they work the way they do:

- **A compile-cache miss is read from the engine's own log first.** A remap keeps the map's geometry and so the
  kernel shapes, so a miss means something fed the compile caches' key that should not have. vLLM logs "Directly
  load the compiled graph(s)" on a hit and "Compiling a graph for compile range" on a miss
  (:func:`compile_cache_evidence`); an engine that compiles nothing (eager) says neither, and then a boot much
  slower than the last successful one with the same geometry (``cache_miss_factor`` times and at least
  ``cache_miss_min_s`` longer) is flagged (:func:`is_cache_miss`). Timing alone is weak: on the H200 a full
  recompile took 1.7x a cache-hit boot (98.7 s against 57.2 s), under the factor, which is why the log comes first.
- **A pin refusal is permanent.** A boot that pin mode refused (its ``pinsidecar pin refused:`` line in the engine
  log: a map that does not fit the model, a quantization no split backend supports) would refuse again, so the
  supervisor fails at once with the hook's reason (:func:`pin_refusal`, :class:`PinRefusedError`).
- **The log is rotated per boot** (:func:`rotate_log`), so all of it is this boot's, and a failed boot's error
  shows only its own last lines.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from pinsidecar_hook.contract import ExpertMap
from pinsidecar_hook.contract.env import PIN_REFUSED_MARKER

from pinsidecar.daemon.config import SupervisorConfig
from pinsidecar.engine import EngineError

__all__: list[str] = []  # nothing here is another package's business


@dataclass(frozen=True)
class BootRecord:
    reason: str  # start | crash | unhealthy | drain-reboot | rollback | retry
    started_at: str
    ok: bool
    seconds: float  # start -> ready (or -> failure)
    map_path: str | None
    map_hash: str | None
    geometry: str
    cache_miss: bool = False
    error: str = ""
    log_tail: tuple[str, ...] = ()  # the engine's last log lines when the boot failed


# vLLM's compile-cache log lines (vllm/compilation/backends.py, 0.26 to 0.33): a hit loads, a miss compiles.
_CACHE_HIT_MARK = "Directly load the compiled graph"
_CACHE_MISS_MARK = "Compiling a graph for"


def compile_cache_evidence(log_path: Path | None) -> bool | None:
    """What the engine's boot log (rotated per boot, so all of it is this boot's) says about its compile cache:
    True (it compiled: a miss), False (it loaded compiled graphs: a hit), None (it says nothing, e.g. an eager
    engine, or no log). Read line by line: a GPU boot log with CUDA-graph capture progress runs to megabytes."""
    hit = False
    try:
        with open(log_path, "rb") if log_path is not None else contextlib.nullcontext(None) as fh:
            if fh is None:
                return None
            for raw in fh:
                if _CACHE_MISS_MARK.encode() in raw:
                    return True
                hit = hit or _CACHE_HIT_MARK.encode() in raw
    except OSError:
        return None
    return False if hit else None


class PinRefusedError(EngineError):
    """Pin mode refused to boot the engine (the hook's message is in ``str``): permanent, like a missing image."""

    permanent = True


def pin_refusal(log_path: Path | None) -> str | None:
    """Pin mode's refusal in the engine's boot log (the hook's ``PIN_REFUSED_MARKER`` line: a map that does not
    fit the model, a layer no split backend supports), or None. A refusal is permanent: the same engine with the
    same map refuses again, so the supervisor reports it instead of restarting into it."""
    found: str | None = None
    marker = PIN_REFUSED_MARKER.encode()
    try:
        with open(log_path, "rb") if log_path is not None else contextlib.nullcontext(None) as fh:
            if fh is None:
                return None
            for raw in fh:
                at = raw.find(marker)
                if at >= 0:
                    found = raw[at + len(marker):].decode("utf-8", "replace").strip()[:2000]
    except OSError:
        return None
    return found


def is_cache_miss(seconds: float, previous: BootRecord | None, cfg: SupervisorConfig) -> bool:
    """A boot much slower than the last successful one with the same geometry: ``cache_miss_factor`` times as
    long and at least ``cache_miss_min_s`` longer (a 3 s boot becoming 7 s is noise, not a recompile)."""
    if previous is None or not previous.ok:
        return False
    return seconds > previous.seconds * cfg.cache_miss_factor and seconds - previous.seconds >= cfg.cache_miss_min_s


def geometry_key(emap: ExpertMap | None) -> str:
    """What the compile caches may depend on: the map's geometry (or ``none`` without a map)."""
    if emap is None:
        return "none"
    g = emap.geometry()
    return ",".join(f"{k}={g[k]}" for k in sorted(g)) + f",layers={'-'.join(map(str, emap.layer_ids))}"


def rotate_log(path: Path | None) -> None:
    """Keep the previous boot's engine log as ``<log>.1``, so a boot's error shows only its own last lines."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        if path.stat().st_size > 0:
            path.replace(path.with_name(path.name + ".1"))
