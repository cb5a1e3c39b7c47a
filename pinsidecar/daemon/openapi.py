"""The control API described as OpenAPI 3.0, served at ``GET /openapi.json``.

Why: an operator (or a client generator) can read what each call takes and answers without reading this code, and
the HTTP fuzz suite (tests/test_fuzz_http.py) generates requests from this same description with schemathesis, so
the description is checked against the server on every CI run: a request the schema calls valid must not get a
5xx, one it calls invalid must get a 4xx, and every answer must be one the schema lists, as JSON.

The request schemas mirror the validation in :mod:`pinsidecar.daemon.control` and
:mod:`pinsidecar.daemon.webhook` (which stay the authority: the schema says what is accepted, the code says why).
"""

from __future__ import annotations

from typing import Any

from pinsidecar.daemon.webhook import ALERTMANAGER_VERSION, MAX_ALERTS, TRIGGERS

__all__: list[str] = []  # nothing here is another package's business

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_OBJECT = {"type": "object"}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "bad input: the message names the field", 401: "missing or wrong bearer token",
            404: "no such path", 405: "method not allowed", 409: "busy (a remap or drain-reboot is running)",
            413: "body over control.max_body_bytes", 422: "an alert that does not start a remap",
            429: "remap cooldown or daily cap", 500: "the operation failed (details in the body)",
            503: "the daemon is still starting"}
    return {str(c): _json(text[c], _ERROR) for c in codes}


_DRAIN_BODY = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "map": {"type": "string", "minLength": 1, "pattern": r"\S",
                "description": "a map file name in the maps folder, a path inside it, or a hash prefix"},
        "timeout_s": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                      "description": "drain timeout in seconds"},
    },
}
_CLI_REMAP_BODY = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "dry_run": {"type": "boolean"},
        "map": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "reason": {"type": "string"},
        "trigger": {"type": "string", "enum": list(TRIGGERS)},
    },
}
_ALERT = {
    "type": "object", "required": ["status", "labels", "startsAt"],
    "properties": {
        "status": {"type": "string", "enum": ["firing", "resolved"]},
        "labels": {"type": "object", "required": ["alertname"],
                   "properties": {"alertname": {"type": "string", "minLength": 1}},
                   "additionalProperties": {"type": "string"}},
        "startsAt": {"type": "string", "minLength": 1},
        "fingerprint": {"type": "string"},
        "annotations": {"type": "object"},
    },
}
_ALERTMANAGER_BODY = {
    "type": "object", "required": ["version", "status", "alerts"],
    "properties": {
        "version": {"type": "string", "enum": [ALERTMANAGER_VERSION]},
        "status": {"type": "string", "enum": ["firing", "resolved"]},
        "receiver": {"type": "string"},
        "groupKey": {"type": "string"},
        "alerts": {"type": "array", "minItems": 1, "maxItems": MAX_ALERTS, "items": _ALERT},
    },
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.0 description of the control API (GET /status and /openapi.json are open; POSTs need the
    bearer token)."""
    bearer = [{"bearer": []}]
    return {
        "openapi": "3.0.3",
        "info": {"title": "pinsidecar control API", "version": "1",
                 "description": "Status, drain-reboot and remap of one pinsidecar lane. Mutating calls need "
                                "`Authorization: Bearer <token>` (control.token_file). Errors are "
                                "`{\"error\": \"...\"}`."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/status": {"get": {
                "summary": "the daemon's state: engine, map, gate, remaps",
                "responses": {"200": _json("status", _OBJECT), **_errors(413)},
            }},
            "/openapi.json": {"get": {
                "summary": "this description",
                "responses": {"200": _json("OpenAPI document", _OBJECT), **_errors(413)},
            }},
            "/drain-reboot": {"post": {
                "summary": "hold new requests, drain, reboot the engine (optionally onto another map)",
                "security": bearer,
                "requestBody": {"required": False, "content": {"application/json": {"schema": _DRAIN_BODY}}},
                "responses": {"200": _json("rebooted", _OBJECT), **_errors(400, 401, 409, 413, 500, 503)},
            }},
            "/remap": {"post": {
                "summary": "start a remap: a request from `pinsidecar remap`, or an Alertmanager webhook delivery",
                "security": bearer,
                "requestBody": {"required": False, "content": {"application/json": {
                    "schema": {"oneOf": [_CLI_REMAP_BODY, _ALERTMANAGER_BODY]}}}},
                "responses": {"200": _json("a dry run's decision, or a delivery that needed no action", _OBJECT),
                              "202": _json("a remap started", _OBJECT),
                              **_errors(400, 401, 409, 413, 422, 429, 503)},
            }},
        },
    }
