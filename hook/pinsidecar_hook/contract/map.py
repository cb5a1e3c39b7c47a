"""The map file: which experts of each MoE layer are hot (HBM) and which cold (pinned host), with the geometry
(pin mode's input)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pinsidecar_hook.contract.counts import CountsArtifact, ModelInfo
from pinsidecar_hook.contract.io import (
    MAP_FORMAT,
    VERSION,
    ArtifactError,
    _field,
    _finite,
    _guarded,
    _int_list,
    _read_dims,
    _read_json,
    _sha256,
    atomic_write_json,
)

# How a cache tier's slots are evicted (docs/cache-tier.md); the simulator models the same two.
CACHE_POLICIES = ("lru", "lfu")

__all__ = ["CACHE_POLICIES", "ExpertMap", "LayerPlacement", "RowMap", "cold_selection_ratio", "load_map",
           "placement_row_map"]


class RowMap(NamedTuple):
    """One layer's placement as a rank sees it (see :func:`placement_row_map`)."""

    rows: list[int]  # global expert id -> row: hot 0..H-1, cold H..H+C-1, -1 when not on this rank
    hot_local: list[int]  # the rank's local expert ids in hot-row order (what re-homing copies to the hot tensor)
    cold_local: list[int]  # the same for the cold rows


def placement_row_map(hot: Sequence[int], cold: Sequence[int], num_experts: int,
                      expert_map: Sequence[int] | None = None) -> RowMap:
    """The row map of one layer: hot experts in rows ``0..H-1`` in the order given, cold ones after them.

    This is the one row-map builder: the map file's :meth:`LayerPlacement.row_map`, pin mode's re-homing and the
    test generators all call it. Experts in neither list get ``-1``. Without expert parallel (``expert_map``
    None) every expert is local and local id == global id. With it, ``expert_map[g]`` is the local id of global
    expert ``g`` on this rank or ``-1`` (vLLM's ``expert_map``); only local experts get rows, in the map's hot
    then cold order, so a rank's hot tensor holds its local hot experts and its cold tensor its local cold ones
    (``H`` and ``C`` count this rank's experts). Raises ``ValueError`` for an id listed twice or out of range.
    """
    listed = [*hot, *cold]
    if len(set(listed)) != len(listed):
        raise ValueError("an expert is listed twice across the hot and cold experts")
    if any(not 0 <= g < num_experts for g in listed):
        raise ValueError(f"expert ids must be in 0..{num_experts - 1}")
    rows = [-1] * num_experts
    tiers: tuple[list[int], list[int]] = ([], [])
    row = 0
    for tier_ids, local_ids in zip((hot, cold), tiers, strict=True):
        for g in tier_ids:
            local = g if expert_map is None else int(expert_map[g])
            if local < 0:
                continue  # another rank's expert
            rows[g] = row
            row += 1
            local_ids.append(local)
    return RowMap(rows, *tiers)


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's residency: ``hot`` global expert ids live in HBM rows 0..H-1 (in this order), ``cold``
    ids in host rows H..H+C-1."""

    layer_id: int
    hot: tuple[int, ...]
    cold: tuple[int, ...]

    def row_map(self, num_experts: int, expert_map: Sequence[int] | None = None) -> RowMap:
        """This layer's rows on one rank (:func:`placement_row_map`)."""
        return placement_row_map(self.hot, self.cold, num_experts, expert_map)


