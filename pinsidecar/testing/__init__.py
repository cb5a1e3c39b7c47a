"""Public test helpers: builders for synthetic artifacts, so tests and benchmarks don't each invent their own.

Like ``structlog.testing``, this ships with the package: anything that exercises the map builder, the remap
pipeline or the drift watch without a real count boot should build its inputs here.
"""

from pinsidecar.testing.artifacts import domain_ranking, make_counts, make_map, write_counts, write_map

__all__ = ["domain_ranking", "make_counts", "make_map", "write_counts", "write_map"]
