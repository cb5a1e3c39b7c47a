"""Builders for synthetic counts and map artifacts, shared by the tests and the benchmarks.

Real routing is skewed (a few experts per layer take most selections) and domain-dependent (another workload
prefers other experts). :func:`make_counts` reproduces both with a Zipf-like popularity over a per-domain ranking
of the experts, and samples ``top_k`` *distinct* experts per token (Gumbel top-k, i.e. sampling without
replacement), so the counts obey the real invariants: every layer sums to ``tokens * top_k`` and no expert is
selected more than once per token.

Use ``domain`` to pick which experts are hot and ``seed`` to draw a different sample of the same traffic: the
same ``domain`` with another ``seed`` is held-out traffic of the same workload; another ``domain`` is another
workload.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pinsidecar_hook.contract import CountsArtifact, ExpertMap, LayerPlacement, ModelInfo, utc_now

__all__ = ["domain_ranking", "make_counts", "make_map", "write_counts", "write_map"]

# Tokens sampled per numpy call: keeps the [chunk, num_experts] noise matrix small for big layers.
_CHUNK_TOKENS = 2048


def domain_ranking(num_layers: int, num_experts: int, domain: int = 0,
                   hot_set: Sequence[int] | Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """int [num_layers, num_experts]: per layer, expert ids from most to least popular for ``domain``.

    ``hot_set`` (one list for all layers, or one list per layer) puts those experts first, in the order given;
    the rest follow in the domain's random order.
    """
    rng = np.random.default_rng([domain, 0x5EED])
    ranking = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    if hot_set is None:
        return ranking
    per_layer: list[Sequence[int]]
    if len(hot_set) and isinstance(hot_set[0], (list, tuple, np.ndarray)):
        per_layer = list(hot_set)  # type: ignore[arg-type]
        if len(per_layer) != num_layers:
            raise ValueError(f"hot_set has {len(per_layer)} layers, expected {num_layers}")
    else:
        per_layer = [hot_set] * num_layers  # type: ignore[list-item]
    for i, first in enumerate(per_layer):
        first = [int(e) for e in first]
        if any(not 0 <= e < num_experts for e in first) or len(set(first)) != len(first):
            raise ValueError(f"hot_set for layer {i} must be distinct expert ids in 0..{num_experts - 1}")
        rest = [int(e) for e in ranking[i] if int(e) not in set(first)]
        ranking[i] = np.asarray(first + rest)
    return ranking


def make_counts(
    num_layers: int = 4,
    num_experts: int = 64,
    top_k: int = 8,
    tokens: int = 1000,
    seed: int = 0,
    skew: float = 1.2,
    hot_set: Sequence[int] | Sequence[Sequence[int]] | None = None,
    *,
    domain: int = 0,
    layer_ids: Sequence[int] | None = None,
    workload: str = "",
    model: ModelInfo | None = None,
    expert_bytes: int | None = None,
) -> CountsArtifact:
    """A counts artifact whose routing looks like real traffic: skewed, per-domain, exact.

    The expert of popularity rank ``r`` (0-based) gets weight ``1 / (r + 1) ** skew``; ``skew=0`` is uniform.
    ``expert_bytes`` is stored in ``meta`` the way a count boot records it.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    layer_ids = list(range(num_layers)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(layer_ids) != num_layers:
        raise ValueError(f"layer_ids has {len(layer_ids)} entries, expected {num_layers}")
    ranking = domain_ranking(num_layers, num_experts, domain, hot_set)
    log_w_by_rank = -skew * np.log(np.arange(1, num_experts + 1, dtype=np.float64))
    rng = np.random.default_rng([seed, domain, 0xC0])
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        log_w = np.empty(num_experts)
        log_w[ranking[layer]] = log_w_by_rank
        done = 0
        while done < tokens:
            n = min(_CHUNK_TOKENS, tokens - done)
            keys = log_w + rng.gumbel(size=(n, num_experts))
            chosen = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
            counts[layer] += np.bincount(chosen.ravel(), minlength=num_experts)
            done += n
    meta: dict[str, Any] = {"synthetic": {"seed": seed, "domain": domain, "skew": skew}}
    if expert_bytes is not None:
        meta["expert_bytes"] = int(expert_bytes)
    return CountsArtifact(
        layer_ids=layer_ids, num_experts=num_experts, top_k=top_k, counts=counts, tokens=tokens,
        model=model or ModelInfo(path="synthetic", name="synthetic-moe"), workload=workload or f"domain{domain}",
        started_at=utc_now(), ended_at=utc_now(), meta=meta,
    )


def make_map(
    num_layers: int = 4,
    num_experts: int = 64,
    hot_rows: int = 16,
    seed: int = 0,
    *,
    top_k: int = 8,
    layer_ids: Sequence[int] | None = None,
    expert_bytes: int = 0,
    label: str = "",
    counts: CountsArtifact | None = None,
) -> ExpertMap:
    """A valid map: built from ``counts`` by :func:`pinsidecar.placement.build_usage_map` when given, else a random
    placement (canonical: hot and cold sorted by expert id) drawn from ``seed``."""
    if counts is not None:
        from pinsidecar.placement import build_usage_map

        return build_usage_map([counts], hot_rows, label, expert_bytes=expert_bytes)
    layer_ids = list(range(num_layers)) if layer_ids is None else [int(i) for i in layer_ids]
    rng = np.random.default_rng([seed, 0x3A9])
    layers = []
    for lid in layer_ids:
        perm = rng.permutation(num_experts)
        layers.append(LayerPlacement(lid, tuple(sorted(int(e) for e in perm[:hot_rows])),
                                     tuple(sorted(int(e) for e in perm[hot_rows:]))))
    return ExpertMap(
        layer_ids=tuple(layer_ids), num_experts=num_experts, top_k=top_k, hot_rows=hot_rows, layers=tuple(layers),
        expert_bytes=expert_bytes, model=ModelInfo(path="synthetic", name="synthetic-moe"), policy="manual",
        label=label or f"random{seed}", created_at=utc_now(),
    )


def write_counts(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """:func:`make_counts` (same arguments) saved to ``path``; returns the path."""
    make_counts(**kwargs).save(path)
    return Path(path)


def write_map(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """:func:`make_map` (same arguments) saved to ``path``; returns the path."""
    make_map(**kwargs).save(path)
    return Path(path)
