"""Where a config key lives: the field metadata that declares a table, and the helpers that find, set and name keys
at their place (or at their old place, before they moved).

A config table is a frozen dataclass; a field's ``metadata`` says what a value must satisfy beyond its type
(:data:`PORT`, :data:`MIN`, :data:`POSITIVE`, :data:`CHOICES`, :data:`EXISTS`) and where its key lives
(:data:`TABLE`, :data:`TOML_KEY`; :data:`ADVANCED` for the tuning keys). Nothing here validates a value: that is
the models' (:mod:`._models`). What is here is the layout, which the reader, the messages, the overrides and the
writers of config files (``laid_out``) share.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pinsidecar.schema._problems import ConfigError

__all__: list[str] = []  # re-exported by the package

T = TypeVar("T")

# Field metadata keys: what a value must satisfy beyond its type.
PORT = "port"  # integer 1-65535
MIN = "min"  # number >= this
POSITIVE = "positive"  # number > 0
CHOICES = "choices"  # one of these strings
EXISTS = "exists"  # the path must exist ("file" or "dir" or "any"), checked unless the reader skips path checks
# Field metadata keys: where the key lives in the file.
TABLE = "table"  # the sub-table of the section that holds the key ([section.TABLE]); absent: the section itself
TOML_KEY = "toml_key"  # the key's name there when it is not the field's name (a vLLM flag's own spelling)
ADVANCED_TABLE = "advanced"
# A tuning key: ``metadata={POSITIVE: True, **ADVANCED}`` puts it in ``[section.advanced]``.
ADVANCED: Mapping[str, Any] = types.MappingProxyType({TABLE: ADVANCED_TABLE})
# A dataclass may name sub-tables that also take keys it does not declare, as ``OPEN_TABLES = {"vllm": "any other
# vLLM flag"}`` (a ClassVar): their other keys are the reader's to check, and the JSON schema allows them.
OPEN_TABLES_ATTR = "OPEN_TABLES"

# What the reader knows about one table it built, kept on the instance (see written_key and usable).
_PLACES_ATTR = "_schema_places"


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
class Places:
    """Where the reader found each key of one table, and which fields it refused (left at their default)."""

    written: Mapping[str, str]  # field name -> the dotted key it was read from
    legacy: bool  # the table used the old layout (a key at its old place): name unwritten keys that way too
    failed: frozenset[str] = frozenset()  # fields whose value was refused: a check across keys skips them


def port_field(default: int) -> Any:
    """A dataclass field holding a TCP port (checked to be 1-65535)."""
    return field(default=default, metadata={PORT: True})


def fields_of(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def open_tables(cls: type) -> Mapping[str, str]:
    """The sub-tables of ``cls`` that take keys it does not declare, with what those keys are."""
    return getattr(cls, OPEN_TABLES_ATTR, {})


def place(f: dataclasses.Field[Any]) -> tuple[str | None, str]:
    """(sub-table or None for the section itself, the key's name there)."""
    return f.metadata.get(TABLE), f.metadata.get(TOML_KEY, f.name)


def layout(cls: type) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The keys of the section itself and of each of its sub-tables (open ones included, maybe empty), each mapped
    to its field's name."""
    top: dict[str, str] = {}
    subs: dict[str, dict[str, str]] = {table: {} for table in open_tables(cls)}
    for f in fields_of(cls).values():
        table, key = place(f)
        (subs.setdefault(table, {}) if table else top)[key] = f.name
    return top, subs


def dotted(section: str, table: str | None, key: str) -> str:
    return f"{section}.{table}.{key}" if table else f"{section}.{key}"


def where(section: str, table: str | None) -> str:
    """How a message names the table a key goes in: ``[drift]``, ``[drift.advanced]``."""
    return f"[{section}.{table}]" if table else f"[{section}]"


def key_name(section: str, cls: type, name: str) -> str:
    """The dotted key of field ``name`` at its (new) place: ``drift.advanced.window_tokens``."""
    table, key = place(fields_of(cls)[name])
    return dotted(section, table, key)


def places_of(cfg: Any) -> Places | None:
    return getattr(cfg, _PLACES_ATTR, None)


def keep_places(cfg: Any, places: Places) -> None:
    object.__setattr__(cfg, _PLACES_ATTR, places)


def written_key(cfg: Any, name: str, section: str) -> str:
    """The dotted key a message about field ``name`` of ``cfg`` (a table the reader built) should name: where the
    file wrote it; for a key the file does not set, its place in the layout the file uses (a file of the old
    layout hears ``drift.window_tokens``, a file of the new one ``drift.advanced.window_tokens``)."""
    places = places_of(cfg)
    if places is not None:
        if name in places.written:
            return places.written[name]
        if places.legacy:
            return f"{section}.{name}"
    return key_name(section, type(cfg), name)


def usable(cfg: Any, *names: str) -> bool:
    """Whether fields ``names`` of ``cfg`` hold what the file meant: a check across keys that involves a value the
    reader refused (and left at its default) says nothing the refusal did not, so it is skipped."""
    places = places_of(cfg)
    return places is None or not places.failed.intersection(names)


def replace_section(cfg: T, **changes: Any) -> T:
    """:func:`dataclasses.replace` that keeps what the reader knows about where the keys were read."""
    out = dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
    places = places_of(cfg)
    if places is not None:
        keep_places(out, places)
    return out


def spellings(sub: Mapping[str, Any], key: str) -> list[str]:
    """The keys of a sub-table that mean ``key`` (a vLLM flag may be spelt with - or _)."""
    canon = key.replace("_", "-")
    return [k for k in sub if isinstance(k, str) and k.replace("_", "-") == canon]


def has_field(table: Mapping[str, Any], cls: type, name: str) -> bool:
    """Whether a parsed table sets field ``name`` anywhere: at its place or its old one."""
    sub_name, key = place(fields_of(cls)[name])
    if name in table:
        return True
    sub = table.get(sub_name) if sub_name else None
    return isinstance(sub, dict) and bool(spellings(sub, key))


def drop_field(table: dict[str, Any], cls: type, name: str) -> None:
    """Remove field ``name`` from a parsed table, wherever the table has it."""
    sub_name, key = place(fields_of(cls)[name])
    table.pop(name, None)
    sub = table.get(sub_name) if sub_name else None
    if isinstance(sub, dict):
        for k in spellings(sub, key):
            del sub[k]


def set_field(table: dict[str, Any], cls: type, name: str, value: Any) -> None:
    """Set field ``name`` in a parsed table at its place, replacing the table's value wherever it has one (an
    override or a command's own value must never meet the file's as "both places")."""
    drop_field(table, cls, name)
    sub_name, key = place(fields_of(cls)[name])
    if sub_name is None:
        table[name] = value
        return
    sub = table.setdefault(sub_name, {})
    if isinstance(sub, dict):  # not a table: left as it is, for the reader to refuse naming the section
        sub[key] = value


def describe(value: Any) -> str:
    """A value as a message quotes it: ``'abc'``, ``3``, ``a table``."""
    return repr(value) if not isinstance(value, dict) else "a table"


def apply_override(doc: dict[str, Any], dotted_key: str, value: Any,
                   sections: Mapping[str, type] | None = None) -> None:
    """Set ``section.key`` in a parsed document (before validation, so an override is checked like the file).

    With ``sections`` (section name -> its dataclass), ``section.field`` names a field by its Python name and is
    set at the key's place, replacing the file's value wherever the file has it (``engine.enforce_eager`` lands
    in ``[engine.vllm]``). Longer keys (``drift.advanced.window_tokens``) are set where they say."""
    section, _, rest = dotted_key.partition(".")
    if not rest:
        raise ConfigError(f"{dotted_key}: an override needs a dotted key (write it like engine.model)")
    table = doc.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: expected a table ([{section}]), got {describe(table)} (make it a table)")
    cls = (sections or {}).get(section)
    if cls is not None and "." not in rest and rest in fields_of(cls):
        set_field(table, cls, rest, value)
        return
    *path, key = rest.split(".")
    trail = section
    for part in path:
        trail = f"{trail}.{part}"
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{trail}: expected a table ([{trail}]), got {describe(table)} (make it a table)")
    table[key] = value
