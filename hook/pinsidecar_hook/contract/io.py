"""Reading and writing the artifact files: the rules every format follows, in one place.

- every file carries ``format`` and ``version``; an unknown version is refused, never guessed at;
- every read validates shape, ranges and internal consistency and raises :class:`ArtifactError` with the path
  and a hint, never a silent default;
- every write goes through :func:`atomic_write_bytes` (write a temp file in the same directory, fsync,
  rename, fsync the directory), so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "COUNTS_FORMAT",
    "MAP_FORMAT",
    "MAX_EXPERTS",
    "MAX_FILE_BYTES",
    "MAX_LAYERS",
    "STATS_FORMAT",
    "TRACE_FORMAT",
    "VERSION",
    "ArtifactError",
    "atomic_write_bytes",
    "atomic_write_json",
    "utc_now",
]

COUNTS_FORMAT = "pinsidecar.counts"
MAP_FORMAT = "pinsidecar.map"
STATS_FORMAT = "pinsidecar.stats"
TRACE_FORMAT = "pinsidecar.trace"  # an .npz, not JSON: see contract/trace.py
# One version for all of them; bump it (and keep a reader for the old one) whenever a field changes meaning.
VERSION = 1
# Bounds on what a reader accepts, checked before anything is allocated from a header's dimensions: a corrupt or
# hostile header claiming 10^12 experts is refused with a message, not an attempt to build a 10^12-entry table.
# Far above any real MoE (DeepSeek-V3: 61 layers x 256 experts), far below what would hurt a host.
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
# A counts, map or stats file is kilobytes to a few MB (a histogram of MAX_LAYERS x MAX_EXPERTS would not fit
# anyway); a larger file is not one of ours, and reading it whole would be the allocation the caps prevent.
MAX_FILE_BYTES = 256 * 1024 * 1024
# Counters are held in int64 (numpy tables, Prometheus deltas): a larger value in a file is corruption.
COUNT_LIMIT = 2**63 - 1


class ArtifactError(ValueError):
    """A counts, map, stats or trace file that cannot be used as it is. The message names the file and the fix."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str, hint: str = "") -> None:
        self.path = None if path is None else str(path)
        self.problem = problem
        self.hint = hint
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{problem}" + (f" ({hint})" if hint else ""))


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, the only time format the artifacts use."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------------- writing


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that no reader, and no crash, ever sees a partial file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    # Compact on purpose: an indented dump takes the pure-Python encoder, ~14x slower on a 40 x 384 map, and these
    # files are read through `pinsidecar counts show` / `map show`, not by eye.
    atomic_write_bytes(path, (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode())


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sha256(obj: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(obj)).hexdigest()


# ---------------------------------------------------------------------------------------------------- reading


def _read_json(path: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ArtifactError(p, f"file is {size} bytes, over the {MAX_FILE_BYTES}-byte limit of a "
                                f"{fmt.split('.')[-1]} file", "this is not a pinsidecar artifact")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(p, "file not found", "check the path") from None
    except OSError as exc:
        raise ArtifactError(p, f"cannot read: {exc.strerror}", "check permissions") from None
    if not raw.strip():
        raise ArtifactError(p, "file is empty", f"regenerate the {fmt.split('.')[-1]} file")
    try:
        doc = json.loads(raw)
    except RecursionError:  # "[[[[..." nested deeper than the parser's stack: corrupt, not a crash
        raise ArtifactError(p, "JSON nested too deeply; the file is corrupt",
                            f"regenerate the {fmt.split('.')[-1]} file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            p, f"not valid JSON ({exc}); the file is corrupt or truncated",
            f"regenerate the {fmt.split('.')[-1]} file",
        ) from None
    if not isinstance(doc, dict):
        raise ArtifactError(p, "top level is not a JSON object", "this is not a pinsidecar artifact")
    found = doc.get("format")
    if found != fmt:
        raise ArtifactError(p, *_wrong_format(found, fmt, "format" in doc))
    version = doc.get("version")
    if type(version) is not int or version != VERSION:  # `true` and `1.0` compare equal to 1 but are not versions
        raise ArtifactError(
            p, f"format version {version!r} is not supported (this pinsidecar reads version {VERSION})",
            "rebuild the file with this pinsidecar version, or upgrade pinsidecar",
        )
    return doc


# Which command writes each kind of file: what to pass instead of a file of another kind.
_WRITTEN_BY = {COUNTS_FORMAT: "a counts file, as `pinsidecar count-boot` writes",
               MAP_FORMAT: "a map file, as `pinsidecar map build` writes",
               STATS_FORMAT: "a stats file, as the hook writes in pin mode"}


def _wrong_format(found: Any, fmt: str, has_format: bool) -> tuple[str, str]:
    """(problem, fix) for a JSON document whose ``format`` is not ``fmt``: another pinsidecar file is named as
    what it is; a document without the field is no pinsidecar file at all."""
    kind = fmt.split(".")[-1]
    fix = f"pass {_WRITTEN_BY.get(fmt, f'a {kind} file')}"
    if found is None:  # absent, or JSON null
        what = "has no" if not has_format else 'has a null'
        return f'not a pinsidecar {kind} file: it {what} "format" field (expected {fmt!r})', fix
    if isinstance(found, str) and found in _WRITTEN_BY:
        return f"a pinsidecar {found.split('.')[-1]} file: format is {found!r}, expected {fmt!r}", fix
    return f"format is {found!r}, expected {fmt!r}", fix


def _field(doc: dict[str, Any], key: str, typ: type | tuple[type, ...], path: Any) -> Any:
    if key not in doc:
        raise ArtifactError(path, f"missing field {key!r}", "the file is truncated or hand-edited; regenerate it")
    value = doc[key]
    if isinstance(value, bool) and typ in (int, float, (int, float)):
        raise ArtifactError(path, f"field {key!r} has type bool")
    if not isinstance(value, typ):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ArtifactError(path, f"field {key!r} should be {name}, got {type(value).__name__}")
    return value


def _finite(value: Any, what: str, path: Any, lo: float | None = None, hi: float | None = None) -> float:
    """An optional number field as a float: finite (JSON readers accept NaN and Infinity) and within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArtifactError(path, f"field {what!r} should be a number, got {type(value).__name__}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond float's range
        out = math.inf
    if not math.isfinite(out) or (lo is not None and out < lo) or (hi is not None and out > hi):
        bounds = f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else ""
        raise ArtifactError(path, f"field {what!r} must be a finite number{bounds}, got {value!r}",
                            "the file is corrupt or hand-edited; regenerate it")
    return out


def _int_list(value: Any, what: str, path: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ArtifactError(path, f"{what} must be a list of integers")
    return value


def _check_dims(layer_ids: list[int], num_experts: int, top_k: int, path: Any) -> None:
    fix = "the file is corrupt; regenerate it"  # every refusal says how to fix it, whichever artifact it is
    if not layer_ids:
        raise ArtifactError(path, "no layers", fix)
    if len(layer_ids) > MAX_LAYERS:
        raise ArtifactError(path, f"{len(layer_ids)} layers, more than the {MAX_LAYERS} a file may describe", fix)
    if num_experts > MAX_EXPERTS:
        raise ArtifactError(path, f"num_experts is {num_experts}, more than the {MAX_EXPERTS} a file may describe", fix)
    if len(set(layer_ids)) != len(layer_ids) or any(i < 0 for i in layer_ids):
        raise ArtifactError(path, f"layer_ids must be distinct non-negative integers, got {layer_ids}", fix)
    if num_experts < 1:
        raise ArtifactError(path, f"num_experts must be >= 1, got {num_experts}", fix)
    if not 1 <= top_k <= num_experts:
        raise ArtifactError(path, f"top_k must be in 1..num_experts ({num_experts}), got {top_k}", fix)


def _read_dims(doc: dict[str, Any], path: Any) -> tuple[list[int], int, int]:
    """The header every format shares (layer ids, experts, top-k), read and checked in one place."""
    layer_ids = _int_list(_field(doc, "layer_ids", list, path), "layer_ids", path)
    num_experts = _field(doc, "num_experts", int, path)
    top_k = _field(doc, "top_k", int, path)
    _check_dims(layer_ids, num_experts, top_k, path)
    return layer_ids, num_experts, top_k


def _guarded(parse: Any, doc: dict[str, Any], path: Any) -> Any:
    """Run a ``from_json`` so that any malformed optional field is an :class:`ArtifactError` too, never a bare
    ValueError/TypeError from deep inside a conversion."""
    try:
        return parse(doc, path)
    except ArtifactError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError) as exc:  # int(inf) is an OverflowError
        raise ArtifactError(path, f"malformed field ({type(exc).__name__}: {exc})",
                            "the file is corrupt or hand-edited; regenerate it") from None
