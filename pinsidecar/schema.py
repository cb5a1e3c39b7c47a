"""TOML tables as frozen dataclasses: the one validator behind every config table pinsidecar reads.

A config table is a frozen dataclass whose fields are the allowed keys; a field's annotation is its type and its
``metadata`` says what a value must satisfy beyond that (:data:`PORT`, :data:`MIN`, :data:`POSITIVE`,
:data:`CHOICES`, :data:`EXISTS`). :func:`build_section` turns one parsed TOML table into that dataclass, refusing
unknown keys, wrong types and out-of-range values with a message that names the key the way it is written in the
file (``engine.port: expected an integer 1-65535, got 'abc'``). Relative paths are taken relative to the config
file's folder.

Where a key lives. Most keys of a table are what an operator sets (a model, a port, a policy threshold); the
tuning keys (window sizes, poll intervals, timeouts, margins, budgets) live one level down, in ``[section.advanced]``
(:data:`ADVANCED` in a field's metadata), so the top of every table stays short enough to read at 3 am. The engine's
vLLM flags live in ``[engine.vllm]`` the same way (:data:`TABLE` and :data:`TOML_KEY`). The dataclass does not
change: a field keeps its Python name wherever its key lives, so nothing that reads a config knows about the
layout. A key found at its old place (the section itself, before it moved) still works: :func:`build_section`
takes it and reports a :class:`Deprecation` that names the new place (logged as a warning, and listed by
``pinsidecar check-config``); a key given at both places is an error naming both.

Why one module: the daemon's config, the count boot's ``--config`` and the drift watch all read tables of the
same file. With one validator, a key means the same thing and is refused with the same message whichever command
reads it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

__all__ = [
    "ADVANCED",
    "CHOICES",
    "EXISTS",
    "MIN",
    "POSITIVE",
    "TABLE",
    "TOML_KEY",
    "ConfigError",
    "Deprecation",
    "apply_override",
    "build_section",
    "drop_field",
    "has_field",
    "port_field",
    "read_toml",
    "replace_section",
    "set_field",
    "warn_deprecations",
    "written_key",
]

T = TypeVar("T")

log = structlog.get_logger(__name__)

# Field metadata keys: what a value must satisfy beyond its type.
PORT = "port"  # integer 1-65535
MIN = "min"  # number >= this
POSITIVE = "positive"  # number > 0
CHOICES = "choices"  # one of these strings
EXISTS = "exists"  # the path must exist ("file" or "dir" or "any")
# Field metadata keys: where the key lives in the file.
TABLE = "table"  # the sub-table of the section that holds the key ([section.TABLE]); absent: the section itself
TOML_KEY = "toml_key"  # the key's name there when it is not the field's name (a vLLM flag's own spelling)
ADVANCED_TABLE = "advanced"
# A tuning key: ``metadata={POSITIVE: True, **ADVANCED}`` puts it in ``[section.advanced]``.
ADVANCED: Mapping[str, Any] = types.MappingProxyType({TABLE: ADVANCED_TABLE})

# Where build_section read each key of a table from, kept on the instance (see written_key).
_PLACES_ATTR = "_schema_places"


class ConfigError(ValueError):
    """The config cannot be used. The message names the file, the key and what is expected."""


@dataclass(frozen=True)
class Deprecation:
    """A key the file sets at its old place: it still works, and the operator is told where it belongs now."""

    key: str  # where the file has it: "drift.window_tokens"
    new_key: str  # where it belongs: "drift.advanced.window_tokens"
    message: str  # what to tell the operator, naming the new place

    def __str__(self) -> str:
        return self.message

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "new_key": self.new_key, "message": self.message}


@dataclass(frozen=True)
class _Places:
    written: Mapping[str, str]  # field name -> the dotted key it was read from
    legacy: bool  # the table used the old layout (a key at its old place): name unwritten keys that way too


def port_field(default: int) -> Any:
    """A dataclass field holding a TCP port (checked to be 1-65535)."""
    return field(default=default, metadata={PORT: True})


def _describe(value: Any) -> str:
    return repr(value) if not isinstance(value, dict) else "a table"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_name(typ: Any) -> str:
    """How a message names a type: what the operator must write."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(typ) if a is not type(None))
    if origin is list:
        return "a list of strings"
    if origin is dict:
        return "a table of string values"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            Path: "a path"}.get(typ, repr(typ))


