"""Remap in place on every tensor-parallel rank: one apply, ordered at one step boundary on all of them.

With tensor parallel each rank holds its shard of every expert and re-homes it by the same row map; an in-place
apply must move the same experts on every rank, before the same step. Only rank 0 runs the side thread that reads
the request file (:mod:`pinsidecar_hook.flusher`), so the other ranks hear of an apply through vLLM's own
tensor-parallel group (its CPU process group, :func:`pinsidecar_hook.vllm_seam.tp_cpu_group`), at a point every
rank reaches in the same order: the step guard around ``execute_model``, which every rank runs for every step.
Every :data:`CHECK_EVERY` steps each rank joins one all-reduce of rank 0's pending request number (an 8-byte
collective on the CPU group, once per that many steps); when one is pending, all ranks, between the same two
steps, on the worker's own thread and under the step lock:

1. take the request from rank 0 (a broadcast);
2. check it, each rank on its own (every check of :func:`pinsidecar_hook.swap.apply._prepare`: the file, its hash, the
   model, the geometry, the row maps), touching nothing, and gather the answers: a refusal on any rank and no rank
   touches anything; the answer names each rank that refused and why;
3. swap their own shard's rows, in one hold (the step waits for the whole apply: a batch between two steps would
   need its own ordering across the ranks), and gather the outcomes: when a rank failed (it has already put its
   own rows back), every rank that applied swaps back by the inverse plan, so the old map serves whole on every
   rank;
4. adopt the candidate on every rank.

The next step any rank runs sees the candidate on every rank, and the answer rank 0 writes says so. No file is
polled per rank, and no RPC door is opened into the workers.

An idle engine runs no steps, so it reaches no boundary: rank 0 answers ``refused`` after :data:`IDLE_TIMEOUT_S`
with that reason (the daemon's fallback, a drain-reboot, costs an idle engine nothing). A request the worker thread
has taken runs to its end; only one not yet taken is withdrawn.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pinsidecar_hook.swap.apply as swap_apply  # its functions are read at call time: tests wrap them there
from pinsidecar_hook.contract import ApplyResult, plan_swap

__all__ = ["CHECK_EVERY", "IDLE_TIMEOUT_S", "RankGroup", "TPApply", "TorchRankGroup"]

log = logging.getLogger("pinsidecar_hook")

CHECK_EVERY = 8  # steps between two looks for a pending apply: one small collective per this many steps
IDLE_TIMEOUT_S = 30.0  # rank 0 withdraws a request no step boundary took within this long


class RankGroup(Protocol):
    """The collectives the apply needs, over the tensor-parallel ranks (every rank calls each, in the same order)."""

    rank: int
    size: int

    def max_int(self, value: int) -> int:
        """The largest ``value`` any rank passed."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        ...


