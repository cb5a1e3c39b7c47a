"""Reading one TOML table into its dataclass: pydantic validates the table's file model (:mod:`._models`), and this
module turns the outcome into the dataclass, the deprecations and the problems.

Every problem of the table is reported, not the first: a refused value is left at its default and its field is
marked failed (:func:`~pinsidecar.schema.usable`), so the reader can go on to the next table and to the checks
across keys. Problems come in the order the file writes the keys.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from pinsidecar.schema._layout import (
    EXISTS,
    Deprecation,
    Places,
    dotted,
    fields_of,
    keep_places,
    layout,
    open_tables,
    where,
)
from pinsidecar.schema._messages import field_problem, not_a_table, unknown_key
from pinsidecar.schema._models import SectionShape, Slot, section_shape
from pinsidecar.schema._problems import ConfigError, Problems

__all__: list[str] = []  # re-exported by the package

T = TypeVar("T")

log = structlog.get_logger(__name__)

_NOT_A_TABLE = {"model_type", "model_attributes_type", "dict_type"}


def _positions(raw: Mapping[str, Any]) -> dict[tuple[str | None, str], int]:
    """Where each key is in the file: (sub-table or None, key) -> its order, a sub-table's keys at its place."""
    out: dict[tuple[str | None, str], int] = {}
    for k, v in raw.items():
        out[(None, k)] = len(out)
        if isinstance(v, dict):
            for sk in v:
                out[(k, sk)] = len(out)
    return out


def _present(raw: Mapping[str, Any], slot: Slot) -> bool:
    if slot.table is None:
        return slot.key in raw
    sub = raw.get(slot.table)
    return isinstance(sub, dict) and slot.key in sub


def _raw_value(raw: Mapping[str, Any], slot: Slot) -> Any:
    return raw[slot.key] if slot.table is None else raw[slot.table][slot.key]