def _has_shape(typ: Any, value: Any) -> bool:
    """Whether ``value`` is the kind of TOML value ``typ`` is read from (a string for a path, any number for a
    float): which members of a union are worth trying, and whose error to give when the value is refused."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return any(_has_shape(a, value) for a in typing.get_args(typ) if a is not type(None))
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return _is_number(value)
    if typ in (str, Path):
        return isinstance(value, str)
    return False


def _convert_union(key: str, typ: Any, value: Any, base: Path) -> Any:
    """A union accepts a value of any of its member types, tried in the order written (``int | str``: 5 stays an
    integer, "5" a string). Refused: a message listing every type allowed, or, when the value has the shape of one
    member but that member refuses it (nan for a ``float``), that member's own message, which says more."""
    args = typing.get_args(typ)
    members = [a for a in args if a is not type(None)]
    optional = len(members) < len(args)
    if optional and value == "" and Path in members:
        return None  # "" means "not set" for optional paths
    if len(members) == 1:
        return convert_value(key, members[0], value, base)
    first_error: ConfigError | None = None
    for member in members:
        if not _has_shape(member, value):
            continue
        try:
            return convert_value(key, member, value, base)
        except ConfigError as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    unset = ' (or "" for not set)' if optional and Path in members else ""
    raise ConfigError(f"{key}: expected {' or '.join(_type_name(m) for m in members)}{unset}, "
                      f"got {_describe(value)}")


