"""The trace file: which experts the router picked, token by token, in every MoE layer (a routing trace).

Counts say how often each expert was picked; a trace keeps the order, which is what a cache tier lives on (an
expert picked by one token is likely picked by the next). It is an ``.npz`` rather than JSON because it is large:
100k tokens x 24 layers x top-6 is 14.4M ids, 29 MB as uint16. Keys:

- ``experts``: integers, shape ``[tokens, layers, top_k]``, each token's selected expert ids in router order;
  any integer dtype whose values fit is read (and held as uint16), floats are refused;
- ``num_experts``: integer scalar, experts per layer (1..65535, so every id fits in uint16);
- ``layer_ids`` (optional): integers, one per layer, distinct; absent means "not recorded", and then only the
  number of layers is compared with a counts file or a map;
- ``meta`` (optional): a JSON object, stored as a string;
- ``format`` / ``version`` (optional): ``"pinsidecar.trace"`` and the format version. A trace someone recorded
  with plain ``numpy.savez(path, experts=..., num_experts=...)`` has neither, and is read as version 1: that is
  the layout version 1 describes, so an absent version is not a guess.

:func:`save_trace` writes through :func:`~pinsidecar_hook.contract.io.atomic_write_bytes` like every artifact;
:func:`load_trace` checks each member's header (shape, dtype) before reading it, so a corrupt or hostile header
is refused with a message rather than becoming an allocation of the size it claims.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pinsidecar_hook.contract.io import (
    MAX_LAYERS,
    TRACE_FORMAT,
    VERSION,
    ArtifactError,
    _check_dims,
    atomic_write_bytes,
)

__all__ = ["RoutingTrace", "load_trace", "save_trace"]

# Expert ids are held as uint16: 65535 experts per layer is the most whose ids (0..65534) all fit.
MAX_TRACE_EXPERTS = 65535
# 2^31 selections (4 GiB as uint16) is ~1M tokens of a 61-layer top-8 model; a header claiming more is refused
# before it is read (split a longer recording into several traces).
MAX_SELECTIONS = 2**31
# The small members (num_experts, version, format, layer_ids, meta) are bytes to kilobytes; this is generous.
_MAX_SMALL_BYTES = 16 * 1024 * 1024
_FIX = "the trace is corrupt or was not written as a routing trace; record it again"


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Every token's selected experts in every MoE layer, in router order, with the layer geometry.

    A value: ``experts`` is a private read-only uint16 copy, checked on construction the same way a file is on
    read (:func:`load_trace`), so a trace that exists is one the simulator can trust (ids in range, no expert
    twice in one token's row). ``layer_ids`` is None when the recording did not say which layers these are.
    """

    experts: np.ndarray = field(repr=False)  # uint16 [tokens, layers, top_k]
    num_experts: int
    layer_ids: tuple[int, ...] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arr = np.asarray(self.experts)
        _check_experts_header(arr.shape, arr.dtype)
        num_experts = _checked_num_experts(self.num_experts)
        layers, top_k = arr.shape[1], arr.shape[2]
        layer_ids = None if self.layer_ids is None else _checked_layer_ids(self.layer_ids, layers)
        # the header every artifact shares (layer count, distinct layer ids, top_k in 1..num_experts), one checker
        _check_dims(list(range(layers)) if layer_ids is None else list(layer_ids), num_experts, top_k, None)
        object.__setattr__(self, "experts", _checked_ids(arr, num_experts))
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "layer_ids", layer_ids)
        object.__setattr__(self, "meta", _checked_meta(self.meta))

    @property
    def tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def selections(self) -> int:
        return int(self.experts.size)

    def counts(self) -> np.ndarray:
        """int64 ``[layers, num_experts]``: how often each expert was picked, the table a counts file holds.

        What ranks experts when a trace, not a count boot, is the training data (a trace and the counts of the
        same traffic rank the same)."""
        return np.stack([np.bincount(self.experts[:, i, :].ravel(), minlength=self.num_experts)
                         for i in range(self.num_layers)]).astype(np.int64, copy=False)


