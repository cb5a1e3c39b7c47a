"""GPU memory used and total per GPU, from NVML (nvidia-ml-py's ``pynvml``), where NVML exists.

NVML is optional: on a CPU host, in CI, or where the driver is missing, the metrics are absent and one log line
says why. It is loaded on the first scrape (not at import), and a failure to load it is not retried every scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric

from pinsidecar.metrics.source import SourceStatus

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class _RealNvml:
    """Marker for "import pynvml on first scrape"."""


REAL_NVML: Any = _RealNvml()


def load_nvml() -> Any:
    """Import and initialise NVML (nvidia-ml-py's ``pynvml``); raises with the reason where it is missing."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


class GpuMemoryCollector:
    """``pinsidecar_gpu_memory_{used,total}_bytes{gpu,uuid}``. ``nvml`` is :data:`REAL_NVML` (load ``pynvml``
    on first scrape), an object with the same functions (tests pass a fake), or None (the source is off)."""

    source = "gpu"

    def __init__(self, nvml: Any = REAL_NVML, loader: Callable[[], Any] = load_nvml) -> None:
        self._nvml: Any = nvml
        self._loader = loader
        self._pending = nvml is not None
        self.status = SourceStatus(self.source)

    def _handle(self) -> Any:
        if self._pending:
            self._pending = False
            try:
                if isinstance(self._nvml, _RealNvml):
                    self._nvml = self._loader()
                else:
                    self._nvml.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors: all mean "no NVML"
                self._nvml = None
                log.info("NVML not available; GPU memory metrics are left out", reason=f"{type(exc).__name__}: {exc}")
        return self._nvml

    def collect(self) -> Iterator[Metric]:
        nvml = self._handle()
        if nvml is None:
            self.status.off()
            return
        used = GaugeMetricFamily("pinsidecar_gpu_memory_used_bytes", "GPU memory in use (NVML), per GPU.",
                                 labels=["gpu", "uuid"])
        total = GaugeMetricFamily("pinsidecar_gpu_memory_total_bytes", "GPU memory installed (NVML), per GPU.",
                                  labels=["gpu", "uuid"])
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                labels = [str(i), uuid.decode() if isinstance(uuid, bytes) else str(uuid)]
                used.add_metric(labels, mem.used)
                total.add_metric(labels, mem.total)
        except Exception as exc:  # NVMLError subclasses (GPU lost, driver reloaded) carry no common base we import
            self.status.fail(f"NVML query failed: {type(exc).__name__}: {exc}")
            return
        self.status.ok()
        yield used
        yield total
