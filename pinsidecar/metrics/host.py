"""Host memory from psutil: total, available, used. Inside a container this is the whole host; the engine's
share is in :mod:`pinsidecar.metrics.cgroup`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric

from pinsidecar.metrics.source import SourceStatus

__all__: list[str] = []  # nothing here is another package's business


class HostMemoryCollector:
    """``pinsidecar_host_memory_{total,available,used}_bytes``; ``virtual_memory`` is injectable for tests."""

    source = "host"

    def __init__(self, virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> None:
        self._virtual_memory = virtual_memory
        self.status = SourceStatus(self.source)

    def collect(self) -> Iterator[Metric]:
        try:
            vm = self._virtual_memory()
        except (OSError, RuntimeError) as exc:
            self.status.fail(f"psutil.virtual_memory(): {exc}")
            return
        self.status.ok()
        for attr in ("total", "available", "used"):
            yield GaugeMetricFamily(f"pinsidecar_host_memory_{attr}_bytes", f"Host memory {attr} (psutil).",
                                    value=getattr(vm, attr))
