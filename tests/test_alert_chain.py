"""The alert chain end to end, with the real servers: Prometheus scrapes the sidecar, the drift alert fires,
Alertmanager routes it to the sidecar's webhook, and the remap runs.

- a real daemon (``pinsidecar run``) serves the demo model on the vLLM CPU engine in pin mode with a code-domain
  map (built from the demo model's recorded routing of the code prompts, ``tests/data/drift``), small drift
  windows, the live remap source, and **``[drift] auto_remap = false``**: the daemon's own detector never starts
  this remap, so the only way it can start is through Alertmanager;
- Debian's Prometheus scrapes the sidecar's exporter every second and evaluates ``grafana/alerts.yml`` (the drift
  alert's ``for:`` shortened to seconds; every expression as shipped);
- Debian's Alertmanager runs ``grafana/alertmanager.yml`` (grouping timers shortened; routes, matchers and the
  bearer token from a credentials file as shipped) and posts to the daemon's ``/remap``;
- prose traffic through the gate makes the projected gain climb over its threshold. The test asserts the remap
  ran with trigger "alert", was applied in place (no boot) and committed; then a drain-reboot under the same
  traffic boots the committed map (and gives the boot panels their data), and every dashboard query returned data
  over the run (with the real engine behind the sidecar), except the few that cannot on a CPU box, each named with
  its reason.

The timeline (seconds from the first prose request to the alert firing in Prometheus, to the webhook starting the
remap in the daemon, to the remap committed) is printed, and written to ``$PINSIDECAR_FIGURES_DIR/alert_chain.json``
when that is set.
"""

from __future__ import annotations

import calendar
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from pinsidecar.placement import build_usage_map
from pinsidecar.remap.record import TERMINAL_STATES
from pinsidecar.testing.alertmanager import AlertmanagerServer, alertmanager_binary, example_config
from pinsidecar.testing.artifacts import counts_from, model_geometry
from pinsidecar.testing.daemon import BOOT_LIMIT_S, DaemonUnderTest
from pinsidecar.testing.figures import record_figure
from pinsidecar.testing.prometheus import PrometheusServer, prometheus_binary, rules_with_for
from pinsidecar.testing.wait import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus missing (apt-get install prometheus)"),
    pytest.mark.skipif(alertmanager_binary() is None,
                       reason="alertmanager missing (apt-get install prometheus-alertmanager)"),
]

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
ROUTING = Path(__file__).parent / "data" / "drift" / "demo_routing.json"
PROSE = [ROOT / "pinsidecar" / "demo" / "fixtures" / n for n in ("prose.jsonl", "prose_heldout.jsonl")]
ALERT = "PinsidecarDriftGain"
HOT_ROWS = 48  # the demo's geometry: 48 of 64 experts hot
# First prose request to a committed remap: 17 s on a 2-core box (2026-12-04: alert pending at 8.8 s, firing 2 s
# later, the webhook at once, an in-place apply and a 256-token verification). A chain that has not committed in 5
# minutes is broken, and waiting 15 would only take CI's time.
CHAIN_LIMIT_S = 300.0
CLIENTS = 3

# Dashboard targets that have no data on this box, and why (every other target must have data).
NO_DATA_HERE = {
    ("GPU memory", "A"): "no NVML on a CPU box (metrics.nvml = false)",
    ("GPU memory", "B"): "no NVML on a CPU box (metrics.nvml = false)",
    ("Cache tier", "D"): "this lane's map has no cache tier: the slots' hit rate is drawn only where there are slots",
}
# Targets that may be empty here depending on the host (the panel still needs another target with data).
MAY_BE_EMPTY = {
    ("Engine cgroup memory", "B"): "absent when the engine's cgroup has no memory limit (memory.max = max)",
    ("Gate", "C"): "only requests the gate did not proxy (rejected, held too long): none in a clean run",
    ("Boot duration", "C"): "boots that missed the compile cache: none expected",
    ("Hook errors and stats age", "A"): "hook errors: none expected",
    # The alert remaps on the projected gain, which a single rising window already shows; the watch confirms drift
    # only at the second window in a row, and the remap (about 6 s now that the parity check no longer waits for
    # vLLM's logprobs compile) is usually over by then, so the window after it is steady.
    ("annotation Drift confirmed", ""): "the alert's remap can finish before the watch confirms drift",
}


