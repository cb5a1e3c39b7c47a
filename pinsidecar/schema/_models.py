"""The file's shape as pydantic models, made from the config dataclasses: the validator of every table, and the
JSON schema editors read.

Why generated rather than written: the dataclasses are what the daemon reads (a field keeps its attribute name
wherever its key lives), and their metadata already says each key's rules and place. A second, hand-written model
of the file would drift from them. So each section's dataclass gives one model of the table as it is written:

- the section's own keys, then its moved keys at their old place (accepted, and marked ``deprecated`` in the
  schema), then one sub-model per sub-table (``[section.advanced]``, ``[engine.vllm]``);
- TOML's types, strict: a quoted ``"8000"`` is not a port, ``1`` is not ``true``, numbers are finite; a path is a
  non-empty string without NUL, resolved against the file's folder (the validation context's ``base``); ``""``
  is "not set" for an optional path;
- the metadata as constraints: :data:`PORT` 1-65535, :data:`MIN` ``>=``, :data:`POSITIVE` ``> 0``,
  :data:`CHOICES` an enum. :data:`EXISTS` is not the schema's business (a file written for another host is still
  well-formed): the reader checks it.

A union is tried member by member, left to right (``int | str``: 5 stays an integer, "5" a string).
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import os
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    WrapValidator,
    create_model,
)
from pydantic_core import PydanticCustomError

from pinsidecar.schema._layout import CHOICES, MIN, PORT, POSITIVE, fields_of, layout, open_tables, place, where

__all__: list[str] = []  # re-exported by the package

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# A key of an open table (any other vLLM flag): what flag_args renders.
OPEN_VALUE_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"}, {"type": "number"}, {"type": "boolean"},
    {"type": "array", "items": {"type": ["string", "number"]}, "minItems": 1}, {"type": "object"}]}
# What a path-like value must be (a custom error, so the message can say it).
PATH_ERROR = "path_value"

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                     field_title_generator=lambda name, info: info.alias or name)


def _resolve_path(value: str, info: ValidationInfo) -> Path:
    if not value or "\x00" in value:
        raise PydanticCustomError(PATH_ERROR, "expected a path (a non-empty string without NUL)")
    p = Path(os.path.expanduser(value))
    base = (info.context or {}).get("base")
    return p if p.is_absolute() or base is None else Path(base) / p


def _empty_is_unset(value: Any, handler: Callable[[Any], Any]) -> Any:
    return None if value == "" else handler(value)


def _as_strings(table: dict[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in table.items()}


_FLOAT = Annotated[float, Strict(), AllowInfNan(False)]
_INT = Annotated[int, Strict()]
_STR = Annotated[str, Strict()]
_PATH = Annotated[_STR, AfterValidator(_resolve_path)]
# [engine] env = { OMP_NUM_THREADS = 1 }: a table of strings, numbers written bare taken as their text
_STRING_TABLE = Annotated[dict[str, _STR | _INT | _FLOAT], AfterValidator(_as_strings)]


def _constraints(md: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    if md.get(PORT):
        out += [Ge(1), Le(65535)]
    if MIN in md:
        out.append(Ge(md[MIN]))
    if md.get(POSITIVE):
        out.append(Gt(0))
    return out


def file_type(typ: Any, md: Mapping[str, Any]) -> Any:
    """The type a value of annotation ``typ`` has in the file, with the field metadata ``md`` as constraints (the
    number rules on number members only, the choices on string members only)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        members = [file_type(a, md) for a in args if a is not type(None)]
        inner = members[0] if len(members) == 1 else Annotated[typing.Union[tuple(members)],  # noqa: UP007
                                                                  Field(union_mode="left_to_right")]
        return Annotated[inner, WrapValidator(_empty_is_unset)] if type(None) in args else inner
    if typ is bool:
        return Annotated[bool, Strict()]
    if typ in (int, float):
        rules = _constraints(md)
        base = _INT if typ is int else _FLOAT
        return Annotated[(base, *rules)] if rules else base
    if typ is str:
        return Literal[tuple(md[CHOICES])] if CHOICES in md else _STR
    if typ is Path:
        return _PATH
    if origin is list and typing.get_args(typ) == (str,):
        return list[_STR]
    if origin is dict and typing.get_args(typ) == (str, str):
        return _STRING_TABLE
    raise AssertionError(f"unsupported config type {typ!r}")  # a bug in a dataclass, not in the file


def schema_default(f: Any) -> Any:
    """A field's default as the file would write it (``None``: none to show)."""
    value = f.default if f.default is not MISSING else (
        f.default_factory() if f.default_factory is not MISSING else None)
    return str(value) if isinstance(value, Path) else value


def field_docs(cls: type) -> dict[str, str]:
    """The comments that document each field of a dataclass (the comment lines just above it and the comments on
    its own lines), for the schema's descriptions: an editor shows what the source says, with no second copy."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    names = set(fields_of(cls))
    docs: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names):
            continue
        above: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        own = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])) + "\n"
        inline = [t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(own).readline)
                  if t.type == tokenize.COMMENT]
        text = " ".join(filter(None, [*above, *inline]))
        if text:
            docs[node.target.id] = text
    return docs


def _first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph as plain text (an editor shows no reST): ``x`` is x, :class:`~a.B` is B."""
    text = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


