"""Turn counts into placements, and placements into the figures that decide whether to deploy them.

Everything here is a pure function over the artifact objects of :mod:`pinsidecar.artifacts` (the only place the
file formats live); the CLI (``pinsidecar map ...``) and the remap pipeline do the I/O around them.

When to use which:

- :func:`build_usage_map` is the map you deploy: per layer the ``hot_rows`` most-selected experts, the same hot
  count in every layer (fixed geometry, so a reboot onto a new map is a compile-cache hit).
- :func:`positional_mask` / :func:`positional_for` is the baseline every placement figure is compared against:
  what vLLM's ``--cpu-offload-gb`` does with the same byte budget. It is an *evaluation-only*
  :class:`PlacementMask`, not an :class:`ExpertMap`, because it cannot have a fixed geometry (see there).
- :func:`evaluate` gives the cold-selection rate of a map or mask on some counts, total and per layer;
  :func:`leave_one_out` is the honest version of the predicted rate when several count boots are available.
- :func:`diff_maps` says what a remap from one map to another moves, and whether the reboot keeps the kernel
  shapes; :func:`summary` is what ``map show`` prints.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog

from pinsidecar.artifacts import (
    ArtifactError,
    CountsArtifact,
    ExpertMap,
    LayerPlacement,
    cold_selection_ratio,
    load_counts,
    load_map,
    utc_now,
)

__all__ = [
    "SKEW_TOP_FRACTION",
    "Placement",
    "PlacementMask",
    "build_usage_map",
    "check_compatible",
    "check_hot_rows",
    "counts_summary",
    "diff_maps",
    "evaluate",
    "hot_rows_for_budget",
    "leave_one_out",
    "load_counts_files",
    "positional_for",
    "positional_mask",
    "read_counts",
    "read_map",
    "save_map",
    "sum_counts",
    "summary",
    "top_share",
]

log = structlog.get_logger(__name__)

# Count-boot meta that describes the engine rather than the traffic; copied into the map when every input agrees,
# so pin mode can check the map against the model it is loaded into.
_MODEL_META_KEYS = ("dtype", "tp_size", "expert_tensors", "moe_layers")

# The skew figure of issue 2: the share of a layer's selections taken by its hottest 25 % of experts.
SKEW_TOP_FRACTION = 0.25


class Placement(Protocol):
    """What :func:`evaluate` needs: an :class:`ExpertMap` or a :class:`PlacementMask`."""

    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    policy: str

    def hot_mask(self) -> np.ndarray: ...


@dataclass(frozen=True, eq=False)
class PlacementMask:
    """A per-layer hot/cold mask with no fixed geometry: the positional baseline, used for evaluation only.

    Why not an :class:`ExpertMap`: vLLM's ``--cpu-offload-gb`` walks the decoder layers in parameter order and
    moves whole tensors to host memory until the byte budget is spent, so the first layers are entirely cold and
    the rest entirely hot. Expressed as a map that is a different hot count in every layer, which the map format
    refuses on purpose (the hook's kernels, and the compile cache, assume one geometry). It is also never
    something the hook should deploy: vLLM deploys it itself. So it is a mask that :func:`evaluate`, reports and
    ``map eval`` use, and nothing writes it to disk as a map.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    hot: np.ndarray = field(repr=False)  # bool [num_layers, num_experts]
    policy: str = "positional"
    expert_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hot = np.array(self.hot, dtype=bool)  # a private, read-only copy: the mask is a value
        if hot.shape != (len(self.layer_ids), self.num_experts):
            raise ValueError(f"hot mask shape {hot.shape} != ({len(self.layer_ids)}, {self.num_experts})")
        hot.flags.writeable = False
        object.__setattr__(self, "hot", hot)
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def cold_total(self) -> int:
        return int((~self.hot).sum())

    def hot_mask(self) -> np.ndarray:
        return self.hot


# ---------------------------------------------------------------------------------------------------- loading


def read_counts(path: str | os.PathLike[str]) -> CountsArtifact:
    """:func:`load_counts`, with any malformed field the validator lets through reported as :class:`ArtifactError`.

    (A hand-edited ``meta`` or a non-numeric optional field surfaces from the reader as a bare ValueError or
    TypeError; the CLI must still answer with the file name and no traceback.)
    """
    try:
        return load_counts(path)
    except ArtifactError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ArtifactError(path, f"malformed field ({exc})", "the file is corrupt or hand-edited; regenerate it"
                            ) from None


def read_map(path: str | os.PathLike[str]) -> ExpertMap:
    """:func:`load_map`, with stray ValueError/TypeError from a malformed field turned into :class:`ArtifactError`."""
    try:
        return load_map(path)
    except ArtifactError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ArtifactError(path, f"malformed field ({exc})", "the map is corrupt or hand-edited; rebuild it with "
                            "`pinsidecar map build`") from None


def load_counts_files(paths: Sequence[str | os.PathLike[str]]) -> list[CountsArtifact]:
    """Load several counts files and check they describe the same layers, experts and top-k."""
    counts = [read_counts(p) for p in paths]
    _check_same_counts_geometry(counts, [str(p) for p in paths])
    return counts


def save_map(emap: ExpertMap, path: str | os.PathLike[str]) -> None:
    """Write ``emap`` atomically (creating the directory), refusing a path that is a directory."""
    target = Path(path)
    if target.is_dir():
        raise ArtifactError(target, "is a directory", "pass a file name for the map, e.g. maps/code.map.json")
    emap.save(target)


# ---------------------------------------------------------------------------------------------------- checks


def _counts_geometry(c: CountsArtifact) -> tuple[tuple[int, ...], int, int]:
    return tuple(c.layer_ids), c.num_experts, c.top_k


def _describe_counts(c: CountsArtifact) -> str:
    return f"{c.num_layers} layers {_short_ids(c.layer_ids)}, {c.num_experts} experts, top-{c.top_k}"


def _short_ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 6:
        return f"[{ids[0]}..{ids[-1]}]"
    return str(ids)


def _check_same_counts_geometry(counts: Sequence[CountsArtifact], names: Sequence[str] | None = None) -> None:
    if not counts:
        raise ArtifactError(None, "no counts given", "pass at least one counts file")
    names = list(names) if names is not None else [f"counts #{i + 1}" for i in range(len(counts))]
    ref = _counts_geometry(counts[0])
    for name, c in zip(names[1:], counts[1:], strict=True):
        if _counts_geometry(c) != ref:
            raise ArtifactError(
                None,
                f"counts {names[0]} ({_describe_counts(counts[0])}) and {name} ({_describe_counts(c)}) "
                "describe different models",
                "build a map only from counts of the same model and engine configuration",
            )


def check_compatible(placement: Placement, counts: CountsArtifact, placement_name: str = "map",
                     counts_name: str = "counts") -> None:
    """Refuse to compare a placement with counts of another geometry, naming both sides."""
    if (tuple(counts.layer_ids), counts.num_experts, counts.top_k) != (
            tuple(placement.layer_ids), placement.num_experts, placement.top_k):
        raise ArtifactError(
            None,
            f"{placement_name} ({len(placement.layer_ids)} layers {_short_ids(placement.layer_ids)}, "
            f"{placement.num_experts} experts, top-{placement.top_k}) and {counts_name} ({_describe_counts(counts)}) "
            "are for different models",
            "evaluate a map against counts from the same model",
        )


def check_hot_rows(hot_rows: int, num_experts: int) -> None:
    """A budget must leave something hot and something cold: ``hot_rows`` in 1..num_experts-1."""
    if hot_rows <= 0:
        raise ArtifactError(
            None, f"hot rows per layer must be at least 1, got {hot_rows}",
            "a budget of zero keeps no expert in HBM; pass --hot-rows N with 1 <= N < num_experts "
            f"({num_experts}) or a larger --hbm-bytes",
        )
    if hot_rows >= num_experts:
        raise ArtifactError(
            None, f"hot rows per layer {hot_rows} >= num_experts ({num_experts}): every expert fits in HBM",
            "no offload is needed; run the engine without a map, or pass a smaller budget",
        )


def hot_rows_for_budget(hbm_bytes: int, num_layers: int, expert_bytes: int, num_experts: int) -> int:
    """Hot rows per layer that an HBM byte budget for experts buys: ``floor(B / (num_layers * expert_bytes))``.

    Validated with :func:`check_hot_rows`, so the message talks about bytes the operator passed.
    """
    if expert_bytes <= 0:
        raise ArtifactError(None, "the size of one expert is unknown, so an HBM byte budget cannot be converted "
                            "to hot rows", "pass --expert-bytes X (bytes per expert, all its tensors) or --hot-rows N")
    if hbm_bytes <= 0:
        raise ArtifactError(None, f"HBM budget must be positive, got {hbm_bytes} bytes",
                            "pass --hbm-bytes B with B > 0 or --hot-rows N")
    hot_rows = hbm_bytes // (num_layers * expert_bytes)
    per_row = num_layers * expert_bytes
    if hot_rows <= 0:
        raise ArtifactError(None, f"HBM budget {hbm_bytes} bytes is smaller than one expert per layer "
                            f"({num_layers} layers x {expert_bytes} bytes = {per_row} bytes)",
                            "raise --hbm-bytes")
    if hot_rows >= num_experts:
        raise ArtifactError(None, f"HBM budget {hbm_bytes} bytes holds all {num_experts} experts of every layer "
                            f"({num_experts * per_row} bytes)", "no offload is needed; run the engine without a map")
    return int(hot_rows)


# ---------------------------------------------------------------------------------------------------- counts


def sum_counts(counts: Sequence[CountsArtifact], names: Sequence[str] | None = None, *,
               record_sources: bool = False) -> CountsArtifact:
    """One counts artifact holding the sum of several of the same geometry (a longer count boot, in effect).

    ``record_sources`` stores the inputs' digests in ``meta["merged_from"]`` (for a merged file on disk; it costs
    a digest per input, so the in-memory sum inside :func:`build_usage_map` skips it).
    """
    _check_same_counts_geometry(counts, names)
    if len(counts) == 1:
        return counts[0]
    first = counts[0]
    total = np.sum([c.counts for c in counts], axis=0, dtype=np.int64)
    models = {c.model for c in counts}
    if len(models) > 1:
        log.warning("counts_from_different_model_paths", models=sorted(m.path for m in models))
    workloads = [c.workload for c in counts if c.workload]
    starts = [c.started_at for c in counts if c.started_at]
    ends = [c.ended_at for c in counts if c.ended_at]
    return CountsArtifact(
        layer_ids=list(first.layer_ids), num_experts=first.num_experts, top_k=first.top_k, counts=total,
        tokens=sum(c.tokens for c in counts), model=first.model,
        workload="+".join(dict.fromkeys(workloads)), started_at=min(starts, default=""), ended_at=max(ends, default=""),
        meta={**_shared_meta(counts), **({"merged_from": [c.digest() for c in counts]} if record_sources else {})},
    )


def _shared_meta(counts: Sequence[CountsArtifact]) -> dict[str, Any]:
    """Meta entries every input agrees on (e.g. ``expert_bytes``); the rest is dropped rather than guessed."""
    keys = set.intersection(*(set(c.meta) for c in counts)) - {"merged_from"}
    return {k: counts[0].meta[k] for k in sorted(keys) if all(c.meta[k] == counts[0].meta[k] for c in counts)}


def top_share(counts: np.ndarray, fraction: float = SKEW_TOP_FRACTION) -> np.ndarray:
    """Per layer, the share of selections taken by the hottest ``fraction`` of experts (0 for an empty layer)."""
    counts = np.asarray(counts)
    k = max(1, math.ceil(counts.shape[1] * fraction))
    top = -np.partition(-counts, k - 1, axis=1)[:, :k]
    totals = counts.sum(axis=1)
    return np.where(totals > 0, top.sum(axis=1) / np.maximum(totals, 1), 0.0)


def counts_summary(counts: CountsArtifact) -> dict[str, Any]:
    """What ``counts show`` prints: dimensions, totals, consistency and per-layer skew."""
    skew = top_share(counts.counts)
    per_layer_sel = counts.counts.sum(axis=1)
    return {
        "num_layers": counts.num_layers,
        "num_experts": counts.num_experts,
        "top_k": counts.top_k,
        "tokens": counts.tokens,
        "selections": counts.selections,
        "consistent": counts.consistent,
        "layer_ids": list(counts.layer_ids),
        "workload": counts.workload,
        "model": {"path": counts.model.path, "revision": counts.model.revision, "name": counts.model.name},
        "started_at": counts.started_at,
        "ended_at": counts.ended_at,
        "digest": counts.digest(),
        "expert_bytes": counts.meta.get("expert_bytes"),
        "skew_top_fraction": SKEW_TOP_FRACTION,
        "skew": {"min": float(skew.min()), "mean": float(skew.mean()), "max": float(skew.max())},
        "per_layer": [
            {"layer_id": lid, "selections": int(s), "top_share": float(t),
             "experts_used": int((row > 0).sum())}
            for lid, s, t, row in zip(counts.layer_ids, per_layer_sel, skew, counts.counts, strict=True)
        ],
    }


# ---------------------------------------------------------------------------------------------------- building


def _hot_order(counts: np.ndarray) -> np.ndarray:
    """Per layer, expert ids from most to least selected; equal counts keep the lower expert id first."""
    return np.argsort(-counts, axis=1, kind="stable")


def build_usage_map(
    counts: Sequence[CountsArtifact],
    hot_rows: int,
    label: str = "",
    *,
    expert_bytes: int = 0,
    names: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
) -> ExpertMap:
    """The deployable map: per layer the ``hot_rows`` most-selected experts of the summed ``counts``.

    Ties break by lower expert id. Hot and cold lists are stored sorted by expert id, so one placement has one
    content hash however it was reached. ``predicted_cold_rate`` is the in-sample rate on the summed counts (use
    :func:`leave_one_out` for the held-out figure); ``meta`` records the per-layer rate as well, so ``map show``
    can draw coverage without the counts. ``names`` (file names) only make error messages name the right file.
    """
    if not counts:
        raise ArtifactError(None, "no counts given", "pass at least one counts file")
    total = sum_counts(counts, names)
    check_hot_rows(hot_rows, total.num_experts)
    if total.selections == 0:
        where = ", ".join(names) if names else "the counts"
        raise ArtifactError(None, f"{where}: no selections counted, so there is nothing to rank experts by",
                            "run the count boot with real traffic (pinsidecar profile) before building a map")
    empty = np.flatnonzero(total.counts.sum(axis=1) == 0)
    if empty.size:
        log.warning("layers_without_selections", layer_ids=[total.layer_ids[i] for i in empty],
                    hint="their hot set falls back to the lowest expert ids")
    order = _hot_order(total.counts)
    hot_sorted = np.sort(order[:, :hot_rows], axis=1).tolist()
    cold_sorted = np.sort(order[:, hot_rows:], axis=1).tolist()
    layers = tuple(
        LayerPlacement(lid, tuple(h), tuple(c))
        for lid, h, c in zip(total.layer_ids, hot_sorted, cold_sorted, strict=True)
    )
    hot = np.zeros(total.counts.shape, dtype=bool)
    np.put_along_axis(hot, order[:, :hot_rows], True, axis=1)
    rate, per_layer = _cold_rates(hot, total.counts)
    emap = ExpertMap(
        layer_ids=tuple(total.layer_ids), num_experts=total.num_experts, top_k=total.top_k, hot_rows=hot_rows,
        layers=layers, expert_bytes=int(expert_bytes), model=counts[0].model, policy="usage", label=label,
        source_counts=tuple(c.digest() for c in counts), predicted_cold_rate=rate, created_at=utc_now(),
        meta={
            "predicted_cold_rate_per_layer": [round(float(x), 6) for x in per_layer],
            "tokens": total.tokens,
            "selections": total.selections,
            "workloads": [c.workload for c in counts],
            **{k: v for k, v in _shared_meta(counts).items() if k in _MODEL_META_KEYS},
            **(meta or {}),
        },
    )
    return emap


def _cold_rates(hot: np.ndarray, counts: np.ndarray) -> tuple[float, np.ndarray]:
    per_layer_total = counts.sum(axis=1)
    per_layer_cold = np.where(hot, 0, counts).sum(axis=1)
    per_layer = np.where(per_layer_total > 0, per_layer_cold / np.maximum(per_layer_total, 1), 0.0)
    all_sel = int(per_layer_total.sum())
    return (float(per_layer_cold.sum() / all_sel) if all_sel else 0.0), per_layer


def positional_mask(layer_ids: Sequence[int], num_experts: int, top_k: int, cold_total: int,
                    expert_bytes: int = 0) -> PlacementMask:
    """What ``--cpu-offload-gb`` does with room for ``cold_total`` experts in host memory.

    Layers are taken in parameter order (ascending layer id), each entirely cold, until the budget is spent; the
    remainder is taken from the next layer's lowest expert ids (its first rows in the stacked expert tensors).
    vLLM itself rounds to whole tensors (it offloads a layer's ``w13`` before its ``w2`` and may overshoot by one
    tensor), so in the real engine the boundary layer has *every* expert partly in host memory; counting the
    remainder at expert granularity is slightly kind to the baseline, never unkind.
    """
    n_layers = len(layer_ids)
    if not 0 <= cold_total <= n_layers * num_experts:
        raise ArtifactError(None, f"positional cold budget {cold_total} experts is outside 0..{n_layers * num_experts}")
    hot = np.ones((n_layers, num_experts), dtype=bool)
    flat_order = np.argsort(np.asarray(layer_ids), kind="stable")  # parameter order = ascending layer id
    left = cold_total
    for idx in flat_order:
        if left <= 0:
            break
        take = min(left, num_experts)
        hot[idx, :take] = False
        left -= take
    return PlacementMask(
        layer_ids=tuple(layer_ids), num_experts=num_experts, top_k=top_k, hot=hot, expert_bytes=expert_bytes,
        meta={"cold_total": cold_total, "full_cold_layers": cold_total // num_experts,
              "partial_layer_cold": cold_total % num_experts},
    )


def positional_for(emap: ExpertMap) -> PlacementMask:
    """The positional baseline with the same byte budget as ``emap`` (the same number of cold experts)."""
    return positional_mask(emap.layer_ids, emap.num_experts, emap.top_k, emap.cold_rows * emap.num_layers,
                           emap.expert_bytes)


# ---------------------------------------------------------------------------------------------------- evaluating


def evaluate(placement: Placement, counts: CountsArtifact, placement_name: str = "map",
             counts_name: str = "counts") -> dict[str, Any]:
    """Cold-selection rate of ``placement`` on ``counts``: total, per layer, and the cold experts touched."""
    check_compatible(placement, counts, placement_name, counts_name)
    rate, per_layer = cold_selection_ratio(placement, counts)  # type: ignore[arg-type]  # duck-typed: hot_mask()
    hot = placement.hot_mask()
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
    return result


def leave_one_out(counts: Sequence[CountsArtifact], hot_rows: int,
                  names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """For each counts i: build from all the others, evaluate on i (empty with fewer than two counts).

    This is the figure to trust when deciding whether a map generalises to traffic it was not built from; the
    in-sample ``predicted_cold_rate`` is always optimistic.
    """
    names = list(names) if names is not None else [f"counts #{i + 1}" for i in range(len(counts))]
    _check_same_counts_geometry(counts, names)
    if len(counts) < 2:
        return []
    check_hot_rows(hot_rows, counts[0].num_experts)
    stack = np.stack([c.counts for c in counts])
    grand = stack.sum(axis=0)
    out = []
    for i, held_out in enumerate(counts):
        train = grand - stack[i]
        order = _hot_order(train)
        hot = np.zeros(train.shape, dtype=bool)
        np.put_along_axis(hot, order[:, :hot_rows], True, axis=1)
        held_rate, _ = _cold_rates(hot, held_out.counts)
        train_rate, _ = _cold_rates(hot, train)
        out.append({"held_out": names[i], "workload": held_out.workload, "cold_rate": held_rate,
                    "train_cold_rate": train_rate, "held_out_selections": held_out.selections})
    return out


# ---------------------------------------------------------------------------------------------------- comparing


def diff_maps(a: ExpertMap, b: ExpertMap) -> dict[str, Any]:
    """What a remap from ``a`` to ``b`` changes, and whether rebooting onto ``b`` keeps every kernel shape.

    ``compile_cache_hit`` is :meth:`ExpertMap.same_geometry`: same layers, experts, top-k, hot and cold rows and
    bytes per expert. Moves are listed per layer only where both maps place the same layers and experts.
    """
    geom_a, geom_b = a.geometry(), b.geometry()
    differing = sorted(k for k in geom_a if geom_a[k] != geom_b.get(k))
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
        "predicted_cold_rate": emap.predicted_cold_rate,
        "predicted_cold_rate_per_layer": emap.meta.get("predicted_cold_rate_per_layer"),
        "source_counts": list(emap.source_counts),
        "meta": {k: v for k, v in emap.meta.items() if k != "predicted_cold_rate_per_layer"},
    }
