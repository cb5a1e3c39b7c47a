"""The in-place deploy (state ``applying``): the hook swaps the candidate's rows into the serving engine.

A drain-reboot stops serving for as long as an engine boot takes; two maps of one geometry differ only in which
experts sit in the hot tier, so the hook can swap those rows between two steps while the engine keeps its
process, compiled graphs and KV cache (:mod:`~pinsidecar.remap.apply` is the request and its answer). This is the
:class:`~pinsidecar.remap.deploy.Deploy` that does it:

- :func:`swap_plan` says whether it can (same geometry, ``remap.in_place``, a live stats file for the hook to
  answer in); the pipeline picks this deploy when there is a plan;
- :meth:`InPlaceDeploy.deploy` records the parity prompts on the serving engine, asks the hook to apply, and
  checks parity on the same engine, token ids only (:mod:`~pinsidecar.remap.parity` says why). A hook that
  refuses, fails or does not answer hands over to the drain-reboot; an engine that dies mid-apply ends the
  remap, because the supervisor restarts it with the committed map, never the candidate;
- :meth:`InPlaceDeploy.roll_back` applies the old map back in place, the cheap way, and reboots with it only
  when the hook cannot.

Every request and answer is in the record's ``apply`` and the metrics (``pinsidecar_remap_apply_*``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ExpertMap
from pinsidecar_hook.contract.requests import HookRequestError
from pinsidecar_hook.contract.swap import SwapPlan, SwapPlanError, plan_swap

from pinsidecar.remap.apply import ApplyAnswer, classify_answer, stats_boot_id, withdraw_apply_request
from pinsidecar.remap.deploy import ENDED, SERVING, Deploy, DeployContext, Deployed, fall_back
from pinsidecar.remap.host import RemapHost
from pinsidecar.remap.record import utc_stamp
from pinsidecar.remap.run import Aborted, RemapRun, first_line

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

_WHY_NOT_APPLIED = {"refused": "the hook refused the apply", "failed": "the apply failed (the hook swapped back)"}


def swap_plan(host: RemapHost, run: RemapRun) -> tuple[SwapPlan | None, str]:
    """The swap plan from the served map to the candidate, or why the candidate cannot be applied in place."""
    assert run.candidate is not None
    if not host.cfg.remap.in_place:
        return None, "remap.in_place is false"
    if host.stats_path is None:
        return None, "cannot apply in place: the engine writes no live stats file (the hook answers there); rebooting"
    _, served = host.served_map
    if (served or run.active).cache_slots or run.candidate.cache_slots:
        return None, ("cannot apply in place: a map with a cache tier deploys by drain-reboot (the hook's swap does "
                      "not move the slots' copies); rebooting")
    try:
        return plan_swap(served or run.active, run.candidate), ""
    except SwapPlanError as exc:
        return None, f"cannot apply in place: {first_line(exc)}; rebooting"


class InPlaceDeploy(Deploy):
    state = "applying"

    def __init__(self, ctx: DeployContext, plan: SwapPlan) -> None:
        super().__init__(ctx)
        self.plan = plan
        self.answer: ApplyAnswer | None = None
        self.parity_figures: dict[str, Any] = {}

    async def deploy(self) -> Deployed:
        ctx, host, run, rec = self.ctx, self.ctx.host, self.ctx.run, self.ctx.record
        assert run.candidate is not None and run.candidate_path is not None
        rec.apply = {"in_place": True,
                     "plan": {k: v for k, v in self.plan.as_dict().items() if k != "rows_per_layer"},
                     "requests": [], "outcome": None}
        ctx.save()
        parity = self.parity(logprobs=False)  # batched with live traffic both times: token ids
        self.parity_figures = parity.figures
        url = host.engine_url
        why = await parity.record(url, run.active)
        if why is not None:
            raise Aborted(f"{why}; nothing was applied")

        answer = await self._apply(run.candidate_path, run.candidate, "candidate")
        if answer.result == "engine_died":
            self._engine_died(answer)
            return ENDED
        if not answer.applied:
            timeout = f"the hook did not answer within remap.apply_timeout_s = {host.cfg.remap.apply_timeout_s:g} s"
            why = _WHY_NOT_APPLIED.get(answer.result, timeout if answer.result == "timeout" else answer.result)
            reason = f"{why}: {answer.reason}; deploying by a drain-reboot instead"
            ctx.apply_outcome("fell_back_reboot", reason)
            log.warning("remap_apply_fell_back", remap=rec.id, result=answer.result, reason=answer.reason)
            return fall_back(reason)
        host.applied_in_place(run.candidate_path, run.candidate)
        self.answer = answer

        why = await parity.check(url)  # the same engine, token for token
        rec.verify = {"ready": True, "in_place": True, "parity": parity.figures, "apply": answer.as_dict()}
        if why is not None:
            await self.roll_back(f"parity after the apply: {why}")
            return ENDED
        return SERVING

    def verify_detail(self) -> dict[str, Any]:
        assert self.answer is not None
        return {"apply": self.answer.as_dict(), "parity": self.parity_figures}

    def committed_detail(self) -> dict[str, Any]:
        return {"in_place": True}

    def on_committed(self) -> None:
        self.ctx.apply_outcome("applied")

    async def _apply(self, path: Path, emap: ExpertMap, purpose: str) -> ApplyAnswer:
        """One apply request, answered or not; never raises. A request that got no answer is withdrawn."""
        ctx, host = self.ctx, self.ctx.host
        stats = host.stats_path
        assert stats is not None
        alive = host.engine_alive_probe()
        boot_before = stats_boot_id(stats)
        at = utc_stamp()
        t0 = time.monotonic()
        log.info("remap_apply_request", remap=ctx.record.id, purpose=purpose, map=str(path), hash=emap.content_hash)
        try:
            result, snap = await asyncio.to_thread(ctx.tools.apply, stats, host.engine_map_path(path),
                                                   emap.content_hash, timeout_s=host.cfg.remap.apply_timeout_s,
                                                   alive=alive, ordering=host.cfg.remap.apply_ordering,
                                                   hold_ms=host.cfg.remap.apply_hold_ms or None)
        except Exception as exc:  # HookRequestError (no answer in time, or the engine exited), or an unreadable one
            withdraw_apply_request(stats)
            result_name = "engine_died" if not alive() else "timeout" if isinstance(exc, HookRequestError) \
                else "failed"
            answer = ApplyAnswer(result_name, first_line(exc), purpose=purpose, map_hash=emap.content_hash,
                                 wait_s=round(time.monotonic() - t0, 3))
        else:
            answer = classify_answer(result, snap, map_hash=emap.content_hash, boot_before=boot_before,
                                     purpose=purpose, wait_s=time.monotonic() - t0)
        answer.at = at
        log.info("remap_apply_answer", remap=ctx.record.id, **answer.as_dict())
        exporter = host.exporter
        if exporter is not None:
            exporter.record_apply_request(answer.result, seconds=answer.seconds if answer.applied else None,
                                          rows=answer.rows, bytes_moved=answer.bytes_moved)
        assert ctx.record.apply is not None
        ctx.record.apply.setdefault("requests", []).append(answer.as_dict())
        ctx.save()
        return answer

    def _engine_died(self, answer: ApplyAnswer) -> None:
        """The engine died (or restarted) mid-apply: the supervisor restarts it with the committed map, which the
        apply never changed; the remap ends here and never reboots with the candidate."""
        ctx = self.ctx
        reason = f"the engine died mid-apply; it restarts with the committed map {ctx.run.committed_label}"
        ctx.apply_outcome("engine_died", f"{reason} ({answer.reason})")
        log.error("remap_engine_died_mid_apply", remap=ctx.record.id, detail=answer.reason)
        ctx.finish("rolled_back", reason, error=f"{reason} ({answer.reason})", detail={"apply": answer.as_dict()})

    async def roll_back(self, why: str, *, error: str | None = None, outcome: str = "rolled_back",
                        then: str = "") -> None:
        """In place again (the cheap way), else by a reboot; nothing to do when a restart already brought the
        committed map back."""
        ctx, host, run, rec = self.ctx, self.ctx.host, self.ctx.run, self.ctx.record
        _, served = host.served_map
        detail: dict[str, Any] = {}
        if served is None or served.content_hash == run.active.content_hash:
            tail = f"the engine serves the committed map {run.committed_label} again (it restarted with it)"
        elif run.active_path is None:
            tail = "the old map has no file to go back to; see pinsidecar status"
        else:
            back = await self._apply(run.active_path, run.active, "rollback")
            detail["rollback_apply"] = back.as_dict()
            if back.applied:
                host.applied_in_place(run.active_path, run.active)
                tail = "rolled back in place: the old map serves"
            elif back.result == "engine_died":
                tail = (f"the engine died during the rollback apply; it restarts with the committed map "
                        f"{run.committed_label}")
            else:
                log.warning("remap_rollback_apply_failed", remap=rec.id, result=back.result, reason=back.reason)
                rb = await host.reboot_with(run.active_path, reason="rollback")
                detail["rollback_reboot"] = {k: rb.get(k) for k in ("ok", "seconds", "boot_s", "error")}
                tail = (f"the rollback apply {back.result} ({back.reason}), so the old map was rebooted: "
                        + ("it serves" if rb.get("ok") else f"the reboot failed too ({rb.get('error')}); see "
                           "pinsidecar status"))
        ctx.apply_outcome("rolled_back")
        if rec.verify is not None:
            rec.verify["rollback"] = detail
        ctx.finish(outcome, f"{why}; {tail}" + (f"; {then}" if then else ""), error=error or why, detail=detail)
