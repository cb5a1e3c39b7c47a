"""The sidecar's Prometheus exporter."""

from pinsidecar.metrics.exporter import *  # noqa: F403
from pinsidecar.metrics.exporter import __all__  # noqa: F401
