"""Steps e-g of a remap, as one contract: a deploy puts the candidate in service, then verify, then commit or back.

There are two ways to put a candidate in service: swap its rows into the serving engine
(:class:`~pinsidecar.remap.in_place.InPlaceDeploy`, state ``applying``) or drain and reboot onto it
(:class:`~pinsidecar.remap.reboot.RebootDeploy`, state ``rebooting``). What comes before and after is the same
for both, so it is written once, here, and each deploy supplies only what differs:

- :meth:`Deploy.deploy` — put the candidate in service and check parity (:mod:`~pinsidecar.remap.parity`) on it.
  It returns :data:`SERVING` (go on and verify), :data:`ENDED` (it ended the remap itself: a parity difference
  rolled back, the engine died, the reboot failed) or, in place only, a fall-back reason: the drain-reboot must
  deploy the candidate instead;
- :meth:`Deploy.verify` — shared: the live cold rate under the candidate, against its prediction;
- :meth:`Deploy.roll_back` — the deploy's own way back to the old map (in place again, or a reboot), which ends
  the remap in the outcome it is given.

:func:`verify_and_commit` is the shared tail. The commit writes ``active-map.json`` durably *before* the record's
``committed`` (:mod:`~pinsidecar.remap.commit`); a write that fails puts the old map back through the deploy's
:meth:`~Deploy.roll_back` and ends ``commit_failed``, because a candidate a restart would not boot must not stay
serving. Which deploy runs is the pipeline's choice, from the swap plan (:func:`~pinsidecar.remap.in_place.swap_plan`).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import structlog

from pinsidecar.remap.commit import active_map_path, commit_failure
from pinsidecar.remap.host import RemapHost
from pinsidecar.remap.parity import DeployParity
from pinsidecar.remap.record import RemapRecord
from pinsidecar.remap.run import Aborted, RemapRun, first_line
from pinsidecar.remap.tools import RemapTools
from pinsidecar.remap.verify import ColdRateResult, cold_rate_verdict

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# How often verification looks at the live stats again while it waits for tokens.
WAIT_STEP_S = 0.5


@dataclass(frozen=True)
class Deployed:
    """What :meth:`Deploy.deploy` came to (see the module docstring)."""

    serving: bool
    fall_back: str | None = None


SERVING = Deployed(True)
ENDED = Deployed(False)


def fall_back(reason: str) -> Deployed:
    return Deployed(False, reason)


@dataclass
class DeployContext:
    """What a deploy may use: the host, the tools, the run, and the pipeline's own record keeping (``enter`` a
    state, ``save`` the record, ``finish`` the remap), so a deploy's transitions are persisted like every other."""

    host: RemapHost
    tools: RemapTools
    run: RemapRun
    ref_file: Path  # where the parity reference is saved (``<id>.parity.json``)
    enter: Callable[[str, dict[str, Any] | None], Awaitable[None]]
    save: Callable[[], None]
    finish: Callable[..., None]  # (state, reason, *, error=None, detail=None)

    @property
    def record(self) -> RemapRecord:
        return self.run.record

    def apply_outcome(self, outcome: str, reason: str | None = None) -> None:
        """How the in-place deploy ended, in the record's ``apply`` and in the metrics."""
        assert self.record.apply is not None
        self.record.apply["outcome"] = outcome
        if reason is not None:
            self.record.apply["reason"] = reason
        exporter = self.host.exporter
        if exporter is not None:
            exporter.record_apply_outcome(outcome)


