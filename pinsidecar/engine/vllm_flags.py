"""The engine's vLLM command line as a table: how ``[engine.vllm]`` keys become vLLM flags, and back.

``[engine.vllm]`` holds one key per vLLM flag, spelt as vLLM's ``--help`` spells it without the dashes
(``max-num-seqs = 16``). Here, apart from the ``[engine]`` table's own reader (:mod:`pinsidecar.engine.spec`),
is what a key's value means on the command line: true is ``--flag``, false ``--no-flag``, a list ``--flag a b``, a
table JSON; for the deprecated ``extra_args``, which flag an argument names and the table lines that say the
same; and which of the flags a file writes the engine's vLLM does not take (``pinsidecar check-config``, against
the parser of the vLLM that will run: :func:`~pinsidecar.engine.installed_vllm.cli_flags`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pinsidecar.schema import ConfigError, Problems, closest

__all__: list[str] = []  # the engine package's own business

_FLAG_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


def spelling(key: str) -> str:
    """A key of ``[engine.vllm]`` as vLLM's ``--help`` spells the flag, without the dashes."""
    return key.lstrip("-").replace("_", "-").lower()


def spelt_flags(vllm: dict[str, Any], table: str, problems: Problems) -> dict[str, Any]:
    """The ``[engine.vllm]`` table (written at ``table``) with each key in vLLM's own spelling: ``max_model_len``
    and ``--max-model-len`` are both ``max-model-len``, as vLLM's parser takes either. A key that is no flag name,
    and two keys for one flag (naming both), are problems; the first spelling is kept."""
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for key, value in vllm.items():
        flag = spelling(key)
        where = f"{table}.{key}"
        if not _FLAG_NAME.fullmatch(flag):
            problems.add(f"{where}: not a vLLM flag name (write it as vLLM's --help spells it, without the dashes: "
                         "max-num-seqs = 16)")
        elif flag in out:
            problems.add(f"{table}.{spelt[flag]} and {where}: the same vLLM flag --{flag} twice (keep one)")
        else:
            out[flag] = value
            spelt[flag] = key
    return out


def flag_args(flag: str, value: Any, where: str) -> list[str]:
    """``--flag value`` for one ``[engine.vllm]`` key that pinsidecar does not read itself: true is ``--flag``,
    false ``--no-flag`` (vLLM's boolean flags take both), a list is ``--flag a b``, a table is JSON (vLLM's
    ``--compilation-config`` and friends take JSON). ``where`` names the key in errors."""
    if isinstance(value, bool):
        return [f"--{flag}"] if value else [f"--no-{flag}"]
    if isinstance(value, dict):
        return [f"--{flag}", json.dumps(_json_value(where, value), separators=(",", ":"))]
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: an empty list gives the flag no value (remove the key)")
        return [f"--{flag}", *(_scalar(f"{where}[{i}]", v) for i, v in enumerate(value))]
    return [f"--{flag}", _scalar(where, value)]


