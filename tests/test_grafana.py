"""grafana/: alert rules (promtool check + unit tests), the Alertmanager example (amtool, and a real Alertmanager
delivering a remap alert with the bearer token to the control API's webhook, which starts one remap and
deduplicates the repeat), and the dashboard (every query names a metric the exporter exports or a rule records).
The whole chain with a real daemon, engine and Prometheus is tests/test_alert_chain.py."""

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
import structlog
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.daemon.control import ControlServer
from pinsidecar.daemon.gate import Gate
from pinsidecar.daemon.webhook import DEFAULT_REMAP_ALERTS
from pinsidecar.drift import DriftWatch, Window
from pinsidecar.drift.config import DriftConfig
from pinsidecar.engine.ports import free_port
from pinsidecar.metrics import Exporter
from pinsidecar.testing.alertmanager import AlertmanagerServer, alertmanager_binary, example_config
from pinsidecar.testing.artifacts import make_counts, make_map
from pinsidecar.testing.control import RecordingTarget
from pinsidecar.testing.metrics import (
    FakeEngineMetrics,
    FakeNvml,
    make_stats,
    write_cgroup_tree,
    write_proc_cgroup,
)
from pinsidecar.testing.wait import wait_until, wait_until_async

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
ALERTS = GRAFANA / "alerts.yml"
DASHBOARD = GRAFANA / "pinsidecar-dashboard.json"
ALERTMANAGER = GRAFANA / "alertmanager.yml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (apt prometheus)")
needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool missing (apt prometheus-alertmanager)")
AM_BINARY = alertmanager_binary()
CREDENTIAL = "/run/credentials/prometheus-alertmanager.service/pinsidecar-control.token"  # LoadCredential


def drift_watch() -> DriftWatch:
    """A watch that has seen a domain shift: every drift series has a value."""
    source = make_counts(tokens=4000, domain=0, seed=9)
    watch = DriftWatch(DriftConfig(), make_map(hot_rows=48, counts=source), reference=source)
    for i, domain in enumerate([0, 0, 1, 1]):
        watch.observe(Window.from_counts(make_counts(tokens=1024, domain=domain, seed=i), i, started=i, ended=i + 1))
    return watch


def exported_names(tmp_path: Path) -> set[str]:
    """Every series name the exporter can produce, with all sources present."""
    write_cgroup_tree(tmp_path / "cgroup")
    make_stats().save(tmp_path / "stats.json")
    with FakeEngineMetrics() as engine:
        now = [0.0]
        emap = dataclasses.replace(make_map(label="l"), predicted_cold_rate=0.01)
        exp = Exporter(stats_path=tmp_path / "stats.json", engine_url=engine.url, engine_pid=5,
                       gate=Gate("127.0.0.1", 0, "http://127.0.0.1:1"), cgroup_root=tmp_path / "cgroup",
                       proc_root=write_proc_cgroup(tmp_path / "proc", 5), nvml=FakeNvml(), clock=lambda: now[0],
                       drift=drift_watch(), remap={"state": "count_boot", "trigger": "alert", "started_at": 1.0})
        exp.on_boot(reason="start", seconds=10.0, map_hash="h", cache_miss=False)
        exp.on_map(emap)
        exp.record_remap("committed", seconds=60.0)
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
    # the webhook acts on exactly these names by default (control.remap_alerts)
    assert set(remap) == set(DEFAULT_REMAP_ALERTS) == {"PinsidecarDriftGain"}
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    for name in ("PinsidecarDriftGain", "PinsidecarRemapStalled", "PinsidecarRemapsRefusedRepeatedly"):
        assert name in rules
    # the drift alert compares the signal with its exported threshold and requires exploitable skew
    gain = rules["PinsidecarDriftGain"]["expr"]
    assert "pinsidecar_drift_projected_gain_ratio_trip_threshold" in gain and "exploitable_skew == 1" in gain