@dataclass(frozen=True)
class ExpertMap:
    """Which experts of each MoE layer are hot (HBM) and which cold (pinned host), with the fixed geometry.

    The geometry (hot and cold rows per layer, bytes per expert) is the same in every layer and is all that the
    engine's compile and autotune caches may see; the placement itself is data. ``content_hash`` covers the
    placement and geometry only, so the same placement built twice has the same hash.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    hot_rows: int
    layers: tuple[LayerPlacement, ...]
    expert_bytes: int = 0
    model: ModelInfo = field(default_factory=ModelInfo)
    policy: str = "usage"  # "usage" (from counts), "positional" (what --cpu-offload-gb does), "manual"
    label: str = ""
    source_counts: tuple[str, ...] = ()  # digests of the counts the map was built from
    predicted_cold_rate: float | None = None
    created_at: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # The cache tier (docs/cache-tier.md): K more HBM rows per layer that hold *copies* of recently used cold experts,
    # filled from host memory while serving and evicted by ``cache_policy``. The cold experts stay in host memory
    # (the master copies), so a cached map has the same cold list as an uncached one with the same hot set.
    cache_slots: int = 0
    cache_policy: str = "lru"  # "lru" | "lfu"; meaningful only when cache_slots > 0

    @property
    def cold_rows(self) -> int:
        return self.num_experts - self.hot_rows

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def hbm_rows(self) -> int:
        """HBM rows per layer: the static hot rows and the cache slots."""
        return self.hot_rows + self.cache_slots

    def geometry(self) -> dict[str, int]:
        """What the engine's kernel shapes see. ``cache_slots`` only when there are some, so that a map without a
        cache keeps the hash and geometry it had before the cache tier existed."""
        geom = {"hot_rows": self.hot_rows, "cold_rows": self.cold_rows, "expert_bytes": self.expert_bytes,
                "num_experts": self.num_experts, "num_layers": self.num_layers, "top_k": self.top_k}
        if self.cache_slots:
            geom["cache_slots"] = self.cache_slots
        return geom

    def same_geometry(self, other: ExpertMap) -> bool:
        """True when a reboot from ``other`` to ``self`` keeps every kernel shape (a compile-cache hit)."""
        return self.geometry() == other.geometry() and self.layer_ids == other.layer_ids

    def layer(self, layer_id: int) -> LayerPlacement:
        for lp in self.layers:
            if lp.layer_id == layer_id:
                return lp
        raise KeyError(layer_id)

    def row_maps(self) -> np.ndarray:
        """int32 [num_layers, num_experts]: expert id -> row (hot rows first)."""
        return np.asarray([lp.row_map(self.num_experts).rows for lp in self.layers], dtype=np.int32)

    def hot_mask(self) -> np.ndarray:
        """bool [num_layers, num_experts]: True where the expert is HBM-resident."""
        mask = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        for i, lp in enumerate(self.layers):
            mask[i, list(lp.hot)] = True
        return mask

    def _placement_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "layer_ids": list(self.layer_ids),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "geometry": self.geometry(),
            "layers": [{"layer_id": lp.layer_id, "hot": list(lp.hot), "cold": list(lp.cold)} for lp in self.layers],
        }
        if self.cache_slots:
            doc["cache_policy"] = self.cache_policy
        return doc

    @property
    def content_hash(self) -> str:
        return _sha256(self._placement_json())

    @property
    def short_hash(self) -> str:
        return self.content_hash.split(":", 1)[1][:12]

    def to_json(self) -> dict[str, Any]:
        doc = self._placement_json()
        doc.update(
            format=MAP_FORMAT, version=VERSION, hash=self.content_hash,
            model=dataclasses.asdict(self.model), policy=self.policy, label=self.label,
            source_counts=list(self.source_counts), predicted_cold_rate=self.predicted_cold_rate,
            created_at=self.created_at, meta=self.meta,
        )
        return doc

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: Any = None) -> ExpertMap:
        layer_ids, num_experts, top_k = _read_dims(doc, path)
        geom = _field(doc, "geometry", dict, path)
        hot_rows = _field(geom, "hot_rows", int, path)
        cold_rows = _field(geom, "cold_rows", int, path)
        expert_bytes = geom.get("expert_bytes", 0) or 0
        if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, int) or expert_bytes < 0:
            raise ArtifactError(path, f"geometry expert_bytes must be a non-negative integer, got {expert_bytes!r}",
                                "the map is corrupt; rebuild it")
        if hot_rows < 0 or cold_rows < 0 or hot_rows + cold_rows != num_experts:
            raise ArtifactError(path, f"geometry hot_rows={hot_rows} + cold_rows={cold_rows} != num_experts "
                                f"({num_experts})", "the map is corrupt; rebuild it")
        cache_slots, cache_policy = _read_cache(doc, geom, hot_rows, cold_rows, path)
        raw_layers = _field(doc, "layers", list, path)
        if len(raw_layers) != len(layer_ids):
            raise ArtifactError(path, f"{len(raw_layers)} layer entries for {len(layer_ids)} layer_ids",
                                "the map is truncated or corrupt; rebuild it")
        layers = []
        for want, entry in zip(layer_ids, raw_layers, strict=True):
            if not isinstance(entry, dict):
                raise ArtifactError(path, "each entry of 'layers' must be an object")
            lid = _field(entry, "layer_id", int, path)
            if lid != want:
                raise ArtifactError(path, f"layer entry {lid} out of order (expected {want})")
            hot = _int_list(_field(entry, "hot", list, path), f"layer {lid} hot", path)
            cold = _int_list(_field(entry, "cold", list, path), f"layer {lid} cold", path)
            _check_partition(lid, hot, cold, num_experts, hot_rows, path)
            layers.append(LayerPlacement(lid, tuple(hot), tuple(cold)))
        pcr = doc.get("predicted_cold_rate")
        emap = cls(
            layer_ids=tuple(layer_ids), num_experts=num_experts, top_k=top_k, hot_rows=hot_rows,
            layers=tuple(layers), expert_bytes=expert_bytes, model=ModelInfo.from_json(doc.get("model", {}), path),
            policy=str(doc.get("policy", "usage")), label=str(doc.get("label", "")),
            source_counts=tuple(str(s) for s in doc.get("source_counts", []) or []),
            predicted_cold_rate=None if pcr is None else _finite(pcr, "predicted_cold_rate", path, 0.0, 1.0),
            created_at=str(doc.get("created_at", "")),
            meta=dict(doc.get("meta", {}) or {}),
            cache_slots=cache_slots, cache_policy=cache_policy,
        )
        stated = doc.get("hash")
        if stated is not None and stated != emap.content_hash:
            raise ArtifactError(path, f"content hash mismatch (file says {stated}, content is {emap.content_hash})",
                                "the map was edited or corrupted; rebuild it with `pinsidecar map build`")
        return emap


def _read_cache(doc: dict[str, Any], geom: dict[str, Any], hot_rows: int, cold_rows: int,
                path: Any) -> tuple[int, str]:
    """The cache tier's slots and policy; absent means no cache (every map written before the cache tier)."""
    slots = geom.get("cache_slots", 0)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= cold_rows:
        raise ArtifactError(path, f"geometry cache_slots must be an integer in 0..{cold_rows} (the cold rows), got "
                            f"{slots!r}", "rebuild the map with `pinsidecar map build --cache-slots K`")
    policy = doc.get("cache_policy", "lru")
    if policy not in CACHE_POLICIES:
        raise ArtifactError(path, f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {policy!r}",
                            "rebuild the map with `pinsidecar map build --cache-policy lru`")
    if slots == 0 and "cache_policy" in doc:
        raise ArtifactError(path, "cache_policy is set but geometry cache_slots is 0",
                            "the map is corrupt; rebuild it")
    return slots, str(policy)


