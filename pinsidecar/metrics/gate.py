"""The drain gate's counters: requests by outcome, requests in flight and held, whether it is holding.

The gate (:class:`pinsidecar.daemon.gate.Gate`) is read at scrape time through :class:`GateView`, the few
read-only members this collector needs, so the metrics package does not import the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__: list[str] = []  # nothing here is another package's business


class GateView(Protocol):
    """What the exporter reads from the drain gate."""

    @property
    def counters(self) -> Mapping[str, int]: ...  # requests answered, by outcome

    @property
    def in_flight(self) -> int: ...

    @property
    def held(self) -> int: ...

    @property
    def holding(self) -> bool: ...


class GateCollector:
    """``pinsidecar_gate_*``. ``gate()`` is asked at every scrape; None (no gate configured) exports nothing."""

    def __init__(self, gate: Callable[[], GateView | None]) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self.gate()
        if gate is None:
            return
        counts = dict(gate.counters)
        fam = CounterMetricFamily("pinsidecar_gate_requests", "Requests the gate answered, by outcome.",
                                  labels=["outcome"])
        for outcome in sorted(counts):
            fam.add_metric([outcome], counts[outcome])
        yield fam
        yield GaugeMetricFamily("pinsidecar_gate_in_flight_requests", "Requests passed to the engine and not done.",
                                value=gate.in_flight)
        yield GaugeMetricFamily("pinsidecar_gate_held_requests", "Requests waiting at the gate during a hold.",
                                value=gate.held)
        yield GaugeMetricFamily("pinsidecar_gate_holding", "1 while the gate holds new requests (drain-reboot).",
                                value=1.0 if gate.holding else 0.0)
