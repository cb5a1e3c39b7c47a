"""Builders of pinsidecar's artifacts and engines for tests: counts, maps, stats, and a hooked vLLM engine.

Like ``structlog.testing``, this ships with the package and imports without pytest: anything that exercises the
placement, the remap pipeline or the drift watch without a real count boot should build its inputs here.

- :mod:`~pinsidecar.testing.artifacts` — counts and maps (re-exported here);
- :mod:`~pinsidecar.testing.engine` — a real engine with the hook on (:func:`~pinsidecar.testing.engine.start_engine`);
- :mod:`~pinsidecar.testing.metrics`, :mod:`~pinsidecar.testing.prometheus`, :mod:`~pinsidecar.testing.upstream`,
  :mod:`~pinsidecar.testing.moe` — stand-ins and servers for the exporter, the gate and the kernels;
- :mod:`~pinsidecar.testing.fixtures` — the pytest fixtures (the one module that needs pytest), loaded with
  ``pytest_plugins = ["pinsidecar.testing.fixtures"]``.

The benchmarks' scenario harness (the remap lane, the heal scenario, its sampler, figures and plot) is not here:
nothing that ships uses it, so it lives beside the benchmarks, in ``bench/scenario/``.
"""

from pinsidecar.engine.ports import free_port
from pinsidecar.testing.artifacts import (
    counts_from,
    domain_ranking,
    make_counts,
    make_map,
    model_geometry,
    swap_experts,
    write_counts,
    write_map,
)

__all__: list[str] = []  # nothing here is another package's business
