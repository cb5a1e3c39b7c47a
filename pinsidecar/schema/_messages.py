"""What the operator reads when pydantic refuses a value: ``<key>: <what> (<how to fix>)``.

pydantic decides whether a value is refused; these functions only say it in the project's words, naming the key as
it is written in the file, the value as it was written, what is expected, and a fix (the key written right, with
the field's default as the example, or the closest allowed key or choice). The wording follows the field's type,
not pydantic's error (``expected an integer 1-65535, got 'abc'`` for a port, whatever pydantic calls it).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from pinsidecar.schema._layout import CHOICES, MIN, PORT, POSITIVE, describe, place, where
from pinsidecar.schema._models import PATH_ERROR, file_type, schema_default

__all__: list[str] = []  # re-exported by the package

_PATH_TEXT = "a path (a non-empty string without NUL)"
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than_equal", "less_than"}


def toml_value(value: Any) -> str:
    """``value`` (a string, number, boolean, list or flat table) as a TOML value, without a TOML writer dependency:
    strings with JSON's escapes (a subset of TOML's basic strings). For an example in a message, and for the
    config files pinsidecar writes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` was most likely meant to be (a typo's fix), if one is close."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def type_name(typ: Any) -> str:
    """How a message names a type: what the operator must write."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(typ) if a is not type(None))
    if origin is list:
        return "a list of strings"
    if origin is dict:
        return "a table of string values"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            Path: "a path"}.get(typ, repr(typ))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer past a float's range
        return False


def has_shape(typ: Any, value: Any) -> bool:
    """Whether ``value`` is the kind of TOML value ``typ`` is read from (a string for a path, any number for a
    float): which union members are worth trying, and whether a refusal is of the type or of the value."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return any(has_shape(a, value) for a in typing.get_args(typ) if a is not type(None))
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
    return typ in (str, Path) and isinstance(value, str)


def _example(f: dataclasses.Field[Any], typ: Any) -> Any:
    default = schema_default(f)
    if default not in (None, "", [], {}):
        return default
    if CHOICES in f.metadata:
        return f.metadata[CHOICES][0]
    union = typing.get_origin(typ) in (typing.Union, types.UnionType)
    first = next(a for a in typing.get_args(typ) if a is not type(None)) if union else typ
    if typing.get_origin(first) is list:
        return ["..."]
    if typing.get_origin(first) is dict:
        return {"NAME": "value"}
    return {bool: True, int: 1, float: 1.0, Path: "/path/to/it"}.get(first, "...")


def _unquoted(value: Any, typ: Any) -> Any:
    """What a quoted ``value`` means when the type wants a number or a boolean written bare, if it means one."""
    if not isinstance(value, str):
        return None
    union = typing.get_origin(typ) in (typing.Union, types.UnionType)
    wanted = {a for a in typing.get_args(typ) if a is not type(None)} if union else {typ}
    text = value.strip()
    if bool in wanted and text in ("true", "false"):
        return text == "true"
    for number in (int, float):
        if number in wanted or (number is int and float in wanted):
            try:
                return number(text)
            except ValueError:
                continue
    return None


def _member_errors(member: Any, md: Mapping[str, Any], value: Any) -> list[ErrorDetails]:
    try:
        TypeAdapter(file_type(member, md)).validate_python(value, context={"base": Path(".")})
    except ValidationError as exc:
        return exc.errors()
    return []


def _what(typ: Any, md: Mapping[str, Any], value: Any, errors: Sequence[ErrorDetails]) -> tuple[str, str]:
    """(what is wrong, the kind of fix it needs) for a refused ``value`` of annotation ``typ``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(members) == 1:
            return _what(members[0], md, value, errors)
        for member in members:  # the value has the shape of a member that refused it: its message says more
            if has_shape(member, value):
                member_errors = _member_errors(member, md, value)
                if member_errors:
                    return _what(member, md, value, member_errors)
        unset = ' (or "" for not set)' if len(members) < len(typing.get_args(typ)) and Path in members else ""
        return f"expected {type_name(typ)}{unset}, got {describe(value)}", "type"
    if md.get(PORT):
        return f"expected an integer 1-65535, got {value!r}", "port"
    if typ is str and CHOICES in md:
        return f"expected one of {', '.join(md[CHOICES])}, got {describe(value)}", "choice"
    kinds = [e["type"] for e in errors]
    if has_shape(typ, value):
        if typ is float and not _finite(value):
            return f"expected a finite number, got {value!r}", "finite"  # nan, inf, an integer past a float's range
        if PATH_ERROR in kinds:
            return f"expected {_PATH_TEXT}, got {describe(value)}", "type"
        if _RANGE_ERRORS.intersection(kinds):
            if md.get(POSITIVE) and value <= 0:
                return f"must be > 0, got {value!r}", "positive"
            return f"must be >= {md[MIN]}, got {value!r}", "minimum"
    return f"expected {_PATH_TEXT if typ is Path else type_name(typ)}, got {describe(value)}", "type"


def field_problem(key: str, f: dataclasses.Field[Any], typ: Any, value: Any,
                  errors: Sequence[ErrorDetails]) -> str:
    """The message for a value of field ``f`` (annotation ``typ``) that pydantic refused, written at ``key``."""
    what, kind = _what(typ, f.metadata, value, errors)
    name = key.rsplit(".", 1)[-1]
    example = f"{name} = {toml_value(_example(f, typ))}"
    bare = _unquoted(value, typ)
    if kind in ("type", "port") and bare is not None:
        fix = f"write it without quotes: {name} = {toml_value(bare)}"
    elif kind == "port":
        fix = f"a TCP port, e.g. {example}"
    elif kind == "positive":
        fix = f"a number above 0, e.g. {example}"
    elif kind == "minimum":
        fix = f"{f.metadata[MIN]} or more, e.g. {example}"
    elif kind == "finite":
        fix = f"nan and inf are not numbers here, e.g. {example}"
    elif kind == "choice":
        near = closest(str(value), f.metadata[CHOICES]) if isinstance(value, str) else None
        fix = f"did you mean {name} = {toml_value(near)}?" if near else f"write one of them, e.g. {example}"
    else:
        fix = f"write it like {example}"
    return f"{key}: {what} ({fix})"


def not_a_table(key: str, value: Any) -> str:
    return f"{key}: expected a table ([{key}]), got {describe(value)} (write it as a [{key}] table)"


def unknown_key(section: str, table: str | None, key: str, top: Mapping[str, str],
                subs: Mapping[str, Mapping[str, str]], fields: Mapping[str, dataclasses.Field[Any]],
                notes: Mapping[str, str]) -> str:
    """The message for a key the section's model does not take at ``[section.table]``: where it belongs, if it is
    a key of another table of the section, else the allowed keys and the closest of them."""
    at = f"{section}.{table}.{key}" if table else f"{section}.{key}"
    if table is not None:
        belongs = _belongs(section, key, top, subs, fields)
        if belongs is not None:
            return f"{at}: not a key of {where(section, table)} (move it to {belongs})"
        keys = subs[table]
        near = closest(key, keys)
        hint = f"did you mean {near}? " if near else ""
        return (f"{at}: unknown key ({hint}allowed in {where(section, table)}: {', '.join(sorted(keys))}"
                f"{notes.get(table, '')})")
    belongs = _belongs(section, key, {}, subs, {})
    if belongs is not None:
        return f"{at}: unknown key here (move it to {belongs})"
    # the closest key of the section, by its name or by its old one (kv_cache_byte: kv-cache-memory-bytes), named
    # with its table when it is not this one
    places = {k: None for k in top} | {k: t for t, keys in subs.items() for k in keys}
    places |= {name: place(f) for name, f in fields.items() if place(f)[0] is not None}
    near = closest(key, places)
    hint = ""
    if near is not None:
        spot = places[near]
        table, name = spot if isinstance(spot, tuple) else (spot, near)
        hint = f"did you mean {name}{f' in {where(section, table)}' if table else ''}? "
    parts = [f"allowed in [{section}]: {', '.join(sorted(top))}"]
    for sub, keys in sorted(subs.items()):
        parts.append(f"in [{section}.{sub}]: {', '.join(sorted(keys))}{notes.get(sub, '')}")
    return f"{at}: unknown key ({hint}{'; '.join(parts)})"


def _belongs(section: str, key: str, top: Mapping[str, str], subs: Mapping[str, Mapping[str, str]],
             fields: Mapping[str, dataclasses.Field[Any]]) -> str | None:
    """Where a key written in the wrong table belongs (by its name there or its field's name), if anywhere."""
    for table, keys in subs.items():
        if key in keys:
            return where(section, table)
    if key in top:
        return f"[{section}]"
    if key in fields:
        table, place_key = place(fields[key])
        return where(section, table) + (f" as {place_key}" if place_key != key else "")
    return None
