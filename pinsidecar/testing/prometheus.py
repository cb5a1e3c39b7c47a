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

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from pinsidecar.testing._loopback_server import LoopbackServer
from pinsidecar.testing.wait import wait_until

__all__: list[str] = []  # nothing here is another package's business


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


class PrometheusServer(LoopbackServer):
    """A throw-away Prometheus scraping ``targets`` every ``scrape_interval_s``; see the module docstring."""

    name = "prometheus"
    install_hint = "apt-get install -y prometheus"

    def __init__(self, targets: Sequence[str], *, rule_files: Sequence[Path] = (), port: int | None = None,
                 scrape_interval_s: float = 1.0, job: str = "pinsidecar", binary: str | None = None,
                 alertmanagers: Sequence[str] = ()) -> None:
        super().__init__(port=port, binary=binary or prometheus_binary())
        self.targets = list(targets)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.alertmanagers = list(alertmanagers)
        self.scrape_interval_s = scrape_interval_s
        self.job = job

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

    def write_config(self, directory: Path) -> Path:
        config = directory / "prometheus.yml"
        config.write_text(self.config_text())
        return config

    def argv(self, config: Path, directory: Path) -> list[str]:
        assert self.binary is not None
        return [self.binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                "--log.level=warn"]

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
        """Until every scrape target is up; the failure lists each target's health and last error."""
        wait_until(lambda: (h := self.targets_health()) and all(up == "up" for _, up, _ in h), "the targets up",
                   timeout_s, detail=lambda: f"targets: {self.targets_health()}")

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns a non-empty vector."""
        result: list[dict[str, Any]] = wait_until(lambda: self.query(expr), f"{expr!r} to return something",
                                                  timeout_s, detail=lambda: f"targets: {self.targets_health()}")
        return result

    def rules(self) -> list[dict[str, Any]]:
        """The loaded rule groups (``/api/v1/rules``)."""
        return self.api("rules")["groups"]
