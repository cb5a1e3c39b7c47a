"""The counts file: per-layer x per-expert router selection counts from a count boot (count mode's output)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pinsidecar_hook.contract.io import (
    COUNT_LIMIT,
    COUNTS_FORMAT,
    VERSION,
    ArtifactError,
    _field,
    _guarded,
    _read_dims,
    _read_json,
    _sha256,
    atomic_write_json,
)

__all__ = ["CountsArtifact", "ModelInfo", "load_counts"]


@dataclass(frozen=True)
class ModelInfo:
    """Which model an artifact belongs to. ``path`` is informational; geometry is what is enforced."""

    path: str = ""
    revision: str = ""
    name: str = ""

    @classmethod
    def from_json(cls, obj: Any, path: Any) -> ModelInfo:
        if not isinstance(obj, dict):
            raise ArtifactError(path, "field 'model' must be an object")
        return cls(**{k: str(obj.get(k, "")) for k in ("path", "revision", "name")})


@dataclass
class CountsArtifact:
    """Per-layer x per-expert router selection counts from one count boot (or one hook flush).

    ``tokens`` is the number of tokens routed through the first MoE layer; with every token visiting every MoE
    layer, each layer's selections sum to ``tokens * top_k`` (checked as :attr:`consistent`, not enforced on
    read, because a periodic flush may land between two layers of one forward).
    """

    layer_ids: list[int]
    num_experts: int
    top_k: int
    counts: np.ndarray  # int64 [num_layers, num_experts]
    tokens: int
    model: ModelInfo = field(default_factory=ModelInfo)
    workload: str = ""
    started_at: str = ""
    ended_at: str = ""
    flush_token: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def selections(self) -> int:
        return int(self.counts.sum())

    @property
    def consistent(self) -> bool:
        return bool((self.counts.sum(axis=1) == self.tokens * self.top_k).all())

    def digest(self) -> str:
        """Content digest of the counts and their dimensions: what a map records as its source."""
        return _sha256(
            {"layer_ids": self.layer_ids, "num_experts": self.num_experts, "top_k": self.top_k,
             "counts": self.counts.tolist(), "tokens": self.tokens}
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": COUNTS_FORMAT,
            "version": VERSION,
            "model": dataclasses.asdict(self.model),
            "layer_ids": list(self.layer_ids),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "tokens": int(self.tokens),
            "selections": self.selections,
            "workload": self.workload,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "flush_token": self.flush_token,
            "meta": self.meta,
            "counts": self.counts.astype(np.int64).tolist(),
            "digest": self.digest(),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: Any = None) -> CountsArtifact:
        layer_ids, num_experts, top_k = _read_dims(doc, path)
        rows = _field(doc, "counts", list, path)
        if len(rows) != len(layer_ids):
            raise ArtifactError(path, f"counts has {len(rows)} rows but there are {len(layer_ids)} layers",
                                "the file is truncated or corrupt; regenerate it")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != num_experts:
                n = len(row) if isinstance(row, list) else type(row).__name__
                raise ArtifactError(path, f"counts row {i} has {n} entries, expected {num_experts}",
                                    "the file is truncated or corrupt; regenerate it")
        # One numpy pass instead of a Python type check per value: a ragged or non-integer table fails here.
        try:
            counts = np.asarray(rows)
        except ValueError:
            raise ArtifactError(path, "counts rows are ragged", "the file is corrupt; regenerate it") from None
        if counts.dtype.kind not in "iu" or counts.shape != (len(layer_ids), num_experts):
            raise ArtifactError(path, f"counts must be a table of integers, found {counts.dtype}",
                                "the file is corrupt; regenerate it")
        counts = counts.astype(np.int64, copy=False)
        if (counts < 0).any():
            raise ArtifactError(path, "negative counts", "the file is corrupt; regenerate it")
        # Every sum over a layer (selections, digests, merges) is int64: a value that could overflow one is corrupt.
        if counts.size and int(counts.max()) > COUNT_LIMIT // num_experts:
            raise ArtifactError(path, f"a count of {int(counts.max())} is too large (a layer's sum would overflow "
                                "64-bit integers)", "the file is corrupt; regenerate it")
        tokens = _field(doc, "tokens", int, path)
        if tokens < 0:
            raise ArtifactError(path, f"tokens must be >= 0, got {tokens}")
        if tokens > COUNT_LIMIT:
            raise ArtifactError(path, f"tokens must be at most {COUNT_LIMIT} (64-bit counters), got {tokens}")
        art = cls(
            layer_ids=layer_ids, num_experts=num_experts, top_k=top_k, counts=counts, tokens=tokens,
            model=ModelInfo.from_json(doc.get("model", {}), path),
            workload=str(doc.get("workload", "")), started_at=str(doc.get("started_at", "")),
            ended_at=str(doc.get("ended_at", "")), flush_token=str(doc.get("flush_token", "")),
            meta=dict(doc.get("meta", {}) or {}),
        )
        digest = doc.get("digest")
        if digest is not None and digest != art.digest():
            raise ArtifactError(path, "digest does not match the counts (file corrupted or edited)",
                                "regenerate the counts file")
        return art


def load_counts(path: str | os.PathLike[str]) -> CountsArtifact:
    return _guarded(CountsArtifact.from_json, _read_json(path, COUNTS_FORMAT), path)
