"""Judge a placement: the figures that decide whether to deploy it, and what deploying it would move.

- :func:`evaluate` gives the cold-selection rate of a map or mask on some counts, total and per layer, with the
  cold experts each layer touched (the cost that matters is distinct cold experts per step, not selections);
- :func:`leave_one_out` is the honest version of a map's predicted rate when several count boots are available;
- :func:`diff_maps` says what a remap from one map to another moves, and whether the reboot keeps the kernel
  shapes (a compile-cache hit); :func:`summary` is what ``map show`` prints.

Placements and counts of different models are refused (:func:`check_compatible`), naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap

from pinsidecar.placement._ranking import cold_rates, usage_hot_mask
from pinsidecar.placement.build import Placement, check_hot_rows
from pinsidecar.placement.cache_model import INDEPENDENT, INDEPENDENT_CAVEAT, miss_rates
from pinsidecar.placement.counts import check_same_geometry, describe_geometry

__all__: list[str] = []  # nothing here is another package's business


def check_compatible(placement: Placement, counts: CountsArtifact, placement_name: str = "map",
                     counts_name: str = "counts") -> None:
    """Refuse to compare a placement with counts of another geometry, naming both sides."""
    if (tuple(counts.layer_ids), counts.num_experts, counts.top_k) != (
            tuple(placement.layer_ids), placement.num_experts, placement.top_k):
        raise ArtifactError(
            None,
            f"{placement_name} ({describe_geometry(placement.layer_ids, placement.num_experts, placement.top_k)}) "
            f"and {counts_name} ({describe_geometry(counts.layer_ids, counts.num_experts, counts.top_k)}) "
            "are for different models",
            "evaluate a map against counts from the same model",
        )


def evaluate(placement: Placement, counts: CountsArtifact, placement_name: str = "map",
             counts_name: str = "counts") -> dict[str, Any]:
    """Cold-selection rate of ``placement`` on ``counts``: total, per layer, and the cold experts touched."""
    check_compatible(placement, counts, placement_name, counts_name)
    hot = placement.hot_mask()
    rate, per_layer = cold_rates(hot, counts.counts)
    slots = int(getattr(placement, "cache_slots", 0) or 0)
    static_rate, static_per_layer = rate, per_layer
    if slots:  # a map with cache slots: the share that misses the hot rows and the slots (cache_model)
        rate, per_layer = miss_rates(hot, counts.counts, slots, placement.cache_policy)  # type: ignore[attr-defined]
    cold_counts = np.where(hot, 0, counts.counts)
    per_layer_cold = cold_counts.sum(axis=1)
    per_layer_sel = counts.counts.sum(axis=1)
    touched = (cold_counts > 0).sum(axis=1)
    result: dict[str, Any] = {
        "policy": placement.policy,
        "cold_rate": rate,
        "selections": int(per_layer_sel.sum()),
        "cold_selections": int(per_layer_cold.sum()),
        "tokens": counts.tokens,
        "counts_digest": counts.digest(),
        "per_layer": [
            {"layer_id": lid, "cold_rate": float(r), "selections": int(s), "cold_selections": int(c),
             "cold_experts": int((~h).sum()), "cold_experts_touched": int(t)}
            for lid, r, s, c, h, t in zip(placement.layer_ids, per_layer, per_layer_sel, per_layer_cold, hot,
                                          touched, strict=True)
        ],
    }
    if isinstance(placement, ExpertMap):
        result.update(map_hash=placement.content_hash, label=placement.label, hot_rows=placement.hot_rows,
                      predicted_cold_rate=placement.predicted_cold_rate)
    if slots:
        # cold_rate is then the expected miss rate; cold_selections stay the selections of cold experts (what
        # reaches the slots), static_cold_rate their share (the hot set alone)
        result.update(cache_slots=slots, cache_policy=placement.cache_policy,  # type: ignore[attr-defined]
                      cache_model=INDEPENDENT, cache_model_note=INDEPENDENT_CAVEAT, static_cold_rate=static_rate)
        for row, st in zip(result["per_layer"], static_per_layer, strict=True):
            row["static_cold_rate"] = float(st)
    return result


def leave_one_out(counts: Sequence[CountsArtifact], hot_rows: int,
                  names: Sequence[str] | None = None, *, cache_slots: int = 0,
                  cache_policy: str = "lru") -> list[dict[str, Any]]:
    """For each counts i: build from all the others, evaluate on i (empty with fewer than two counts).

    This is the figure to trust when deciding whether a map generalises to traffic it was not built from; the
    in-sample ``predicted_cold_rate`` is always optimistic. With ``cache_slots``, the rates are miss rates under
    the independent-reference cache model (:mod:`~pinsidecar.placement.cache_model`).
    """
    names = list(names) if names is not None else [f"counts #{i + 1}" for i in range(len(counts))]
    check_same_geometry(counts, names)
    if len(counts) < 2:
        return []
    check_hot_rows(hot_rows, counts[0].num_experts)
    stack = np.stack([c.counts for c in counts])
    grand = stack.sum(axis=0)
    out = []
    for i, held_out in enumerate(counts):
        train = grand - stack[i]
        hot = usage_hot_mask(train, hot_rows)  # what build_usage_map would keep hot, without the artifact
        held_rate, _ = miss_rates(hot, held_out.counts, cache_slots, cache_policy)
        train_rate, _ = miss_rates(hot, train, cache_slots, cache_policy)
        out.append({"held_out": names[i], "workload": held_out.workload, "cold_rate": held_rate,
                    "train_cold_rate": train_rate, "held_out_selections": held_out.selections})
    return out


def diff_maps(a: ExpertMap, b: ExpertMap) -> dict[str, Any]:
    """What a remap from ``a`` to ``b`` changes, and whether rebooting onto ``b`` keeps every kernel shape.

    ``compile_cache_hit`` is :meth:`ExpertMap.same_geometry`: same layers, experts, top-k, hot and cold rows and
    bytes per expert. Moves are listed per layer only where both maps place the same layers and experts.
    """
    geom_a, geom_b = a.geometry(), b.geometry()
    differing = sorted(k for k in {**geom_a, **geom_b} if geom_a.get(k) != geom_b.get(k))
    if tuple(a.layer_ids) != tuple(b.layer_ids):
        differing.append("layer_ids")
    hit = a.same_geometry(b)
    result: dict[str, Any] = {
        "a": {"hash": a.content_hash, "label": a.label, "policy": a.policy, "geometry": geom_a},
        "b": {"hash": b.content_hash, "label": b.label, "policy": b.policy, "geometry": geom_b},
        "identical": a.content_hash == b.content_hash,
        "same_geometry": hit,
        "compile_cache_hit": hit,
        "geometry_differences": differing,
        "verdict": (
            "identical placement: nothing to do" if a.content_hash == b.content_hash
            else "same geometry: a reboot from a to b is a compile-cache hit (only row maps and weights move)"
            if hit else
            f"geometry differs ({', '.join(differing)}): a reboot from a to b is NOT a compile-cache hit and pays "
            "a full recompile/autotune"
        ),
    }
    comparable = a.num_experts == b.num_experts
    shared = [lid for lid in a.layer_ids if lid in set(b.layer_ids)] if comparable else []
    layers = []
    total_to_cold = total_to_hot = 0
    for lid in shared:
        ha, hb = set(a.layer(lid).hot), set(b.layer(lid).hot)
        to_cold, to_hot = sorted(ha - hb), sorted(hb - ha)
        total_to_cold += len(to_cold)
        total_to_hot += len(to_hot)
        layers.append({"layer_id": lid, "hot_to_cold": to_cold, "cold_to_hot": to_hot})
    result.update(
        comparable_layers=len(shared),
        per_layer=layers,
        hot_to_cold=total_to_cold,
        cold_to_hot=total_to_hot,
        layers_changed=sum(1 for lay in layers if lay["hot_to_cold"] or lay["cold_to_hot"]),
        moved_bytes=(total_to_cold + total_to_hot) * a.expert_bytes if a.expert_bytes == b.expert_bytes else None,
    )
    return result


def summary(emap: ExpertMap) -> dict[str, Any]:
    """What ``map show`` prints: identity, geometry, byte split and the prediction the map was built with."""
    return {
        "hash": emap.content_hash,
        "short_hash": emap.short_hash,
        "label": emap.label,
        "policy": emap.policy,
        "model": {"path": emap.model.path, "revision": emap.model.revision, "name": emap.model.name},
        "created_at": emap.created_at,
        "geometry": emap.geometry(),
        "layer_ids": list(emap.layer_ids),
        "hot_bytes": emap.hot_rows * emap.num_layers * emap.expert_bytes,
        "cold_bytes": emap.cold_rows * emap.num_layers * emap.expert_bytes,
        "hot_fraction": emap.hot_rows / emap.num_experts,
        **({"cache_slots": emap.cache_slots, "cache_policy": emap.cache_policy, "hbm_rows": emap.hbm_rows,
            "cache_bytes": emap.cache_slots * emap.num_layers * emap.expert_bytes,
            "cache_model": emap.meta.get("cache_model")} if emap.cache_slots else {}),
        "predicted_cold_rate": emap.predicted_cold_rate,
        "predicted_cold_rate_per_layer": emap.meta.get("predicted_cold_rate_per_layer"),
        "source_counts": list(emap.source_counts),
        "meta": {k: v for k, v in emap.meta.items() if k != "predicted_cold_rate_per_layer"},
    }
