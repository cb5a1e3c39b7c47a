"""Builders for synthetic counts and map artifacts, shared by the tests and the benchmarks.

Real routing is skewed (a few experts per layer take most selections) and domain-dependent (another workload
prefers other experts). :func:`make_counts` reproduces both with a Zipf-like popularity over a per-domain ranking
of the experts, and samples ``top_k`` *distinct* experts per token (Gumbel top-k, i.e. sampling without
replacement), so the counts obey the real invariants: every layer sums to ``tokens * top_k`` and no expert is
selected more than once per token.

Use ``domain`` to pick which experts are hot and ``seed`` to draw a different sample of the same traffic: the
same ``domain`` with another ``seed`` is held-out traffic of the same workload; another ``domain`` is another
workload.

When a test checks a figure by hand, :func:`counts_from` takes the exact per-layer counts instead. For a remap of
the same geometry, :func:`swap_experts` trades one hot and one cold expert of a map. For a map that a real engine
will load, :func:`model_geometry` reads the layers, experts and top-k from the model's ``config.json``::

    write_map(tmp / "a.json", **model_geometry(model_dir), hot_rows=40, seed=1)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pinsidecar_hook.contract import CountsArtifact, ExpertMap, LayerPlacement, ModelInfo, utc_now

__all__: list[str] = []  # nothing here is another package's business

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


def counts_from(rows: Sequence[Sequence[int]] | np.ndarray, *, top_k: int = 1, layer_ids: Sequence[int] | None = None,
                tokens: int | None = None, workload: str = "", meta: dict[str, Any] | None = None) -> CountsArtifact:
    """A counts artifact holding exactly ``rows`` (one row of per-expert selections per layer).

    For figures a test works out by hand. ``tokens`` defaults to the first layer's selections / ``top_k``, which is
    right for consistent counts; pass it to build inconsistent ones on purpose.
    """
    counts = np.asarray(rows, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"rows must be [layers][experts], got shape {counts.shape}")
    layer_ids = list(range(counts.shape[0])) if layer_ids is None else [int(i) for i in layer_ids]
    return CountsArtifact(
        layer_ids=layer_ids, num_experts=counts.shape[1], top_k=top_k, counts=counts,
        tokens=int(counts[0].sum()) // top_k if tokens is None else tokens,
        model=ModelInfo(path="synthetic", name="synthetic-moe"), workload=workload, meta=dict(meta or {}),
    )


def model_geometry(model_dir: str | os.PathLike[str]) -> dict[str, int]:
    """``num_layers``, ``num_experts`` and ``top_k`` of a Qwen-MoE-style model folder, for :func:`make_map`.

    Reads ``config.json``; newer transformers name the expert count ``num_local_experts``.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {"num_layers": int(cfg["num_hidden_layers"]),
            "num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
            "top_k": int(cfg["num_experts_per_tok"])}


def swap_experts(emap: ExpertMap, layer_id: int, hot_expert: int | None = None,
                 cold_expert: int | None = None) -> ExpertMap:
    """``emap`` with one hot and one cold expert of ``layer_id`` traded: another map of the same geometry.

    Defaults to the layer's lowest hot and lowest cold expert id. The result is a new, valid map (lists sorted,
    new content hash); use it for a remap that must be a compile-cache hit.
    """
    lp = emap.layer(layer_id)
    hot_expert = lp.hot[0] if hot_expert is None else hot_expert
    cold_expert = lp.cold[0] if cold_expert is None else cold_expert
    if hot_expert not in lp.hot or cold_expert not in lp.cold:
        raise ValueError(f"layer {layer_id}: expert {hot_expert} must be hot and {cold_expert} cold")
    hot = tuple(sorted({*lp.hot} - {hot_expert} | {cold_expert}))
    cold = tuple(sorted({*lp.cold} - {cold_expert} | {hot_expert}))
    layers = tuple(LayerPlacement(layer_id, hot, cold) if other.layer_id == layer_id else other
                   for other in emap.layers)
    return dataclasses.replace(emap, layers=layers)


def make_map(
    num_layers: int = 4,
    num_experts: int = 64,
    hot_rows: int = 16,
    seed: int = 0,
    *,
    top_k: int | None = None,
    layer_ids: Sequence[int] | None = None,
    expert_bytes: int = 0,
    label: str = "",
    counts: CountsArtifact | None = None,
) -> ExpertMap:
    """A valid map: built from ``counts`` by :func:`pinsidecar.placement.build_usage_map` when given, else a random
    placement (canonical: hot and cold sorted by expert id) drawn from ``seed``. ``top_k`` defaults to 8, or
    ``num_experts`` when there are fewer."""
    if counts is not None:
        from pinsidecar.placement import build_usage_map

        return build_usage_map([counts], hot_rows, label, expert_bytes=expert_bytes)
    layer_ids = list(range(num_layers)) if layer_ids is None else [int(i) for i in layer_ids]
    top_k = min(8, num_experts) if top_k is None else top_k
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
