"""The engine's own ``/metrics`` (vLLM's ``vllm:*`` series), read at scrape time: tokens, tok/s, queue, KV cache.

Only the few series the sidecar re-exports are parsed; vLLM's ``/metrics`` runs to hundreds of histogram lines,
and this runs inside every scrape. The engine's URL is asked for at every scrape (a callable), so an engine that
moved (a drain-reboot onto another port) is followed without anyone telling the exporter.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.metrics.source import SourceStatus

__all__: list[str] = []  # nothing here is another package's business

# The engine's /metrics is read inside our scrape; Prometheus' default scrape timeout is 10 s, so stay well below.
ENGINE_SCRAPE_TIMEOUT_S = 1.0
# Two engine scrapes closer than this reuse the previous rate instead of dividing by a tiny interval.
MIN_RATE_INTERVAL_S = 1.0
# The engine series the exporter reads; everything else in the engine's (large) /metrics is skipped unparsed.
ENGINE_SERIES = ("vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")


def metrics_url(url: str | None) -> str | None:
    """The engine's ``/metrics`` URL from its base URL (or from the ``/metrics`` URL itself)."""
    if url is None:
        return None
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def parse_engine_metrics(text: str, names: tuple[str, ...] = ENGINE_SERIES) -> dict[str, float]:
    """Sum every sample of each series in ``names`` over its labels (an engine may export one series per engine
    index). Only lines starting with one of the names are parsed."""
    wanted = [line for line in text.splitlines() if line.startswith(names)]
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            if sample.name in names and not math.isnan(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


class EngineMetricsCollector:
    """Reads the engine's ``/metrics`` at scrape time and re-exports what the sidecar needs.

    ``url()`` gives the engine's base URL (or its full ``/metrics`` URL), or None when there is no engine to ask
    (the source is then off). Generation tokens per second is the counter's increase over the interval since an
    earlier scrape, so it needs two scrapes at least :data:`MIN_RATE_INTERVAL_S` apart; an engine restart (the
    counter went down) counts the new value as the increase; a new URL starts the rate afresh.
    """

    source = "engine"

    def __init__(self, url: Callable[[], str | None], *, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = ENGINE_SCRAPE_TIMEOUT_S, client: httpx.Client | None = None) -> None:
        self.url = url
        self._clock = clock
        self._timeout_s = timeout_s
        self._client = client
        self._lock = threading.Lock()
        self._rate_url: str | None = None  # the URL the rate's base was read from
        self._prev: tuple[float, float] | None = None  # (time, tokens) of the rate's base
        self._rate: float | None = None
        self.status = SourceStatus(self.source)

    def _fetch(self, url: str) -> str:
        if self._client is None:
            # one client for the exporter's life: a fresh one per scrape would build an SSL context each time
            # (~10 ms of CPU) and a new connection; trust_env=False so a proxy setting never captures loopback
            self._client = httpx.Client(timeout=self._timeout_s, trust_env=False)
        resp = self._client.get(url, timeout=self._timeout_s)
        resp.raise_for_status()
        return resp.text

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            url = metrics_url(self.url())
            if url is None:
                self.status.off()
                return
            if url != self._rate_url:
                self._rate_url, self._prev, self._rate = url, None, None
            try:
                values = parse_engine_metrics(self._fetch(url))
            except httpx.HTTPError as exc:
                self.status.fail(f"GET {url}: {type(exc).__name__}: {exc}")
                return
            except ValueError as exc:
                self.status.fail(f"GET {url}: unparsable metrics text: {exc}")
                return
            tokens = values.get("vllm:generation_tokens_total")
            if tokens is None:
                self.status.fail(f"GET {url}: no vllm:generation_tokens_total in the engine's metrics")
                return
            self.status.ok()
            now = self._clock()
            if self._prev is None:
                self._prev = (now, tokens)
            elif now - self._prev[0] >= MIN_RATE_INTERVAL_S:
                t0, v0 = self._prev
                delta = tokens - v0 if tokens >= v0 else tokens  # counter reset: the engine restarted
                self._rate = delta / (now - t0)
                self._prev = (now, tokens)
            rate = self._rate
        yield CounterMetricFamily("pinsidecar_engine_generation_tokens",
                                  "Generation tokens the engine has produced (its vllm:generation_tokens_total; "
                                  "resets when the engine restarts).", value=tokens)
        if rate is not None:
            yield GaugeMetricFamily("pinsidecar_engine_generation_tokens_per_second",
                                    "Generation tokens per second between the last two scrapes of the engine.",
                                    value=rate)
        for src, name, doc in (
            ("vllm:num_requests_running", "pinsidecar_engine_requests_running", "Requests the engine is running."),
            ("vllm:num_requests_waiting", "pinsidecar_engine_requests_waiting", "Requests waiting in the engine."),
            ("vllm:kv_cache_usage_perc", "pinsidecar_engine_kv_cache_usage_ratio",
             "Fraction of the engine's KV cache in use (0..1)."),
        ):
            if src in values:
                yield GaugeMetricFamily(name, doc, value=values[src])
