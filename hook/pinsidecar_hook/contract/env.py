"""The hook's configuration and the environment variables that carry it from the daemon to the engine.

Environment rather than vLLM arguments because the hook must work with an unmodified engine command line and
in a container whose image cannot be rebuilt: the daemon sets these variables on the process or container it
launches. Nothing here may import vLLM or torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Pin mode's split backends (canonical names and short aliases) come from the one registry.
from pinsidecar_hook.contract.backends import AUTO_BACKEND, PIN_BACKEND_ALIASES, PIN_BACKENDS

__all__ = [
    "AUTO_BACKEND",
    "ENV",
    "MODES",
    "PIN_BACKENDS",
    "PIN_BACKEND_ALIASES",
    "PIN_REFUSED_MARKER",
    "HookConfig",
    "HookConfigError",
    "pin_backend_name",
]

# Variable names, in one place: the daemon's launcher builds the environment from these.
ENV = {
    "mode": "PINSIDECAR_HOOK_MODE",  # off | count | pin
    "counts_path": "PINSIDECAR_COUNTS_PATH",  # count mode writes here
    "map_path": "PINSIDECAR_MAP_PATH",  # pin mode reads this map at boot
    "stats_path": "PINSIDECAR_STATS_PATH",  # pin mode writes live stats here
    "flush_interval_s": "PINSIDECAR_FLUSH_INTERVAL_S",
    "workload": "PINSIDECAR_WORKLOAD",
    "histogram": "PINSIDECAR_STATS_HISTOGRAM",  # 1: stats carry the full [layer][expert] histogram
    "backend": "PINSIDECAR_PIN_BACKEND",  # auto, or one of PIN_BACKENDS / PIN_BACKEND_ALIASES
    # 1: at attach, compare every layer's split with vLLM's unsplit call on generated routing, bit for bit, and
    # report it (engine log, stats meta "selfcheck"); a few forwards per layer at boot, nothing while serving.
    "selfcheck": "PINSIDECAR_PIN_SELFCHECK",
    # 1: run each layer's cold tier on a side stream while its hot tier runs (backends whose two calls are
    # independent: triton_experts, torch_ref); the output is the same bits, only the schedule changes
    "overlap_tiers": "PINSIDECAR_PIN_OVERLAP",
    # count mode only: also record the routing trace (contract.trace) here, at most trace_tokens tokens, every
    # trace_every-th step
    "trace_path": "PINSIDECAR_TRACE_PATH",
    "trace_tokens": "PINSIDECAR_TRACE_TOKENS",
    "trace_every": "PINSIDECAR_TRACE_EVERY",
}

MODES = ("off", "count", "pin")
# The engine log line pin mode writes, on the worker's stderr, when it refuses to boot (a map that does not fit, a
# layer no backend can split): the daemon's supervisor reads it to report the refusal as a permanent failure
# (no retry can fix it) instead of restarting the engine into the same refusal.
PIN_REFUSED_MARKER = "pinsidecar pin refused: "
# Periodic flush: often enough that a SIGKILLed worker loses at most a few seconds of counts, rarely enough
# that the copy of a [layers, experts] int64 tensor is noise.
DEFAULT_FLUSH_INTERVAL_S = 5.0
# A trace is a device buffer of tokens x layers x top_k ids for the whole recording (no host copy per step), so its
# size is fixed at boot: 65536 tokens of a 48-layer top-8 model is 48 MiB as int16 on the device, 48 MiB on disk
# before compression, enough for a simulator's reuse statistics (they live within tens of tokens).
DEFAULT_TRACE_TOKENS = 65536
MAX_TRACE_TOKENS = 1 << 24


class HookConfigError(ValueError):
    """A hook setting that cannot work. Raised at engine boot so that the engine refuses to start."""


def pin_backend_name(raw: str) -> str:
    """The canonical backend name for a ``PINSIDECAR_PIN_BACKEND`` value (``auto``, a canonical name, or a short
    alias; case and surrounding blanks ignored). Raises :class:`HookConfigError` listing the accepted names."""
    name = raw.strip().lower() or AUTO_BACKEND
    name = PIN_BACKEND_ALIASES.get(name, name)
    if name != AUTO_BACKEND and name not in PIN_BACKENDS:
        aliases = ", ".join(f"{short} (= {full})" for short, full in PIN_BACKEND_ALIASES.items())
        raise HookConfigError(f"{ENV['backend']}={raw!r} is not a pin backend; use {AUTO_BACKEND} (pick by device "
                              f"and experts class), one of {', '.join(PIN_BACKENDS)}, or a short name: {aliases}")
    return name


@dataclass(frozen=True)
class HookConfig:
    mode: str = "off"
    counts_path: Path | None = None
    map_path: Path | None = None
    stats_path: Path | None = None
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    workload: str = ""
    histogram: bool = True
    backend: str = AUTO_BACKEND  # canonical (aliases are resolved on construction)
    selfcheck: bool = False
    overlap_tiers: bool = False  # pin mode: the cold tier on a side stream, concurrently with the hot one
    trace_path: Path | None = None  # count mode: record the routing trace here too (None: no trace)
    trace_tokens: int = DEFAULT_TRACE_TOKENS  # the recording's bound, in tokens
    trace_every: int = 1  # record every n-th step (1: all of them, so the trace's counts equal the counts')

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", pin_backend_name(self.backend))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HookConfig:
        env = os.environ if env is None else env
        mode = env.get(ENV["mode"], "off").strip().lower() or "off"
        if mode not in MODES:
            raise HookConfigError(f"{ENV['mode']}={mode!r} is not one of {MODES}")

        def path(key: str) -> Path | None:
            raw = env.get(ENV[key], "").strip()
            return Path(raw) if raw else None

        def positive_int(key: str, default: int, most: int) -> int:
            raw = env.get(ENV[key], "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise HookConfigError(f"{ENV[key]}={raw!r} is not an integer") from None
            if not 1 <= value <= most:
                raise HookConfigError(f"{ENV[key]} must be between 1 and {most}, got {value}")
            return value

        raw_interval = env.get(ENV["flush_interval_s"], "").strip()
        try:
            interval = float(raw_interval) if raw_interval else DEFAULT_FLUSH_INTERVAL_S
        except ValueError:
            raise HookConfigError(f"{ENV['flush_interval_s']}={raw_interval!r} is not a number") from None
        if interval <= 0:
            raise HookConfigError(f"{ENV['flush_interval_s']} must be > 0, got {interval}")
        cfg = cls(
            mode=mode, counts_path=path("counts_path"), map_path=path("map_path"), stats_path=path("stats_path"),
            flush_interval_s=interval, workload=env.get(ENV["workload"], ""),
            histogram=env.get(ENV["histogram"], "1").strip() not in ("0", "false", "no"),
            backend=pin_backend_name(env.get(ENV["backend"], AUTO_BACKEND)),
            selfcheck=env.get(ENV["selfcheck"], "0").strip().lower() in ("1", "true", "yes"),
            overlap_tiers=env.get(ENV["overlap_tiers"], "0").strip().lower() in ("1", "true", "yes"),
            trace_path=path("trace_path"),
            trace_tokens=positive_int("trace_tokens", DEFAULT_TRACE_TOKENS, MAX_TRACE_TOKENS),
            trace_every=positive_int("trace_every", 1, 1 << 20),
        )
        if cfg.trace_path is not None and mode != "count":
            raise HookConfigError(f"{ENV['trace_path']} is set, but only count mode records a routing trace "
                                  f"(mode is {mode}); unset it, or boot a count engine (pinsidecar count-boot "
                                  "--trace)")
        if mode == "count" and cfg.counts_path is None:
            raise HookConfigError(f"count mode needs {ENV['counts_path']} (where to write the counts)")
        if mode == "pin" and cfg.map_path is None:
            raise HookConfigError(f"pin mode needs {ENV['map_path']} (the row map to apply)")
        return cfg

    def to_env(self) -> dict[str, str]:
        """The inverse of :meth:`from_env`, for launchers."""
        out = {ENV["mode"]: self.mode, ENV["flush_interval_s"]: str(self.flush_interval_s),
               ENV["histogram"]: "1" if self.histogram else "0", ENV["backend"]: self.backend}
        if self.selfcheck:
            out[ENV["selfcheck"]] = "1"
        if self.overlap_tiers:
            out[ENV["overlap_tiers"]] = "1"
        if self.trace_path is not None:
            out[ENV["trace_tokens"]] = str(self.trace_tokens)
            out[ENV["trace_every"]] = str(self.trace_every)
        for key in ("counts_path", "map_path", "stats_path", "trace_path"):
            value = getattr(self, key)
            if value is not None:
                out[ENV[key]] = str(value)
        if self.workload:
            out[ENV["workload"]] = self.workload
        return out
