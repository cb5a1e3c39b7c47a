"""HTTP fuzzing of the control API and of the Alertmanager webhook on ``POST /remap``, over real loopback HTTP.

Requests come from the OpenAPI description the server itself serves (``GET /openapi.json``), through schemathesis:
*positive* cases (valid by the schema) and *negative* ones (violating it: wrong types, unknown fields, out-of-range
numbers, bodies that are not objects). Each case is sent three times, with no token, a wrong token and the right
one. The properties:

- never a 5xx, whatever the body or the token;
- a mutating call without the right token is 401 with ``WWW-Authenticate: Bearer``, whatever the body;
- every answer is JSON, and every error is ``{"error": "<message>"}``;
- with the right token, the answer is one the description lists (status, content type, body schema), and a case
  that violates the schema is refused with a 4xx (schemathesis' ``negative_data_rejection``).

The webhook gets mutated Alertmanager deliveries (fields replaced by hostile values, deleted, lists cut or grown):
a valid one is acted on or acknowledged (200/202/422), a malformed one is 4xx with a message, nothing is 5xx.

The daemon behind the API is :class:`~pinsidecar.testing.control.RecordingTarget` (records, never reboots): these
are the API's rules; the real daemon behind the same API is in the daemon tests. Engine-free.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from pinsidecar.daemon.control import ControlServer
from pinsidecar.daemon.openapi import openapi_document
from pinsidecar.testing.control import RecordingTarget
from pinsidecar.testing.fuzz import EXAMPLES, hostile_values, mutate

TOKEN = "fuzz-" + "k" * 40
WRONG = "fuzz-" + "j" * 40
MAX_BODY = 4096
SCHEMA = schemathesis.openapi.from_dict(openapi_document())
# The tests send the credentials themselves (none, wrong, right), so schemathesis must not generate its own.
SCHEMA.config.generation.update(with_security_parameters=False)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class _Served:
    def __init__(self, server: ControlServer, target: RecordingTarget) -> None:
        self.server, self.target = server, target
        self.base = f"http://127.0.0.1:{server.port}"
        self.client = httpx.Client(base_url=self.base, timeout=30)  # one keep-alive connection for every example
        self.session = requests.Session()  # the same for schemathesis' calls


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    """One control API on a free loopback port, served from its own event loop thread (schemathesis calls are
    synchronous) for the whole module."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="control-api", daemon=True)
    thread.start()
    target = RecordingTarget()
    server = ControlServer(target, TOKEN, port=0, max_body_bytes=MAX_BODY)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    served = _Served(server, target)
    try:
        yield served
    finally:
        served.client.close()
        served.session.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def _header(response: Any, name: str) -> str:
    """A header of an httpx response or of a schemathesis one (lower-case keys, list values)."""
    value = response.headers.get(name.lower(), response.headers.get(name, ""))
    return value[0] if isinstance(value, list) else value


def _assert_json_answer(status: int, content_type: str, text: str) -> dict[str, Any]:
    assert status < 500, f"{status}: {text[:300]}"
    assert content_type.startswith("application/json"), (status, content_type, text[:200])
    body = json.loads(text)
    assert isinstance(body, dict)
    if status >= 400:
        assert isinstance(body.get("error"), str) and body["error"].strip(), body
    return body


def test_the_api_serves_its_own_description(served: _Served) -> None:
    r = served.client.get("/openapi.json")
    assert r.status_code == 200 and r.json() == openapi_document()
    loaded = schemathesis.openapi.from_url(f"{served.base}/openapi.json")  # a valid OpenAPI document
    ops = {f"{op.ok().method.upper()} {op.ok().path}" for op in loaded.get_all_operations()}
    assert {"GET /status", "POST /drain-reboot", "POST /remap"} <= ops  # (it leaves out the document's own URL)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@settings(max_examples=EXAMPLES(50))
@given(data=st.data())
def test_schemathesis_cases_with_no_wrong_and_right_token(served: _Served, mode: GenerationMode,
                                                          data: st.DataObject) -> None:
    case = data.draw(SCHEMA.as_strategy(mode), label="case")
    mutating = case.method.upper() != "GET"
    drains, remaps = len(served.target.drains), len(served.target.remaps)
    for token in (None, WRONG):
        r = case.call(base_url=served.base, session=served.session, headers=_headers(token), timeout=30)
        _assert_json_answer(r.status_code, _header(r, "Content-Type"), r.text)
        if mutating:
            assert r.status_code in (401, 413), f"{case.method} {case.path} without the right token: {r.status_code}"
            assert r.status_code == 413 or _header(r, "WWW-Authenticate") == "Bearer"
    assert (len(served.target.drains), len(served.target.remaps)) == (drains, remaps)  # refused: nothing done
    r = case.call(base_url=served.base, session=served.session, headers=_headers(TOKEN), timeout=30)
    _assert_json_answer(r.status_code, _header(r, "Content-Type"), r.text)
    assert r.status_code != 401
    # a schema-violating case must be refused with a 4xx; 413 (over max_body_bytes) is one, not in schemathesis' list
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE and r.status_code != 413 else [])
    case.validate_response(r, checks=checks, headers=_headers(TOKEN))