class Deploy(ABC):
    """One way to put the candidate in service (see the module docstring)."""

    state: ClassVar[str]  # the record's state while it deploys

    def __init__(self, ctx: DeployContext) -> None:
        self.ctx = ctx

    def parity(self, *, logprobs: bool) -> DeployParity:
        """The parity prompts of this deploy, loaded (a bad prompts file aborts: nothing was touched yet)."""
        rcfg, host = self.ctx.host.cfg.remap, self.ctx.host
        try:
            return DeployParity(self.ctx.tools.parity, rcfg.parity_prompts_path, host.model_name, self.ctx.ref_file,
                                logprobs=logprobs)
        except ValueError as exc:
            raise Aborted(f"parity prompts: {first_line(exc)}") from None

    @abstractmethod
    async def deploy(self) -> Deployed: ...

    @abstractmethod
    def verify_detail(self) -> dict[str, Any]:
        """The deploy step's detail as verification begins (the record's timeline)."""

    def committed_detail(self) -> dict[str, Any]:
        return {}

    def on_committed(self) -> None:  # noqa: B027 - a hook; the reboot has nothing to add
        """The commit is on disk; the deploy's own bookkeeping follows."""

    @abstractmethod
    async def roll_back(self, why: str, *, error: str | None = None, outcome: str = "rolled_back",
                        then: str = "") -> None:
        """Bring the old map back and end the remap in ``outcome``: reason ``"<why>; <how it went>[; <then>]"``,
        ``error`` (default ``why``)."""

    async def verify(self) -> tuple[bool, str, dict[str, Any]]:
        """The live cold rate over ``remap.verify_tokens`` tokens served under the candidate (or what there was by
        ``verify_timeout_s``), against the decision's prediction; an engine that restarts meanwhile fails it."""
        host, rcfg, run = self.ctx.host, self.ctx.host.cfg.remap, self.ctx.run
        assert run.candidate is not None and run.decision is not None
        predicted = run.decision.candidate_cold_rate
        verdict = {"tokens_needed": rcfg.verify_tokens, "tolerance": rcfg.verify_tolerance,
                   "requires_traffic": rcfg.verify_requires_traffic}
        if host.stats_path is None:
            return cold_rate_verdict(ColdRateResult(0, 0, 0), predicted, **verdict)
        probe = self.ctx.tools.cold_probe(host.stats_path, run.candidate.content_hash)
        t0 = time.monotonic()
        deadline = t0 + rcfg.verify_timeout_s
        while True:
            result = probe.poll()
            if getattr(probe, "restarted", False):
                return False, "the engine restarted while the new map was being verified", {"tokens": result.tokens}
            _, served = host.served_map
            if served is not None and served.content_hash != run.candidate.content_hash:
                # a restart boots the committed map, not one applied in place: the candidate no longer serves
                return False, (f"the engine restarted while the new map was being verified and serves "
                               f"{served.label or served.short_hash}"), {"tokens": result.tokens}
            if result.tokens >= rcfg.verify_tokens or time.monotonic() >= deadline:
                break
            await asyncio.sleep(WAIT_STEP_S)
        ok, why, figures = cold_rate_verdict(result, predicted, **verdict)
        figures["wait_s"] = round(time.monotonic() - t0, 3)
        return ok, why, figures


async def verify_and_commit(deploy: Deploy) -> None:
    """The candidate serves and passed parity: verify it, then commit, or roll back the deploy's way."""
    ctx = deploy.ctx
    rec = ctx.record
    await ctx.enter("verifying", deploy.verify_detail())
    ok, why, figures = await deploy.verify()
    assert rec.verify is not None
    rec.verify["cold_rate"] = {**figures, "reason": why}
    if not ok:
        log.warning("remap_verify_failed", remap=rec.id, reason=why)
        await deploy.roll_back(f"verification failed: {why}", error=why)
        return
    await commit(deploy, why, figures)


async def commit(deploy: Deploy, why: str, figures: dict[str, Any]) -> None:
    """``active-map.json`` first (durable), then the supervisor, then the record: ``committed`` is never written
    unless the file that a restart boots from names the candidate."""
    ctx = deploy.ctx
    host, run, rec = ctx.host, ctx.run, ctx.record
    assert run.candidate is not None and run.candidate_path is not None and rec.verify is not None
    file = active_map_path(host.state_dir)
    try:
        ctx.tools.write_active_map(file, run.candidate_path, run.candidate.content_hash)
    except OSError as exc:
        what, todo = commit_failure(exc, file)
        rec.verify["commit"] = {"ok": False, "file": str(file), "errno": exc.errno, "error": what}
        log.error("remap_commit_failed", remap=rec.id, file=str(file), error=what)
        await deploy.roll_back(what, error=f"{what}; {todo}", outcome="commit_failed", then=todo)
        return
    rec.verify["commit"] = {"ok": True, "file": str(file)}
    host.committed(run.candidate_path, run.candidate.content_hash)
    deploy.on_committed()
    ctx.finish("committed", why, detail={"cold_rate": figures, **deploy.committed_detail()})
