"""Run a real Prometheus server against the exporter, for tests: the proof that a scrape works is a scrape.

``promtool check metrics`` checks the text; only a real server shows that Prometheus can reach the endpoint, parse
what it gets (it negotiates OpenMetrics, not the text format promtool reads), store it and answer PromQL over it, and
that the alert rules load into a running rule manager. :class:`PrometheusServer` starts ``/usr/bin/prometheus``
(Debian's ``prometheus`` package) on loopback with a temporary config and data directory, waits until it is ready,
and stops it (and removes its files) on exit. Use it as a context manager from a pytest fixture::

    with PrometheusServer(targets=["127.0.0.1:8301"], rule_files=[Path("grafana/alerts.yml")]) as prom:
        prom.wait_for_target_up()
        prom.query("pinsidecar_engine_state")
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pinsidecar.engine.ports import free_port

__all__ = ["PORT_RANGE", "PrometheusServer", "free_port", "prometheus_binary", "rules_with_for"]

# The ports Prometheus and its scrape targets take in these tests (``free_port(*PORT_RANGE)``): a fixed range
# away from the engines' ports. ``free_port`` is :func:`pinsidecar.engine.ports.free_port`, re-exported here.
PORT_RANGE = (8300, 8349)


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)


def rules_with_for(src: Path, dest: Path, durations: dict[str, str]) -> Path:
    """Write ``src`` (a Prometheus rule file) to ``dest`` with the ``for:`` of each alert named in ``durations``
    replaced (e.g. ``{"PinsidecarDriftGain": "5s"}``); every expression and label stays as shipped. Raises
    ``KeyError`` when an alert named there is not in the file (a renamed rule must fail the test, not skip it)."""
    import yaml  # only tests derive rule files

    doc = yaml.safe_load(Path(src).read_text())
    seen = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") in durations:
                rule["for"] = durations[rule["alert"]]
                seen.add(rule["alert"])
    missing = sorted(set(durations) - seen)
    if missing:
        raise KeyError(f"{src}: no alert rule named {', '.join(missing)}")
    dest.write_text(json.dumps(doc, indent=1))
    return dest


class PrometheusServer:
    """A throw-away Prometheus scraping ``targets`` every ``scrape_interval_s``; see the module docstring."""

    def __init__(self, targets: Sequence[str], *, rule_files: Sequence[Path] = (), port: int | None = None,
                 scrape_interval_s: float = 1.0, job: str = "pinsidecar", binary: str | None = None,
                 alertmanagers: Sequence[str] = ()) -> None:
        self.targets = list(targets)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.alertmanagers = list(alertmanagers)
        self.port = port
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.binary = binary or prometheus_binary()
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return self._dir / "prometheus.log"

    def config_text(self) -> str:
        iv = f"{self.scrape_interval_s:g}s"
        cfg = {
            "global": {"scrape_interval": iv, "evaluation_interval": iv, "scrape_timeout": iv},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        }
        if self.alertmanagers:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": self.alertmanagers}]}]}
        return json.dumps(cfg, indent=1)  # JSON is YAML

    def start(self, timeout_s: float = 30.0) -> None:
        if self.binary is None:
            raise FileNotFoundError("prometheus binary not found; apt-get install -y prometheus")
        self._dir = Path(tempfile.mkdtemp(prefix="pinsidecar-prom-"))
        if self.port is None:
            self.port = free_port(*PORT_RANGE)
        config = self._dir / "prometheus.yml"
        config.write_text(self.config_text())
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self._dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready within {timeout_s} s")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------ API
    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        r.raise_for_status()
        doc = r.json()
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus API {path}: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        """Range query (Unix seconds); the result matrix (``[{"metric": {...}, "values": [[t, "v"], ...]}]``)."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step_s:g}s")["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts the rule manager holds now, pending or firing (``/api/v1/alerts``)."""
        return self.api("alerts")["alerts"]

    def targets_health(self) -> list[tuple[str, str, str]]:
        """(scrape URL, health, last error) per active target."""
        return [(t["scrapeUrl"], t["health"], t.get("lastError", "")) for t in self.api("targets")["activeTargets"]]

    def wait_for_target_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        health: list[tuple[str, str, str]] = []
        while time.monotonic() < deadline:
            health = self.targets_health()
            if health and all(h == "up" for _, h, _ in health):
                return
            time.sleep(0.2)
        raise TimeoutError(f"targets not up within {timeout_s} s: {health}")

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns a non-empty vector."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.2)
        raise TimeoutError(f"{expr!r} returned nothing within {timeout_s} s; targets: {self.targets_health()}")

    def rules(self) -> list[dict[str, Any]]:
        """The loaded rule groups (``/api/v1/rules``)."""
        return self.api("rules")["groups"]
