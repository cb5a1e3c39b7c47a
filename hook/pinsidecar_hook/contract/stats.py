"""The stats file: pin mode's live counters, rewritten now and then by the hook's side thread (pin mode's output).

When the hook cannot write the configured path it writes :func:`fallback_stats_path` instead; every reader must
look there too, which is why the fallback is defined here, beside the format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract.io import (
    COUNT_LIMIT,
    STATS_FORMAT,
    VERSION,
    ArtifactError,
    _field,
    _finite,
    _guarded,
    _int_list,
    _read_dims,
    _read_json,
    atomic_write_json,
)

__all__ = ["CACHE_COUNTERS", "StatsSnapshot", "fallback_stats_path", "load_stats"]


def fallback_stats_path(stats_path: str | os.PathLike[str]) -> Path:
    """Where the stats go when ``stats_path``'s directory cannot be written: one file per configured path in the
    system temp directory, so the daemon (on the same host) finds it from the path it configured."""
    key = hashlib.sha256(str(Path(stats_path).absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "pinsidecar-stats-fallback" / f"{key}.json"


@dataclass
class StatsSnapshot:
    """Live counters from pin mode, written now and then by the hook's side thread.

    ``seq`` grows by one per write within one engine boot, and ``boot_id`` changes every boot: a reader that sees
    ``boot_id`` change or ``seq`` go backwards knows the engine restarted and its counters started from zero.
    """

    boot_id: str
    seq: int
    layer_ids: list[int]
    num_experts: int
    top_k: int
    selections: list[int]  # per layer
    cold_selections: list[int]  # per layer
    tokens: int
    map_hash: str = ""
    map_label: str = ""
    pid: int = 0
    written_at: float = 0.0
    tier_bytes: dict[str, int] = field(default_factory=dict)  # {"hbm": ..., "host": ...}
    histogram: list[list[int]] | None = None  # [layer][expert] selections, optional
    errors: dict[str, int] = field(default_factory=dict)  # e.g. {"stats_write": 3}
    flush_token: str = ""  # the last flush/reset request served (contract.requests), echoed until the next one
    meta: dict[str, Any] = field(default_factory=dict)
    # The cache tier, when the map has slots (docs/cache-tier.md); None otherwise. Keys: ``slots`` and ``policy``
    # (the map's), and per layer: ``hits`` (selections served by a slot filled before the step), ``fills`` (cold
    # experts copied into a slot) and ``evictions`` (fills that replaced another expert). With a cache,
    # ``cold_selections`` are the misses: selections of a cold expert that was not in a slot when its step began,
    # each read from host memory once for the step (into a slot, or in place when no slot was free).
    cache: dict[str, Any] | None = None

    @property
    def total_selections(self) -> int:
        return int(sum(self.selections))

    @property
    def total_cold_selections(self) -> int:
        return int(sum(self.cold_selections))

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc.update(format=STATS_FORMAT, version=VERSION)
        return doc

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: Any = None) -> StatsSnapshot:
        layer_ids, num_experts, top_k = _read_dims(doc, path)
        sel = _int_list(_field(doc, "selections", list, path), "selections", path)
        cold = _int_list(_field(doc, "cold_selections", list, path), "cold_selections", path)
        if len(sel) != len(layer_ids) or len(cold) != len(layer_ids):
            raise ArtifactError(path, "selections / cold_selections must have one entry per layer")
        if any(c < 0 or c > s for s, c in zip(sel, cold, strict=True)):
            raise ArtifactError(path, "cold_selections must be between 0 and selections in every layer")
        hist = doc.get("histogram")
        if hist is not None:
            if not isinstance(hist, list) or len(hist) != len(layer_ids):
                raise ArtifactError(path, "histogram must have one row per layer")
            for i, row in enumerate(hist):
                if len(_int_list(row, f"histogram row {i}", path)) != num_experts:
                    raise ArtifactError(path, f"histogram row {i} must have {num_experts} entries")
            for i, row in enumerate(hist):
                if any(not 0 <= v <= COUNT_LIMIT for v in row):
                    raise ArtifactError(path, f"histogram row {i} has counts outside 0..{COUNT_LIMIT}")
        if any(s > COUNT_LIMIT for s in sel):
            raise ArtifactError(path, f"selections must be at most {COUNT_LIMIT} (64-bit counters)")
        seq = _field(doc, "seq", int, path)
        tokens = _field(doc, "tokens", int, path)
        if not (0 <= seq <= COUNT_LIMIT and 0 <= tokens <= COUNT_LIMIT):
            raise ArtifactError(path, f"seq and tokens must be >= 0, got seq={seq}, tokens={tokens}",
                                "the file is corrupt; it is rewritten at the engine's next stats write")
        return cls(
            boot_id=str(_field(doc, "boot_id", str, path)), seq=seq, layer_ids=layer_ids,
            num_experts=num_experts, top_k=top_k, selections=sel, cold_selections=cold,
            tokens=tokens, map_hash=str(doc.get("map_hash", "")),
            map_label=str(doc.get("map_label", "")), pid=int(doc.get("pid", 0) or 0),
            written_at=_finite(doc.get("written_at", 0.0) or 0.0, "written_at", path, 0.0),
            tier_bytes={str(k): int(v) for k, v in (doc.get("tier_bytes") or {}).items()},
            histogram=hist, errors={str(k): int(v) for k, v in (doc.get("errors") or {}).items()},
            flush_token=str(doc.get("flush_token", "") or ""), meta=dict(doc.get("meta", {}) or {}),
            cache=_read_cache_stats(doc.get("cache"), sel, cold, path),
        )


CACHE_COUNTERS = ("hits", "fills", "evictions")


def _read_cache_stats(raw: Any, sel: list[int], cold: list[int], path: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    fix = "the file is corrupt; it is rewritten at the engine's next stats write"
    if not isinstance(raw, dict):
        raise ArtifactError(path, f"cache must be an object, got {type(raw).__name__}", fix)
    slots = _field(raw, "slots", int, path)
    if slots < 1:
        raise ArtifactError(path, f"cache slots must be at least 1, got {slots}", fix)
    out: dict[str, Any] = {"slots": slots, "policy": str(raw.get("policy", "lru"))}
    for key in CACHE_COUNTERS:
        values = _int_list(_field(raw, key, list, path), f"cache {key}", path)
        if len(values) != len(sel) or any(not 0 <= v <= COUNT_LIMIT for v in values):
            raise ArtifactError(path, f"cache {key} must have one count in 0..{COUNT_LIMIT} per layer", fix)
        out[key] = values
    if any(h + c > s for h, c, s in zip(out["hits"], cold, sel, strict=True)):
        raise ArtifactError(path, "cache hits + cold_selections exceed selections in a layer", fix)
    if any(e > f for e, f in zip(out["evictions"], out["fills"], strict=True)):
        raise ArtifactError(path, "cache evictions exceed fills in a layer (every eviction is a fill's)", fix)
    return out


def load_stats(path: str | os.PathLike[str]) -> StatsSnapshot:
    return _guarded(StatsSnapshot.from_json, _read_json(path, STATS_FORMAT), path)
