"""What ``POST /remap`` bodies mean: a request from ``pinsidecar remap``, or an Alertmanager webhook delivery.

Pure functions and one small memory, no server: the control API (:mod:`pinsidecar.daemon.control`) parses a body
here, then asks the daemon for a remap (``request_remap``, the one gate with the cooldown and the daily cap) only
for what this module says deserves one. Every rule is testable without HTTP.

Two kinds of body share the path, told apart by shape (:func:`is_alertmanager_body`):

- **the CLI's** ``{"dry_run": bool, "map": str | null, "reason": str, "trigger": "manual" | "timer"}``
  (:func:`parse_cli_body`; unknown keys are refused, so a typo is an error, not a silent default);
- **Alertmanager's** webhook payload, version ``"4"``: ``receiver``, ``status``, ``groupKey``, ``alerts[]`` each
  with ``status``, ``labels.alertname``, ``fingerprint``, ``startsAt`` (:func:`parse_alertmanager_body`).

What an Alertmanager delivery does, and why:

- **only named alerts remap**: every alert in the delivery must be one of the remap alerts (``remap_alerts``: the
  rules labelled ``action="remap"`` in ``grafana/alerts.yml``); an unknown name refuses the whole delivery with
  422 and nothing is done. A routing mistake that sends the wrong alerts here must show as an error in
  Alertmanager's log, not as a remap.
- **firing remaps, resolved does not**: a delivery whose alerts are all resolved is acknowledged (200) with no
  action; a drift that went away needs nothing.
- **one remap per delivery**: the new firing alerts of one delivery are one request (Alertmanager groups them; a
  second request would only be refused as "already running").
- **repeats are deduplicated** by ``(fingerprint, startsAt)``: the same firing episode of the same alert (a repeat
  notification, a retry, a second Alertmanager of an HA pair) starts at most one remap. A *new* episode (the alert
  resolved and fired again) has a new ``startsAt`` and is acted on. The memory is bounded
  (:data:`DEDUP_MEMORY`); an episode is remembered only once the daemon accepted its remap, so one refused by the
  cooldown is tried again by Alertmanager's next repeat.
- Alertmanager does not retry a 4xx, so every refusal here (malformed, unknown alert, the gate's 409/429) is
  final for that notification; it retries 5xx.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

# The webhook payload version Alertmanager has sent since 0.x ("4" in every release to date); another version
# may change the fields, so it is refused rather than guessed at.
ALERTMANAGER_VERSION = "4"
# The alerts that may start a remap: the rules labelled action="remap" in grafana/alerts.yml.
DEFAULT_REMAP_ALERTS = ("PinsidecarDriftGain",)
# (fingerprint, startsAt) pairs remembered: one per firing episode acted on. A remap takes minutes and the daily
# cap is single digits, so 1024 episodes is days of history, in ~100 KB.
DEDUP_MEMORY = 1024
# Who may ask through POST /remap with a CLI body (the alert trigger comes only from an Alertmanager body, the
# drift trigger only from inside the daemon).
TRIGGERS = ("manual", "timer")
# Bounds on what is copied from a body into the remap record and logs.
MAX_REASON_CHARS = 500
MAX_ALERTS = 100


class WebhookError(ValueError):
    """A body that cannot be acted on: ``status`` (400 malformed, 422 well-formed but not ours) and a message
    that says what is wrong and how to fix it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CliRemapRequest:
    """``pinsidecar remap``'s request (or the systemd timer's, which runs the same command)."""

    trigger: str = "manual"
    dry_run: bool = False
    map_ref: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class AlertNotice:
    """One alert of a delivery."""

    name: str
    status: str  # "firing" or "resolved"
    fingerprint: str
    starts_at: str
    labels: Mapping[str, str] = field(default_factory=dict)
    summary: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """What identifies one firing episode of one alert."""
        return (self.fingerprint, self.starts_at)

    def as_dict(self) -> dict[str, Any]:
        return {"alertname": self.name, "status": self.status, "fingerprint": self.fingerprint,
                "startsAt": self.starts_at, "instance": self.labels.get("instance", ""), "summary": self.summary}


