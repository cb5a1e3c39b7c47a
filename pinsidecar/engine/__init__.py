"""The engine: one description of a vLLM engine (:class:`EngineSpec`) and the launchers that run it.

- :mod:`~pinsidecar.engine.process` — a local process (the CPU demo lane, CI, bare-metal GPU lanes);
- :mod:`~pinsidecar.engine.container` — docker or podman, with the hook bind-mounted into a stock vLLM image.

Everything that starts an engine (the daemon's supervisor, the count boot, parity, the demo, the tests) goes
through here, so a map measured under one launcher is served the same way under another.
"""

from pinsidecar.engine.process import (
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_BYTES,
    EngineBootError,
    EngineError,
    EngineProcess,
    EngineSpec,
    Launcher,
    PortInUseError,
    default_cache_root,
    port_in_use,
    probe_health,
    probe_ready,
)

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_KV_CACHE_BYTES",
    "EngineBootError",
    "EngineError",
    "EngineProcess",
    "EngineSpec",
    "Launcher",
    "PortInUseError",
    "default_cache_root",
    "port_in_use",
    "probe_health",
    "probe_ready",
]
