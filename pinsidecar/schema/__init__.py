"""TOML tables as frozen dataclasses, validated by pydantic: the one reader behind every config table pinsidecar
reads, and the JSON schema of the file.

A config table is a frozen dataclass whose fields are the allowed keys; a field's annotation is its type and its
``metadata`` says what a value must satisfy beyond that (:data:`PORT`, :data:`MIN`, :data:`POSITIVE`,
:data:`CHOICES`, :data:`EXISTS`). From each dataclass a pydantic model of the table *as written in the file* is made
(:mod:`._models`): pydantic refuses unknown keys, wrong types and out-of-range values, all of them in one pass, and
the same models give the JSON schema editors read (``pinsidecar check-config --schema``). :func:`build_section`
turns one parsed TOML table into its dataclass and says every refusal in the project's words, naming the key the
way it is written in the file, with a fix (``engine.port: expected an integer 1-65535, got 'abc' (a TCP port, e.g.
port = 8000)``). Relative paths are taken relative to the config file's folder.

Where a key lives. Most keys of a table are what an operator sets (a model, a port, a policy threshold); the
tuning keys (window sizes, poll intervals, timeouts, margins, budgets) live one level down, in ``[section.advanced]``
(:data:`ADVANCED` in a field's metadata), so the top of every table stays short enough to read at 3 am. The engine's
vLLM flags live in ``[engine.vllm]`` the same way (:data:`TABLE` and :data:`TOML_KEY`). The dataclass does not
change: a field keeps its Python name wherever its key lives, so nothing that reads a config knows about the
layout. A key found at its old place (the section itself, before it moved) still works: :func:`build_section`
takes it and reports a :class:`Deprecation` that names the new place (logged as a warning, and listed by
``pinsidecar check-config``); a key given at both places is an error naming both.

Every problem, not the first: readers add to a :class:`Problems` list and go on, leaving a refused value at its
default (:func:`usable` tells the checks across keys to skip it); one :class:`ConfigError` holds them all.

Why one reader: the daemon's config, the count boot's ``--config`` and the drift watch all read tables of the
same file. With one reader, a key means the same thing and is refused with the same message whichever command
reads it.
"""

from pinsidecar.schema._build import build_section, end_table, read_toml, warn_deprecations
from pinsidecar.schema._layout import (
    ADVANCED,
    ADVANCED_TABLE,
    CHOICES,
    EXISTS,
    MIN,
    PORT,
    POSITIVE,
    TABLE,
    TOML_KEY,
    Deprecation,
    apply_override,
    drop_field,
    has_field,
    key_name,
    port_field,
    replace_section,
    set_field,
    usable,
    written_key,
)
from pinsidecar.schema._messages import closest, toml_value
from pinsidecar.schema._models import document_schema
from pinsidecar.schema._problems import ConfigError, Problems

__all__ = [
    "ADVANCED",
    "ADVANCED_TABLE",
    "CHOICES",
    "EXISTS",
    "MIN",
    "POSITIVE",
    "TABLE",
    "TOML_KEY",
    "ConfigError",
    "Deprecation",
    "Problems",
    "apply_override",
    "build_section",
    "closest",
    "document_schema",
    "drop_field",
    "end_table",
    "has_field",
    "key_name",
    "port_field",
    "read_toml",
    "replace_section",
    "set_field",
    "toml_value",
    "usable",
    "warn_deprecations",
    "written_key",
]