def _scalar(where: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        got = "a table" if isinstance(value, dict) else repr(value)
        raise ConfigError(f"{where}: expected a string, a number, true or false, a list or a table, got {got} "
                          "(write the value as vLLM's command line takes it)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r} (nan and inf are no flag values)")
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(f"{where}: a command-line argument cannot hold NUL (remove it from the value)")
    return str(value)


def _json_value(where: str, value: Any) -> Any:
    """A table's value, checked to be JSON (TOML's dates are not, nor are nan and inf)."""
    if isinstance(value, dict):
        return {str(k): _json_value(f"{where}.{k}", v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r} (JSON has no nan or inf)")
    if isinstance(value, str | int | float):
        return value
    raise ConfigError(f"{where}: expected a string, a number, true or false, a list or a table, got {value!r} "
                      "(JSON has no dates: write it as a string)")


def arg_flag(arg: str) -> str | None:
    """The flag an ``extra_args`` element names (``--max-model-len=4`` -> ``max-model-len``), None for a value."""
    if not arg.startswith("--") or len(arg) == 2:
        return None
    return arg[2:].split("=", 1)[0].replace("_", "-").lower()


def suggest(args: Sequence[str]) -> str:
    """``extra_args`` as the ``[engine.vllm]`` lines that say the same, for the deprecation message."""
    lines: list[str] = []
    i = 0
    while i < len(args):
        flag = arg_flag(args[i])
        if flag is None:
            return 'e.g. "--max-num-seqs", "16" is max-num-seqs = 16'
        inline = "=" in args[i]
        values: list[str] = [args[i].split("=", 1)[1]] if inline else []
        i += 1
        while not inline and i < len(args) and arg_flag(args[i]) is None:
            values.append(args[i])
            i += 1
        if not values:
            lines.append(f"{flag} = true")
        elif len(values) == 1:
            v = values[0]
            lines.append(f"{flag} = {v}" if re.fullmatch(r"-?\d+(\.\d+)?", v) else f"{flag} = {json.dumps(v)}")
        else:
            lines.append(f"{flag} = {json.dumps(values)}")
    return "; ".join(lines) if lines else "nothing to move: remove it"


# ----------------------------------------------------------------------------- flags the installed vLLM takes


@dataclass(frozen=True)
class UnknownFlag:
    """A flag the config gives vLLM that the engine's vLLM does not take: the engine would refuse to boot."""

    key: str  # where the file writes it: "engine.vllm.max-modle-len", "engine.extra_args"
    option: str  # what vLLM would get, without the dashes: "max-modle-len", "no-trust-remote-code"
    suggestion: str | None  # the closest flag vLLM does take
    negation: bool  # `flag = false` for a flag that has no --no- form

    def message(self, vllm: str) -> str:
        if self.negation:
            bare = self.option.removeprefix("no-")
            return (f"{self.key} = false: {vllm} has no flag --{self.option} (remove the key: --{bare} is off "
                    "unless given)")
        fix = (f"did you mean {self.suggestion}?" if self.suggestion else
               "see python -m vllm.entrypoints.openai.api_server --help for its flags")
        return f"{self.key}: {vllm} has no flag --{self.option} ({fix})"

    def as_dict(self, vllm: str) -> dict[str, Any]:
        return {"key": self.key, "flag": f"--{self.option}", "suggestion": self.suggestion,
                "message": self.message(vllm)}


def written_flags(engine: Any, skip: Collection[str]) -> dict[str, str]:
    """The flags an ``[engine]`` table (as parsed) gives vLLM, as vLLM gets them (``flag = false`` is
    ``no-flag``), each with the key that writes it: the keys of ``[engine.vllm]`` and the deprecated
    ``extra_args``, without the flags in ``skip`` (pinsidecar's own) and without what the reader refuses anyway."""
    out: dict[str, str] = {}
    if not isinstance(engine, dict):
        return out
    table = engine.get("vllm")
    for key, value in (table.items() if isinstance(table, dict) else ()):
        flag = spelling(str(key))
        if _FLAG_NAME.fullmatch(flag) and flag.removeprefix("no-") not in skip:
            out.setdefault(f"no-{flag}" if value is False else flag, f"engine.vllm.{key}")
    extra = engine.get("extra_args")
    for arg in (extra if isinstance(extra, list) else ()):
        flag = arg_flag(arg) if isinstance(arg, str) else None
        if flag is not None and flag.removeprefix("no-") not in skip:
            out.setdefault(flag, "engine.extra_args")
    return out


def unknown_flags(written: Mapping[str, str], known: Collection[str]) -> list[UnknownFlag]:
    """The flags of ``written`` (option -> key, :func:`written_flags`) that are not in ``known`` (what the
    engine's vLLM takes), each with the closest flag it does take."""
    out: list[UnknownFlag] = []
    for option, key in written.items():
        if option in known:
            continue
        bare = option.removeprefix("no-")
        if option != bare and bare in known:
            out.append(UnknownFlag(key, option, None, negation=True))
        else:
            out.append(UnknownFlag(key, option, closest(option, known), negation=False))
    return out