@settings(max_examples=EXAMPLES(60))
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       path=st.one_of(st.sampled_from(["/", "/status/", "/remap/x", "/../status", "/openapi.yaml", "//status"]),
                      st.text(alphabet="abcdefghijklmnopqrstuvwxyz/._-%", max_size=20).map(lambda p: "/" + p)),
       token=st.sampled_from([None, WRONG, TOKEN]))
def test_unknown_paths_and_methods_get_json_errors(served: _Served, method: str, path: str, token: str | None) -> None:
    r = served.client.request(method, path, headers=_headers(token))
    if method == "HEAD":
        return
    body = _assert_json_answer(r.status_code, _header(r, "Content-Type"), r.text)
    if method != "GET" and token != TOKEN:
        assert r.status_code == 401, body
    if r.status_code == 405:
        assert "Allow" in r.headers


@settings(max_examples=EXAMPLES(60))
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
       path=st.sampled_from(["/remap", "/drain-reboot"]))
@example(raw=b"[" * 3000, path="/remap")  # deeper than the JSON parser's stack, within the body limit
@example(raw=b'{"timeout_s": NaN}', path="/drain-reboot")  # not JSON; Python's parser would take it
@example(raw=b'{"timeout_s": Infinity}', path="/drain-reboot")
@example(raw=b"\xff\xfe{}", path="/remap")
@example(raw=b"x" * (MAX_BODY + 1), path="/remap")
def test_garbage_bodies_are_4xx_with_a_message(served: _Served, raw: bytes, path: str) -> None:
    drains, remaps = len(served.target.drains), len(served.target.remaps)
    r = served.client.post(path, content=raw, headers={**_headers(TOKEN), "Content-Type": "application/json"})
    body = _assert_json_answer(r.status_code, _header(r, "Content-Type"), r.text)
    if r.status_code >= 400:
        assert r.status_code in (400, 409, 413, 422), body
        assert (len(served.target.drains), len(served.target.remaps)) == (drains, remaps)  # nothing done


def _delivery() -> dict[str, Any]:
    """A delivery the way Alertmanager 0.25 sends it (the fields beyond the ones parsed included)."""
    return {
        "version": "4", "groupKey": '{}:{alertname="PinsidecarDriftGain"}', "truncatedAlerts": 0,
        "status": "firing", "receiver": "pinsidecar-remap",
        "groupLabels": {"alertname": "PinsidecarDriftGain"}, "commonLabels": {"alertname": "PinsidecarDriftGain"},
        "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093",
        "alerts": [{"status": "firing",
                    "labels": {"alertname": "PinsidecarDriftGain", "instance": "lane-a", "action": "remap"},
                    "annotations": {"summary": "a new map would cut cold selections"},
                    "startsAt": "2026-11-30T23:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                    "generatorURL": "http://prometheus/graph", "fingerprint": "abc123"}],
    }


@settings(max_examples=EXAMPLES(100))
@given(data=st.data())
def test_malformed_alertmanager_deliveries_are_4xx_with_a_message(served: _Served, data: st.DataObject) -> None:
    body = mutate(data, _delivery(), hostile_values())
    raw = json.dumps(body, allow_nan=False, default=str) if _finite_json(body) else None
    if raw is None:  # NaN/Infinity are not JSON; a sender cannot send them as numbers
        raw = json.dumps(body, allow_nan=True)
    r = served.client.post("/remap", content=raw.encode(),
                           headers={**_headers(TOKEN), "Content-Type": "application/json"})
    answer = _assert_json_answer(r.status_code, _header(r, "Content-Type"), r.text)
    assert r.status_code in (200, 202, 400, 413, 422), answer
    if r.status_code in (400, 422):
        assert len(answer["error"]) > 10  # says what is wrong, not just "bad request"


def _finite_json(obj: Any) -> bool:
    try:
        json.dumps(obj, allow_nan=False)
    except ValueError:
        return False
    return True