@dataclass(frozen=True)
class WebhookDelivery:
    """One Alertmanager webhook delivery, validated."""

    receiver: str
    status: str
    group_key: str
    alerts: tuple[AlertNotice, ...]

    @property
    def firing(self) -> tuple[AlertNotice, ...]:
        return tuple(a for a in self.alerts if a.status == "firing")

    @property
    def resolved(self) -> tuple[AlertNotice, ...]:
        return tuple(a for a in self.alerts if a.status == "resolved")


def _text(value: Any, what: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise WebhookError(400, f"{what}: expected a non-empty string, got {value!r}")
    return value


def _reason(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebhookError(400, f"reason: expected a string, got {value!r}")
    return value.strip()[:MAX_REASON_CHARS]


def is_alertmanager_body(body: Mapping[str, Any]) -> bool:
    """True when ``body`` has the shape of an Alertmanager webhook payload (an ``alerts`` key beside one of
    ``version``, ``receiver`` or ``groupKey``). Such a body is then validated strictly as one; a CLI body never
    has these keys."""
    return "alerts" in body and any(k in body for k in ("version", "receiver", "groupKey"))


def refuse_nulls(body: Mapping[str, Any]) -> None:
    """A control body's fields are optional by leaving them out, never by ``null``: the OpenAPI document types each
    one, and a client that sends ``"map": null`` most likely lost a value on its way, so it is told rather than
    given the default (a drain-reboot onto the active map is not what it asked for)."""
    nulls = sorted(k for k, v in body.items() if v is None)
    if nulls:
        raise WebhookError(400, f"{nulls[0]}: null is not a value; leave the field out to get its default")


def parse_cli_body(body: Mapping[str, Any]) -> CliRemapRequest:
    """Validate a CLI remap body. Raises :class:`WebhookError` (400) naming the bad field."""
    allowed = {"dry_run", "map", "reason", "trigger"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise WebhookError(400, f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))}; an "
                           "Alertmanager delivery needs its version, receiver and alerts fields)")
    refuse_nulls(body)
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise WebhookError(400, f"dry_run: expected true or false, got {dry_run!r}")
    map_ref = body.get("map")
    if map_ref is not None and (not isinstance(map_ref, str) or not map_ref.strip()):
        raise WebhookError(400, "map: expected a path, a file name or label in the maps folder, or a hash prefix")
    trigger = body.get("trigger", "manual")
    if trigger not in TRIGGERS:
        raise WebhookError(400, f"trigger: expected one of {', '.join(TRIGGERS)}, got {trigger!r}")
    return CliRemapRequest(trigger=trigger, dry_run=dry_run, map_ref=map_ref.strip() if map_ref else None,
                           reason=_reason(body.get("reason")))


def _fingerprint(labels: Mapping[str, str]) -> str:
    """Alertmanager has sent ``fingerprint`` since 0.19; for an older sender, a stable hash of the labels."""
    return "labels:" + hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]


def _alert(raw: Any, i: int) -> AlertNotice:
    where = f"alerts[{i}]"
    if not isinstance(raw, Mapping):
        raise WebhookError(400, f"{where}: expected an object")
    status = raw.get("status")
    if status not in ("firing", "resolved"):
        raise WebhookError(400, f"{where}.status: expected \"firing\" or \"resolved\", got {status!r}")
    labels = raw.get("labels")
    if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in labels.items()):
        raise WebhookError(400, f"{where}.labels: expected an object of string labels")
    name = _text(labels.get("alertname"), f"{where}.labels.alertname")
    starts_at = _text(raw.get("startsAt"), f"{where}.startsAt")
    fingerprint = _text(raw.get("fingerprint"), f"{where}.fingerprint", required=False) or _fingerprint(labels)
    annotations = raw.get("annotations")
    summary = ""
    if isinstance(annotations, Mapping) and isinstance(annotations.get("summary"), str):
        summary = annotations["summary"][:MAX_REASON_CHARS]
    return AlertNotice(name=name, status=status, fingerprint=fingerprint, starts_at=starts_at, labels=dict(labels),
                       summary=summary)


