"""Remap in place: the swap plan between two maps, and the answer the hook gives to an ``apply`` request.

Both sides need the plan: the daemon to decide whether a candidate can be applied in place at all (and to report
rows and bytes before it asks), the hook to carry it out. So it lives in the contract, computed from the two map
files alone.

**A swap, not a re-home.** Between the active map and a candidate of the same geometry, each layer has as many
experts entering the hot tier as leaving it. The plan pairs them: the expert entering takes the hot row of the
one leaving, and the one leaving takes the entering one's cold row. The hot tensor never grows, host memory never
holds a second copy of the experts, and every other row stays where it is. The engine therefore ends with the
candidate's *placement* (which experts are hot, which cold) but not necessarily its row order inside a tier;
outputs do not depend on row order (the split's finalize reduces each token's k rows in slot order), and the
stats file reports the candidate's hash because the hash names the placement the engine serves.

**The answer.** The hook serves ``apply`` through the same request file as ``flush`` and ``reset``
(:mod:`~pinsidecar_hook.contract.requests`): it writes the stats file with the request's token, and
``meta["apply"]`` holds an :class:`ApplyResult`. ``outcome`` is one of :data:`APPLY_OUTCOMES`:

- ``applied``: every row swapped, every row map flipped; the stats' ``map_hash`` is the candidate's;
- ``refused``: nothing was touched (a geometry mismatch, a map that fails validation, a hash that is not the one
  asked for, a second worker the hook cannot coordinate); ``reason`` says which;
- ``failed``: the swap started and raised; every swapped row was swapped back, so the old map serves whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pinsidecar_hook.contract.map import ExpertMap

__all__ = ["APPLY_OUTCOMES", "ApplyResult", "LayerSwap", "SwapPlan", "SwapPlanError", "plan_swap"]

APPLY_OUTCOMES = ("applied", "refused", "failed")


class SwapPlanError(ValueError):
    """The candidate cannot be applied in place to the active map; the message says why (a reboot can)."""


@dataclass(frozen=True)
class LayerSwap:
    """One layer's swaps: ``entering[i]`` takes the hot row of ``leaving[i]``, which takes its cold row."""

    layer_id: int
    entering: tuple[int, ...]
    leaving: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.entering)