def test_every_alert_has_a_promtool_unit_test() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    tests = yaml.safe_load((GRAFANA / "alerts_test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])
              if any(a.get("exp_alerts") for a in [t])}
    for name in ("PinsidecarDriftGain", "PinsidecarRemapStalled", "PinsidecarRemapsRefusedRepeatedly",
                 "PinsidecarRemapFailing"):
        assert name in tested, f"{name}: no promtool test where it fires"
    assert {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r} >= tested


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
    assert "http://127.0.0.1:8090/remap" in cfg and CREDENTIAL in cfg
    cfg = cfg.replace("http://127.0.0.1:8090/remap", f"http://127.0.0.1:{hook.port}/remap")
    cfg = cfg.replace(CREDENTIAL, str(token_file))  # the copy systemd would hand it
    (tmp_path / "am.yml").write_text(cfg)
    port = free_port(lo=hook.port + 1)
    with open(tmp_path / "am.log", "wb") as log:
        proc = subprocess.Popen([AM_BINARY, f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address=", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, "alertmanager ready", 30.0,
                   ignore=(httpx.HTTPError,), gone=lambda: None if proc.poll() is None else "alertmanager exited",
                   detail=lambda: (tmp_path / "am.log").read_text())
        yield url, hook, token
    finally:
        proc.terminate()
        proc.wait(10)
        hook.close()


def _webhook_calls_answered(am: AlertmanagerServer, n: int) -> bool:
    """Alertmanager has made ``n`` webhook calls that returned: its latency histogram observes a call once the
    receiver has answered (its notifications counter counts a call before it is sent)."""
    text = httpx.get(f"{am.url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "alertmanager_notification_latency_seconds_count"
               and s.labels.get("integration") == "webhook") >= n


def test_alertmanager_routes_remap_alerts_to_the_webhook_with_the_token(alertmanager: tuple) -> None:
    url, hook, token = alertmanager
    alerts = [
        {"labels": {"alertname": "PinsidecarDriftGain", "action": "remap", "severity": "warning",
                    "instance": "gpu-a:9108", "job": "pinsidecar"},
         "annotations": {"summary": "drift"}},
        {"labels": {"alertname": "PinsidecarBootSlow", "severity": "warning", "instance": "gpu-a:9108",
                    "job": "pinsidecar"}},
    ]
    r = httpx.post(f"{url}/api/v2/alerts", json=alerts, timeout=10)
    assert r.status_code == 200, r.text
    wait_until(lambda: hook.calls, "alertmanager calling the webhook", 30.0, step_s=0.1)
    time.sleep(1.0)  # anything else it would send arrives now
    assert len(hook.calls) == 1
    path, auth, body = hook.calls[0]
    assert path == "/remap"
    assert auth == f"Bearer {token}"
    assert [a["labels"]["alertname"] for a in body["alerts"]] == ["PinsidecarDriftGain"]
    assert body["status"] == "firing"


def test_alertmanager_delivers_to_the_control_api_which_remaps_once(tmp_path: Path) -> None:
    """The shipped example (timers shortened), a real Alertmanager, the real control API: a firing drift alert
    starts one remap (trigger "alert"); Alertmanager's repeat of the same episode starts none; an alert that is
    not a remap alert never reaches the webhook."""
    import asyncio

    if AM_BINARY is None:
        pytest.skip("prometheus-alertmanager missing (apt prometheus-alertmanager)")
    token = "am-to-control-" + "c" * 20
    token_file = tmp_path / "control.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    target = RecordingTarget()

    async def scenario() -> None:
        server = ControlServer(target, token, port=0)
        await server.start()
        cfg = example_config(ALERTMANAGER, webhook_url=f"http://127.0.0.1:{server.port}/remap",
                             token_file=token_file, group_wait="0s", group_interval="1s", repeat_interval="2s")
        am = AlertmanagerServer(cfg)
        await asyncio.to_thread(am.start)
        try:
            alerts = [{"labels": {"alertname": "PinsidecarDriftGain", "action": "remap", "severity": "warning",
                                  "instance": "cpu:8301", "job": "pinsidecar"},
                       "annotations": {"summary": "gain 42 pts"}, "startsAt": "2026-11-29T10:00:00Z"},
                      {"labels": {"alertname": "PinsidecarBootSlow", "severity": "warning", "instance": "cpu:8301",
                                  "job": "pinsidecar"}}]
            await asyncio.to_thread(am.post_alerts, alerts)
            for _ in range(300):
                if target.remaps:
                    break
                await asyncio.sleep(0.05)
            assert target.remaps, f"no remap requested; alertmanager log:\n{am.log_tail()}"
            # Alertmanager re-sends the same firing episode after repeat_interval: the repeat has reached the
            # webhook, and its answer came back, once Alertmanager has timed two webhook calls
            await wait_until_async(lambda: asyncio.to_thread(_webhook_calls_answered, am, 2),
                                   "Alertmanager's repeat of the firing episode answered by the webhook", 60.0,
                                   detail=am.log_tail)
        finally:
            await asyncio.to_thread(am.stop)
            await server.stop()
        assert len(target.remaps) == 1, target.remaps
        rec = target.remaps[0]
        assert rec["trigger"] == "alert" and rec["reason"] == "alert PinsidecarDriftGain on cpu:8301: gain 42 pts"
        assert rec["detail"]["receiver"] == "pinsidecar-remap"

    with structlog.testing.capture_logs() as logs:
        asyncio.run(scenario())
    deliveries = [e for e in logs if e["event"] == "remap_webhook"]
    assert deliveries[0]["new"] == 1
    assert len(deliveries) >= 2 and all(e["new"] == 0 and e["duplicates"] == 1 for e in deliveries[1:]), deliveries


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
                 "Boots", "Remaps", "Projected gain vs trip threshold",
                 "Cold-selection ratio: last window vs threshold", "Divergence from the map's source counts",
                 "Drift detector", "Exploitable skew", "Remaps by outcome", "Remap in progress"):
        assert want in titles, want
    # each drift signal is drawn against its threshold series on the same panel
    exprs_by_title = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in dash["panels"]}
    for title, signal in (("Projected gain vs trip threshold", "pinsidecar_drift_projected_gain_ratio"),
                          ("Cold-selection ratio: last window vs threshold", "pinsidecar_drift_cold_selection_ratio"),
                          ("Divergence from the map's source counts", "pinsidecar_drift_divergence"),
                          ("Skew: how far below uniform a map can get", "pinsidecar_drift_skew_gap_ratio")):
        panel = exprs_by_title[title]
        assert signal + "{" in panel, title
        assert signal + "_threshold" in panel or signal + "_trip_threshold" in panel, title
    skew = next(p for p in dash["panels"] if p["title"] == "Exploitable skew")
    texts = [o["text"] for m in skew["fieldConfig"]["defaults"]["mappings"] for o in m["options"].values()]
    assert "no exploitable skew" in texts
    notes = {a["name"]: a for a in dash["annotations"]["list"]}
    assert "pinsidecar_remaps_total" in notes["Remaps"]["expr"] and "changes(" in notes["Remaps"]["expr"]
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
