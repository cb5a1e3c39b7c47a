"""grafana/: alert rules (promtool check + unit tests), the Alertmanager example (amtool, and a real Alertmanager
delivering a remap alert to a webhook with the bearer token), and the dashboard (every query names a metric the
exporter exports or a rule records)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pinsidecar.daemon.gate import Gate
from pinsidecar.metrics import Exporter
from pinsidecar.testing import make_map
from pinsidecar.testing.metrics import (
    FakeEngineMetrics,
    FakeNvml,
    make_stats,
    write_cgroup_tree,
    write_proc_cgroup,
)
from pinsidecar.testing.prometheus import free_port

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
ALERTS = GRAFANA / "alerts.yml"
DASHBOARD = GRAFANA / "pinsidecar-dashboard.json"
ALERTMANAGER = GRAFANA / "alertmanager.yml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (apt prometheus)")
needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool missing (apt prometheus-alertmanager)")
AM_BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def exported_names(tmp_path: Path) -> set[str]:
    """Every series name the exporter can produce, with all sources present."""
    write_cgroup_tree(tmp_path / "cgroup")
    make_stats().save(tmp_path / "stats.json")
    with FakeEngineMetrics() as engine:
        now = [0.0]
        emap = dataclasses.replace(make_map(label="l"), predicted_cold_rate=0.01)
        exp = Exporter(stats_path=tmp_path / "stats.json", engine_url=engine.url, engine_pid=5,
                       gate=Gate("127.0.0.1", 0, "http://127.0.0.1:1"), cgroup_root=tmp_path / "cgroup",
                       proc_root=write_proc_cgroup(tmp_path / "proc", 5), nvml=FakeNvml(), clock=lambda: now[0])
        exp.on_boot(reason="start", seconds=10.0, map_hash="h", cache_miss=False)
        exp.on_map(emap)
        exp.record_remap("activated")
        exp.render()
        now[0] = 5.0
        text = exp.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def rule_records() -> set[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


# ------------------------------------------------------------------------------------------------ rules


@needs_promtool
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout and "WARNING" not in check.stdout + check.stderr
    unit = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=GRAFANA, capture_output=True,
                          text=True, timeout=120)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_alert_rules_use_exported_metrics_and_remap_alerts_are_labelled(tmp_path: Path) -> None:
    known = exported_names(tmp_path) | rule_records() | {"up"}
    doc = yaml.safe_load(ALERTS.read_text())
    remap = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"\b(pinsidecar[:_][a-zA-Z0-9_:]*|up)\b(?=\s*[{\[)\s])", rule["expr"] + " "):
                assert name in known, f"{rule.get('alert') or rule.get('record')}: {name} is not exported"
            if rule.get("labels", {}).get("action") == "remap":
                remap.append(rule["alert"])
    assert set(remap) == {"PinsidecarColdSelectionDrift", "PinsidecarColdSelectionHigh"}


# ------------------------------------------------------------------------------------------------ alertmanager


@needs_amtool
def test_alertmanager_example_passes_amtool() -> None:
    proc = subprocess.run(["amtool", "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


class WebhookRecorder:
    """Records what Alertmanager POSTs (path, Authorization header, JSON body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, dict[str, Any]]] = []
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                rec.calls.append((self.path, self.headers.get("Authorization"), json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[tuple[str, WebhookRecorder, str]]:
    if AM_BINARY is None:
        pytest.skip("prometheus-alertmanager missing (apt prometheus-alertmanager)")
    hook = WebhookRecorder()
    token = "s3cret-token-for-test"
    token_file = tmp_path / "control.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    cfg = ALERTMANAGER.read_text()
    assert "http://127.0.0.1:8090/remap" in cfg and "/etc/pinsidecar/control.token" in cfg
    cfg = cfg.replace("http://127.0.0.1:8090/remap", f"http://127.0.0.1:{hook.port}/remap")
    cfg = cfg.replace("/etc/pinsidecar/control.token", str(token_file))
    (tmp_path / "am.yml").write_text(cfg)
    port = free_port(lo=hook.port + 1)
    with open(tmp_path / "am.log", "wb") as log:
        proc = subprocess.Popen([AM_BINARY, f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address=", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "am.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "alertmanager not ready"
            time.sleep(0.2)
        yield url, hook, token
    finally:
        proc.terminate()
        proc.wait(10)
        hook.close()


def test_alertmanager_routes_remap_alerts_to_the_webhook_with_the_token(alertmanager: tuple) -> None:
    url, hook, token = alertmanager
    alerts = [
        {"labels": {"alertname": "PinsidecarColdSelectionDrift", "action": "remap", "severity": "warning",
                    "instance": "gpu-a:9108", "job": "pinsidecar"},
         "annotations": {"summary": "drift"}},
        {"labels": {"alertname": "PinsidecarBootSlow", "severity": "warning", "instance": "gpu-a:9108",
                    "job": "pinsidecar"}},
    ]
    r = httpx.post(f"{url}/api/v2/alerts", json=alerts, timeout=10)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not hook.calls:
        assert time.monotonic() < deadline, "alertmanager never called the webhook"
        time.sleep(0.1)
    time.sleep(1.0)  # anything else it would send arrives now
    assert len(hook.calls) == 1
    path, auth, body = hook.calls[0]
    assert path == "/remap"
    assert auth == f"Bearer {token}"
    assert [a["labels"]["alertname"] for a in body["alerts"]] == ["PinsidecarColdSelectionDrift"]
    assert body["status"] == "firing"


# ------------------------------------------------------------------------------------------------ dashboard


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    out += [("annotation " + a["name"], a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]
    return out


def test_dashboard_is_well_formed_and_covers_the_required_views() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pinsidecar-main"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    for want in ("Generation tokens / s", "Cold-selection ratio", "Cold-selection ratio per layer",
                 "Expert bytes by tier", "Engine cgroup memory", "Host memory", "GPU memory", "Engine state",
                 "Boots", "Remaps"):
        assert want in titles, want
    heat = next(p for p in dash["panels"] if p["title"] == "Cold-selection ratio per layer")
    assert heat["type"] == "heatmap" and "layer" in heat["targets"][0]["expr"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_dashboard_queries_name_only_exported_metrics(tmp_path: Path) -> None:
    known = exported_names(tmp_path) | rule_records()
    for title, expr in dashboard_exprs():
        names = re.findall(r"\b(pinsidecar[:_][a-zA-Z0-9_:]*)", expr)
        assert names, f"{title}: {expr} reads no pinsidecar metric"
        for name in names:
            assert name in known, f"panel {title!r}: {name} is not exported"
