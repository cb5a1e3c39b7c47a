"""The heal scenario's attribution figures on recorded data: the waits during the apply request, the longest gaps
with their stage, and the Triton compiles read back from a cache folder laid out as Triton writes it.

The GPU run is where these matter (a 16-stream run stood still for a second in ``applying``, and the figure could
not say whether the apply, the parity reference or a JIT compile did it); here they are checked on inputs whose
answer is known.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.scenario.figures import apply_request_gaps, long_gaps
from bench.scenario.jit_cache import compiles_since, per_kernel
from pinsidecar.testing.streaming import ClientStats, Gap

WALL0 = 1_800_000_000.0
STAGES = [{"stage": "code", "start_s": 0.0, "end_s": 10.0}, {"stage": "remap", "start_s": 10.0, "end_s": 20.0}]


def _client(*gaps: tuple[float, float, str]) -> ClientStats:
    return ClientStats(gaps=[Gap(WALL0 + a, WALL0 + b, kind) for a, b, kind in gaps])


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(WALL0 + t)) + f".{min(999, round((t % 1) * 1000)):03d}Z"


def test_the_apply_request_window_tells_its_gaps_from_the_rest_of_applying() -> None:
    # a 1 s token gap after the answer (the parity compare), a 40 ms one inside the request's window
    clients = [_client((11.0, 11.04, "token"), (13.0, 14.0, "token")), _client((11.5, 11.8, "first"))]
    rec = {"apply": {"requests": [{"at": _stamp(10.5), "wait_s": 1.5, "wall_s": 0.6, "hold_max_s": 0.009}]}}
    got = apply_request_gaps(rec, clients, WALL0)
    assert got is not None and got["state"] == "apply_request" and got["t"] == 10.5 and got["seconds"] == 1.5
    assert got["longest_gap_within_stream_s"] == 0.04 and got["longest_gap_s"] == 0.3  # the first-token wait
    assert got["hook_wall_s"] == 0.6 and got["hold_max_s"] == 0.009
    # against the prose stage's windows of the request's length (1.5 s): 20 ms in each of two, nothing in a third
    prose = [_client((20.2, 20.22, "token"), (22.0, 22.02, "token"))]
    based = apply_request_gaps(rec, clients + prose, WALL0, (WALL0 + 19.0, WALL0 + 23.5))
    assert based is not None and based["baseline"] == {"windows": 3, "median_ms": 20.0, "max_ms": 20.0}
    assert based["excess_ms"] == 20.0  # 40 ms during the apply, 20 ms in an equal window without one
    assert apply_request_gaps({"apply": {"requests": []}}, clients, WALL0) is None
    assert apply_request_gaps({}, clients, WALL0) is None


def test_long_gaps_keep_the_longest_in_time_order_with_stage_and_overlapping_compiles() -> None:
    clients = [_client((1.0, 1.1, "token"), (2.0, 4.5, "first"), (12.0, 13.0, "token")),
               _client((3.0, 3.3, "token"), (15.0, 15.2, "token"))]
    compiles = [{"kernel": "_partition_kernel", "t": 2.5, "t_end": 3.1},
                {"kernel": "fused_moe_kernel", "t": 12.2, "t_end": 12.9},
                {"kernel": "late", "t": 16.0, "t_end": 16.5}]
    got = long_gaps(clients, WALL0, STAGES, compiles, min_s=0.25, limit=3)
    assert [g["t"] for g in got] == [2.0, 3.0, 12.0]  # the 0.1 and 0.2 s gaps are under min_s
    assert [g["stage"] for g in got] == ["code", "code", "remap"]
    assert [g["kind"] for g in got] == ["first", "token", "token"] and [g["client"] for g in got] == [0, 1, 0]
    assert got[0]["compiles"] == ["_partition_kernel"] and got[1]["compiles"] == ["_partition_kernel"]
    assert got[2]["compiles"] == ["fused_moe_kernel"]
    assert [g["seconds"] for g in long_gaps(clients, WALL0, STAGES, min_s=0.25, limit=1)] == [2.5]
    assert "compiles" not in long_gaps(clients, WALL0, STAGES, None)[0]


def _compile(cache: Path, key: str, kernel: str, first: float, last: float) -> None:
    d = cache / key
    d.mkdir(parents=True)
    for i, ext in enumerate(("ttir", "ttgir", "llir", "ptx", "cubin", "json")):
        f = d / f"{kernel}.{ext}"
        f.write_text("x")
        t = first + (last - first) * i / 5
        os.utime(f, (t, t))
    g = d / f"__grp__{kernel}.json"
    g.write_text("{}")
    os.utime(g, (last, last))


def test_compiles_are_read_back_from_the_cache_folder_after_the_run_began(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    _compile(cache, "aaa", "fused_moe_kernel", WALL0 - 50, WALL0 - 49)  # an earlier process's: not this run's
    _compile(cache, "bbb", "fused_moe_kernel", WALL0 + 5.0, WALL0 + 6.2)
    _compile(cache, "ccc", "_partition_kernel", WALL0 + 2.0, WALL0 + 2.3)
    _compile(cache, "ddd", "fused_moe_kernel", WALL0 + 9.0, WALL0 + 9.9)
    (cache / "stray-file").write_text("")  # not a compile's folder
    (cache / "empty").mkdir()
    got = compiles_since(cache, WALL0)
    assert [(c["kernel"], c["t"], c["t_end"]) for c in got] == [
        ("_partition_kernel", 2.0, 2.3), ("fused_moe_kernel", 5.0, 6.2), ("fused_moe_kernel", 9.0, 9.9)]
    assert per_kernel(got) == {"fused_moe_kernel": 2, "_partition_kernel": 1}
    assert compiles_since(tmp_path / "absent", WALL0) == []
