"""The three files that are the whole interface between the hook and the daemon.

The hook (inside the vLLM worker) and the daemon (outside it) never import each other's code or talk over a
socket: they exchange *counts* (count mode out), a *map* (pin mode in) and *stats* (pin mode out). Everything
about those files lives here, so that the one module both sides import is the single place to read and change
a format:

- every file carries ``format`` and ``version``; an unknown version is refused, never guessed at;
- every read validates shape, ranges and internal consistency and raises :class:`ArtifactError` with the path
  and a hint, never a silent default;
- every write goes through :func:`atomic_write_bytes` (write a temp file in the same directory, fsync,
  rename, fsync the directory), so a reader sees the old file or the new one, never half of one.

This module only needs the standard library and numpy: it must import inside a container that has nothing of
pinsidecar but the bind-mounted ``hook/`` folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "COUNTS_FORMAT",
    "MAP_FORMAT",
    "STATS_FORMAT",
    "VERSION",
    "ArtifactError",
    "CountsArtifact",
    "ExpertMap",
    "LayerPlacement",
    "ModelInfo",
    "StatsSnapshot",
    "atomic_write_bytes",
    "atomic_write_json",
    "cold_selection_ratio",
    "load_counts",
    "load_map",
    "load_stats",
    "read_hook_request",
    "request_path",
    "utc_now",
    "write_hook_request",
]

COUNTS_FORMAT = "pinsidecar.counts"
MAP_FORMAT = "pinsidecar.map"
STATS_FORMAT = "pinsidecar.stats"
# One version for all three; bump it (and keep a reader for the old one) whenever a field changes meaning.
VERSION = 1


class ArtifactError(ValueError):
    """A counts, map or stats file that cannot be used as it is. The message names the file and the fix."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str, hint: str = "") -> None:
        self.path = None if path is None else str(path)
        self.problem = problem
        self.hint = hint
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{problem}" + (f" ({hint})" if hint else ""))


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, the only time format the artifacts use."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------------- writing


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that no reader, and no crash, ever sees a partial file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    # Compact on purpose: an indented dump takes the pure-Python encoder, ~14x slower on a 40 x 384 map, and these
    # files are read through `pinsidecar counts show` / `map show`, not by eye.
    atomic_write_bytes(path, (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode())


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sha256(obj: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(obj)).hexdigest()


# ---------------------------------------------------------------------------------------------------- reading


def _read_json(path: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(p, "file not found", "check the path") from None
    except OSError as exc:
        raise ArtifactError(p, f"cannot read: {exc.strerror}", "check permissions") from None
    if not raw.strip():
        raise ArtifactError(p, "file is empty", f"regenerate the {fmt.split('.')[-1]} file")
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            p, f"not valid JSON ({exc}); the file is corrupt or truncated",
            f"regenerate the {fmt.split('.')[-1]} file",
        ) from None
    if not isinstance(doc, dict):
        raise ArtifactError(p, "top level is not a JSON object", "this is not a pinsidecar artifact")
    found = doc.get("format")
    if found != fmt:
        raise ArtifactError(p, f"format is {found!r}, expected {fmt!r}", "pass the right kind of file")
    version = doc.get("version")
    if version != VERSION:
        raise ArtifactError(
            p, f"format version {version!r} is not supported (this pinsidecar reads version {VERSION})",
            "rebuild the file with this pinsidecar version, or upgrade pinsidecar",
        )
    return doc


def _field(doc: dict[str, Any], key: str, typ: type | tuple[type, ...], path: Any) -> Any:
    if key not in doc:
        raise ArtifactError(path, f"missing field {key!r}", "the file is truncated or hand-edited; regenerate it")
    value = doc[key]
    if isinstance(value, bool) and typ in (int, float, (int, float)):
        raise ArtifactError(path, f"field {key!r} has type bool")
    if not isinstance(value, typ):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ArtifactError(path, f"field {key!r} should be {name}, got {type(value).__name__}")
    return value


def _int_list(value: Any, what: str, path: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ArtifactError(path, f"{what} must be a list of integers")
    return value


# ---------------------------------------------------------------------------------------------------- model


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


def _check_dims(layer_ids: list[int], num_experts: int, top_k: int, path: Any) -> None:
    if not layer_ids:
        raise ArtifactError(path, "no layers")
    if len(set(layer_ids)) != len(layer_ids) or any(i < 0 for i in layer_ids):
        raise ArtifactError(path, f"layer_ids must be distinct non-negative integers, got {layer_ids}")
    if num_experts < 1:
        raise ArtifactError(path, f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ArtifactError(path, f"top_k must be in 1..num_experts ({num_experts}), got {top_k}")


# ---------------------------------------------------------------------------------------------------- counts


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
        layer_ids = _int_list(_field(doc, "layer_ids", list, path), "layer_ids", path)
        num_experts = _field(doc, "num_experts", int, path)
        top_k = _field(doc, "top_k", int, path)
        _check_dims(layer_ids, num_experts, top_k, path)
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
        tokens = _field(doc, "tokens", int, path)
        if tokens < 0:
            raise ArtifactError(path, f"tokens must be >= 0, got {tokens}")
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


def _guarded(parse: Any, doc: dict[str, Any], path: Any) -> Any:
    """Run a ``from_json`` so that any malformed optional field is an :class:`ArtifactError` too, never a bare
    ValueError/TypeError from deep inside a conversion."""
    try:
        return parse(doc, path)
    except ArtifactError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ArtifactError(path, f"malformed field ({type(exc).__name__}: {exc})",
                            "the file is corrupt or hand-edited; regenerate it") from None


def load_counts(path: str | os.PathLike[str]) -> CountsArtifact:
    return _guarded(CountsArtifact.from_json, _read_json(path, COUNTS_FORMAT), path)


# ---------------------------------------------------------------------------------------------------- map


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's residency: ``hot`` global expert ids live in HBM rows 0..H-1 (in this order), ``cold``
    ids in host rows H..H+C-1."""

    layer_id: int
    hot: tuple[int, ...]
    cold: tuple[int, ...]

    def row_map(self, num_experts: int) -> list[int]:
        """Expert id -> row in the re-homed layout (hot rows first). The hook turns this into an int32 tensor."""
        rows = [-1] * num_experts
        for r, e in enumerate((*self.hot, *self.cold)):
            rows[e] = r
        return rows


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

    @property
    def cold_rows(self) -> int:
        return self.num_experts - self.hot_rows

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def geometry(self) -> dict[str, int]:
        return {"hot_rows": self.hot_rows, "cold_rows": self.cold_rows, "expert_bytes": self.expert_bytes,
                "num_experts": self.num_experts, "num_layers": self.num_layers, "top_k": self.top_k}

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
        return np.asarray([lp.row_map(self.num_experts) for lp in self.layers], dtype=np.int32)

    def hot_mask(self) -> np.ndarray:
        """bool [num_layers, num_experts]: True where the expert is HBM-resident."""
        mask = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        for i, lp in enumerate(self.layers):
            mask[i, list(lp.hot)] = True
        return mask

    def _placement_json(self) -> dict[str, Any]:
        return {
            "layer_ids": list(self.layer_ids),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "geometry": self.geometry(),
            "layers": [{"layer_id": lp.layer_id, "hot": list(lp.hot), "cold": list(lp.cold)} for lp in self.layers],
        }

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
        layer_ids = _int_list(_field(doc, "layer_ids", list, path), "layer_ids", path)
        num_experts = _field(doc, "num_experts", int, path)
        top_k = _field(doc, "top_k", int, path)
        _check_dims(layer_ids, num_experts, top_k, path)
        geom = _field(doc, "geometry", dict, path)
        hot_rows = _field(geom, "hot_rows", int, path)
        cold_rows = _field(geom, "cold_rows", int, path)
        expert_bytes = int(geom.get("expert_bytes", 0) or 0)
        if hot_rows < 0 or cold_rows < 0 or hot_rows + cold_rows != num_experts:
            raise ArtifactError(path, f"geometry hot_rows={hot_rows} + cold_rows={cold_rows} != num_experts "
                                f"({num_experts})", "the map is corrupt; rebuild it")
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
            predicted_cold_rate=None if pcr is None else float(pcr), created_at=str(doc.get("created_at", "")),
            meta=dict(doc.get("meta", {}) or {}),
        )
        stated = doc.get("hash")
        if stated is not None and stated != emap.content_hash:
            raise ArtifactError(path, f"content hash mismatch (file says {stated}, content is {emap.content_hash})",
                                "the map was edited or corrupted; rebuild it with `pinsidecar map build`")
        return emap


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
    missing = sorted(set(range(num_experts)) - seen)
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


# ---------------------------------------------------------------------------------------------------- stats


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
    meta: dict[str, Any] = field(default_factory=dict)

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
        layer_ids = _int_list(_field(doc, "layer_ids", list, path), "layer_ids", path)
        num_experts = _field(doc, "num_experts", int, path)
        top_k = _field(doc, "top_k", int, path)
        _check_dims(layer_ids, num_experts, top_k, path)
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
        seq = _field(doc, "seq", int, path)
        return cls(
            boot_id=str(_field(doc, "boot_id", str, path)), seq=seq, layer_ids=layer_ids,
            num_experts=num_experts, top_k=top_k, selections=sel, cold_selections=cold,
            tokens=_field(doc, "tokens", int, path), map_hash=str(doc.get("map_hash", "")),
            map_label=str(doc.get("map_label", "")), pid=int(doc.get("pid", 0) or 0),
            written_at=float(doc.get("written_at", 0.0) or 0.0),
            tier_bytes={str(k): int(v) for k, v in (doc.get("tier_bytes") or {}).items()},
            histogram=hist, errors={str(k): int(v) for k, v in (doc.get("errors") or {}).items()},
            meta=dict(doc.get("meta", {}) or {}),
        )


def load_stats(path: str | os.PathLike[str]) -> StatsSnapshot:
    return _guarded(StatsSnapshot.from_json, _read_json(path, STATS_FORMAT), path)


# ---------------------------------------------------------------------------------------------------- requests


def request_path(artifact_path: str | os.PathLike[str]) -> Path:
    """Where the daemon drops a request for the hook that writes ``artifact_path`` (counts or stats).

    A file rather than a signal or socket because the engine's worker may be a grandchild process, or live in a
    container: the daemon can always reach the artifact's directory, and nothing else.
    """
    p = Path(artifact_path)
    return p.with_name(p.name + ".request")


HOOK_OPS = ("flush", "reset")


def write_hook_request(artifact_path: str | os.PathLike[str], op: str) -> str:
    """Ask the hook to ``flush`` (write its counters now) or ``reset`` (zero them, then write).

    Returns a token; the hook copies it into the next artifact it writes (``flush_token``), which is how the
    caller knows its request was served.
    """
    if op not in HOOK_OPS:
        raise ValueError(f"unknown hook request {op!r}; expected one of {HOOK_OPS}")
    token = f"{op}-{os.getpid()}-{time.time_ns()}"
    atomic_write_json(request_path(artifact_path), {"op": op, "token": token})
    return token


def read_hook_request(artifact_path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The pending (op, token), or None. A malformed request is ignored (and removed) rather than fatal: the
    hook runs inside the serving engine and must never fail because of a stray file."""
    p = request_path(artifact_path)
    try:
        doc = json.loads(p.read_bytes())
        op, token = str(doc["op"]), str(doc["token"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            p.unlink()
        return None
    return (op, token) if op in HOOK_OPS else None