def _checked_num_experts(num_experts: Any) -> int:
    """An int within what uint16 ids can name (a trace's own bound, stricter than the other artifacts')."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer):
        raise ArtifactError(None, f"num_experts must be an integer, got {type(num_experts).__name__}", _FIX)
    if not 1 <= int(num_experts) <= MAX_TRACE_EXPERTS:
        raise ArtifactError(None, f"num_experts must be in 1..{MAX_TRACE_EXPERTS}, got {int(num_experts)}",
                            "expert ids are stored as uint16; " + _FIX)
    return int(num_experts)


def _checked_ids(arr: np.ndarray, num_experts: int) -> np.ndarray:
    """``arr`` (header already checked) as a read-only uint16 copy once every id is an expert and no token's
    row names one twice; :class:`ArtifactError` (no path: the caller adds it) otherwise."""
    top_k = arr.shape[2]
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        where = np.argwhere(arr == bad)[0]
        raise ArtifactError(None, f"expert id {bad} at token {where[0]}, layer {where[1]} is outside "
                            f"0..{num_experts - 1} (num_experts={num_experts})",
                            "num_experts is wrong, or the ids are not expert ids; " + _FIX)
    out = arr.astype(np.uint16, copy=True)
    if top_k > 1:
        ordered = np.sort(out, axis=2)
        twice = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
        if twice.any():
            t, layer = (int(i) for i in np.argwhere(twice)[0])
            row = out[t, layer].tolist()
            dup = next(e for e in row if row.count(e) > 1)
            raise ArtifactError(None, f"token {t}, layer {layer} selects expert {dup} more than once in its top-k "
                                f"row {row} (a router never picks an expert twice for one token)", _FIX)
    out.flags.writeable = False
    return out


def _check_experts_header(shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """What can be refused from the shape and dtype alone, before a single id is read."""
    if len(shape) != 3:
        raise ArtifactError(None, f"experts must have 3 dimensions [tokens, layers, top_k], got shape {shape}",
                            "store every token's selections as experts[token, layer, slot]")
    if dtype.kind not in "iu":
        raise ArtifactError(None, f"experts must hold integers, found dtype {dtype}",
                            "store expert ids as integers, e.g. experts.astype(numpy.uint16)")
    tokens, layers, top_k = shape
    if tokens < 1 or layers < 1 or top_k < 1:
        raise ArtifactError(None, f"experts has shape {shape}: a trace needs at least one token, one layer and "
                            "top_k >= 1", "record at least one token")
    if tokens * layers * top_k > MAX_SELECTIONS:
        raise ArtifactError(None, f"{tokens * layers * top_k} selections, more than the {MAX_SELECTIONS} a trace "
                            "may hold", "split the recording into several traces")


def _checked_layer_ids(layer_ids: Any, layers: int) -> tuple[int, ...]:
    ids = np.asarray(layer_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ArtifactError(None, f"layer_ids must be a 1-D list of integers, got {ids.dtype} of shape {ids.shape}",
                            _FIX)
    if ids.size != layers:
        raise ArtifactError(None, f"layer_ids has {ids.size} entries but experts has {layers} layers",
                            "give one layer id per layer of experts, or leave layer_ids out")
    return tuple(int(i) for i in ids)  # distinct and non-negative: io._check_dims, as for every artifact


def _checked_meta(meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise ArtifactError(None, f"meta must be a JSON object, got {type(meta).__name__}",
                            "store meta as json.dumps({...}) of a dict")
    try:
        return json.loads(json.dumps(meta))  # a private copy, and proof it can be written
    except (TypeError, ValueError) as exc:
        raise ArtifactError(None, f"meta is not JSON-serialisable ({exc})", "keep meta to JSON values") from None


# ---------------------------------------------------------------------------------------------------- writing


def save_trace(path: str | os.PathLike[str], trace: RoutingTrace) -> None:
    """Write ``trace`` atomically (a reader sees the old file or the new one), compressed, with its version."""
    target = Path(path)
    if target.is_dir():
        raise ArtifactError(target, "is a directory", "pass a file name for the trace, e.g. traces/code.trace.npz")
    members: dict[str, Any] = {
        "format": np.array(TRACE_FORMAT), "version": np.array(VERSION, dtype=np.int64),
        "experts": trace.experts, "num_experts": np.array(trace.num_experts, dtype=np.int64),
        "meta": np.array(json.dumps(trace.meta, sort_keys=True)),
    }
    if trace.layer_ids is not None:
        members["layer_ids"] = np.asarray(trace.layer_ids, dtype=np.int64)
    buf = io.BytesIO()
    np.savez_compressed(buf, **members)
    atomic_write_bytes(target, buf.getvalue())


# ---------------------------------------------------------------------------------------------------- reading


def load_trace(path: str | os.PathLike[str]) -> RoutingTrace:
    """Read and check a trace; :class:`ArtifactError` naming the file, the problem and the fix otherwise."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            magic = fh.read(6)
    except FileNotFoundError:
        raise ArtifactError(p, "file not found", "check the path") from None
    except IsADirectoryError:
        raise ArtifactError(p, "is a directory", "pass the trace's .npz file") from None
    except OSError as exc:
        raise ArtifactError(p, f"cannot read: {exc.strerror}", "check permissions") from None
    if magic == b"\x93NUMPY":
        raise ArtifactError(p, "is a single .npy array, not an .npz archive",
                            "save it with numpy.savez(path, experts=..., num_experts=...)")
    if not zipfile.is_zipfile(p):
        if magic.startswith(b"PK\x03\x04"):
            raise ArtifactError(p, "a zip archive without its directory: the .npz is truncated or damaged", _FIX)
        raise ArtifactError(p, "not an .npz archive (not a zip file)",
                            "a trace is written by numpy.savez(path, experts=..., num_experts=...)")
    try:
        with zipfile.ZipFile(p) as zf:
            return _read(zf, p)
    except ArtifactError as exc:
        raise ArtifactError(p, exc.problem, exc.hint) from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, TypeError, KeyError,
            NotImplementedError, RuntimeError) as exc:  # a damaged archive or member: zlib, short reads, headers
        raise ArtifactError(p, f"unreadable .npz ({type(exc).__name__}: {exc})", _FIX) from None


