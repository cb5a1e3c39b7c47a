"""Turn counts into placements: the usage map you deploy, and the positional baseline it is measured against.

- :func:`build_usage_map` is the map you deploy: per layer the ``hot_rows`` most-selected experts, the same hot
  count in every layer (fixed geometry, so a reboot onto a new map is a compile-cache hit). The budget comes as
  hot rows (:func:`check_hot_rows`) or as HBM bytes (:func:`hot_rows_for_budget`); :func:`save_map` writes it.
- :func:`positional_mask` / :func:`positional_for` is the baseline every placement figure is compared against:
  what vLLM's ``--cpu-offload-gb`` does with the same byte budget. It is an *evaluation-only*
  :class:`PlacementMask`, not an :class:`ExpertMap`, because it cannot have a fixed geometry (see there).
- :class:`Placement` is what both have in common, and all that :mod:`~pinsidecar.placement.evaluate` needs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog
from pinsidecar_hook.contract import (
    ArtifactError,
    CountsArtifact,
    ExpertMap,
    LayerPlacement,
    RoutingTrace,
    utc_now,
)

from pinsidecar.placement._ranking import cold_rates, usage_hot_mask, usage_order
from pinsidecar.placement.cache_model import INDEPENDENT, INDEPENDENT_CAVEAT, TRACE, check_cache, miss_rates
from pinsidecar.placement.counts import shared_meta, sum_counts
from pinsidecar.placement.simulate import HotRanking, SimResult, check_trace_geometry, simulate

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# Count-boot meta that describes the engine rather than the traffic; copied into the map when every input agrees,
# so pin mode can check the map against the model it is loaded into.
_MODEL_META_KEYS = ("dtype", "tp_size", "expert_tensors", "moe_layers")
# Of those, the ones that describe the checkpoint *format* (a quantized twin has other tensors and dtypes).
_FORMAT_META_KEYS = ("dtype", "expert_tensors")


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


def build_usage_map(
    counts: Sequence[CountsArtifact],
    hot_rows: int,
    label: str = "",
    *,
    expert_bytes: int = 0,
    names: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
    same_format: bool = True,
    cache_slots: int = 0,
    cache_policy: str = "lru",
    trace: RoutingTrace | None = None,
    trace_name: str = "the trace",
) -> ExpertMap:
    """The deployable map: per layer the ``hot_rows`` most-selected experts of the summed ``counts``.

    Ties break by lower expert id. Hot and cold lists are stored sorted by expert id, so one placement has one
    content hash however it was reached. ``predicted_cold_rate`` is the in-sample rate on the summed counts (use
    :func:`leave_one_out` for the held-out figure); ``meta`` records the per-layer rate as well, so ``map show``
    can draw coverage without the counts. ``names`` (file names) only make error messages name the right file.
    ``same_format=False`` says the map is for another checkpoint format than the counts were counted on (the FP8
    twin of a bf16 model: same experts, same routing): the counted engine's ``dtype`` and ``expert_tensors`` are
    then left out of the map (pin mode checks ``expert_tensors`` against the loaded model, and would refuse the
    twin for tensors it was never meant to have).

    ``cache_slots`` K > 0 gives the map a cache tier (docs/cache-tier.md): ``hot_rows`` stays the static hot set
    (the top ``hot_rows``), K more HBM rows hold copies of recently used cold experts, evicted by ``cache_policy``.
    Its ``predicted_cold_rate`` is then the share of selections that miss both: with a ``trace`` (a routing trace
    of the same workload and model) the simulator's miss rate of this split on it (``meta["cache_model"] =
    "trace"``), else the independent-reference model of :mod:`~pinsidecar.placement.cache_model` on the summed
    counts (``"independent"``: it ignores temporal reuse, so it over-states misses when routing has it). A
    ``trace`` with ``cache_slots == 0`` makes the figure the static hot set's miss rate on the trace.
    """
    if not counts:
        raise ArtifactError(None, "no counts given", "pass at least one counts file")
    total = sum_counts(counts, names)
    check_hot_rows(hot_rows, total.num_experts)
    if total.selections == 0:
        where = ", ".join(names) if names else "the counts"
        raise ArtifactError(None, f"{where}: no selections counted, so there is nothing to rank experts by",
                            "run the count boot with real traffic (pinsidecar count-boot) before building a map")
    empty = np.flatnonzero(total.counts.sum(axis=1) == 0)
    if empty.size:
        log.warning("layers_without_selections", layer_ids=[total.layer_ids[i] for i in empty],
                    hint="their hot set falls back to the lowest expert ids")
    order = usage_order(total.counts)
    hot_sorted = np.sort(order[:, :hot_rows], axis=1).tolist()
    cold_sorted = np.sort(order[:, hot_rows:], axis=1).tolist()
    layers = tuple(
        LayerPlacement(lid, tuple(h), tuple(c))
        for lid, h, c in zip(total.layer_ids, hot_sorted, cold_sorted, strict=True)
    )
    check_cache(cache_slots, cache_policy, hot_rows, total.num_experts)
    rate, per_layer = cold_rates(usage_hot_mask(total.counts, hot_rows), total.counts)
    cache_meta: dict[str, Any] = {}
    if cache_slots:
        rate, per_layer = miss_rates(usage_hot_mask(total.counts, hot_rows), total.counts, cache_slots, cache_policy)
        cache_meta = {"cache_model": INDEPENDENT, "cache_model_note": INDEPENDENT_CAVEAT}
    emap = ExpertMap(
        layer_ids=tuple(total.layer_ids), num_experts=total.num_experts, top_k=total.top_k, hot_rows=hot_rows,
        cache_slots=cache_slots, cache_policy=cache_policy if cache_slots else "lru", layers=layers,
        expert_bytes=int(expert_bytes), model=counts[0].model, policy="usage", label=label,
        source_counts=tuple(c.digest() for c in counts), predicted_cold_rate=rate, created_at=utc_now(),
        meta={
            "predicted_cold_rate_per_layer": [round(float(x), 6) for x in per_layer],
            "tokens": total.tokens,
            "selections": total.selections,
            "workloads": [c.workload for c in counts],
            **{k: v for k, v in shared_meta(counts).items()
               if k in _MODEL_META_KEYS and (same_format or k not in _FORMAT_META_KEYS)},
            **cache_meta,
            **(meta or {}),
        },
    )
    if trace is not None:
        emap = with_trace_prediction(emap, trace, trace_name)
    return emap


def trace_miss_rates(emap: ExpertMap, trace: RoutingTrace, trace_name: str = "the trace",
                     batch: int = 1) -> tuple[SimResult, list[float]]:
    """The simulator's figures of ``emap``'s split (its hot set as it is, plus its slots and policy) on ``trace``:
    the whole run (:func:`~pinsidecar.placement.simulate.simulate`'s, summed over layers, which it replays one
    by one too), and the miss rate per layer. Refuses a trace of another model (the simulator's check)."""
    ranking = HotRanking.from_map(emap)
    check_trace_geometry(trace, ranking, trace_name, "the map")
    policy = emap.cache_policy if emap.cache_slots else "lru"
    per_layer: list[float] = []
    misses = fetches = 0
    per_token = trace.tokens * trace.top_k
    for i in range(trace.num_layers):  # layers are independent in the model: the run is the sum of its layers
        one = RoutingTrace(trace.experts[:, i:i + 1, :], trace.num_experts,
                           None if trace.layer_ids is None else (trace.layer_ids[i],))
        part = HotRanking(ranking.order[i:i + 1], ranking.num_experts, "map", None, ranking.fixed_hot_rows)
        r = simulate(one, part, emap.hbm_rows, emap.cache_slots, policy, batch)
        misses += r.misses
        fetches += r.host_fetches
        per_layer.append(r.misses / per_token if per_token else 0.0)
    result = SimResult(emap.hot_rows, emap.cache_slots, policy, trace.tokens, trace.selections, misses, fetches)
    return result, per_layer


def with_trace_prediction(emap: ExpertMap, trace: RoutingTrace, trace_name: str = "the trace") -> ExpertMap:
    """``emap`` with ``predicted_cold_rate`` (and its per-layer figures) from the simulator on ``trace``
    (:func:`trace_miss_rates`), and ``meta["cache_model"] = "trace"``; the placement and its hash are unchanged."""
    result, per_layer = trace_miss_rates(emap, trace, trace_name)
    meta = {k: v for k, v in emap.meta.items() if k != "cache_model_note"}
    meta.update(
        cache_model=TRACE,
        predicted_cold_rate_per_layer=[round(float(x), 6) for x in per_layer],
        trace={"name": str(trace_name), "tokens": trace.tokens, "layers": trace.num_layers, "top_k": trace.top_k,
               "batch": 1, "misses": result.misses, "selections": result.selections,
               "host_fetches_per_token": result.host_fetches_per_token},
    )
    return dataclasses.replace(emap, predicted_cold_rate=result.miss_rate, meta=meta)


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
    cold = emap.num_experts - emap.hbm_rows  # the cold rows, less the cache slots' share of the budget
    return positional_mask(emap.layer_ids, emap.num_experts, emap.top_k, cold * emap.num_layers, emap.expert_bytes)


def save_map(emap: ExpertMap, path: str | os.PathLike[str]) -> None:
    """Write ``emap`` atomically (creating the directory), refusing a path that is a directory."""
    target = Path(path)
    if target.is_dir():
        raise ArtifactError(target, "is a directory", "pass a file name for the map, e.g. maps/code.map.json")
    emap.save(target)
