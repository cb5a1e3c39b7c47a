"""The maps library: a folder of map files, watched, each one validated as it appears.

Maps are per-workload artifacts (docs/design.md), built elsewhere (``pinsidecar map build``, the remap
pipeline) and dropped into ``maps.dir``. The library's job is to know what is there and whether each file is
usable, *not* to act on it: a valid new map is logged and listed in ``pinsidecar status``; an invalid one is listed
with the reason. Activation happens only by command (``pinsidecar drain-reboot --map``) or by the remap policy.

The folder is watched with ``watchdog`` (inotify on Linux). Its callbacks run on the observer's thread, so they only
hand the path to the event loop; validation (:func:`~pinsidecar_hook.contract.load_map`) runs there. Atomic writers
(:func:`~pinsidecar_hook.contract.atomic_write_bytes`) create ``.<name>.<rand>.tmp`` and rename it into place: hidden
and ``.tmp`` files are ignored and the rename is seen as the new file.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, ExpertMap, load_map, utc_now
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class MapNotFound(LookupError):
    """No map matches the reference given (path, file name in the library, or hash prefix)."""


class MapPathRefused(MapNotFound):
    """A map reference whose path leads out of the maps folder (``..``, an absolute path elsewhere, a symlink
    pointing out). A :class:`MapNotFound`, so every caller that answers 400 for an unknown map answers 400 here."""


@dataclass
class MapEntry:
    path: Path
    valid: bool
    seen_at: str
    hash: str = ""
    label: str = ""
    created_at: str = ""
    geometry: dict[str, int] = field(default_factory=dict)
    predicted_cold_rate: float | None = None
    error: str = ""
    map: ExpertMap | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("map")
        out["path"] = str(self.path)
        return out


def _ignored(path: Path) -> bool:
    # <map>.counts.json: the counts a map was built from, kept beside it (pinsidecar.remap.candidates)
    return path.name.startswith(".") or path.name.endswith((".tmp", ".swp", "~", ".counts.json"))


def check_map(path: Path) -> MapEntry:
    """Validate one file into a library entry (never raises for a bad map)."""
    try:
        emap = load_map(path)
    except ArtifactError as exc:
        return MapEntry(path=path, valid=False, seen_at=utc_now(), error=str(exc))
    except OSError as exc:
        return MapEntry(path=path, valid=False, seen_at=utc_now(), error=f"{path}: {exc.strerror}")
    return MapEntry(path=path, valid=True, seen_at=utc_now(), hash=emap.content_hash, label=emap.label,
                    created_at=emap.created_at, geometry=emap.geometry(),
                    predicted_cold_rate=emap.predicted_cold_rate, map=emap)


class _Handler(FileSystemEventHandler):
    def __init__(self, notify: Callable[[Path, bool], None]) -> None:
        self.notify = notify

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type in ("opened", "closed_no_write"):
            return
        if event.event_type == "moved":
            self.notify(Path(os.fsdecode(event.src_path)), False)
            self.notify(Path(os.fsdecode(event.dest_path)), True)
        elif event.event_type == "deleted":
            self.notify(Path(os.fsdecode(event.src_path)), False)
        else:  # created, modified, closed
            self.notify(Path(os.fsdecode(event.src_path)), True)


class MapLibrary:
    """What is in the maps folder. ``await start()`` scans it and starts watching; ``entries()`` lists it."""

    def __init__(self, directory: Path, watch: bool = True,
                 on_change: Callable[[MapEntry | None, Path], None] | None = None) -> None:
        self.directory = Path(directory)
        self.watch = watch
        self.on_change = on_change
        self._entries: dict[Path, MapEntry] = {}
        self._observer: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        if self.watch:
            # Start watching before the scan, so that a file written in between is not missed.
            observer = Observer()
            observer.schedule(_Handler(self._from_thread), str(self.directory), recursive=False)
            observer.daemon = True
            observer.start()
            self._observer = observer
        for p in sorted(self.directory.iterdir()):
            if p.is_file() and not _ignored(p):
                self.refresh(p)
        log.info("maps_library", dir=str(self.directory), maps=len(self._entries),
                 valid=sum(e.valid for e in self._entries.values()), watching=self.watch)

    async def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            await asyncio.to_thread(self._observer.join, 5.0)
            self._observer = None

    def _from_thread(self, path: Path, present: bool) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_event, path, present)

    def _on_event(self, path: Path, present: bool) -> None:
        if _ignored(path) or path.parent != self.directory:
            return
        if present and path.is_file():
            self.refresh(path)
        elif path in self._entries:
            del self._entries[path]
            log.info("map_removed", path=str(path))
            if self.on_change is not None:
                self.on_change(None, path)

    def refresh(self, path: Path) -> MapEntry:
        """(Re)validate one file and record it; logs what changed."""
        entry = check_map(path)
        old = self._entries.get(path)
        self._entries[path] = entry
        if old is not None and old.valid == entry.valid and old.hash == entry.hash and old.error == entry.error:
            return entry  # a repeated event for the same content (modified + closed)
        if entry.valid:
            log.info("map_found", path=str(path), hash=entry.hash, label=entry.label, geometry=entry.geometry,
                     predicted_cold_rate=entry.predicted_cold_rate)
        else:
            log.warning("map_invalid", path=str(path), reason=entry.error)
        if self.on_change is not None:
            self.on_change(entry, path)
        return entry

    def entries(self) -> list[MapEntry]:
        return sorted(self._entries.values(), key=lambda e: str(e.path))

    def resolve(self, ref: str) -> Path:
        """A map reference from the control API: a file name in the library, a path inside the maps folder
        (absolute, or relative to it), or a hash (prefix, ``sha256:`` optional, at least 8 hex digits). Raises
        :class:`MapNotFound`; :class:`MapPathRefused` for a path that leads out of the maps folder.

        Why confined: the reference comes over HTTP, and the engine would load whatever file it names. Every
        path is resolved (``..`` and symlinks followed) and must end inside the maps folder; ``../x``,
        ``/etc/passwd`` or a symlink in the folder pointing out are refused, before anything reads the file."""
        if "\x00" in ref:
            raise MapPathRefused(f"map reference {ref!r} contains a NUL byte")
        root = self.directory.resolve()
        target = (root / ref).resolve()  # an absolute ref replaces root; `..` and symlinks are followed
        if not target.is_relative_to(root):
            raise MapPathRefused(
                f"map {ref!r} is outside the maps folder {root} (resolves to {target}); maps are taken only from "
                f"that folder: copy the file there (cp FILE {root}/) and pass its name")
        try:
            if target.is_file():
                return target
        except OSError as exc:  # a name too long, a loop of symlinks: not a map either way
            raise MapNotFound(f"no map {ref[:200]!r}: {exc.strerror}") from None
        digest = ref.removeprefix("sha256:").lower()
        if len(digest) >= 8 and all(c in "0123456789abcdef" for c in digest):
            hits = [e for e in self._entries.values() if e.valid and e.hash.removeprefix("sha256:").startswith(digest)]
            if len(hits) == 1:
                return hits[0].path
            if len(hits) > 1:
                raise MapNotFound(f"map hash {ref!r} is ambiguous ({len(hits)} maps); give more digits")
        raise MapNotFound(f"no map {ref!r}: not a file, not a file in {self.directory}, not a known hash")
