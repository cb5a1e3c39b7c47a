"""Counts as placement sees them: load several, check they describe one model, merge them, measure their skew.

A map is only as good as the counts it is built from, so everything that combines counts first checks that they
agree on layers, experts and top-k (:func:`check_same_geometry`) and says which two files disagree. Skew (the
share of a layer's selections taken by its hottest quarter of experts) is the first look at whether a workload
has anything for placement to exploit: near-uniform routing gives about 25 %, and no map can do much with it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
from pinsidecar_hook.contract import (
    ArtifactError,
    CountsArtifact,
    load_counts,
)

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# The skew figure: the share of a layer's selections taken by its hottest 25 % of experts (uniform routing: 25 %).
SKEW_TOP_FRACTION = 0.25


def load_counts_files(paths: Sequence[str | os.PathLike[str]]) -> list[CountsArtifact]:
    """Load several counts files and check they describe the same layers, experts and top-k."""
    counts = [load_counts(p) for p in paths]
    check_same_geometry(counts, [str(p) for p in paths])
    return counts


def _geometry(c: CountsArtifact) -> tuple[tuple[int, ...], int, int]:
    return tuple(c.layer_ids), c.num_experts, c.top_k


def describe_geometry(layer_ids: Sequence[int], num_experts: int, top_k: int) -> str:
    """``4 layers [0, 1, 2, 3], 64 experts, top-8``: how error messages name a model's MoE shape."""
    ids = list(layer_ids)
    shown = f"[{ids[0]}..{ids[-1]}]" if len(ids) > 6 else str(ids)
    return f"{len(ids)} layers {shown}, {num_experts} experts, top-{top_k}"


def _describe(c: CountsArtifact) -> str:
    return describe_geometry(c.layer_ids, c.num_experts, c.top_k)


def check_same_geometry(counts: Sequence[CountsArtifact], names: Sequence[str] | None = None) -> None:
    """Refuse counts that describe different layers, experts or top-k, naming the first two that disagree."""
    if not counts:
        raise ArtifactError(None, "no counts given", "pass at least one counts file")
    names = list(names) if names is not None else [f"counts #{i + 1}" for i in range(len(counts))]
    ref = _geometry(counts[0])
    for name, c in zip(names[1:], counts[1:], strict=True):
        if _geometry(c) != ref:
            raise ArtifactError(
                None,
                f"counts {names[0]} ({_describe(counts[0])}) and {name} ({_describe(c)}) "
                "describe different models",
                "build a map only from counts of the same model and engine configuration",
            )


def sum_counts(counts: Sequence[CountsArtifact], names: Sequence[str] | None = None, *,
               record_sources: bool = False) -> CountsArtifact:
    """One counts artifact holding the sum of several of the same geometry (a longer count boot, in effect).

    ``record_sources`` stores the inputs' digests in ``meta["merged_from"]`` (for a merged file on disk; it costs
    a digest per input, so the in-memory sum inside :func:`build_usage_map` skips it).
    """
    check_same_geometry(counts, names)
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
        meta={**shared_meta(counts), **({"merged_from": [c.digest() for c in counts]} if record_sources else {})},
    )


def shared_meta(counts: Sequence[CountsArtifact]) -> dict[str, Any]:
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
