"""Step e, in place: ask the hook to swap the candidate into the serving engine, and read its answer.

A drain-reboot stops serving for as long as an engine boot takes (44 s under load on the 2-core box, minutes for a
large GPU model). Between two maps of the same geometry nothing about the engine's shape changes: each layer has as
many experts entering its hot tier as leaving it, and the hook can swap those rows between the tiers while the
engine keeps its process, its compiled graphs and its KV cache (:func:`~pinsidecar_hook.contract.swap.plan_swap`).
Serving stands still only while the hook holds its step lock for the copies. So the pipeline tries that first and
keeps the drain-reboot as the fallback.

The request travels the way ``flush`` and ``reset`` do (:mod:`pinsidecar_hook.contract.requests`): a request file
beside the stats file, ``{"op": "apply", "args": {"map": <path as the engine sees it>, "hash": <candidate hash>}}``,
answered by a stats write carrying the request's token and ``meta["apply"]``
(:class:`~pinsidecar_hook.contract.swap.ApplyResult`). This module is that client, plus what the pipeline makes
of the answer (:class:`ApplyAnswer`, one of :data:`REQUEST_RESULTS`):

- ``applied`` — every row swapped, the stats report the candidate's hash;
- ``refused`` — the hook touched nothing (it cannot coordinate several workers, the map does not fit, ...);
- ``failed`` — the swap started and raised; the hook swapped every row back, the old map serves whole;
- ``timeout`` — no answer within ``remap.apply_timeout_s`` from an engine that still runs;
- ``engine_died`` — the engine exited (or restarted: another ``boot_id``) before it answered.

A request that gets no answer is withdrawn (:func:`withdraw_apply_request`): otherwise the engine the supervisor
restarts, with the committed map, would find it and apply an uncommitted candidate with no remap watching. For the
same reason the daemon withdraws any request a killed predecessor left behind before it boots an engine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import StatsSnapshot, load_stats
from pinsidecar_hook.contract.requests import apply_args, request_and_wait, request_path
from pinsidecar_hook.contract.swap import ApplyResult

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

APPLY_OP = "apply"
# What one apply request came to (pinsidecar_remap_apply_requests_total{result}).
REQUEST_RESULTS = ("applied", "refused", "failed", "timeout", "engine_died")
# How an in-place deploy ended, once per remap that tried one (pinsidecar_remap_apply_total{outcome}):
# applied (the candidate stayed and was committed), rolled_back (applied, then parity or verification failed and
# the old map came back), fell_back_reboot (not applied in place: the drain-reboot deployed instead),
# engine_died (the engine died mid-apply; the supervisor restarts it with the committed map).
DEPLOY_OUTCOMES = ("applied", "rolled_back", "fell_back_reboot", "engine_died")

# The apply client's signature: (stats file, map path as the engine sees it, map hash, timeout, alive) ->
# (the hook's answer, the stats snapshot that carried it). Blocking: the pipeline runs it in a thread.
ApplyClient = Callable[..., tuple[ApplyResult, StatsSnapshot]]


def request_apply(stats_path: Path, engine_map: str, map_hash: str, *, timeout_s: float,
                  alive: Callable[[], bool], ordering: str | None = None,
                  hold_ms: float | None = None) -> tuple[ApplyResult, StatsSnapshot]:
    """Ask the hook of the engine writing ``stats_path`` to apply the map at ``engine_map`` (a path inside the
    engine's filesystem) whose content hash is ``map_hash``, its batches ordered by ``ordering`` and each bounded
    by ``hold_ms`` (None: the hook's defaults); wait for its answer. Raises
    :class:`~pinsidecar_hook.contract.requests.HookRequestError` without one (timeout, or ``alive()`` false), and
    ``ValueError`` for an answer without a readable ``meta["apply"]``."""
    stats = request_and_wait(stats_path, APPLY_OP, load_stats, timeout_s=timeout_s, alive=alive,
                             args=apply_args(engine_map, map_hash, hold_ms=hold_ms, ordering=ordering))
    doc = stats.meta.get("apply")
    if doc is None:
        raise ValueError(f"the hook answered the apply request without meta.apply ({stats_path})")
    return ApplyResult.from_json(doc), stats


def withdraw_apply_request(stats_path: Path | None) -> bool:
    """Remove a pending ``apply`` request beside ``stats_path`` (a flush or reset is left alone). Returns whether
    one was removed. A request file that cannot be read is removed too: nothing but the daemon writes it."""
    if stats_path is None:
        return False
    p = request_path(stats_path)
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        doc = {"op": APPLY_OP}
    if not isinstance(doc, dict) or doc.get("op") != APPLY_OP:
        return False
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
        log.info("apply_request_withdrawn", path=str(p), token=doc.get("token"))
        return True
    return False


def stats_boot_id(stats_path: Path | None) -> str | None:
    """The engine life the stats file describes now (None: no readable file yet)."""
    if stats_path is None:
        return None
    try:
        return load_stats(stats_path).boot_id
    except (OSError, ValueError):
        return None


@dataclass
class ApplyAnswer:
    """What one apply request came to, as the record and the metrics keep it."""

    result: str  # one of REQUEST_RESULTS
    reason: str = ""
    purpose: str = "candidate"  # "candidate" or "rollback"
    map_hash: str = ""  # the map asked for
    served_hash: str = ""  # what the stats report after the answer
    seconds: float = 0.0  # the hook's: the step lock held, summed over its batches (serving stood still that long)
    wait_s: float = 0.0  # the daemon's: from dropping the request to reading the answer
    rows: int = 0
    bytes_moved: int = 0
    layers: int = 0
    batches: int = 0  # the hook's batches between steps; the longest one is the longest a step waited
    hold_max_s: float = 0.0
    wall_s: float = 0.0  # the hook's: first batch to last, steps in between included
    link_GBps: float = 0.0  # bytes moved over the time the copies took
    drain_max_s: float = 0.0  # the longest part of a hold spent waiting for the last step's kernels to end
    stream_batches: int = 0  # batches queued on the engine's stream (no host wait under the lock)
    device_max_s: float = 0.0  # the longest batch on the device: what a step queued behind it waited there
    at: str = ""

    @property
    def applied(self) -> bool:
        return self.result == "applied"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify_answer(result: ApplyResult, stats: StatsSnapshot, *, map_hash: str, boot_before: str | None,
                    purpose: str, wait_s: float) -> ApplyAnswer:
    """Read the hook's answer. An ``applied`` that the stats contradict (another hash) counts as ``failed``: the
    daemon cannot tell which map serves, and only the reboot fallback makes that certain again."""
    base = {"purpose": purpose, "map_hash": map_hash, "served_hash": stats.map_hash, "wait_s": round(wait_s, 3),
            "seconds": round(result.seconds, 6), "layers": result.layers, "batches": result.batches,
            "hold_max_s": round(result.hold_max_s, 6), "wall_s": round(result.wall_s, 6),
            "link_GBps": round(result.link_GBps, 3), "drain_max_s": round(result.drain_max_s, 6),
            "stream_batches": result.stream_batches, "device_max_s": round(result.device_max_s, 6)}
    if boot_before is not None and stats.boot_id != boot_before:
        return ApplyAnswer("engine_died", f"the engine restarted during the apply (boot {boot_before} -> "
                           f"{stats.boot_id})", **base)
    if result.outcome == "applied":
        if stats.map_hash != map_hash or (result.map_hash and result.map_hash != map_hash):
            return ApplyAnswer("failed", f"the hook answered applied but the stats report map {stats.map_hash!r}, "
                               f"not {map_hash!r}", **base)
        return ApplyAnswer("applied", result.reason, rows=result.rows, bytes_moved=result.bytes_moved, **base)
    return ApplyAnswer(result.outcome, result.reason or f"the hook answered {result.outcome}", **base)


def apply_summary(remap_id: str, state: str, apply: dict[str, Any]) -> dict[str, Any]:
    """The last in-place deploy as ``pinsidecar status`` shows it, from a record's ``apply``: how it ended, and the
    candidate's request (the first one: a rollback's comes after it)."""
    requests = apply.get("requests") or []
    first = requests[0] if requests else {}
    plan = apply.get("plan") or {}
    return {"remap": remap_id, "remap_state": state, "in_place": apply.get("in_place"),
            "outcome": apply.get("outcome"), "reason": apply.get("reason"), "result": first.get("result"),
            "seconds": first.get("seconds"), "wait_s": first.get("wait_s"), "at": first.get("at"),
            "batches": first.get("batches"), "hold_max_s": first.get("hold_max_s"), "link_GBps": first.get("link_GBps"),
            "rows": first.get("rows") or plan.get("rows"), "bytes_moved": first.get("bytes_moved") or
            plan.get("bytes_moved"), "planned_rows": plan.get("rows"), "requests": len(requests)}
