"""The routing-trace file: round trip, a foreign ``numpy.savez`` trace, and every refusal naming its problem.

Each bad file must raise the contract's one error type, :class:`ArtifactError`, with the path and the problem in
the message (and a fix in the hint), never a numpy or zipfile exception.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pinsidecar_hook.contract import TRACE_FORMAT, VERSION, ArtifactError, RoutingTrace, load_trace, save_trace

E, L, K = 16, 3, 4


def _experts(tokens: int = 20, seed: int = 0) -> np.ndarray:
    """int64 [tokens, L, K], distinct experts per row (a router's top-k)."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, L, E)), axis=2)[:, :, :K]


def _savez(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def _refused(path: Path, *fragments: str) -> ArtifactError:
    with pytest.raises(ArtifactError) as err:
        load_trace(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert err.value.hint, msg  # every refusal says how to fix it
    return err.value


# ---------------------------------------------------------------------------------------------------- round trip


def test_round_trip_keeps_everything_and_writes_the_version(tmp_path: Path) -> None:
    ex = _experts()
    trace = RoutingTrace(ex, E, layer_ids=(3, 7, 11), meta={"workload": "code", "model": {"name": "m"}})
    save_trace(tmp_path / "sub" / "t.npz", trace)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.npz"]  # no temp file left behind
    back = load_trace(tmp_path / "sub" / "t.npz")
    assert back.experts.dtype == np.uint16 and np.array_equal(back.experts, ex)
    assert (back.num_experts, back.layer_ids, back.meta) == (E, (3, 7, 11), trace.meta)
    assert (back.tokens, back.num_layers, back.top_k, back.selections) == (20, L, K, 20 * L * K)
    with np.load(tmp_path / "sub" / "t.npz") as raw:
        assert str(raw["format"]) == TRACE_FORMAT and int(raw["version"]) == VERSION


def test_a_trace_is_a_value() -> None:
    ex = _experts()
    trace = RoutingTrace(ex, E)
    ex[0, 0, 0] = (ex[0, 0, 0] + 1) % E  # the caller's array is not the trace's
    assert trace.experts[0, 0, 0] != ex[0, 0, 0]
    with pytest.raises(ValueError, match="read-only"):
        trace.experts[0, 0, 0] = 1


def test_save_replaces_an_old_trace_and_refuses_a_directory(tmp_path: Path) -> None:
    save_trace(tmp_path / "t.npz", RoutingTrace(_experts(seed=1), E))
    save_trace(tmp_path / "t.npz", RoutingTrace(_experts(seed=2), E))
    assert np.array_equal(load_trace(tmp_path / "t.npz").experts, _experts(seed=2))
    with pytest.raises(ArtifactError, match="is a directory"):
        save_trace(tmp_path, RoutingTrace(_experts(), E))


def test_a_foreign_trace_without_version_loads_as_version_1(tmp_path: Path) -> None:
    """Recorded elsewhere with plain numpy.savez: no format, no version, int64 ids, a plain int num_experts."""
    ex = _experts()
    back = load_trace(_savez(tmp_path / "foreign.npz", experts=ex, num_experts=E))
    assert back.experts.dtype == np.uint16 and np.array_equal(back.experts, ex)
    assert (back.num_experts, back.layer_ids, back.meta) == (E, None, {})
    np.savez_compressed(tmp_path / "z.npz", experts=ex.astype(np.int8), num_experts=np.uint8(E), other=np.ones(3))
    assert np.array_equal(load_trace(tmp_path / "z.npz").experts, ex)  # compressed, other dtypes, extra keys


def test_counts_are_per_layer_selections() -> None:
    ex = np.array([[[0, 1]], [[1, 2]], [[1, 3]]])  # 3 tokens, 1 layer, top-2
    assert RoutingTrace(ex, 5).counts().tolist() == [[1, 3, 1, 1, 0]]
    many = RoutingTrace(_experts(tokens=50), E)
    counts = many.counts()
    assert counts.shape == (L, E) and counts.dtype == np.int64
    assert (counts.sum(axis=1) == 50 * K).all()
    assert counts[1, 5] == int((many.experts[:, 1, :] == 5).sum())


# ---------------------------------------------------------------------------------------------------- refusals


def test_not_an_npz_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path / "missing.npz", "file not found")
    (tmp_path / "t.json").write_text('{"experts": []}')
    _refused(tmp_path / "t.json", "not an .npz archive")
    np.save(tmp_path / "a.npy", _experts())
    _refused(tmp_path / "a.npy", "single .npy array")
    (tmp_path / "d.npz").mkdir()
    _refused(tmp_path / "d.npz", "is a directory")


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    good = _savez(tmp_path / "good.npz", experts=_experts(200), num_experts=E).read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[: len(good) // 2] + good[-200:])  # the directory survives, data not
    _refused(tmp_path / "cut.npz", "unreadable .npz")
    (tmp_path / "short.npz").write_bytes(good[:-10])  # the directory is gone
    _refused(tmp_path / "short.npz", "truncated or damaged")


def test_missing_keys_are_named(tmp_path: Path) -> None:
    _refused(_savez(tmp_path / "a.npz", num_experts=E), "missing key 'experts'")
    _refused(_savez(tmp_path / "b.npz", experts=_experts()), "missing key 'num_experts'")


def test_wrong_dimensions_are_refused(tmp_path: Path) -> None:
    _refused(_savez(tmp_path / "a.npz", experts=_experts()[:, 0, :], num_experts=E), "3 dimensions", "(20, 4)")
    _refused(_savez(tmp_path / "b.npz", experts=np.zeros((0, L, K), np.uint16), num_experts=E), "at least one token")
    _refused(_savez(tmp_path / "c.npz", experts=np.zeros((5, L, 0), np.uint16), num_experts=E), "top_k >= 1")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, np.complex64])
def test_ids_that_are_not_integers_are_refused(tmp_path: Path, dtype: Any) -> None:
    path = _savez(tmp_path / "t.npz", experts=_experts().astype(dtype), num_experts=E)
    _refused(path, "must hold integers", np.dtype(dtype).name)


def test_ids_out_of_range_are_refused(tmp_path: Path) -> None:
    ex = _experts()
    ex[4, 1, 2] = E
    _refused(_savez(tmp_path / "hi.npz", experts=ex, num_experts=E), f"expert id {E} at token 4, layer 1",
             f"outside 0..{E - 1}")
    ex[4, 1, 2] = -1
    _refused(_savez(tmp_path / "lo.npz", experts=ex, num_experts=E), "expert id -1", "outside")


@pytest.mark.parametrize("num_experts", [0, -3, 65536, 70000])
def test_num_experts_out_of_range_is_refused(tmp_path: Path, num_experts: int) -> None:
    path = _savez(tmp_path / "t.npz", experts=_experts() % 2, num_experts=num_experts)
    _refused(path, "num_experts must be in 1..65535", str(num_experts))


def test_num_experts_must_be_one_integer(tmp_path: Path) -> None:
    _refused(_savez(tmp_path / "f.npz", experts=_experts(), num_experts=16.0), "num_experts must be one integer")
    _refused(_savez(tmp_path / "v.npz", experts=_experts(), num_experts=[16, 16]), "num_experts must be one integer")


def test_top_k_beyond_num_experts_is_refused(tmp_path: Path) -> None:
    ex = np.zeros((2, 1, 5), np.uint16)
    _refused(_savez(tmp_path / "t.npz", experts=ex, num_experts=4), "top_k must be in 1..num_experts (4), got 5")


def test_an_expert_twice_in_one_row_is_refused(tmp_path: Path) -> None:
    ex = _experts()
    ex[7, 2, 3] = ex[7, 2, 0]
    err = _refused(_savez(tmp_path / "t.npz", experts=ex, num_experts=E), "token 7, layer 2",
                   f"expert {ex[7, 2, 0]} more than once", "a router never picks an expert twice")
    assert "record it again" in err.hint


def test_bad_layer_ids_are_refused(tmp_path: Path) -> None:
    _refused(_savez(tmp_path / "n.npz", experts=_experts(), num_experts=E, layer_ids=[0, 1]),
             "layer_ids has 2 entries but experts has 3 layers")
    _refused(_savez(tmp_path / "d.npz", experts=_experts(), num_experts=E, layer_ids=[0, 4, 4]),
             "distinct", "[0, 4, 4]")
    _refused(_savez(tmp_path / "f.npz", experts=_experts(), num_experts=E, layer_ids=[0.0, 1.0, 2.0]),
             "layer_ids must be a 1-D list of integers")


@pytest.mark.parametrize(("meta", "problem"), [
    ("[1, 2]", "meta must be a JSON object, got a JSON list"),
    ("{not json", "meta is not valid JSON"),
    (np.arange(3), "meta must be a JSON object stored as a string"),
])
def test_meta_that_is_not_a_json_object_is_refused(tmp_path: Path, meta: Any, problem: str) -> None:
    _refused(_savez(tmp_path / "t.npz", experts=_experts(), num_experts=E, meta=meta), problem)


def test_meta_as_a_json_string_loads(tmp_path: Path) -> None:
    path = _savez(tmp_path / "t.npz", experts=_experts(), num_experts=E, meta=json.dumps({"a": [1, 2]}))
    assert load_trace(path).meta == {"a": [1, 2]}


def test_an_unknown_version_is_refused_never_guessed(tmp_path: Path) -> None:
    path = _savez(tmp_path / "t.npz", experts=_experts(), num_experts=E, version=VERSION + 1)
    _refused(path, f"trace version {VERSION + 1} is not supported", f"reads version {VERSION}")
    _refused(_savez(tmp_path / "s.npz", experts=_experts(), num_experts=E, version="1"), "version must be one integer")


def test_another_format_is_refused(tmp_path: Path) -> None:
    path = _savez(tmp_path / "t.npz", experts=_experts(), num_experts=E, format="pinsidecar.counts")
    _refused(path, "format is 'pinsidecar.counts'", TRACE_FORMAT)


def test_pickled_members_are_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, experts=_experts(), num_experts=E, meta=np.array([{"a": 1}], dtype=object))
    _refused(path, "holds Python objects")


def test_a_header_claiming_a_huge_array_is_refused_before_allocating(tmp_path: Path) -> None:
    """A member whose .npy header claims 2^35 selections, with no data behind it: refused from the header."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<u2", "fortran_order": False,
                                                  "shape": (2**20, 4096, 8)})
    num = io.BytesIO()
    np.save(num, np.array(E))
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("experts.npy", b"\x93NUMPY\x01\x00" + header.getvalue()[8:])
        zf.writestr("num_experts.npy", num.getvalue())
    _refused(path, "more than the 2147483648 a trace may hold")


def test_the_constructor_checks_like_the_reader() -> None:
    with pytest.raises(ArtifactError, match="more than once"):
        RoutingTrace(np.array([[[1, 1]]]), 4)
    with pytest.raises(ArtifactError, match="num_experts must be an integer"):
        RoutingTrace(np.array([[[1, 2]]]), 4.0)  # type: ignore[arg-type]
    with pytest.raises(ArtifactError, match="meta must be a JSON object"):
        RoutingTrace(np.array([[[1, 2]]]), 4, meta=[1])  # type: ignore[arg-type]
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        RoutingTrace(np.array([[[1, 2]]]), 4, meta={"x": object()})
