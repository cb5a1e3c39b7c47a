"""A real Prometheus server scrapes the exporter, answers PromQL over what it stored, evaluates our alert rules
(the recording rule gives the live cold-selection ratio), and accepts every dashboard query."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pinsidecar.engine.ports import free_port
from pinsidecar.metrics import Exporter
from pinsidecar.testing.artifacts import make_map
from pinsidecar.testing.metrics import (
    FakeEngineMetrics,
    FakeNvml,
    make_stats,
    write_cgroup_tree,
    write_proc_cgroup,
)
from pinsidecar.testing.prometheus import PrometheusServer, prometheus_binary

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
MAP = dataclasses.replace(make_map(label="code"), created_at="2026-11-29T10:00:00Z", predicted_cold_rate=0.02)

pytestmark = pytest.mark.skipif(prometheus_binary() is None, reason="prometheus missing (apt-get install prometheus)")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusServer, Exporter, Path]]:
    tmp = tmp_path_factory.mktemp("prom")
    write_cgroup_tree(tmp / "cgroup")
    stats_path = tmp / "stats.json"
    # cold is 5 % from the start, so rate() extrapolates numerator and denominator alike
    make_stats("b1", 1, (100, 200), (5, 10)).save(stats_path)
    with FakeEngineMetrics() as engine:
        exp = Exporter(stats_path=stats_path, engine_url=engine.url, engine_pid=77, cgroup_root=tmp / "cgroup",
                       proc_root=write_proc_cgroup(tmp / "proc", 77), nvml=FakeNvml())
        exp.on_state("ready")
        exp.on_boot(reason="start", seconds=14.2, map_hash="sha256:feed", cache_miss=False)
        exp.on_map(MAP)
        port = free_port()
        exp.start_http("127.0.0.1", port)
        try:
            with PrometheusServer([f"127.0.0.1:{port}"], rule_files=[GRAFANA / "alerts.yml"]) as prom:
                prom.wait_for_target_up()
                yield prom, exp, stats_path
        finally:
            exp.stop()


def test_prometheus_scrapes_and_answers_for_pinsidecar_metrics(scraped: tuple) -> None:
    prom, _, _ = scraped
    result = prom.wait_for("pinsidecar_expert_selections_total")
    assert float(result[0]["value"][1]) == 300
    ready = prom.wait_for('pinsidecar_engine_state{state="ready"}')
    assert float(ready[0]["value"][1]) == 1
    gpu = prom.wait_for('pinsidecar_gpu_memory_used_bytes{gpu="1"}')
    assert float(gpu[0]["value"][1]) == 20_000_000_000
    assert prom.targets_health()[0][1] == "up"
    info = prom.wait_for("pinsidecar_map_info")
    assert info[0]["metric"]["hash"] == MAP.content_hash and info[0]["metric"]["label"] == "code"


def test_recording_rule_gives_the_windowed_cold_selection_ratio(scraped: tuple) -> None:
    prom, _, stats_path = scraped
    prom.wait_for("pinsidecar_expert_selections_total")
    make_stats("b1", 2, (1100, 1200), (55, 60)).save(stats_path)  # +2000 selections, +100 cold: 5 %
    prom.wait_for("pinsidecar_expert_selections_total > 300")
    ratio = prom.wait_for("pinsidecar:cold_selection_ratio:rate10m")
    assert float(ratio[0]["value"][1]) == pytest.approx(0.05, rel=1e-6)
    per_layer = prom.wait_for('pinsidecar:layer_cold_selection_ratio:rate10m{layer="3"}')
    assert float(per_layer[0]["value"][1]) == pytest.approx(50 / 1000, rel=1e-6)


def test_alert_rules_load_and_evaluate_in_the_server(scraped: tuple) -> None:
    prom, _, _ = scraped
    groups = {g["name"]: g for g in prom.rules()}
    assert set(groups) == {"pinsidecar-placement", "pinsidecar-drift", "pinsidecar-engine", "pinsidecar-sidecar"}
    rules = [r for g in groups.values() for r in g["rules"]]
    names = {r["name"] for r in rules}
    assert {"PinsidecarColdSelectionDrift", "PinsidecarDriftGain", "PinsidecarRemapStalled",
            "PinsidecarEngineFailed", "PinsidecarBootCacheMiss"} <= names
    assert all(r.get("health") in ("ok", "unknown") for r in rules), [r for r in rules if r.get("health") == "err"]


def test_every_dashboard_query_parses_in_prometheus(scraped: tuple) -> None:
    prom, _, _ = scraped
    dash = json.loads((GRAFANA / "pinsidecar-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    answered = 0
    for expr in exprs:
        q = (expr.replace("$instance", ".*").replace("$__rate_interval", "1m").replace("$__range", "5m"))
        r = httpx.get(f"{prom.url}/api/v1/query", params={"query": q}, timeout=10)
        assert r.status_code == 200, f"{expr}: {r.text}"
        answered += bool(r.json()["data"]["result"])
    assert answered >= len(exprs) // 2  # most panels have data from this exporter already
