"""Candidate maps: the library the pipeline checks first, how a new candidate is built, and how it lands there.

**The library first.** Maps are per traffic class (``ExpertMap.label``), and traffic classes come back: the code
traffic of the morning returns in the afternoon. If a map already in the library fits the live window better
than the active map by the margin, deploying it costs a reboot only; a count boot would spend minutes of a second
engine to rebuild what is already on disk. :func:`library_maps` lists the labelled maps of the folder.

**A new candidate is the active map rebuilt** from the traffic served now (:func:`build_candidate`): the one map
builder's :func:`~pinsidecar.placement.rebuild_map`, with the active map's geometry, bytes per expert and cache,
so it carries the same meta as a map ``pinsidecar map build`` writes from the same counts.

**A candidate lands atomically, beside its counts.** :func:`save_candidate` writes the counts the map was built
from as ``<map>.counts.json`` first, then the map, each with write-fsync-rename, into a *new* file named after
its label and hash: a crash leaves either no map or a whole one (a write refused by a full or read-only folder
leaves neither: the counts already written are removed), and a candidate never replaces the file of the
map that serves (the active map's file is never written). The counts beside a map are what the drift watch
measures divergence against once that map serves (:func:`reference_counts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import structlog
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap, load_counts

from pinsidecar.drift.windows import Window
from pinsidecar.placement import rebuild_map

__all__ = ["COUNTS_SUFFIX", "counts_path_for", "find_by_label", "reference_counts"]

log = structlog.get_logger(__name__)

COUNTS_SUFFIX = ".counts.json"


def counts_path_for(map_path: Path) -> Path:
    """Where the counts a map was built from live: ``maps/code.json`` -> ``maps/code.counts.json``."""
    return map_path.with_name(map_path.stem + COUNTS_SUFFIX)


def reference_counts(map_path: Path | None, emap: ExpertMap | None = None) -> CountsArtifact | None:
    """The counts beside ``map_path``, if present, readable and of the map's model; else None (the drift watch then
    uses its first window under the map)."""
    if map_path is None:
        return None
    path = counts_path_for(Path(map_path))
    if not path.is_file():
        return None
    try:
        counts = load_counts(path)
    except (ArtifactError, OSError) as exc:
        log.warning("map_counts_unusable", path=str(path), error=str(exc))
        return None
    if emap is not None and (tuple(counts.layer_ids) != tuple(emap.layer_ids)
                             or counts.num_experts != emap.num_experts):
        log.warning("map_counts_other_model", path=str(path), map=emap.short_hash)
        return None
    return counts


def build_candidate(counts: Sequence[CountsArtifact | Window], active: ExpertMap, label: str = "") -> ExpertMap:
    """A usage map from counted traffic with the active map's geometry (same hot rows and bytes per expert, and
    the same cache slots and policy: a remap never drops the cache, and the candidate stays eligible for an
    in-place apply).

    Pass the counts of one traffic class (one count boot, or the recent windows of what is served now); this never
    mixes classes on its own. A drift window is named ``window<index>`` in the map's ``source_files``.
    """
    arts = [c.to_counts() if isinstance(c, Window) else c for c in counts]
    names = [f"window{c.index}" if isinstance(c, Window) else (c.workload or f"counts{i}")
             for i, c in enumerate(counts)]
    return rebuild_map(arts, active, label=label, names=names)


def library_maps(entries: Iterable[object]) -> list[tuple[Path, ExpertMap]]:
    """The valid, labelled maps of the library (:class:`~pinsidecar.daemon.map_library.MapEntry` objects)."""
    out = []
    for e in entries:
        emap = getattr(e, "map", None)
        if getattr(e, "valid", False) and emap is not None and emap.label:
            out.append((Path(e.path), emap))  # type: ignore[attr-defined]
    return out


def find_by_label(entries: Iterable[object], label: str) -> Path | None:
    """The library map labelled ``label`` (the newest one if several are)."""
    hits = [(emap.created_at, str(p), p) for p, emap in library_maps(entries) if emap.label == label]
    return max(hits)[2] if hits else None


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:80] or "map"


def save_candidate(maps_dir: Path, emap: ExpertMap, counts: CountsArtifact | None,
                   existing: Iterable[tuple[Path, ExpertMap]] = ()) -> Path:
    """Put ``emap`` into the library (counts first, then the map; both atomic) and return its path. A map with the
    same placement already there is reused (its counts are added if it had none)."""
    for path, other in existing:
        if other.content_hash == emap.content_hash:
            if counts is not None and not counts_path_for(path).exists():
                counts.save(counts_path_for(path))
            return path
    path = Path(maps_dir) / f"{_safe(emap.label)}-{emap.short_hash}.json"
    wrote: list[Path] = []
    try:
        if counts is not None:
            counts.save(counts_path_for(path))
            wrote.append(counts_path_for(path))
        emap.save(path)
    except OSError as exc:  # a full or read-only folder: leave nothing of this candidate behind, say where
        for p in wrote:
            with contextlib.suppress(OSError):
                p.unlink()
        raise OSError(exc.errno, f"cannot write candidate map {path.name} into {maps_dir}: {exc.strerror}; free "
                      "space there or set maps.dir to a writable folder") from exc
    return path
