"""TOML tables as frozen dataclasses: the one validator behind every config table pinsidecar reads.

A config table is a frozen dataclass whose fields are the allowed keys; a field's annotation is its type and its
``metadata`` says what a value must satisfy beyond that (:data:`PORT`, :data:`MIN`, :data:`POSITIVE`,
:data:`CHOICES`, :data:`EXISTS`). :func:`build_section` turns one parsed TOML table into that dataclass, refusing
unknown keys, wrong types and out-of-range values with a message that names the key the way it is written in the
file (``engine.port: expected an integer 1-65535, got 'abc'``). Relative paths are taken relative to the config
file's folder.

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
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "CHOICES",
    "EXISTS",
    "MIN",
    "POSITIVE",
    "ConfigError",
    "apply_override",
    "build_section",
    "port_field",
    "read_toml",
]

T = TypeVar("T")

# Field metadata keys: what a value must satisfy beyond its type.
PORT = "port"  # integer 1-65535
MIN = "min"  # number >= this
POSITIVE = "positive"  # number > 0
CHOICES = "choices"  # one of these strings
EXISTS = "exists"  # the path must exist ("file" or "dir" or "any")


class ConfigError(ValueError):
    """The config cannot be used. The message names the file, the key and what is expected."""


def port_field(default: int) -> Any:
    """A dataclass field holding a TCP port (checked to be 1-65535)."""
    return field(default=default, metadata={PORT: True})


def _describe(value: Any) -> str:
    return repr(value) if not isinstance(value, dict) else "a table"


def convert_value(key: str, typ: Any, value: Any, base: Path) -> Any:
    """Check ``value`` against the annotation ``typ`` and convert it (paths resolved against ``base``)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value == "" and Path in args:
            return None  # "" means "not set" for optional paths
        return convert_value(key, args[0], value, base)
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
    """Apply the field's metadata rules to an already converted ``value``."""
    md = f.metadata
    if value is None:
        return
    if md.get(PORT) and not (isinstance(value, int) and 1 <= value <= 65535):
        raise ConfigError(f"{key}: expected an integer 1-65535, got {value!r}")
    if MIN in md and value < md[MIN]:
        raise ConfigError(f"{key}: must be >= {md[MIN]}, got {value!r}")
    if md.get(POSITIVE) and value <= 0:
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


def build_section(name: str, cls: type[T], raw: Any, base: Path, check_paths: bool = True) -> T:
    """The table ``[name]`` (``raw``, as parsed) as an instance of the dataclass ``cls``; absent keys take the
    field defaults. ``check_paths=False`` skips "does this path exist" (for a host that only talks to a daemon
    running elsewhere). Raises :class:`ConfigError` naming ``name.key``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table ([{name}]), got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown key (allowed in [{name}]: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{name}.{k}"
        try:
            value = convert_value(key, hints[k], v, base)
        except ConfigError:
            if fields[k].metadata.get(PORT):
                raise ConfigError(f"{key}: expected an integer 1-65535, got {v!r}") from None
            raise
        check_value(key, fields[k], value, check_paths)
        kwargs[k] = value
    return cls(**kwargs)


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


def apply_override(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``section.key`` in a parsed document (before validation, so an override is checked like the file)."""
    section, _, key = dotted.partition(".")
    if not key:
        raise ConfigError(f"{dotted}: an override needs a dotted key like engine.model")
    table = doc.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: expected a table ([{section}]), got {_describe(table)}")
    table[key] = value
