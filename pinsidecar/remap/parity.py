"""Parity across a deploy, for both deploys: one reference recorded before, one comparison after.

Placement must never change a result, so every deploy records the parity prompts' greedy outputs on the engine
serving the old map (saved beside the record as ``<id>.parity.json``, a :class:`~pinsidecar.counts.parity.ParityRef`)
and compares the engine serving the candidate with them before the candidate is trusted. The two deploys differ
in one thing only, which is why one class serves both (:class:`DeployParity`, ``logprobs`` says which):

- **across a reboot** (the gate holds, the engine is idle, every prompt is sent alone) nothing can differ but the
  placement, so token ids *and* logprobs must match bitwise, as ``pinsidecar parity check`` demands;
- **across an in-place apply** the gate does not hold, so both runs are batched with live traffic, and a batch of
  another size may change a logprob's last bits (the kernels' reduction order follows the batch), which says
  nothing about placement; a misplaced expert changes tokens. So token ids must match, and the largest logprob
  difference is reported, not judged.

:func:`compare_outputs` is that comparison; differences are described the way the parity gate describes them
(:class:`~pinsidecar.counts.parity.PromptDiff`), and a different number of answers is a difference, not an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import ExpertMap

from pinsidecar.counts.parity import ParityRef, PromptDiff, PromptOutput, prompts_digest
from pinsidecar.counts.workload import WorkloadRequest
from pinsidecar.remap.run import first_line
from pinsidecar.remap.verify import load_parity_prompts

__all__: list[str] = []  # nothing here is another package's business

Generate = Callable[[str, str, Sequence[WorkloadRequest]], list[PromptOutput]]


@dataclass
class ParityVerdict:
    ok: bool
    reason: str  # the first difference, or what matched
    figures: dict[str, Any] = field(default_factory=dict)


def _first_diff(want: PromptOutput, got: PromptOutput, logprobs: bool) -> PromptDiff | None:
    n = min(len(want.token_ids), len(got.token_ids))
    for i in range(n):
        if want.token_ids[i] != got.token_ids[i] or (logprobs and want.logprobs[i] != got.logprobs[i]):
            return PromptDiff(got.source, i, want.token_ids[i], got.token_ids[i], want.logprobs[i], got.logprobs[i])
    if len(want.token_ids) != len(got.token_ids):  # one is a prefix of the other: the shorter one ended
        def at(v: Sequence[Any]) -> Any:
            return v[n] if n < len(v) else None
        return PromptDiff(got.source, n, at(want.token_ids), at(got.token_ids), at(want.logprobs), at(got.logprobs))
    return None


def compare_outputs(want: Sequence[PromptOutput], got: Sequence[PromptOutput], *, logprobs: bool) -> ParityVerdict:
    """``got`` against the reference ``want``, prompt by prompt: token ids always, logprobs bitwise when
    ``logprobs`` (see the module docstring)."""
    figures: dict[str, Any] = {"prompts": len(got), "tokens": sum(len(o.token_ids) for o in got),
                               "differing_prompts": 0,
                               "compared": "token ids and logprobs" if logprobs else "token ids",
                               "max_logprob_diff": 0.0}
    first = ""
    for w, g in zip(want, got, strict=False):  # a count mismatch is counted below
        n = min(len(w.token_ids), len(g.token_ids))
        diffs = [abs(a - b) for a, b in zip(w.logprobs[:n], g.logprobs[:n], strict=False)
                 if a is not None and b is not None]
        figures["max_logprob_diff"] = max([figures["max_logprob_diff"], *diffs])
        diff = _first_diff(w, g, logprobs)
        if diff is not None:
            figures["differing_prompts"] += 1
            first = first or diff.describe()
    if len(want) != len(got):
        figures["differing_prompts"] += abs(len(want) - len(got))
        first = first or f"{len(want)} prompts recorded, {len(got)} answered"
    if first:
        figures["first_diff"] = first
        return ParityVerdict(False, first, figures)
    return ParityVerdict(True, f"{figures['tokens']} tokens of {len(got)} prompts match", figures)


class DeployParity:
    """The parity prompts of one deploy: :meth:`record` on the engine serving the old map, :meth:`check` on the one
    serving the candidate. ``figures`` is the record's ``verify.parity``. Each returns None when all is well, else
    why not (the deploy decides what that costs)."""

    def __init__(self, generate: Generate, prompts_file: Path, model_name: str, ref_file: Path, *,
                 logprobs: bool) -> None:
        self.generate, self.prompts_file, self.model_name, self.ref_file = generate, prompts_file, model_name, ref_file
        self.logprobs = logprobs
        self.prompts = load_parity_prompts(prompts_file)  # ValueError (ParityError, WorkloadError) on a bad file
        self.figures: dict[str, Any] = {"prompts": len(self.prompts), "prompts_file": str(prompts_file)}
        self.reference: list[PromptOutput] | None = None

    async def record(self, url: str | None, active: ExpertMap) -> str | None:
        if url is None:
            return "no engine serving to record the parity fixture from"
        try:
            self.reference = await asyncio.to_thread(self.generate, url, self.model_name, self.prompts)
        except Exception as exc:
            return f"recording the parity fixture on the serving engine failed: {first_line(exc)}"
        ref = ParityRef(model=self.model_name, mode="pin", prompts_file=str(self.prompts_file),
                        prompts_digest=prompts_digest(self.prompts), outputs=self.reference,
                        map_hash=active.content_hash, map_label=active.label)
        await asyncio.to_thread(ref.save, self.ref_file)
        return None

    async def check(self, url: str | None) -> str | None:
        assert self.reference is not None, "check() before record()"
        got: list[PromptOutput] | None = None
        if url is None:
            self.figures["error"] = "no engine URL"
        else:
            try:
                got = await asyncio.to_thread(self.generate, url, self.model_name, self.prompts)
            except Exception as exc:
                self.figures["error"] = first_line(exc)
        if got is None:
            self.figures["ok"] = False
            return f"the engine did not answer the parity prompts ({self.figures['error']})"
        verdict = compare_outputs(self.reference, got, logprobs=self.logprobs)
        self.figures.update(ok=verdict.ok, **verdict.figures)
        return None if verdict.ok else verdict.reason