class TorchRankGroup:
    """:class:`RankGroup` over a ``torch.distributed`` process group (vLLM's tensor-parallel CPU group)."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def max_int(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass
class _Job:
    epoch: int
    args: dict[str, Any]
    token: str
    taken: bool = False
    result: ApplyResult | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _said(answers: list[dict[str, Any]], outcome: str) -> str:
    return "; ".join(f"rank {r}: {a['reason']}" for r, a in enumerate(answers) if a["outcome"] == outcome)


class TPApply:
    """One rank's part of the tensor-parallel apply (see the module docstring): rank 0's side thread
    :meth:`submit`\\ s a request, every rank's step guard calls :meth:`at_step_boundary`."""

    def __init__(self, group: RankGroup, *, check_every: int = CHECK_EVERY,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.group = group
        self.check_every = check_every
        self.idle_timeout_s = idle_timeout_s
        self._steps = 0
        self._epoch = 0
        self._job: _Job | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ rank 0, side thread

    def submit(self, args: Mapping[str, Any], token: str) -> ApplyResult:
        """Hand the request to the next step boundary and wait for every rank's answer (rank 0 only)."""
        with self._lock:
            self._epoch += 1
            job = _Job(self._epoch, dict(args), token)
            self._job = job
        if not job.done.wait(self.idle_timeout_s):
            with self._lock:
                if not job.taken:
                    self._job = None
                    reason = (f"no step began within {self.idle_timeout_s:g} s: a tensor-parallel apply runs on "
                              f"every rank between two steps, so it needs traffic (the engine looks idle); "
                              "reboot instead, which costs an idle engine nothing")
                    log.warning("pinsidecar pin: apply %s refused: %s", token, reason)
                    return ApplyResult(token=token, outcome="refused", reason=reason)
            job.done.wait()  # taken: it is running on the worker thread, and ends
        assert job.result is not None
        return job.result

    # ------------------------------------------------------------------------------- every rank, worker thread

    def at_step_boundary(self, target: Any) -> None:
        """Before a step: every :attr:`check_every` steps, look (all ranks together) for a pending apply and run it."""
        self._steps += 1
        if self._steps % self.check_every:
            return
        job = None
        if self.group.rank == 0:
            with self._lock:
                job, self._job = self._job, None
                if job is not None:
                    job.taken = True
        if self.group.max_int(job.epoch if job is not None else 0) == 0:
            return
        args, token = self.group.broadcast((job.args, job.token) if job is not None else None)
        result = ApplyResult(token=token, outcome="failed", map_hash=target.emap.content_hash)
        try:
            result = self.run(target, args, token)
        except Exception as exc:  # a collective broke: the ranks no longer agree, nothing sane is left to do
            log.exception("pinsidecar pin: tensor-parallel apply %s broke off", token)
            result.reason = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if job is not None:  # rank 0's side thread hears back either way
                job.result = result
                job.done.set()

    def run(self, target: Any, args: Mapping[str, Any], token: str) -> ApplyResult:
        """The apply on this rank, in step with the others (all ranks call it with the same request)."""
        t0 = time.perf_counter()
        active = target.emap
        result = ApplyResult(token=token, outcome="refused", map_hash=active.content_hash,
                             from_hash=active.content_hash)
        with target.step_lock:
            prepared = None
            try:
                prepared = swap_apply._prepare(target, args, tensor_parallel=True)
                mine = {"outcome": "ok", "reason": ""}
            except swap_apply.ApplyRefused as exc:
                mine = {"outcome": "refused", "reason": str(exc)}
            except Exception as exc:  # ours: still a refusal on this rank, touching nothing
                mine = {"outcome": "refused", "reason": f"{type(exc).__name__}: {exc}"}
            answers = self.group.gather(mine)
            if any(a["outcome"] != "ok" for a in answers):
                result.reason = f"refused on every rank (nothing touched) because {_said(answers, 'refused')}"
                log.warning("pinsidecar pin: apply %s %s", token, result.reason)
                return result
            assert prepared is not None
            candidate, path, plan = prepared[0], prepared[1], prepared[2]
            result.to_hash = candidate.content_hash
            stats = None
            try:
                stats = swap_apply.swap_layers(target.layers, plan, target.step_lock, hold_budget_s=math.inf,
                                               ordering="host", switch_interval_s=None)
                mine = {"outcome": "applied", "reason": "", "seconds": stats.seconds, "rows": stats.rows,
                        "bytes": stats.bytes_moved, "layers": stats.layers, "link_GBps": stats.link_GBps}
            except Exception as exc:  # SwapFailed: this rank's rows are back; anything else: the same promise
                mine = {"outcome": "failed", "reason": str(exc)}
            answers = self.group.gather(mine)
            if any(a["outcome"] != "applied" for a in answers):
                if stats is not None:
                    self._swap_back(target, candidate, path, active, token)
                result.outcome = "failed"
                result.reason = (f"failed on {sum(a['outcome'] != 'applied' for a in answers)} of {len(answers)} "
                                 f"ranks, every rank swapped back, the old map serves: {_said(answers, 'failed')}")
                log.error("pinsidecar pin: apply %s %s", token, result.reason)
                return result
            target.adopt(candidate, path)
        result.outcome, result.map_hash = "applied", candidate.content_hash
        result.rows, result.layers, result.batches = answers[0]["rows"], answers[0]["layers"], 1
        result.bytes_moved = sum(a["bytes"] for a in answers)  # every rank's link
        result.seconds = result.hold_max_s = round(max(a["seconds"] for a in answers), 6)
        result.wall_s = round(time.perf_counter() - t0, 6)
        result.link_GBps = round(min(a["link_GBps"] for a in answers), 3)
        log.info("pinsidecar pin: applied map %s (%s, hash %s) in place over %s on all %d tensor-parallel ranks at "
                 "one step boundary: %d rows swapped per rank in %d layers, %.1f MiB moved in all, step lock held "
                 "%.3f s (the longest rank)", path, candidate.label or "-", candidate.short_hash, active.short_hash,
                 len(answers), result.rows, result.layers, result.bytes_moved / 2**20, result.seconds)
        return result

    def _swap_back(self, target: Any, candidate: Any, path: Any, active: Any, token: str) -> None:
        """Another rank failed: put this rank's rows back (the inverse plan). Should that fail too, the rows follow
        the candidate, so this rank serves it under its own name rather than under a hash its rows do not hold."""
        try:
            swap_apply.swap_layers(target.layers, plan_swap(candidate, active), target.step_lock,
                                   hold_budget_s=math.inf, ordering="host", switch_interval_s=None)
        except Exception:
            log.exception("pinsidecar pin: apply %s: this rank could not swap back; it serves the candidate", token)
            target.adopt(candidate, path)
