"""Step f of a remap: is the rebooted engine the same model, serving the new map as predicted?

Two checks, each a plain function the pipeline calls (and a test can replace):

- **Parity** (:func:`parity_outputs`, compared by :mod:`~pinsidecar.remap.parity` for both deploys): a few short
  prompts, greedy, token ids and logprobs as serialized, recorded from the engine serving the old map and checked
  on the one serving the candidate. Placement must never change a result; across a reboot both runs happen while
  the gate holds client traffic, so a difference is a real one, and the remap is rolled back before any client is
  served by the new engine.
- **Cold rate** (:class:`ColdRateProbe`): after the gate releases, the live cold-selection rate over
  ``verify_tokens`` routed tokens served under the new map, from the hook's stats, must be at most what the
  candidate predicted on the held-out window plus ``verify_tolerance``. One-sided on purpose: doing better than
  predicted is not a reason to roll back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pinsidecar.counts.parity import PromptOutput, generate, load_prompts
from pinsidecar.counts.workload import WorkloadRequest
from pinsidecar.live_stats import StatsReader, ratio

__all__ = ["ColdRateProbe", "ColdRateResult"]


def load_parity_prompts(path: Path) -> list[WorkloadRequest]:
    return load_prompts(path)


def parity_outputs(base_url: str, model_name: str, requests: Sequence[WorkloadRequest]) -> list[PromptOutput]:
    """Greedy outputs of the engine at ``base_url`` (blocking: run it in a thread)."""
    return generate(base_url, model_name, requests)


@dataclass
class ColdRateResult:
    tokens: int
    selections: int
    cold_selections: int
    map_hash: str = ""

    @property
    def cold_rate(self) -> float | None:
        return ratio(self.cold_selections, self.selections)


class ColdRateProbe:
    """The live cold rate of the engine serving ``map_hash``, counted from the first stats reading of that map.

    The first reading under the map is the baseline (the parity prompts, and anything before the gate released,
    are in it and not counted); every later reading adds its deltas. An engine restart in between is reported
    (``restarted``): the figure would mix two engine lives.
    """

    def __init__(self, stats_path: Path, map_hash: str) -> None:
        self.reader = StatsReader(stats_path)
        self.map_hash = map_hash
        self.baseline_seen = False
        self.restarted = False
        self.result = ColdRateResult(0, 0, 0, map_hash)

    def poll(self) -> ColdRateResult:
        reading = self.reader.read()
        if reading is None or reading.snapshot.map_hash != self.map_hash:
            return self.result
        if not self.baseline_seen:
            self.baseline_seen = True
            return self.result
        if reading.restarted:
            self.restarted = True
            return self.result
        self.result.tokens += max(0, reading.delta_tokens)
        self.result.selections += max(0, sum(reading.delta_selections))
        self.result.cold_selections += max(0, sum(reading.delta_cold_selections))
        return self.result


def cold_rate_verdict(result: ColdRateResult, predicted: float | None, *, tokens_needed: int, tolerance: float,
                      requires_traffic: bool) -> tuple[bool, str, dict[str, Any]]:
    """(ok, reason, figures) for the cold-rate check once the wait is over."""
    live = result.cold_rate
    figures = {"live_cold_rate": live, "predicted_cold_rate": predicted, "tolerance": tolerance,
               "tokens": result.tokens, "tokens_needed": tokens_needed, "selections": result.selections}
    if result.tokens < tokens_needed or live is None:
        reason = f"unverified: only {result.tokens} tokens under the new map (remap.verify_tokens = {tokens_needed})"
        figures["status"] = "unverified"
        return (not requires_traffic, reason + (" and remap.verify_requires_traffic is set" if requires_traffic
                                                else "; committed on parity and the held-out decision"), figures)
    if predicted is None:
        figures["status"] = "unverified"
        return True, "unverified: the decision had no predicted cold rate to compare with", figures
    if live > predicted + tolerance:
        figures["status"] = "failed"
        return False, (f"live cold rate {live:.2%} over {result.tokens} tokens is above the predicted {predicted:.2%} "
                       f"+ tolerance {tolerance:.2%}"), figures
    figures["status"] = "verified"
    return True, (f"live cold rate {live:.2%} over {result.tokens} tokens, predicted {predicted:.2%} "
                  f"(tolerance {tolerance:.2%})"), figures