def _read(zf: zipfile.ZipFile, path: Path) -> RoutingTrace:
    members = {n[: -len(".npy")]: n for n in zf.namelist() if n.endswith(".npy")}
    for key in ("experts", "num_experts"):
        if key not in members:
            raise ArtifactError(path, f"missing key {key!r} (found {sorted(members) or 'no arrays'})",
                                "save the trace with numpy.savez(path, experts=..., num_experts=...)")
    fmt = _small(zf, members, "format", path)
    if fmt is not None and (fmt.ndim != 0 or fmt.dtype.kind not in "US" or str(fmt[()]) != TRACE_FORMAT):
        raise ArtifactError(path, f"format is {_show(fmt)}, expected {TRACE_FORMAT!r}", "pass a routing trace")
    version = _small(zf, members, "version", path)
    found = 1 if version is None else _int_scalar(version, "version", path)
    if found != VERSION:
        raise ArtifactError(path, f"trace version {found} is not supported (this pinsidecar reads version "
                            f"{VERSION}; an absent version means 1)",
                            "record the trace with this pinsidecar version, or upgrade pinsidecar")
    num_experts = _int_scalar(_small(zf, members, "num_experts", path), "num_experts", path)
    shape, dtype = _header(zf, members["experts"])
    _check_experts_header(shape, dtype)
    with zf.open(members["experts"]) as fh:
        experts = np.lib.format.read_array(fh, allow_pickle=False)
    ids = _small(zf, members, "layer_ids", path)
    meta_arr = _small(zf, members, "meta", path)
    meta: Any = {}
    if meta_arr is not None:
        if meta_arr.ndim != 0 or meta_arr.dtype.kind not in "US":
            raise ArtifactError(path, f"meta must be a JSON object stored as a string, found {meta_arr.dtype} "
                                f"of shape {meta_arr.shape}", "save meta=json.dumps({...})")
        raw = meta_arr[()]
        try:
            meta = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        except (ValueError, RecursionError) as exc:
            raise ArtifactError(path, f"meta is not valid JSON ({exc})", "save meta=json.dumps({...})") from None
        if not isinstance(meta, dict):
            raise ArtifactError(path, f"meta must be a JSON object, got a JSON {type(meta).__name__}",
                                "save meta=json.dumps({...}) of a dict")
    return RoutingTrace(experts=experts, num_experts=num_experts, layer_ids=None if ids is None else ids, meta=meta)


def _header(zf: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """A member's shape and dtype from its .npy header, without reading its data."""
    with zf.open(name) as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ArtifactError(None, f"member {name} is .npy format {version[0]}.{version[1]}, which this reader "
                                "does not take", "save the trace with numpy.savez")
    if dtype.hasobject:
        raise ArtifactError(None, f"member {name} holds Python objects (a pickle), which a trace never does",
                            "store numbers and strings as plain arrays, meta as json.dumps({...})")
    return tuple(int(n) for n in shape), dtype


def _small(zf: zipfile.ZipFile, members: dict[str, str], key: str, path: Path) -> np.ndarray | None:
    """One of the small members, read after its header says it is small; None when absent."""
    if key not in members:
        return None
    shape, dtype = _header(zf, members[key])
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if key == "layer_ids" and (len(shape) != 1 or shape[0] > MAX_LAYERS):
        raise ArtifactError(path, f"layer_ids must be a list of at most {MAX_LAYERS} integers, got shape {shape}",
                            _FIX)
    if size > _MAX_SMALL_BYTES:
        raise ArtifactError(path, f"{key} claims {size} bytes, far more than it can need", _FIX)
    with zf.open(members[key]) as fh:
        return np.lib.format.read_array(fh, allow_pickle=False)


def _int_scalar(arr: np.ndarray | None, key: str, path: Path) -> int:
    assert arr is not None
    if arr.size != 1 or arr.ndim > 1 or arr.dtype.kind not in "iu":
        raise ArtifactError(path, f"{key} must be one integer, found {arr.dtype} of shape {arr.shape}",
                            f"save {key} as a plain int")
    return int(arr.reshape(()))


def _show(arr: np.ndarray) -> str:
    return repr(str(arr[()])) if arr.ndim == 0 else f"{arr.dtype} of shape {arr.shape}"