def code_map(model_dir: Path, out: Path) -> Path:
    """The demo's code-domain map (48 hot rows), built from the recorded routing of the code training prompts:
    the map a count boot of those prompts gives, without booting a second engine."""
    doc = json.loads(ROUTING.read_text())
    geo = model_geometry(model_dir)
    assert (len(doc["layer_ids"]), doc["num_experts"], doc["top_k"]) == (
        geo["num_layers"], geo["num_experts"], geo["top_k"]), "recorded routing is for another model geometry"
    reqs = doc["requests"]["code"]
    counts = counts_from(np.sum([r["counts"] for r in reqs], axis=0), top_k=doc["top_k"], layer_ids=doc["layer_ids"],
                         tokens=sum(r["tokens"] for r in reqs), workload="code")
    emap = build_usage_map([counts], HOT_ROWS, label="code")
    out.parent.mkdir(parents=True, exist_ok=True)
    emap.save(out)
    return out


@pytest.fixture(scope="module")
def chain(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonUnderTest]:
    tmp = tmp_path_factory.mktemp("chain")
    overrides = {
        # small windows: a few seconds of CPU traffic each (the hook writes its stats every 5 s); the daemon's own
        # detector must not start this remap (auto_remap off): Alertmanager does
        "drift": {"window_tokens": 512, "min_tokens": 256, "max_window_s": 30, "auto_remap": False, "cooldown_s": 0},
        "remap": {"source": "live", "min_count_tokens": 256, "verify_tokens": 256, "verify_timeout_s": 180,
                  "watch_interval_s": 1},
    }
    with DaemonUnderTest(tmp, demo_model_dir, code_map(demo_model_dir, tmp / "maps" / "code.json"),
                         overrides=overrides) as d:
        yield d


