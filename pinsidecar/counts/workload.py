"""Workloads: JSONL files of completion or chat requests, validated up front, replayed against an engine.

A count boot is only as good as the traffic it replays, and a replay that dies on line 3,000 of a file after
twenty minutes of engine time wastes all of it. So every line of every file is parsed and checked *before*
anything is sent, and a bad line is a :class:`WorkloadError` that names ``FILE:LINE`` and what is wrong with it.

One request per line, one JSON object each:

- completion: ``{"prompt": "text"}`` (or a list of token ids);
- chat: ``{"messages": [{"role": "user", "content": "text"}, ...]}``;
- optional: ``max_tokens`` (default :data:`DEFAULT_MAX_TOKENS`), ``temperature`` (default 0, so a replay is
  repeatable), ``top_p``, ``top_k``, ``min_tokens``, ``stop``, ``ignore_eos``, ``seed``; ``model`` is accepted and
  ignored (the replay targets the engine's served model); ``id`` and ``label`` are kept as metadata, not sent.

Anything else (an unknown key, ``n`` or ``stream``, which would break the per-request token accounting) is an error:
a typo in a sampling parameter should not silently change the workload.

:func:`replay` sends the requests with bounded concurrency (a thread pool sharing one ``httpx`` client) and
returns each request's ``usage`` (prompt and completion tokens) or its error, in input order. A progress bar
shows on a terminal only.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["WorkloadError", "WorkloadRequest", "load_workload", "parse_request"]

# A request without max_tokens would otherwise generate up to the model's context length; 128 keeps a replay's
# cost predictable and is plenty to reach decode-phase routing.
DEFAULT_MAX_TOKENS = 128
_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_tokens", "stop", "ignore_eos", "seed"}
_META_KEYS = {"id", "label", "model"}


class WorkloadError(ValueError):
    """A workload file or line that cannot be replayed. The message starts with ``FILE:LINE``."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One validated request. ``body`` is what is sent, minus ``model`` (set at replay time)."""

    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    source: str  # FILE:LINE
    request_id: str = ""

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


@dataclass
class RequestResult:
    source: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class ReplayResult:
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.results)

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.results if r.ok)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results if r.ok)

    @property
    def tokens_processed(self) -> int:
        """Tokens the engine ran through the model: every prompt token and every sampled token but the last of
        each request (the last one is returned, never fed back). With prefix caching off this is exactly the
        number of tokens the first MoE layer routes."""
        return sum(r.prompt_tokens + r.completion_tokens - 1 for r in self.results if r.ok and r.completion_tokens)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "failed": len(self.errors), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "tokens_processed": self.tokens_processed,
                "wall_s": round(self.wall_s, 3)}


# ---------------------------------------------------------------------------------------------------- parsing


def _bad(source: str, problem: str, hint: str = "") -> WorkloadError:
    return WorkloadError(f"{source}: {problem}" + (f" ({hint})" if hint else ""))


