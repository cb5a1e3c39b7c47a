"""The engine: what vLLM engine to run (the ``[engine]`` table, one :class:`EngineSpec`) and the launchers that
run it.

- :mod:`~pinsidecar.engine.spec` — the ``[engine]`` table (:class:`EngineConfig`, :func:`load_engine_config`), the
  resolved :class:`EngineSpec`, and :func:`hooked_spec`, the one builder of an engine with the hook in it;
- :mod:`~pinsidecar.engine.launcher` — the :class:`Launcher` protocol every launcher implements, and its errors;
- :mod:`~pinsidecar.engine.readiness` — liveness, readiness and the boot wait, shared by the launchers;
- :mod:`~pinsidecar.engine.process` — a local process (the CPU demo lane, CI, bare-metal GPU lanes);
- :mod:`~pinsidecar.engine.container` — docker or podman, with the hook bind-mounted into a stock vLLM image;
- :mod:`~pinsidecar.engine.ports` — is a port taken, and a free one.

Everything that starts an engine (the daemon's supervisor, the count boot, parity, the demo, the tests) goes
through here, so a map measured under one launcher is served the same way under another.
"""

from pinsidecar.engine.launcher import (
    BOOT_LOG_LINES,
    EngineBootError,
    EngineError,
    EngineSetupError,
    Launcher,
    PortInUseError,
)
from pinsidecar.engine.ports import free_port, port_in_use
from pinsidecar.engine.process import EngineProcess
from pinsidecar.engine.readiness import probe_health, probe_ready, wait_until_ready
from pinsidecar.engine.spec import (
    DEFAULT_KV_CACHE_BYTES,
    EngineConfig,
    EngineSpec,
    default_cache_root,
    hooked_spec,
    load_engine_config,
)

__all__ = [
    "EngineBootError",
    "EngineConfig",
    "EngineError",
    "EngineProcess",
    "EngineSpec",
    "Launcher",
    "PortInUseError",
    "free_port",
    "hooked_spec",
    "load_engine_config",
    "port_in_use",
]