class ProseTraffic:
    """``CLIENTS`` threads sending the shipped prose prompts through the gate until stopped."""

    def __init__(self, gate_port: int) -> None:
        prompts = [json.loads(line) for p in PROSE for line in p.read_text().splitlines() if line.strip()]
        self.prompts = itertools.cycle(prompts)
        self.url = f"http://127.0.0.1:{gate_port}/v1/completions"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = self.ok = self.failed = 0
        self.first_sent: float | None = None
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=BOOT_LIMIT_S) as client:
            while not self.stop.is_set():
                with self.lock:
                    req = next(self.prompts)
                    self.sent += 1
                    if self.first_sent is None:
                        self.first_sent = time.time()
                try:
                    r = client.post(self.url, json={"model": "demo", "prompt": req["prompt"],
                                                    "max_tokens": req.get("max_tokens", 32), "temperature": 0})
                    good = r.status_code == 200
                except httpx.HTTPError:
                    good = False
                with self.lock:
                    self.ok += good
                    self.failed += not good
                if not good:
                    time.sleep(0.5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(BOOT_LIMIT_S)


class StatusPoller:
    """Polls the daemon's status in a thread: the alert's remap as last seen, and when it ended."""

    def __init__(self, chain: DaemonUnderTest) -> None:
        self.chain = chain
        self.remap_ended: float | None = None
        self.record: dict[str, Any] | None = None
        self.last_seen: dict[str, Any] | None = None
        self.drift_trips: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            st = self.chain.status_or_none()
            if st is None:
                time.sleep(0.2)
                continue
            now = time.time()
            remap = st.get("remap") or {}
            for rec in (remap.get("current"), remap.get("last"), *(remap.get("history") or [])):
                if not rec:
                    continue
                if rec.get("trigger") == "drift":
                    self.drift_trips.append(rec)
                if rec.get("trigger") != "alert":
                    continue
                self.last_seen = rec
                if rec.get("state") in TERMINAL_STATES and self.remap_ended is None and rec is remap.get("last"):
                    self.remap_ended, self.record = now, rec
            time.sleep(0.2)

    def describe(self) -> str:
        """What the poller saw of the alert's remap, for a failure message."""
        if self.last_seen is None:
            return "no remap with trigger 'alert' in the daemon's status yet (the webhook was never called)"
        steps = [(s.get("state"), s.get("seconds")) for s in self.last_seen.get("steps") or []]
        return (f"the alert's remap {self.last_seen.get('id')}: state {self.last_seen.get('state')}, steps {steps}, "
                f"error {self.last_seen.get('error')}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _alert_active_at(prom: PrometheusServer, since: float) -> float:
    """When the alert went pending (Unix seconds), from Prometheus's history: ``ALERTS_FOR_STATE`` holds an alert's
    active-at time as its value; and the alert must have fired (``ALERTS{alertstate="firing"}``), not only been
    pending, for Alertmanager to have called the webhook."""
    now = time.time()
    fired = prom.query_range(f'ALERTS{{alertname="{ALERT}", alertstate="firing"}}', since, now, step_s=1.0)
    assert fired, f"{ALERT} never fired in Prometheus, yet a remap with trigger 'alert' ran"
    active = prom.query_range(f'ALERTS_FOR_STATE{{alertname="{ALERT}"}}', since, now, step_s=1.0)
    assert active, f"Prometheus holds no ALERTS_FOR_STATE series for {ALERT}"
    return float(active[0]["values"][0][1])


def _chain_detail(prom: PrometheusServer, poller: StatusPoller, chain: DaemonUnderTest) -> str:
    """Where the chain stopped: the alert in Prometheus, the remap in the daemon, the daemon's log."""
    try:
        alerts = [(a["labels"].get("alertname"), a["state"]) for a in prom.alerts()]
    except Exception as exc:  # the failure message must not hide the failure
        alerts = [f"(prometheus: {type(exc).__name__}: {exc})"]
    return (f"alerts in Prometheus now: {alerts}\n{poller.describe()}\n"
            f"daemon log {chain.log_path} ends:\n{chain.log_tail()}")


def _epoch(stamp: str) -> float:
    """The remap record's ``YYYY-MM-DDTHH:MM:SS.fffZ`` (UTC) as Unix seconds."""
    base, _, frac = stamp.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def test_drift_alert_fires_alertmanager_calls_the_webhook_and_the_remap_commits(chain: DaemonUnderTest,
                                                                                tmp_path: Path) -> None:
    rules = rules_with_for(GRAFANA / "alerts.yml", tmp_path / "alerts.yml", {ALERT: "2s"})
    am_cfg = example_config(GRAFANA / "alertmanager.yml",
                            webhook_url=f"{chain.control_url}/remap",
                            token_file=chain.token_file, group_wait="0s", group_interval="1s", repeat_interval="1h")
    timeline: dict[str, float | None] = {}
    with AlertmanagerServer(am_cfg) as am, \
            PrometheusServer([f"127.0.0.1:{chain.ports.metrics}"], rule_files=[rules],
                             alertmanagers=[am.address]) as prom:
        prom.wait_for_target_up()
        boots_before_remap = chain.status()["engine"]["boots"]
        run_start = time.time()
        traffic = ProseTraffic(chain.ports.gate)
        poller = StatusPoller(chain)
        traffic.start()
        try:
            # Wait on what persists (the daemon's record of the remap), not on the alert's firing state: that lasts
            # only from the firing evaluation to the first window after the commit, a few seconds that a starved
            # poller can miss. Prometheus's own history says afterwards when the alert was pending and firing.
            wait_until(lambda: poller.remap_ended, "the alert's remap ended (Prometheus fires the alert, "
                       "Alertmanager calls the webhook, the pipeline runs)", CHAIN_LIMIT_S, step_s=1.0,
                       gone=chain.exited, detail=lambda: _chain_detail(prom, poller, chain))
            timeline["alert_pending"] = _alert_active_at(prom, run_start)
            boots_after_remap = chain.status()["engine"]["boots"]
            # The remap applied in place, so nothing booted; the dashboard's boot panels and annotation need a boot
            # in the run, and the committed map must be what a boot serves: a drain-reboot, under the same traffic.
            with chain.control() as control:
                dr = control.post("/drain-reboot", json={"timeout_s": 300})
            assert dr.status_code == 200 and dr.json().get("ok"), dr.text
            # the dashboard's queries are checked on data that includes a whole remap, a boot and traffic after:
            # a request served by the rebooted engine, then a scrape of the sidecar taken after it
            served = traffic.ok
            wait_until(lambda: traffic.ok > served, "a request served after the drain-reboot", BOOT_LIMIT_S,
                       gone=chain.exited)
            after_boot = time.time()
            prom.wait_for(f"timestamp(pinsidecar_engine_last_boot_duration_seconds) > {after_boot:.3f}")
        finally:
            traffic.close()
            poller.close()
        run_end = time.time()
        assert traffic.first_sent is not None
        t0 = traffic.first_sent
        rec = poller.record
        assert rec is not None
        # the daemon's own clock for the remap: started when the webhook's request was accepted, ended at commit
        timeline.update(webhook=_epoch(rec["started_at"]), committed=_epoch(rec["ended_at"]))
        figures = {
            "first_prose_to_alert_pending_s": round(timeline["alert_pending"] - t0, 1),  # type: ignore[operator]
            "first_prose_to_alert_firing_s": round(timeline["alert_pending"] + 2.0 - t0, 1),  # type: ignore[operator]
            "first_prose_to_webhook_s": round(timeline["webhook"] - t0, 1),  # type: ignore[operator]
            "first_prose_to_remap_end_s": round(timeline["committed"] - t0, 1),  # type: ignore[operator]
            "remap_state": rec["state"], "remap_seconds": rec.get("seconds"),
            "remap_steps": [(s.get("state"), s.get("seconds")) for s in rec.get("steps") or []],
            "requests": {"sent": traffic.sent, "ok": traffic.ok, "failed": traffic.failed},
        }
        record_figure("alert_chain", figures, title="alert chain timeline")

        # the chain: alert -> Alertmanager -> webhook -> the pipeline, and nothing else started a remap
        assert rec["trigger"] == "alert", rec
        assert rec["state"] == "committed", f"remap ended {rec['state']}: {rec.get('error')}\n{rec}"
        detail = rec.get("detail") or {}
        assert [a["alertname"] for a in detail.get("alerts", [])] == [ALERT], detail
        assert detail.get("receiver") == "pinsidecar-remap"
        assert not poller.drift_trips, "drift.auto_remap = false, yet the detector started a remap"
        st = chain.status()
        assert st["remap"]["last"]["id"] == rec["id"] and st["remap"]["last"]["trigger"] == "alert"
        assert st["engine"]["map"]["hash"] == rec["candidate"]["hash"]  # the engine serves the new map
        assert traffic.failed == 0
        states = [step.get("state") for step in rec.get("steps") or []]
        assert "applying" in states and "rebooting" not in states, states  # same geometry: applied in place
        assert boots_before_remap == boots_after_remap, "the in-place remap booted the engine"
        assert st["engine"]["boots"] == boots_after_remap + 1 and st["engine"]["last_boot"]["ok"]
        committed = prom.wait_for('pinsidecar_remaps_total{outcome="committed"} == 1', timeout_s=30)
        assert committed
        _check_dashboard(prom, run_start, run_end)

    # the operator's side of the same daemon: status names the alert's remap; a dry run changes nothing
    human = chain.cli("status", timeout=60)
    assert human.returncode == 0 and f"remap    last {rec['id']} (alert): committed" in human.stdout, human.stdout
    assert "drift    " in human.stdout
    dry = chain.cli("remap", "--dry-run", "--json", timeout=300)
    assert dry.returncode == 0, dry.stderr
    answer = json.loads(dry.stdout)
    assert answer["dry_run"] is True and answer["remap_id"] is None
    after = chain.status()
    assert after["engine"]["map"]["hash"] == rec["candidate"]["hash"] and after["remap"]["current"] is None
    assert after["remap"]["last"]["id"] == rec["id"]


def _check_dashboard(prom: PrometheusServer, start: float, end: float) -> None:
    """Every dashboard target returned data at some point of the run, except the named ones."""
    # A range query evaluates at start, start + step, ... <= end: the last scrape (the one after the reboot the run
    # waited for) can fall after the last evaluation by up to one step, and the boot annotation, which only that
    # scrape answers, then had no data (2026-12-07, once on the 2-core box). One step more evaluates it.
    end += 2.0
    dash = json.loads((GRAFANA / "pinsidecar-dashboard.json").read_text())
    empty: list[tuple[str, str, str]] = []
    allowed: list[tuple[str, str]] = []
    for panel in dash["panels"]:
        answered = []
        for t in panel.get("targets", []):
            q = (t["expr"].replace("$instance", ".*").replace("$__rate_interval", "30s")
                 .replace("$__range", f"{int(end - start) + 1}s"))
            got = bool(prom.query_range(q, start, end, step_s=2.0))
            answered.append(got)
            key = (panel["title"], t["refId"])
            if got:
                assert key not in NO_DATA_HERE, f"{key} has data now: drop it from NO_DATA_HERE"
            elif key not in NO_DATA_HERE and key not in MAY_BE_EMPTY:
                empty.append((panel["title"], t["refId"], t["expr"]))
            else:
                allowed.append(key)
        if panel.get("targets") and panel["title"] != "GPU memory":
            assert any(answered), f"panel {panel['title']!r}: no target returned data"
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            q = a["expr"].replace("$instance", ".*")
            if not prom.query_range(q, start, end, step_s=2.0) and ("annotation " + a["name"], "") not in MAY_BE_EMPTY:
                empty.append(("annotation " + a["name"], "", a["expr"]))
    print("dashboard targets without data here (allowed):", allowed)
    assert not empty, "dashboard queries with no data:\n" + "\n".join(map(str, empty))
