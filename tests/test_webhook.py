"""The Alertmanager webhook on ``POST /remap``: the parsing and dedup rules as pure functions, then over real HTTP
against the control API with a recording target (bearer token, firing, resolved, repeats, unknown alerts,
malformed and oversized bodies: a clear 4xx and no action)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest

from pinsidecar.daemon.control import ControlServer
from pinsidecar.daemon.webhook import (
    DEFAULT_REMAP_ALERTS,
    AlertMemory,
    WebhookError,
    is_alertmanager_body,
    parse_alertmanager_body,
    parse_cli_body,
    plan_delivery,
)
from pinsidecar.testing.control import RecordingTarget

TOKEN = "webhook-" + "b" * 24
ALERT = DEFAULT_REMAP_ALERTS[0]


def alert(status: str = "firing", name: str = ALERT, fingerprint: str = "f00d", starts: str = "2026-11-29T10:00:00Z",
          instance: str = "gpu-a:9108") -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": name, "action": "remap", "instance": instance,
                                         "severity": "warning"},
            "annotations": {"summary": "projected gain 42 pts"}, "startsAt": starts,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom/graph", "fingerprint": fingerprint}


def delivery(*alerts: dict[str, Any], status: str | None = None) -> dict[str, Any]:
    """An Alertmanager webhook payload (version 4) as Alertmanager 0.2x sends it."""
    alerts = alerts or (alert(),)
    return {"version": "4", "groupKey": '{}/{action="remap"}:{instance="gpu-a:9108"}', "truncatedAlerts": 0,
            "status": status or ("firing" if any(a["status"] == "firing" for a in alerts) else "resolved"),
            "receiver": "pinsidecar-remap", "groupLabels": {"instance": "gpu-a:9108"},
            "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093", "alerts": list(alerts)}


# ------------------------------------------------------------------------------------------------ pure functions


def test_the_two_bodies_are_told_apart_by_shape() -> None:
    assert is_alertmanager_body(delivery())
    assert not is_alertmanager_body({"dry_run": True, "map": "x"})
    assert not is_alertmanager_body({})
    assert is_alertmanager_body({"alerts": "junk", "receiver": "x"})  # then validated strictly, as a delivery


def test_cli_body() -> None:
    req = parse_cli_body({"dry_run": True, "map": " prose ", "reason": "  nightly re-profile ", "trigger": "timer"})
    assert (req.trigger, req.dry_run, req.map_ref, req.reason) == ("timer", True, "prose", "nightly re-profile")
    assert parse_cli_body({}).trigger == "manual"
    assert len(parse_cli_body({"reason": "x" * 5000}).reason) == 500
    for bad, what in [({"alerts": []}, "unknown field 'alerts'"), ({"dry_run": 1}, "dry_run"),
                      ({"map": 3}, "map"), ({"trigger": "drift"}, "trigger")]:
        with pytest.raises(WebhookError, match=what) as err:
            parse_cli_body(bad)
        assert err.value.status == 400


@pytest.mark.parametrize(("mutate", "status", "message"), [
    (lambda d: d.update(version="3"), 400, "version"),
    (lambda d: d.update(status="pending"), 400, "status"),
    (lambda d: d.update(alerts=[]), 400, "non-empty list"),
    (lambda d: d.update(alerts={"a": 1}), 400, "non-empty list"),
    (lambda d: d.update(alerts=["x"]), 400, r"alerts\[0\]: expected an object"),
    (lambda d: d["alerts"][0].update(status="weird"), 400, r"alerts\[0\].status"),
    (lambda d: d["alerts"][0].update(labels={"alertname": 5}), 400, "labels"),
    (lambda d: d["alerts"][0]["labels"].pop("alertname"), 400, "alertname"),
    (lambda d: d["alerts"][0].pop("startsAt"), 400, "startsAt"),
    (lambda d: d.update(alerts=[alert()] * 101), 400, "at most 100"),
    (lambda d: d["alerts"].append(alert(name="PinsidecarBootSlow")), 422, "'PinsidecarBootSlow' does not start"),
])
def test_malformed_and_foreign_deliveries_are_refused(mutate: Any, status: int, message: str) -> None:
    body = delivery()
    mutate(body)
    with pytest.raises(WebhookError, match=message) as err:
        parse_alertmanager_body(body, DEFAULT_REMAP_ALERTS)
    assert err.value.status == status


def test_firing_resolved_and_repeats() -> None:
    mem = AlertMemory()
    d = parse_alertmanager_body(delivery(alert(), alert(fingerprint="beef")), DEFAULT_REMAP_ALERTS)
    plan = plan_delivery(d, mem)
    assert plan.remap and [a.fingerprint for a in plan.new] == ["f00d", "beef"]
    assert plan.reason() == f"alert {ALERT} on gpu-a:9108: projected gain 42 pts; {ALERT} on gpu-a:9108: " \
                            "projected gain 42 pts"
    assert len(mem) == 0  # planning changes nothing; the caller remembers what the daemon accepted
    mem.remember(a.key for a in plan.new)
    again = plan_delivery(d, mem)
    assert not again.remap and len(again.duplicates) == 2 and again.why_not.startswith("duplicate")
    # the same alert firing again later is a new episode (new startsAt)
    later = parse_alertmanager_body(delivery(alert(starts="2026-11-29T12:00:00Z")), DEFAULT_REMAP_ALERTS)
    assert plan_delivery(later, mem).remap
    resolved = parse_alertmanager_body(delivery(alert("resolved")), DEFAULT_REMAP_ALERTS)
    p = plan_delivery(resolved, AlertMemory())
    assert not p.remap and p.why_not.startswith("resolved") and len(p.resolved) == 1
    # one delivery naming the same episode twice is one remap
    twice = parse_alertmanager_body(delivery(alert(), alert()), DEFAULT_REMAP_ALERTS)
    assert len(plan_delivery(twice, AlertMemory()).new) == 1


def test_a_missing_fingerprint_falls_back_to_the_labels() -> None:
    a, b = alert(), alert(instance="gpu-b:9108")
    for x in (a, b):
        x.pop("fingerprint")
    d = parse_alertmanager_body(delivery(a, b), DEFAULT_REMAP_ALERTS)
    fps = [x.fingerprint for x in d.alerts]
    assert fps[0].startswith("labels:") and fps[0] != fps[1]
    assert parse_alertmanager_body(delivery(copy.deepcopy(a)), DEFAULT_REMAP_ALERTS).alerts[0].fingerprint == fps[0]


def test_the_memory_is_bounded_oldest_first() -> None:
    mem = AlertMemory(size=3)
    mem.remember([("a", "1"), ("b", "1"), ("c", "1")])
    mem.remember([("d", "1")])
    assert len(mem) == 3 and ("a", "1") not in mem and ("d", "1") in mem
    with pytest.raises(ValueError):
        AlertMemory(size=0)


# ------------------------------------------------------------------------------------------------ over HTTP


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _serve(target: RecordingTarget, scenario: Any, **kwargs: Any) -> Any:
    server = ControlServer(target, TOKEN, port=0, max_body_bytes=8 * 1024, **kwargs)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            return await scenario(client)
    finally:
        await server.stop()


def run(scenario: Any, target: RecordingTarget | None = None, **kwargs: Any) -> tuple[RecordingTarget, Any]:
    target = target or RecordingTarget()
    return target, asyncio.run(_serve(target, scenario, **kwargs))


def test_a_firing_delivery_starts_one_remap_and_its_repeat_none() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        body = delivery(alert(), alert(fingerprint="beef"))
        return [await c.post("/remap", json=body, headers=_auth()), await c.post("/remap", json=body, headers=_auth())]

    target, (first, repeat) = run(scenario)
    assert first.status_code == 202
    assert first.json()["action"] == "remap" and first.json()["remap_id"] == "r1"
    assert repeat.status_code == 200 and repeat.json()["action"] == "none"
    assert "duplicate" in repeat.json()["reason"]
    assert len(target.remaps) == 1
    rec = target.remaps[0]
    assert rec["trigger"] == "alert" and rec["dry_run"] is False and rec["reason"].startswith(f"alert {ALERT}")
    assert [a["fingerprint"] for a in rec["detail"]["alerts"]] == ["f00d", "beef"]
    assert rec["detail"]["receiver"] == "pinsidecar-remap"


def test_resolved_is_acknowledged_with_no_action() -> None:
    async def scenario(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post("/remap", json=delivery(alert("resolved")), headers=_auth())

    target, r = run(scenario)
    assert r.status_code == 200 and r.json()["action"] == "none" and r.json()["accepted"] is False
    assert target.remaps == []


def test_bad_deliveries_are_a_clear_4xx_and_no_action() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.post("/remap", json=delivery()),  # no token
            await c.post("/remap", json=delivery(), headers=_auth("wrong-token-0123456789")),
            await c.post("/remap", json=delivery(alert(name="PinsidecarBootSlow")), headers=_auth()),
            await c.post("/remap", json={**delivery(), "version": "5"}, headers=_auth()),
            await c.post("/remap", content=b'{"version": "4", "alerts": [', headers=_auth()),
            await c.post("/remap", json=delivery(*[alert(fingerprint=f"{i:04x}") for i in range(40)]),
                         headers=_auth()),  # ~16 KB, over the 8 KB limit
        ]

    target, rs = run(scenario)
    assert [r.status_code for r in rs] == [401, 401, 422, 400, 400, 413]
    assert "does not start a remap" in rs[2].json()["error"]
    assert "version" in rs[3].json()["error"] and "not JSON" in rs[4].json()["error"]
    assert "over the limit" in rs[5].json()["error"]
    assert target.remaps == []


def test_a_delivery_the_gate_refuses_is_retried_by_the_next_repeat() -> None:
    target = RecordingTarget()

    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        target.refuse = (429, "cooldown: 200 s left of 300 s since the last remap")
        refused = await c.post("/remap", json=delivery(), headers=_auth())
        target.refuse = None
        return [refused, await c.post("/remap", json=delivery(), headers=_auth())]

    _, (refused, retried) = run(scenario, target)
    assert refused.status_code == 429 and "cooldown" in refused.json()["error"]
    assert retried.status_code == 202 and len(target.remaps) == 1


def test_the_remap_alert_names_are_configurable() -> None:
    async def scenario(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/remap", json=delivery(alert(name="MyDrift")), headers=_auth()),
                await c.post("/remap", json=delivery(alert()), headers=_auth())]

    target, (mine, default) = run(scenario, remap_alerts=["MyDrift"])
    assert mine.status_code == 202 and default.status_code == 422
    assert [r["trigger"] for r in target.remaps] == ["alert"]
