"""The drain-reboot deploy (state ``rebooting``): the daemon's one drain-reboot, onto the candidate.

The fallback deploy, and the only one for a candidate of another geometry or with ``remap.in_place = false``.
It goes through the host's :meth:`~pinsidecar.remap.host.RemapHost.reboot_with`, which holds the gate, drains
in-flight requests and reboots; this :class:`~pinsidecar.remap.deploy.Deploy` adds the parity check *inside* that
hold: the prompts are recorded on the drained old engine before it stops and compared on the new one before the
gate releases, token ids and logprobs bitwise (the engine is idle, every prompt is sent alone, so nothing but the
placement can differ). A difference, or a boot that fails, boots the old map again inside the hold: no client is
ever served by an engine that failed parity. Its way back after a failed verification (or commit) is a reboot
with the old map.
"""

from __future__ import annotations

from typing import Any

from pinsidecar.remap.deploy import ENDED, SERVING, Deploy, DeployContext, Deployed

__all__: list[str] = []  # nothing here is another package's business

# What of the drain-reboot's result the record keeps (its verify.reboot).
REBOOT_KEYS = ("ok", "seconds", "drain_s", "boot_s", "hold_s", "hash_hit", "cache_miss", "in_flight_cut",
               "held_at_release", "rolled_back", "error", "skipped")
ROLLBACK_KEYS = ("ok", "seconds", "boot_s", "error")


class RebootDeploy(Deploy):
    state = "rebooting"

    def __init__(self, ctx: DeployContext) -> None:
        super().__init__(ctx)
        self.reboot: dict[str, Any] = {}
        self.parity_figures: dict[str, Any] = {}

    async def deploy(self) -> Deployed:
        ctx, host, run = self.ctx, self.ctx.host, self.ctx.run
        assert run.candidate_path is not None
        parity = self.parity(logprobs=True)  # inside the hold: bitwise
        self.parity_figures = parity.figures

        async def before_stop(result: dict[str, Any]) -> str | None:
            return await parity.record(host.engine_url, run.active)

        async def after_boot(result: dict[str, Any]) -> str | None:
            why = await parity.check(host.engine_url)
            return None if why is None else f"parity: {why}"

        result = await host.reboot_with(run.candidate_path, reason="remap", before_stop=before_stop,
                                        after_boot=after_boot)
        self.reboot = reboot = {k: result.get(k) for k in REBOOT_KEYS}
        ctx.record.verify = {"ready": bool(result.get("ok")), "parity": parity.figures, "reboot": reboot}
        if result.get("ok"):
            return SERVING
        error = result.get("error") or "the reboot failed"
        if result.get("skipped"):
            ctx.finish("aborted", f"{error} (nothing was rebooted; the old map serves)", error=error,
                       detail={"reboot": reboot})
        else:
            rb = "rolled back: the old map serves" if result.get("rolled_back") else \
                f"the rollback failed too ({result.get('rollback_error')})"
            ctx.finish("rolled_back", f"{error}; {rb}", error=error, detail={"reboot": reboot})
        return ENDED

    def verify_detail(self) -> dict[str, Any]:
        return {"reboot": self.reboot, "parity": self.parity_figures}

    async def roll_back(self, why: str, *, error: str | None = None, outcome: str = "rolled_back",
                        then: str = "") -> None:
        ctx, host, run = self.ctx, self.ctx.host, self.ctx.run
        back = await host.reboot_with(run.active_path, reason="rollback") if run.active_path else {"ok": False}
        rolled = {k: back.get(k) for k in ROLLBACK_KEYS}
        if ctx.record.verify is not None:
            ctx.record.verify["rollback"] = rolled
        tail = "rolled back: the old map serves" if back.get("ok") else \
            f"the rollback reboot failed ({back.get('error')}); see pinsidecar status"
        ctx.finish(outcome, f"{why}; {tail}" + (f"; {then}" if then else ""), error=error or why,
                   detail={"rollback": rolled})