def _check_partition(lid: int, hot: Sequence[int], cold: Sequence[int], num_experts: int, hot_rows: int,
                     path: Any) -> None:
    if len(hot) != hot_rows:
        raise ArtifactError(path, f"layer {lid} has {len(hot)} hot experts, geometry says {hot_rows}",
                            "every layer must have the same hot count; rebuild the map")
    ids = [*hot, *cold]
    bad = sorted({e for e in ids if not 0 <= e < num_experts})
    if bad:
        raise ArtifactError(path, f"layer {lid} has out-of-range expert ids {bad[:8]} (num_experts={num_experts})")
    seen: set[int] = set()
    dup = sorted({e for e in ids if e in seen or seen.add(e)})  # type: ignore[func-returns-value]
    if dup:
        raise ArtifactError(path, f"layer {lid} lists experts {dup[:8]} more than once")
    missing = sorted(set(range(num_experts)) - seen)  # bounded: _read_dims capped num_experts at MAX_EXPERTS
    if missing:
        raise ArtifactError(path, f"layer {lid} does not place experts {missing[:8]}")


def load_map(path: str | os.PathLike[str]) -> ExpertMap:
    return _guarded(ExpertMap.from_json, _read_json(path, MAP_FORMAT), path)


def cold_selection_ratio(emap: ExpertMap, counts: CountsArtifact) -> tuple[float, np.ndarray]:
    """Fraction of ``counts``' selections that fall on ``emap``'s cold experts: (total, per layer).

    Raises :class:`ArtifactError` when the two do not describe the same layers and experts.
    """
    if tuple(counts.layer_ids) != emap.layer_ids or counts.num_experts != emap.num_experts:
        raise ArtifactError(
            None,
            f"map (layers {list(emap.layer_ids)}, {emap.num_experts} experts) and counts (layers "
            f"{counts.layer_ids}, {counts.num_experts} experts) are for different geometries",
            "evaluate a map against counts from the same model",
        )
    cold = ~emap.hot_mask()
    per_layer_total = counts.counts.sum(axis=1)
    per_layer_cold = (counts.counts * cold).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = np.where(per_layer_total > 0, per_layer_cold / np.maximum(per_layer_total, 1), 0.0)
    total = float(per_layer_cold.sum() / per_layer_total.sum()) if per_layer_total.sum() else 0.0
    return total, per_layer
