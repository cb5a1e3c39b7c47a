"""The deploy decision: does a candidate map beat the active one, on traffic it was not built from?

This is the remap's evaluation step (the pipeline's ``evaluating``, a dry run's answer, the offline replay's
verdicts): the rule "never deploy a candidate that predicts worse on the traffic actually served" lives here and
nowhere else. The drift watch only says traffic moved; whether to act on it is decided here.

A trip only says traffic moved. Before a remap reboots the engine, the candidate (rebuilt from counted traffic,
or taken from the map library) is judged against the active map on a **held-out window**: the most recent window
that was not used to build it. Both maps are scored on the same held-out histogram, so the comparison is fair and
out of sample (a map scored on the counts it was built from always looks better than it will do).

:func:`decide` deploys only when the candidate's cold rate on the held-out window is lower than the active map's
by at least ``margin``; so a deployed candidate never predicts worse than the active map. It refuses, with the
reason and both rates, a candidate of another geometry (a reboot onto it would not be a hash hit: it would
recompile and re-autotune every kernel), the active map itself, and a candidate that was built from the held-out
window (an in-sample judgement). The one exception is a map an operator names (``allow_geometry_change``): another
hot-row count is a budget change someone asked for, so it is judged on the same figures and says it needs a full
reboot (never an in-place apply, never a compile-cache hit).

:func:`pick_from_library` is what the pipeline runs before paying for a count boot: the library holds one map per
traffic class (``label``), and if one of them fits the live window better than the active map by the margin, it
is deployed as it is. A rebuilt candidate (:func:`~pinsidecar.remap.candidates.build_candidate`) comes from one
traffic class's counts only. A blend of classes is never built by default: a map built from mixed traffic was
measured to cost the majority class 10 % against its own map, so adaptation means choosing or rebuilding the map of
what is served now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap

from pinsidecar.drift.signals import map_cold_rate_on
from pinsidecar.drift.windows import Window

__all__: list[str] = []  # nothing here is another package's business


@dataclass(frozen=True)
class Decision:
    """Deploy or refuse, why, and the figures it rests on (both rates are on the same held-out window)."""

    deploy: bool
    reason: str
    candidate_cold_rate: float | None
    active_cold_rate: float | None
    margin: float
    candidate_hash: str = ""
    candidate_label: str = ""
    active_hash: str = ""
    active_label: str = ""
    held_out: dict[str, Any] = field(default_factory=dict)
    source: str = "rebuild"  # "rebuild" (count boot or window) or "library"
    candidate: ExpertMap | None = field(default=None, repr=False, compare=False)

    @property
    def gain(self) -> float | None:
        if self.candidate_cold_rate is None or self.active_cold_rate is None:
            return None
        return self.active_cold_rate - self.candidate_cold_rate

    def as_dict(self) -> dict[str, Any]:
        return {"deploy": self.deploy, "reason": self.reason, "candidate_cold_rate": self.candidate_cold_rate,
                "active_cold_rate": self.active_cold_rate, "gain": self.gain, "margin": self.margin,
                "candidate_hash": self.candidate_hash, "candidate_label": self.candidate_label,
                "active_hash": self.active_hash, "active_label": self.active_label, "held_out": self.held_out,
                "source": self.source}


def _held_out_counts(held_out: Window | CountsArtifact) -> tuple[CountsArtifact, dict[str, Any]]:
    if isinstance(held_out, Window):
        counts = held_out.to_counts()
        return counts, {"window": held_out.index, "tokens": held_out.tokens, "source": held_out.source}
    return held_out, {"tokens": held_out.tokens, "source": held_out.workload, "digest": held_out.digest()}


def _name(emap: ExpertMap) -> str:
    return f"{emap.label or 'unlabelled'} ({emap.short_hash})"


def _check_held_out(emap: ExpertMap, counts: CountsArtifact) -> None:
    if (tuple(counts.layer_ids), counts.num_experts) != (tuple(emap.layer_ids), emap.num_experts):
        raise ArtifactError(None, f"held-out traffic ({counts.num_layers} layers, {counts.num_experts} experts) and "
                            f"map {_name(emap)} ({emap.num_layers} layers, {emap.num_experts} experts) are for "
                            "different models", "judge maps on traffic of the model they were built for")


def decide(candidate: ExpertMap, active: ExpertMap, held_out: Window | CountsArtifact, margin: float, *,
           source: str = "rebuild", allow_geometry_change: bool = False) -> Decision:
    """Deploy ``candidate`` in place of ``active``, or refuse; judged on ``held_out`` (not used to build it).
    ``allow_geometry_change``: judge a candidate of another geometry too (a map an operator named), as long as it
    is for the same model (layers and experts)."""
    counts, held = _held_out_counts(held_out)
    _check_held_out(active, counts)
    note = ""

    def verdict(deploy: bool, reason: str, cand_rate: float | None = None,
                active_rate: float | None = None) -> Decision:
        return Decision(deploy, reason, cand_rate, active_rate, margin, candidate_hash=candidate.content_hash,
                        candidate_label=candidate.label, active_hash=active.content_hash, active_label=active.label,
                        held_out=held, source=source, candidate=candidate)

    if not candidate.same_geometry(active):
        ga, gc = active.geometry(), candidate.geometry()
        diff = ", ".join(f"{k} {gc.get(k, 0)} vs {ga.get(k, 0)}" for k in {**ga, **gc}
                         if ga.get(k) != gc.get(k)) or "layer ids differ"
        if not allow_geometry_change:
            return verdict(False, f"refused: candidate {_name(candidate)} has another geometry than the active map "
                           f"({diff}): not a hash-hit reboot (every kernel would recompile); rebuild it with the "
                           f"active map's {active.hot_rows} hot rows"
                           + (f" and {active.cache_slots} cache slots" if active.cache_slots else ""))
        _check_held_out(candidate, counts)
        note = f" (another geometry: {diff}; deployed by a full reboot, not a compile-cache hit)"
    cand_rate = map_cold_rate_on(candidate, counts.counts)
    active_rate = map_cold_rate_on(active, counts.counts)
    if cand_rate is None or active_rate is None:
        return verdict(False, "refused: the held-out window has no selections")
    if candidate.content_hash == active.content_hash:
        return verdict(False, "refused: the candidate is the active map (same placement)", cand_rate, active_rate)
    if counts.digest() in candidate.source_counts:
        return verdict(False, "refused: the candidate was built from the held-out window (an in-sample judgement "
                       "flatters it); judge it on a later window", cand_rate, active_rate)
    gain = active_rate - cand_rate
    if gain <= 0 or gain < margin:
        how = "worse than" if gain < 0 else "no better than" if gain == 0 else "better than"
        return verdict(False, f"refused: candidate {_name(candidate)} predicts {cand_rate:.2%} cold on the held-out "
                       f"window, {how} the active map's {active_rate:.2%} ({100 * gain:+.2f} pts), under the margin "
                       f"of {100 * margin:.2f} pts", cand_rate, active_rate)
    return verdict(True, f"deploy: candidate {_name(candidate)} predicts {cand_rate:.2%} cold on the held-out window "
                   f"vs {active_rate:.2%} for the active map ({100 * gain:+.2f} pts >= margin {100 * margin:.2f} pts)"
                   + note, cand_rate, active_rate)


def pick_from_library(library: Sequence[ExpertMap], active: ExpertMap, window: Window | CountsArtifact,
                      margin: float) -> Decision:
    """The library map (one per traffic class) that best fits ``window``, as a :class:`Decision`.

    Maps of another geometry are skipped (they would not be a hash-hit reboot), as are the active map and maps
    built from ``window`` itself. ``deploy`` is True only when the best one beats the active map by ``margin``;
    otherwise the pipeline goes on to a count boot.
    """
    counts, held = _held_out_counts(window)
    _check_held_out(active, counts)
    digest = counts.digest()
    usable = [m for m in library if m.same_geometry(active) and m.content_hash != active.content_hash
              and digest not in m.source_counts]
    if not usable:
        skipped = len(library)
        return Decision(False, f"no library map to try ({skipped} in the library; none other than the active map "
                        f"with its geometry)", None, map_cold_rate_on(active, counts.counts), margin,
                        active_hash=active.content_hash, active_label=active.label, held_out=held, source="library")
    best = min(usable, key=lambda m: (map_cold_rate_on(m, counts.counts) or 1.0, m.label, m.content_hash))
    return decide(best, active, window, margin, source="library")
