"""The parity gate: record an engine's greedy outputs over fixed prompts, and check another boot against them.

Operators run it around every map change ("does the new placement change any output?"), and the adaptation loop
runs it to verify a reboot. Placement must never change results, so the check is exact: every generated token id,
and every logprob bitwise *as serialized* by the engine (JSON floats round-trip exactly), for every prompt.

- :func:`record` boots the real engine (the one launcher, :mod:`pinsidecar.engine`) in the requested hook mode,
  sends every prompt greedily (temperature 0, ``logprobs=1``, token ids returned as ids) one at a time (so
  batching cannot differ between record and check), and returns a :class:`ParityRef`.
- :func:`compare` reports, per prompt, the first difference (index, both tokens, both logprobs), or a match.

A reference file is versioned and validated on read like the other artifacts: a wrong, truncated or hand-edited
file is a :class:`ParityError` naming the file and the fix, and so is a prompts file that is not the one the
reference was recorded with (compared by digest).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog
from pinsidecar_hook.contract import atomic_write_json, load_map, utc_now

from pinsidecar.counts.workload import WorkloadRequest, load_workload

__all__ = [
    "ParityError",
    "ParityRef",
    "PromptOutput",
    "check_prompts_match",
    "compare",
    "generate",
    "load_prompts",
    "load_ref",
    "outputs_from",
    "prompts_digest",
    "record",
]

log = structlog.get_logger(__name__)

PARITY_FORMAT = "pinsidecar.parity"
PARITY_VERSION = 1
# Per-request time limit: generous for a busy 2-core CI box; a hung engine is caught by it, not a slow one.
REQUEST_TIMEOUT_S = 600.0


class ParityError(ValueError):
    """A reference or prompts file that cannot be used. The message names the file and the fix."""


@dataclass
class PromptOutput:
    source: str  # FILE:LINE of the prompt
    token_ids: list[int]
    logprobs: list[float | None]


@dataclass
class ParityRef:
    model: str
    mode: str  # off | count | pin
    prompts_file: str
    prompts_digest: str
    outputs: list[PromptOutput]
    map_hash: str = ""
    map_label: str = ""
    created_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": PARITY_FORMAT, "version": PARITY_VERSION, "model": self.model, "mode": self.mode,
                "map_hash": self.map_hash, "map_label": self.map_label, "prompts_file": self.prompts_file,
                "prompts_digest": self.prompts_digest, "created_at": self.created_at,
                "outputs": [asdict(o) for o in self.outputs]}

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_json())


@dataclass
class PromptDiff:
    source: str
    index: int  # first differing position (a length difference counts at the shorter length)
    ref_token: int | None
    got_token: int | None
    ref_logprob: float | None
    got_logprob: float | None

    def describe(self) -> str:
        if self.ref_token is None or self.got_token is None:
            return (f"{self.source}: length differs at token {self.index} (reference "
                    f"{'ends' if self.ref_token is None else self.ref_token}, this run "
                    f"{'ends' if self.got_token is None else self.got_token})")
        if self.ref_token != self.got_token:
            return f"{self.source}: token {self.index} is {self.got_token}, reference {self.ref_token}"
        return (f"{self.source}: token {self.index} ({self.got_token}) has logprob {self.got_logprob!r}, "
                f"reference {self.ref_logprob!r}")


@dataclass
class ParityReport:
    prompts: int
    tokens: int
    diffs: list[PromptDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diffs

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "prompts": self.prompts, "tokens": self.tokens, "differing_prompts": len(self.diffs),
                "diffs": [asdict(d) | {"message": d.describe()} for d in self.diffs]}


# ---------------------------------------------------------------------------------------------------- files


def prompts_digest(requests: Sequence[WorkloadRequest]) -> str:
    canon = json.dumps([r.body for r in requests], sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canon).hexdigest()


def load_prompts(path: Path) -> list[WorkloadRequest]:
    requests = load_workload(path)  # WorkloadError (FILE:LINE) on a bad line
    chats = [r.source for r in requests if r.kind != "completion"]
    if chats:
        raise ParityError(f"{chats[0]}: parity prompts must be completions ({{\"prompt\": ...}}), not chat messages "
                          "(the gate compares per-token logprobs from the completions API)")
    return requests


def _bad(path: Path, problem: str) -> ParityError:
    return ParityError(f"{path}: {problem} (record a reference with `pinsidecar parity record`)")


def load_ref(path: str | os.PathLike[str]) -> ParityRef:
    p = Path(path)
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        raise ParityError(f"{p}: reference file not found (check the path, or record one with "
                          "`pinsidecar parity record`)") from None
    except OSError as exc:
        raise ParityError(f"{p}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(p, f"not valid JSON ({exc}); the file is corrupt or truncated") from None
    if not isinstance(doc, dict) or doc.get("format") != PARITY_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _bad(p, f"not a parity reference (format {found!r}, expected {PARITY_FORMAT!r})")
    if doc.get("version") != PARITY_VERSION:
        raise _bad(p, f"reference version {doc.get('version')!r} is not supported (this pinsidecar reads "
                      f"{PARITY_VERSION})")
    try:
        outputs = []
        for i, o in enumerate(doc["outputs"]):
            ids, lps = o["token_ids"], o["logprobs"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _bad(p, f"outputs[{i}].token_ids must be a list of integers")
            if not isinstance(lps, list) or len(lps) != len(ids) or not all(
                    v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in lps):
                raise _bad(p, f"outputs[{i}].logprobs must be one number per token")
            outputs.append(PromptOutput(str(o["source"]), ids, lps))
        return ParityRef(model=str(doc["model"]), mode=str(doc["mode"]), prompts_file=str(doc["prompts_file"]),
                         prompts_digest=str(doc["prompts_digest"]), outputs=outputs,
                         map_hash=str(doc.get("map_hash", "")), map_label=str(doc.get("map_label", "")),
                         created_at=str(doc.get("created_at", "")))
    except (KeyError, TypeError) as exc:
        raise _bad(p, f"missing or malformed field {exc}; the file is truncated or hand-edited") from None


# ---------------------------------------------------------------------------------------------------- engine


@contextlib.contextmanager
def engine_for(model: Path, mode: str, map_path: Path | None, *, port: int | None = None,
               log_path: Path | None = None, extra_args: Sequence[str] = (),
               boot_timeout_s: float = 900.0) -> Iterator[Any]:
    """A ready engine on ``model`` with the hook in ``mode`` (``pin`` needs ``map_path``), stopped on exit.

    Eager, on a free port unless ``port`` is given; hook files in a temp folder removed on exit."""
    from pinsidecar_hook.contract.env import HookConfig

    from pinsidecar.engine import EngineConfig, EngineProcess, free_port, hooked_spec

    with tempfile.TemporaryDirectory(prefix="pinsidecar-parity-") as tmp:
        hook = HookConfig(mode=mode, map_path=map_path if mode == "pin" else None,
                          counts_path=Path(tmp) / "counts.json" if mode == "count" else None,
                          stats_path=Path(tmp) / "stats.json" if mode == "pin" else None)
        cfg = EngineConfig(model=Path(model), extra_args=list(extra_args), enforce_eager=True)
        spec = hooked_spec(cfg, hook, port=port or free_port(), log_path=log_path or Path(tmp) / "engine.log")
        engine = EngineProcess(spec)
        engine.start()
        try:
            engine.wait_ready(boot_timeout_s)
            yield engine
        finally:
            engine.stop()


def generate(base_url: str, model_name: str, requests: Sequence[WorkloadRequest]) -> list[PromptOutput]:
    """Greedy outputs, one request at a time: token ids and their logprobs as the engine serialized them."""
    outputs = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for req in requests:
            body = {**req.body, "model": model_name, "temperature": 0.0, "logprobs": 1,
                    "return_tokens_as_token_ids": True, "stream": False}
            body.setdefault("max_tokens", 32)
            resp = client.post(f"{base_url}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{req.source}: engine answered HTTP {resp.status_code}: {resp.text[:300]}")
            lp = resp.json()["choices"][0]["logprobs"]
            ids = [int(str(t).rsplit(":", 1)[1]) for t in lp["tokens"]]  # "token_id:123"
            outputs.append(PromptOutput(req.source, ids, list(lp["token_logprobs"])))
    return outputs


def served_model_name(base_url: str) -> str:
    """The model name a running engine serves (its first ``/v1/models`` entry)."""
    try:
        resp = httpx.get(f"{base_url}/v1/models", timeout=30.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ParityError(f"{base_url}: no engine serving a model there ({exc}); check --base-url") from None


@contextlib.contextmanager
def outputs_from(model: Path, mode: str, map_path: Path | None, requests: Sequence[WorkloadRequest], *,
                 base_url: str | None = None, port: int | None = None,
                 log_path: Path | None = None) -> Iterator[list[PromptOutput]]:
    """Generate on a running engine (``base_url``: verify a reboot in place) or on one booted for the purpose."""
    if base_url:
        yield generate(base_url.rstrip("/"), served_model_name(base_url.rstrip("/")), requests)
        return
    with engine_for(model, mode, map_path, port=port, log_path=log_path) as engine:
        yield generate(engine.base_url, engine.spec.model_name, requests)


def record(model: Path, prompts: Path, *, mode: str, map_path: Path | None = None, port: int | None = None,
           log_path: Path | None = None, base_url: str | None = None) -> ParityRef:
    requests = load_prompts(prompts)
    emap = load_map(map_path) if mode == "pin" and map_path is not None else None
    with outputs_from(model, mode, map_path, requests, base_url=base_url, port=port, log_path=log_path) as out:
        outputs = out
    return ParityRef(model=str(model), mode=mode, prompts_file=str(prompts), prompts_digest=prompts_digest(requests),
                     outputs=outputs, map_hash=emap.content_hash if emap else "",
                     map_label=emap.label if emap else "", created_at=utc_now())


def compare(ref: ParityRef, outputs: Sequence[PromptOutput]) -> ParityReport:
    """Exact comparison, prompt by prompt; the first difference of each differing prompt."""
    report = ParityReport(prompts=len(outputs), tokens=sum(len(o.token_ids) for o in outputs))
    for want, got in zip(ref.outputs, outputs, strict=True):
        n = min(len(want.token_ids), len(got.token_ids))
        for i in range(n):
            if want.token_ids[i] != got.token_ids[i] or want.logprobs[i] != got.logprobs[i]:
                report.diffs.append(PromptDiff(got.source, i, want.token_ids[i], got.token_ids[i], want.logprobs[i],
                                               got.logprobs[i]))
                break
        else:
            if len(want.token_ids) != len(got.token_ids):
                report.diffs.append(PromptDiff(
                    got.source, n, want.token_ids[n] if n < len(want.token_ids) else None,
                    got.token_ids[n] if n < len(got.token_ids) else None,
                    want.logprobs[n] if n < len(want.logprobs) else None,
                    got.logprobs[n] if n < len(got.logprobs) else None))
    return report


def check_prompts_match(ref: ParityRef, requests: Sequence[WorkloadRequest], ref_path: Path, prompts: Path) -> None:
    if prompts_digest(requests) != ref.prompts_digest or len(requests) != len(ref.outputs):
        raise ParityError(f"{prompts}: these prompts are not the ones {ref_path} was recorded with "
                          f"({ref.prompts_file}, {len(ref.outputs)} prompts); check with the same prompts file")