@dataclass(frozen=True)
class Slot:
    """One key of a section's file model: the field it fills, where it is written, and its attribute in the model
    (``k0``, ``k1``...: the TOML key is the alias, since ``max-model-len`` is no Python name)."""

    field: str
    table: str | None  # None: the section itself (where a moved key's old place is too)
    key: str
    old: bool  # a moved key at its old place, under its field's name
    attr: str


@dataclass(frozen=True)
class SectionShape:
    """The file model of one section, and how its keys map onto the dataclass's fields."""

    name: str
    cls: type
    model: type[BaseModel]
    slots: tuple[Slot, ...]
    tables: Mapping[str, str]  # sub-table -> its attribute in the model

    def value(self, validated: BaseModel, slot: Slot) -> Any:
        holder = validated if slot.table is None else getattr(validated, self.tables[slot.table])
        return getattr(holder, slot.attr)

    def new_place(self, field: str) -> Slot:
        """Where field ``field`` is written now (for a moved key: its sub-table)."""
        return next(s for s in self.slots if s.field == field and not s.old)


def _schema_extra(default: Any, extra: Mapping[str, Any]) -> Callable[[dict[str, Any]], None]:
    def edit(schema: dict[str, Any]) -> None:
        schema.pop("default", None)
        if default not in (None, "", [], {}):
            schema["default"] = default
        schema.update(extra)

    return edit


@functools.cache
def section_shape(name: str, cls: type) -> SectionShape:
    """The file model of section ``[name]``, whose keys are the fields of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    fields = fields_of(cls)
    docs = field_docs(cls)
    top, subs = layout(cls)
    slots: list[Slot] = []
    counter = iter(range(10_000))

    def entry(fname: str, key: str, extra: Mapping[str, Any]) -> tuple[str, tuple[Any, Any]]:
        f = fields[fname]
        attr = f"k{next(counter)}"
        doc = {"description": docs[fname]} if fname in docs else {}
        return attr, (file_type(hints[fname], f.metadata),
                      Field(default=None, alias=key, json_schema_extra=_schema_extra(schema_default(f),
                                                                                     {**doc, **extra})))

    top_fields: dict[str, Any] = {}
    for key, fname in top.items():
        attr, spec = entry(fname, key, {})
        top_fields[attr] = spec
        slots.append(Slot(fname, None, key, False, attr))
    for fname, f in fields.items():  # the moved keys, at their old place
        table, key = place(f)
        if table is None:
            continue
        as_key = f" as {key}" if key != fname else ""
        attr, spec = entry(fname, fname, {"deprecated": True,
                                          "description": f"Deprecated here: move it to {where(name, table)}{as_key}."})
        top_fields[attr] = spec
        slots.append(Slot(fname, None, fname, True, attr))
    tables: dict[str, str] = {}
    opened = open_tables(cls)
    for table, keys in subs.items():
        sub_fields: dict[str, Any] = {}
        for key, fname in keys.items():
            attr, spec = entry(fname, key, {})
            sub_fields[attr] = spec
            slots.append(Slot(fname, table, key, False, attr))
        extra: dict[str, Any] = {}
        config = _STRICT
        if table in opened:
            config = ConfigDict(**{**_STRICT, "extra": "allow"})
            extra = {"additionalProperties": OPEN_VALUE_SCHEMA,
                     "description": f"{where(name, table)}: the keys below, and {opened[table]}."}
        elif table == "advanced":
            extra = {"description": f"{where(name, table)}: the tuning keys of [{name}]."}
        sub_model = create_model(f"{cls.__name__}_{table}", __config__=ConfigDict(
            **{**config, "json_schema_extra": extra}), **sub_fields)
        attr = f"k{next(counter)}"
        top_fields[attr] = (sub_model, Field(default=None, alias=table, json_schema_extra=_schema_extra(None, {})))
        tables[table] = attr
    model = create_model(cls.__name__, __config__=ConfigDict(
        **{**_STRICT, "json_schema_extra": {"description": _first_paragraph(cls.__doc__) or f"[{name}]"}}),
        **top_fields)
    return SectionShape(name, cls, model, tuple(slots), tables)


def document_schema(sections: Mapping[str, type], title: str, description: str) -> dict[str, Any]:
    """The JSON schema of a whole config file whose tables are ``sections`` (name -> dataclass)."""
    fields = {f"s{i}": (section_shape(name, cls).model,
                        Field(default=None, alias=name, json_schema_extra=_schema_extra(None, {})))
              for i, (name, cls) in enumerate(sections.items())}
    model = create_model("Document", __config__=ConfigDict(**{**_STRICT, "title": title}), **fields)
    return {"$schema": JSON_SCHEMA_DIALECT, "description": description, **model.model_json_schema()}