def parse_alertmanager_body(body: Mapping[str, Any], remap_alerts: Iterable[str]) -> WebhookDelivery:
    """Validate an Alertmanager delivery. Raises :class:`WebhookError`: 400 for a malformed payload, 422 when an
    alert in it is not one of ``remap_alerts`` (the whole delivery is refused: no action)."""
    version = body.get("version")
    if version != ALERTMANAGER_VERSION:
        raise WebhookError(400, f"version: expected Alertmanager webhook version \"{ALERTMANAGER_VERSION}\", got "
                           f"{version!r}")
    status = body.get("status")
    if status not in ("firing", "resolved"):
        raise WebhookError(400, f"status: expected \"firing\" or \"resolved\", got {status!r}")
    raw_alerts = body.get("alerts")
    if not isinstance(raw_alerts, list) or not raw_alerts:
        raise WebhookError(400, "alerts: expected a non-empty list")
    if len(raw_alerts) > MAX_ALERTS:
        raise WebhookError(400, f"alerts: {len(raw_alerts)} alerts in one delivery, at most {MAX_ALERTS} "
                           "(set max_alerts on the webhook receiver)")
    alerts = tuple(_alert(a, i) for i, a in enumerate(raw_alerts))
    known = set(remap_alerts)
    unknown = sorted({a.name for a in alerts} - known)
    if unknown:
        raise WebhookError(422, f"alert {unknown[0]!r} does not start a remap (remap alerts: "
                           f"{', '.join(sorted(known)) or 'none'}); route only alerts labelled action=\"remap\" "
                           "to this webhook, or add the name to control.remap_alerts")
    return WebhookDelivery(receiver=_text(body.get("receiver"), "receiver", required=False), status=status,
                           group_key=_text(body.get("groupKey"), "groupKey", required=False), alerts=alerts)


class AlertMemory:
    """The firing episodes already acted on: ``(fingerprint, startsAt)`` pairs, oldest forgotten first beyond
    ``size``. Not thread-safe; the control API uses it from its one event loop."""

    def __init__(self, size: int = DEDUP_MEMORY) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def forget(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._seen.pop(key, None)


@dataclass(frozen=True)
class DeliveryPlan:
    """What to do with a delivery: ``remap`` with the alerts that start it, or no action and why."""

    remap: bool
    new: tuple[AlertNotice, ...]
    duplicates: tuple[AlertNotice, ...]
    resolved: tuple[AlertNotice, ...]
    why_not: str = ""

    def reason(self) -> str:
        """The remap record's reason, for a person."""
        parts = [f"{a.name}" + (f" on {a.labels['instance']}" if a.labels.get("instance") else "")
                 + (f": {a.summary}" if a.summary else "") for a in self.new]
        return "alert " + "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"new": [a.as_dict() for a in self.new], "duplicates": [a.as_dict() for a in self.duplicates],
                "resolved": [a.as_dict() for a in self.resolved]}


def plan_delivery(delivery: WebhookDelivery, memory: AlertMemory) -> DeliveryPlan:
    """Split a delivery into new firing alerts (a remap), repeats of episodes already acted on, and resolved ones.
    The memory is not changed: the caller remembers ``plan.new`` once the daemon accepted the remap."""
    new: list[AlertNotice] = []
    dups: list[AlertNotice] = []
    seen_here: set[tuple[str, str]] = set()
    for a in delivery.firing:
        if a.key in memory or a.key in seen_here:
            dups.append(a)
        else:
            new.append(a)
            seen_here.add(a.key)
    resolved = delivery.resolved
    if new:
        return DeliveryPlan(True, tuple(new), tuple(dups), resolved)
    why = ("duplicate: already acted on this firing episode (same fingerprint and startsAt)" if dups
           else "resolved: nothing to do")
    return DeliveryPlan(False, (), tuple(dups), resolved, why)