def convert_value(key: str, typ: Any, value: Any, base: Path) -> Any:
    """Check ``value`` against the annotation ``typ`` and convert it (paths resolved against ``base``)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(key, typ, value, base)
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
        # TOML has nan and inf, and integers beyond a float's range: none is a usable interval, size or rate
        # (nan passes every `<` check, so it must be refused here, not left to the range rules).
        try:
            out = float(value)
        except OverflowError:
            out = math.inf
        if not math.isfinite(out):
            raise ConfigError(f"{key}: expected a finite number, got {_describe(value)}")
        return out
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
        return value
    if typ is Path:
        if not isinstance(value, str) or not value or "\x00" in value:
            raise ConfigError(f"{key}: expected a path (a non-empty string without NUL), got {_describe(value)}")
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else (base / p)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {_describe(value)}")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                                  for v in value.values()):
            raise ConfigError(f"{key}: expected a table of string values, got {_describe(value)}")
        return {str(k): str(v) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {typ!r} for {key}")  # a bug in a dataclass, not in the file


def check_value(key: str, f: dataclasses.Field[Any], value: Any, check_paths: bool = True) -> None:
    """Apply the field's metadata rules to an already converted ``value`` (the number rules to numbers only: a
    union field may hold a string where it also takes a number)."""
    md = f.metadata
    if value is None:
        return
    if md.get(PORT) and not (isinstance(value, int) and 1 <= value <= 65535):
        raise ConfigError(f"{key}: expected an integer 1-65535, got {value!r}")
    if MIN in md and _is_number(value) and value < md[MIN]:
        raise ConfigError(f"{key}: must be >= {md[MIN]}, got {value!r}")
    if md.get(POSITIVE) and _is_number(value) and value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")
    if CHOICES in md and value not in md[CHOICES]:
        raise ConfigError(f"{key}: expected one of {', '.join(md[CHOICES])}, got {value!r}")
    kind = md.get(EXISTS)
    if kind and check_paths and isinstance(value, Path):
        if not value.exists():
            raise ConfigError(f"{key}: {value} does not exist (fix the path or create it)")
        if kind == "file" and not value.is_file():
            raise ConfigError(f"{key}: {value} is not a file")
        if kind == "dir" and not value.is_dir():
            raise ConfigError(f"{key}: {value} is not a folder")


# ------------------------------------------------------------------------------------------- where keys live


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _place(f: dataclasses.Field[Any]) -> tuple[str | None, str]:
    """(sub-table or None for the section itself, the key's name there)."""
    return f.metadata.get(TABLE), f.metadata.get(TOML_KEY, f.name)


def _layout(cls: type) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The keys of the section itself and of each of its sub-tables, each mapped to its field's name."""
    top: dict[str, str] = {}
    subs: dict[str, dict[str, str]] = {}
    for f in _fields(cls).values():
        table, key = _place(f)
        (subs.setdefault(table, {}) if table else top)[key] = f.name
    return top, subs


def _dotted(section: str, table: str | None, key: str) -> str:
    return f"{section}.{table}.{key}" if table else f"{section}.{key}"


def _where(section: str, table: str | None) -> str:
    """How a message names the table a key goes in: ``[drift]``, ``[drift.advanced]``."""
    return f"[{section}.{table}]" if table else f"[{section}]"


def key_name(section: str, cls: type, name: str) -> str:
    """The dotted key of field ``name`` at its (new) place: ``drift.advanced.window_tokens``."""
    table, key = _place(_fields(cls)[name])
    return _dotted(section, table, key)


def written_key(cfg: Any, name: str, section: str) -> str:
    """The dotted key a message about field ``name`` of ``cfg`` (a table :func:`build_section` built) should name:
    where the file wrote it; for a key the file does not set, its place in the layout the file uses (a file of
    the old layout hears ``drift.window_tokens``, a file of the new one ``drift.advanced.window_tokens``)."""
    places: _Places | None = getattr(cfg, _PLACES_ATTR, None)
    if places is not None:
        if name in places.written:
            return places.written[name]
        if places.legacy:
            return f"{section}.{name}"
    return key_name(section, type(cfg), name)


def replace_section(cfg: T, **changes: Any) -> T:
    """:func:`dataclasses.replace` that keeps what :func:`written_key` knows about where the keys were read."""
    out = dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
    places = getattr(cfg, _PLACES_ATTR, None)
    if places is not None:
        object.__setattr__(out, _PLACES_ATTR, places)
    return out


def _spellings(sub: Mapping[str, Any], key: str) -> list[str]:
    """The keys of a sub-table that mean ``key`` (a vLLM flag may be spelt with - or _)."""
    canon = key.replace("_", "-")
    return [k for k in sub if isinstance(k, str) and k.replace("_", "-") == canon]


def has_field(table: Mapping[str, Any], cls: type, name: str) -> bool:
    """Whether a parsed table sets field ``name`` anywhere: at its place or its old one."""
    sub_name, key = _place(_fields(cls)[name])
    if name in table:
        return True
    sub = table.get(sub_name) if sub_name else None
    return isinstance(sub, dict) and bool(_spellings(sub, key))


def drop_field(table: dict[str, Any], cls: type, name: str) -> None:
    """Remove field ``name`` from a parsed table, wherever the table has it."""
    sub_name, key = _place(_fields(cls)[name])
    table.pop(name, None)
    sub = table.get(sub_name) if sub_name else None
    if isinstance(sub, dict):
        for k in _spellings(sub, key):
            del sub[k]


def set_field(table: dict[str, Any], cls: type, name: str, value: Any) -> None:
    """Set field ``name`` in a parsed table at its place, replacing the table's value wherever it has one (an
    override or a command's own value must never meet the file's as "both places")."""
    drop_field(table, cls, name)
    sub_name, key = _place(_fields(cls)[name])
    if sub_name is None:
        table[name] = value
        return
    sub = table.setdefault(sub_name, {})
    if isinstance(sub, dict):  # not a table: left as it is, for the validator to refuse naming the section
        sub[key] = value


def _allowed(section: str, top: Mapping[str, str], subs: Mapping[str, Mapping[str, str]],
             notes: Mapping[str, str]) -> str:
    parts = [f"allowed in [{section}]: {', '.join(sorted(top))}"]
    for table, keys in sorted(subs.items()):
        listed = ", ".join(sorted(keys))
        parts.append(f"in [{section}.{table}]: {listed}{notes.get(table, '')}")
    return "; ".join(parts)


def _misplaced(section: str, key: str, top: Mapping[str, str], subs: Mapping[str, Mapping[str, str]],
               fields: Mapping[str, dataclasses.Field[Any]]) -> str | None:
    """Where a key written in the wrong table belongs (by its name there or its field's name), if anywhere."""
    for table, keys in subs.items():
        if key in keys:
            return _where(section, table)
    if key in top:
        return f"[{section}]"
    if key in fields:
        table, place_key = _place(fields[key])
        return _where(section, table) + (f" as {place_key}" if place_key != key else "")
    return None


def build_section(name: str, cls: type[T], raw: Any, base: Path, check_paths: bool = True, *,
                  deprecations: list[Deprecation] | None = None, notes: Mapping[str, str] | None = None) -> T:
    """The table ``[name]`` (``raw``, as parsed) as an instance of the dataclass ``cls``; absent keys take the
    field defaults. ``check_paths=False`` skips "does this path exist" (for a host that only talks to a daemon
    running elsewhere). Raises :class:`ConfigError` naming ``name.key``.

    A field with :data:`TABLE` metadata is read from ``[name.TABLE]`` (as its :data:`TOML_KEY`, when it has one);
    found in ``[name]`` under its field name instead (where it was before it moved), it is taken and a
    :class:`Deprecation` is appended to ``deprecations`` (``None``: logged here, see :func:`warn_deprecations`);
    found in both, it is an error naming both. ``notes``: what an unknown-key message adds about a sub-table."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table ([{name}]), got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    top, subs = _layout(cls)
    notes = notes or {}
    written: dict[str, list[tuple[str, Any, bool]]] = {}  # field -> [(dotted key, raw value, at its old place)]
    for k, v in raw.items():
        if k in subs:
            if not isinstance(v, dict):
                raise ConfigError(f"{name}.{k}: expected a table ([{name}.{k}]), got {_describe(v)}")
            for sk, sv in v.items():
                dotted = f"{name}.{k}.{sk}"
                if sk not in subs[k]:
                    where = _misplaced(name, sk, top, subs, fields)
                    if where is not None:
                        raise ConfigError(f"{dotted}: not a key of [{name}.{k}]: it belongs in {where}")
                    raise ConfigError(f"{dotted}: unknown key (allowed in [{name}.{k}]: "
                                      f"{', '.join(sorted(subs[k]))}{notes.get(k, '')})")
                written.setdefault(subs[k][sk], []).append((dotted, sv, False))
        elif k in top:
            written.setdefault(top[k], []).append((f"{name}.{k}", v, False))
        elif k in fields:  # a key that moved, at its old place
            written.setdefault(k, []).append((f"{name}.{k}", v, True))
        else:
            where = _misplaced(name, k, {}, subs, {})
            hint = f"; it belongs in {where}" if where is not None else ""
            raise ConfigError(f"{name}.{k}: unknown key ({_allowed(name, top, subs, notes)}){hint}")
    found: list[Deprecation] = []
    kwargs: dict[str, Any] = {}
    places: dict[str, str] = {}
    for fname, entries in written.items():
        if len(entries) > 1:
            old = next(e[0] for e in entries if e[2])
            new = next(e[0] for e in entries if not e[2])
            raise ConfigError(f"{old} and {new}: the same key set in two places; keep {new} and remove {old}")
        key, v, moved = entries[0]
        if moved:
            table, place_key = _place(fields[fname])
            as_key = f" as {place_key}" if place_key != fname else ""
            found.append(Deprecation(key, _dotted(name, table, place_key),
                                     f"{key} is deprecated here: move it to {_where(name, table)}{as_key}"))
        try:
            value = convert_value(key, hints[fname], v, base)
        except ConfigError:
            if fields[fname].metadata.get(PORT):
                raise ConfigError(f"{key}: expected an integer 1-65535, got {v!r}") from None
            raise
        check_value(key, fields[fname], value, check_paths)
        kwargs[fname] = value
        places[fname] = key
    out = cls(**kwargs)
    object.__setattr__(out, _PLACES_ATTR, _Places(types.MappingProxyType(places), legacy=bool(found)))
    if deprecations is None:
        warn_deprecations(found)
    else:
        deprecations.extend(found)
    return out


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
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except RecursionError:  # arrays nested deeper than the parser's stack
        raise ConfigError(f"{p}: not valid TOML: nested too deeply") from None


def apply_override(doc: dict[str, Any], dotted: str, value: Any,
                   sections: Mapping[str, type] | None = None) -> None:
    """Set ``section.key`` in a parsed document (before validation, so an override is checked like the file).

    With ``sections`` (section name -> its dataclass), ``section.field`` names a field by its Python name and is
    set at the key's place, replacing the file's value wherever the file has it (``engine.enforce_eager`` lands
    in ``[engine.vllm]``). Longer keys (``drift.advanced.window_tokens``) are set where they say."""
    section, _, rest = dotted.partition(".")
    if not rest:
        raise ConfigError(f"{dotted}: an override needs a dotted key like engine.model")
    table = doc.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: expected a table ([{section}]), got {_describe(table)}")
    cls = (sections or {}).get(section)
    if cls is not None and "." not in rest and rest in _fields(cls):
        set_field(table, cls, rest, value)
        return
    *path, key = rest.split(".")
    trail = section
    for part in path:
        trail = f"{trail}.{part}"
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{trail}: expected a table ([{trail}]), got {_describe(table)}")
    table[key] = value