def _without(raw: Mapping[str, Any], drop: Iterable[tuple[str | None, str]]) -> dict[str, Any]:
    """A copy of the table without the keys ``drop`` names ((None, key) or (sub-table, key))."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for table, key in drop:
        holder = out if table is None else out.get(table)
        if isinstance(holder, dict):
            holder.pop(key, None)
    return out


def _exists_problem(key: str, kind: str, value: Path) -> str | None:
    if not value.exists():
        return f"{key}: {value} does not exist (fix the path or create it)"
    if kind == "file" and not value.is_file():
        return f"{key}: {value} is not a file (point it at a file)"
    if kind == "dir" and not value.is_dir():
        return f"{key}: {value} is not a folder (point it at a folder)"
    return None


class _TableReader:
    """One pass over one table; :meth:`read` gives the dataclass and fills ``found`` and ``problems``."""

    def __init__(self, name: str, cls: type, raw: dict[str, Any], base: Path, notes: Mapping[str, str]) -> None:
        self.name, self.cls, self.raw, self.base, self.notes = name, cls, raw, base, notes
        self.shape: SectionShape = section_shape(name, cls)
        self.fields = fields_of(cls)
        self.hints = typing.get_type_hints(cls)
        self.top, self.subs = layout(cls)
        self.positions = _positions(raw)
        self.problems: list[tuple[int, str]] = []
        self.failed: set[str] = set()
        self.dropped: set[tuple[str | None, str]] = set()

    def _problem(self, at: tuple[str | None, str], message: str) -> None:
        self.problems.append((self.positions.get(at, len(self.positions)), message))

    def _slot_at(self, table: str | None, key: str) -> Slot | None:
        """The slot a key of the table fills (a moved key at its old place is in the section itself)."""
        for slot in self.shape.slots:
            if slot.table == table and slot.key == key:
                return slot
        return None

    def _both_places(self) -> None:
        """A moved key written at its old place and at its new one: which one the operator meant is not ours to
        say, so it is an error naming both (and neither is read)."""
        for slot in self.shape.slots:
            if not slot.old or not _present(self.raw, slot):
                continue
            new = self.shape.new_place(slot.field)
            if _present(self.raw, new):
                old_key, new_key = dotted(self.name, None, slot.key), dotted(self.name, new.table, new.key)
                self._problem((None, slot.key), f"{old_key} and {new_key}: the same key set in two places (keep "
                                                f"{new_key} and remove {old_key})")
                self.failed.add(slot.field)
                self.dropped |= {(None, slot.key), (new.table, new.key)}

    def _errors(self, errors: list[ErrorDetails]) -> None:
        by_slot: dict[Slot, list[ErrorDetails]] = {}
        for err in errors:
            loc = [str(part) for part in err["loc"]]
            table = loc[0] if loc[0] in self.shape.tables and len(loc) > 1 else None
            key = loc[1] if table is not None else loc[0]
            if err["type"] == "extra_forbidden":
                self._problem((table, key), unknown_key(self.name, table, key, self.top, self.subs, self.fields,
                                                        self.notes))
                self.dropped.add((table, key))
            elif table is None and key in self.shape.tables and err["type"] in _NOT_A_TABLE:
                self._problem((None, key), not_a_table(f"{self.name}.{key}", self.raw[key]))
                self.dropped.add((None, key))
                self.failed |= set(self.subs[key].values())
            else:
                slot = self._slot_at(table, key)
                if slot is None:  # nothing else reaches here; a message rather than a crash if it ever does
                    self._problem((table, key), f"{'.'.join([self.name, *loc])}: {err['msg']} (fix the value)")
                    self.dropped.add((table, key))
                    continue
                by_slot.setdefault(slot, []).append(err)
        for slot, errs in by_slot.items():
            key = dotted(self.name, slot.table, slot.key)
            self._problem((slot.table, slot.key),
                          field_problem(key, self.fields[slot.field], self.hints[slot.field],
                                        _raw_value(self.raw, slot), errs))
            self.failed.add(slot.field)
            self.dropped.add((slot.table, slot.key))

    def _validate(self) -> tuple[Any, dict[str, Any]]:
        """The validated model of the table, after taking every refusal out of it (and the table it read)."""
        context = {"base": self.base}
        table = _without(self.raw, self.dropped)
        try:
            return self.shape.model.model_validate(table, context=context), table
        except ValidationError as exc:
            self._errors(exc.errors())
        table = _without(self.raw, self.dropped)
        try:
            return self.shape.model.model_validate(table, context=context), table
        except ValidationError as exc:  # a refusal the first pass did not name: none known; every key refused
            self._problem((None, ""), f"{self.name}: {exc.errors()[0]['msg']} (fix the table)")
            self.failed |= set(self.fields)
            return None, {}

    def read(self, check_paths: bool, found: list[Deprecation]) -> Any:
        self._both_places()
        model, table = self._validate()
        kwargs: dict[str, Any] = {}
        written: dict[str, str] = {}
        for slot in self.shape.slots:
            key = dotted(self.name, slot.table, slot.key)
            if _present(self.raw, slot) and slot.field not in written:
                written[slot.field] = key
            if model is None or not _present(table, slot):
                continue
            value = self.shape.value(model, slot)
            kind = self.fields[slot.field].metadata.get(EXISTS)
            problem = _exists_problem(key, kind, value) if kind and check_paths and isinstance(value, Path) else None
            if problem is not None:
                self._problem((slot.table, slot.key), problem)
                self.failed.add(slot.field)
                continue
            kwargs[slot.field] = value
            if slot.old:
                new = self.shape.new_place(slot.field)
                as_key = f" as {new.key}" if new.key != slot.field else ""
                found.append(Deprecation(key, dotted(self.name, new.table, new.key),
                                         f"{key} is deprecated here: move it to {where(self.name, new.table)}"
                                         f"{as_key}"))
        out = self.cls(**kwargs)
        keep_places(out, Places(written, legacy=any(s.old and _present(self.raw, s) for s in self.shape.slots),
                                failed=frozenset(self.failed)))
        return out


def build_section(name: str, cls: type[T], raw: Any, base: Path, check_paths: bool = True, *,
                  deprecations: list[Deprecation] | None = None, notes: Mapping[str, str] | None = None,
                  problems: Problems | None = None) -> T:
    """The table ``[name]`` (``raw``, as parsed) as an instance of the dataclass ``cls``; absent keys take the
    field defaults. ``check_paths=False`` skips "does this path exist" (for a host that only talks to a daemon
    running elsewhere).

    A field with :data:`~pinsidecar.schema.TABLE` metadata is read from ``[name.TABLE]``; found in ``[name]`` under
    its field name instead (where it was before it moved), it is taken and a :class:`Deprecation` is appended to
    ``deprecations`` (``None``: logged here, see :func:`warn_deprecations`); found in both, it is an error naming
    both. ``notes``: what an unknown-key message adds about a sub-table.

    With ``problems``, every problem is added there and the table is returned anyway, refused values at their
    default (:func:`~pinsidecar.schema.usable` says which); without, a :class:`ConfigError` holding every problem
    of the table is raised."""
    own = Problems() if problems is None else problems
    found: list[Deprecation] = []
    if not isinstance(raw, dict):
        own.add(not_a_table(name, raw))
        out = _default_instance(cls)
    else:
        reader = _TableReader(name, cls, raw, base, {**{t: f", and {d}" for t, d in open_tables(cls).items()},
                                                     **(notes or {})})
        out = reader.read(check_paths, found)
        for _, message in sorted(reader.problems, key=lambda p: p[0]):
            own.add(message)
    end_table(own, problems is not None, found, deprecations)
    return out


def end_table(problems: Problems, collecting: bool, found: list[Deprecation],
              deprecations: list[Deprecation] | None) -> None:
    """The end of reading one table: its problems raised, unless the caller ``collecting`` them goes on to the
    next table; then its deprecations handed to the caller's ``deprecations`` (``None``: logged here)."""
    if not collecting:
        problems.raise_any()
    if deprecations is None:
        warn_deprecations(found)
    else:
        deprecations.extend(found)


def warn_deprecations(found: Iterable[Deprecation], source: str | os.PathLike[str] | None = None) -> None:
    """Log each deprecated key once, as a warning naming its new place (and the file, when known): the journal
    and a person at a terminal both see it, and the config still loads."""
    for d in found:
        log.warning("config_key_deprecated", detail=d.message, key=d.key, move_to=d.new_key,
                    file=str(source) if source is not None else None)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a TOML config file. Raises :class:`ConfigError` naming the file when it is missing or not TOML."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found (pass --config PATH)") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a folder, not a config file (pass --config FILE)") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror} (check its permissions)") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc} (fix the syntax there)") from None
    except RecursionError:  # arrays nested deeper than the parser's stack
        raise ConfigError(f"{p}: not valid TOML: nested too deeply (fix the syntax)") from None


def _default_instance(cls: type[T]) -> T:
    """``cls()`` with every field marked failed: what a reader uses for a table it could not read at all."""
    out = cls()
    keep_places(out, Places({}, legacy=False, failed=frozenset(fields_of(cls))))
    return out