def _check_messages(messages: Any, source: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad(source, "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(source, f"messages[{i}] is not an object")
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise _bad(source, f"messages[{i}] has no 'role' string")
        content = msg.get("content")
        if not (isinstance(content, str) or (isinstance(content, list) and content)):
            raise _bad(source, f"messages[{i}] has no 'content' (a string)")


def parse_request(line: str, source: str) -> WorkloadRequest:
    """Validate one JSONL line. ``source`` (``FILE:LINE``) starts every error message."""
    if not line.strip():
        raise _bad(source, "empty line", "remove it: every line must be one JSON request")
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _bad(source, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(doc, dict):
        raise _bad(source, f"expected a JSON object, got {type(doc).__name__}")
    has_prompt, has_messages = "prompt" in doc, "messages" in doc
    if has_prompt == has_messages:
        raise _bad(source, "missing 'prompt' (completion) or 'messages' (chat)" if not has_prompt
                   else "has both 'prompt' and 'messages'", "give exactly one of them")
    body: dict[str, Any] = {}
    if has_prompt:
        prompt = doc["prompt"]
        ok = (isinstance(prompt, str) and prompt != "") or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise _bad(source, "'prompt' must be a non-empty string (or a non-empty list of token ids)")
        body["prompt"] = prompt
        kind = "completion"
    else:
        _check_messages(doc["messages"], source)
        body["messages"] = doc["messages"]
        kind = "chat"
    unknown = sorted(set(doc) - _SAMPLING_KEYS - _META_KEYS - {"prompt", "messages"})
    if unknown:
        raise _bad(source, f"unknown or unsupported key(s) {unknown}",
                   f"allowed: prompt/messages, {sorted(_SAMPLING_KEYS | _META_KEYS)}")
    for key in _SAMPLING_KEYS & set(doc):
        body[key] = doc[key]
    if "max_tokens" in body:
        mt = body["max_tokens"]
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise _bad(source, f"'max_tokens' must be a positive integer, got {mt!r}")
    if "temperature" in body and (isinstance(body["temperature"], bool)
                                  or not isinstance(body["temperature"], int | float) or body["temperature"] < 0):
        raise _bad(source, f"'temperature' must be a number >= 0, got {body['temperature']!r}")
    return WorkloadRequest(kind=kind, body=body, source=source, request_id=str(doc.get("id", "")))


def load_workload(paths: Path | str | Sequence[Path | str]) -> list[WorkloadRequest]:
    """Every request of every file, in order. Raises :class:`WorkloadError` on the first bad file or line."""
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise WorkloadError("no workload files given (pass at least one JSONL file)")
    out: list[WorkloadRequest] = []
    for path in map(Path, paths):
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise WorkloadError(f"{path}: file not found (check the path)") from None
        except IsADirectoryError:
            raise WorkloadError(f"{path}: is a directory (pass a JSONL file)") from None
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise WorkloadError(f"{path}: cannot read: {exc.strerror}") from None
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line does not start another
        if not lines:
            raise WorkloadError(f"{path}: no requests (the file is empty)")
        for lineno, line in enumerate(lines, start=1):
            out.append(parse_request(line.rstrip("\r"), f"{path}:{lineno}"))
    return out


# ---------------------------------------------------------------------------------------------------- replay


def _send(client: httpx.Client, base_url: str, model: str, req: WorkloadRequest, max_tokens: int | None,
          temperature: float) -> RequestResult:
    body = {"temperature": temperature, "max_tokens": DEFAULT_MAX_TOKENS, **req.body, "model": model,
            "stream": False}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    t0 = time.monotonic()
    try:
        resp = client.post(base_url + req.endpoint, json=body)
    except httpx.HTTPError as exc:
        return RequestResult(req.source, error=f"{type(exc).__name__}: {exc}", latency_s=time.monotonic() - t0)
    latency = time.monotonic() - t0
    if resp.status_code != 200:
        return RequestResult(req.source, error=f"HTTP {resp.status_code}: {resp.text[:300]}", latency_s=latency)
    try:
        usage = resp.json()["usage"]
        return RequestResult(req.source, int(usage["prompt_tokens"]), int(usage["completion_tokens"] or 0),
                             latency_s=latency)
    except (ValueError, KeyError, TypeError) as exc:
        return RequestResult(req.source, error=f"response without usage: {exc}", latency_s=latency)


def replay(requests: Iterable[WorkloadRequest], base_url: str, model: str, *, concurrency: int = 4,
           max_tokens: int | None = None, temperature: float = 0.0, timeout_s: float = 600.0,
           progress: bool | None = None, on_result: Callable[[RequestResult], None] | None = None) -> ReplayResult:
    """Send every request, at most ``concurrency`` at a time; failures are recorded, not raised.

    ``max_tokens`` overrides every request's own value; ``temperature`` applies where a request sets none.
    ``progress`` defaults to "stderr is a terminal".
    """
    reqs = list(requests)
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if progress is None:
        progress = sys.stderr.isatty()
    results: list[RequestResult | None] = [None] * len(reqs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="replay", unit="req", file=sys.stderr)
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        with httpx.Client(timeout=timeout_s, limits=limits) as client, \
                ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="replay") as pool:
            futures = {pool.submit(_send, client, base_url.rstrip("/"), model, r, max_tokens, temperature): i
                       for i, r in enumerate(reqs)}
            for fut in as_completed(futures):
                res = fut.result()
                results[futures[fut]] = res
                if on_result is not None:
                    on_result(res)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return ReplayResult([r for r in results if r is not None], wall_s=time.monotonic() - t0)