@dataclass(frozen=True)
class SwapPlan:
    """Per layer, the experts entering and leaving the hot tier, paired into swaps."""

    from_hash: str
    to_hash: str
    layers: tuple[LayerSwap, ...]
    expert_bytes: int  # bytes of one expert on one rank, as the maps record it (0: unknown)

    @property
    def rows(self) -> int:
        """Swapped pairs over all layers (each moves one expert in and one out)."""
        return sum(layer.rows for layer in self.layers)

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross between the tiers: two experts per swap, one each way (0 when expert size unknown)."""
        return 2 * self.rows * self.expert_bytes

    @property
    def empty(self) -> bool:
        return self.rows == 0

    def as_dict(self) -> dict[str, Any]:
        return {"from_hash": self.from_hash, "to_hash": self.to_hash, "rows": self.rows,
                "bytes_moved": self.bytes_moved, "layers_touched": sum(1 for x in self.layers if x.rows),
                "rows_per_layer": {str(x.layer_id): x.rows for x in self.layers}}


def plan_swap(active: ExpertMap, candidate: ExpertMap) -> SwapPlan:
    """The swap plan from ``active`` to ``candidate``; :class:`SwapPlanError` when the geometry differs (another
    hot-row count, layer set, expert count, top-k or expert size): such a candidate needs a reboot."""
    if not candidate.same_geometry(active):
        diffs = [f"{k} {active.geometry()[k]} -> {candidate.geometry()[k]}" for k in active.geometry()
                 if active.geometry()[k] != candidate.geometry()[k]]
        if candidate.layer_ids != active.layer_ids:
            diffs.append(f"layer ids {list(active.layer_ids)} -> {list(candidate.layer_ids)}")
        raise SwapPlanError(f"candidate {candidate.label or candidate.short_hash} has another geometry than the active "
                            f"map {active.label or active.short_hash} ({'; '.join(diffs)}): the hot tensor would "
                            "change shape, so it cannot be applied in place; a reboot applies it")
    layers = []
    for old, new in zip(active.layers, candidate.layers, strict=True):
        old_hot, new_hot = set(old.hot), set(new.hot)
        # In the candidate's order (hottest first when built from counts), so a partial listing reads naturally.
        entering = tuple(e for e in new.hot if e not in old_hot)
        leaving = tuple(e for e in old.hot if e not in new_hot)
        assert len(entering) == len(leaving)  # same hot-row count, checked by same_geometry
        layers.append(LayerSwap(old.layer_id, entering, leaving))
    return SwapPlan(active.content_hash, candidate.content_hash, tuple(layers), active.expert_bytes)


@dataclass
class ApplyResult:
    """The hook's answer to one ``apply`` request (``meta["apply"]`` of the stats file it wrote)."""

    token: str
    outcome: str  # one of APPLY_OUTCOMES
    reason: str = ""
    map_hash: str = ""  # the map serving after the attempt (the candidate's only when applied)
    from_hash: str = ""
    to_hash: str = ""
    rows: int = 0  # swapped pairs (0 unless applied)
    bytes_moved: int = 0  # bytes copied between the tiers, both directions
    seconds: float = 0.0  # the step lock held, all batches together: how long serving stood still in all
    layers: int = 0
    # Batched applies (files written before them lack these: read as 0). A step waits at most one batch.
    batches: int = 0  # times the step lock was taken; steps ran in between
    hold_max_s: float = 0.0  # the longest single hold: the longest any step waited for the apply
    hold_budget_s: float = 0.0  # what one hold was bounded by (0: not bounded, one batch)
    wall_s: float = 0.0  # the whole apply, steps in between included
    link_GBps: float = 0.0  # bytes moved / time spent copying them (prefetch + copies under the lock)
    # Where a hold goes (files written before these: 0): the longest wait, at a batch's start, for the previous
    # step's kernels still running (vLLM launches asynchronously), part of that batch's hold.
    drain_max_s: float = 0.0
    # Stream-ordered batches (files written before these: 0): how many were queued on the engine's stream instead
    # of ordered by host syncs, and the longest batch on the device, what a step queued behind one waited there.
    stream_batches: int = 0
    device_max_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ApplyResult:
        """Read ``meta["apply"]``; a malformed one is a ``ValueError`` naming what is wrong."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"meta.apply must be an object, got {type(doc).__name__}")
        outcome = str(doc.get("outcome", ""))
        if outcome not in APPLY_OUTCOMES:
            raise ValueError(f"meta.apply.outcome is {outcome!r}, expected one of {APPLY_OUTCOMES}")
        try:
            return cls(token=str(doc.get("token", "")), outcome=outcome, reason=str(doc.get("reason", "")),
                       map_hash=str(doc.get("map_hash", "")), from_hash=str(doc.get("from_hash", "")),
                       to_hash=str(doc.get("to_hash", "")), rows=int(doc.get("rows", 0)),
                       bytes_moved=int(doc.get("bytes_moved", 0)), seconds=float(doc.get("seconds", 0.0)),
                       layers=int(doc.get("layers", 0)), batches=int(doc.get("batches", 0)),
                       hold_max_s=float(doc.get("hold_max_s", 0.0)),
                       hold_budget_s=float(doc.get("hold_budget_s", 0.0)), wall_s=float(doc.get("wall_s", 0.0)),
                       link_GBps=float(doc.get("link_GBps", 0.0)),
                       drain_max_s=float(doc.get("drain_max_s", 0.0)),
                       stream_batches=int(doc.get("stream_batches", 0)),
                       device_max_s=float(doc.get("device_max_s", 0.0)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"meta.apply has a malformed field ({exc})") from None
