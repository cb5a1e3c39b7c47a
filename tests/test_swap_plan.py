"""Remap in place, the contract side: the swap plan between two maps, the ``apply`` request and its answer.

The plan is what both sides compute from the two map files alone (the daemon to decide whether a candidate can be
applied without a reboot, the hook to carry it out), so it is checked here without tensors; the swap itself is in
``test_swap_apply.py`` (CPU) and ``test_swap_gpu.py`` (H200).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pinsidecar_hook import contract as A
from pinsidecar_hook.contract import (
    ApplyResult,
    ExpertMap,
    HookRequest,
    LayerPlacement,
    SwapPlanError,
    apply_args,
    parse_apply_args,
    plan_swap,
    read_hook_request,
    request_path,
    write_hook_request,
)

E = 16


def _map(hot_sets: list[list[int]], *, hot_rows: int | None = None, label: str = "", expert_bytes: int = 0,
         layer_ids: tuple[int, ...] | None = None, top_k: int = 4) -> ExpertMap:
    ids = layer_ids or tuple(range(len(hot_sets)))
    layers = []
    for lid, hot in zip(ids, hot_sets, strict=True):
        cold = [e for e in range(E) if e not in hot]
        layers.append(LayerPlacement(lid, tuple(hot), tuple(cold)))
    return ExpertMap(layer_ids=ids, num_experts=E, top_k=top_k, hot_rows=hot_rows or len(hot_sets[0]),
                     layers=tuple(layers), label=label, expert_bytes=expert_bytes)


def _random_map(seed: int, hot_rows: int = 10, layers: int = 3, expert_bytes: int = 0) -> ExpertMap:
    rng = random.Random(seed)
    return _map([rng.sample(range(E), hot_rows) for _ in range(layers)], expert_bytes=expert_bytes,
                label=f"r{seed}")


def test_pairs_entering_with_leaving_in_map_order() -> None:
    active = _map([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    candidate = _map([[7, 0, 1, 2, 3, 6], [0, 1, 2, 3, 4, 5]])
    plan = plan_swap(active, candidate)
    first, second = plan.layers
    assert (first.layer_id, first.entering, first.leaving) == (0, (7, 6), (4, 5))  # candidate's order, active's order
    assert second.rows == 0 and second.entering == second.leaving == ()
    assert plan.rows == 2 and not plan.empty
    assert (plan.from_hash, plan.to_hash) == (active.content_hash, candidate.content_hash)


@pytest.mark.parametrize("seed", range(8))
def test_every_plan_reaches_the_candidate_placement_without_growing_the_hot_tier(seed: int) -> None:
    active, candidate = _random_map(seed), _random_map(100 + seed)
    plan = plan_swap(active, candidate)
    for old, new, swap in zip(active.layers, candidate.layers, plan.layers, strict=True):
        assert len(swap.entering) == len(swap.leaving) == swap.rows
        hot = set(old.hot)
        for e_in, e_out in zip(swap.entering, swap.leaving, strict=True):
            assert e_in not in hot and e_out in hot  # in from the cold tier, out from the hot one
            hot.remove(e_out)
            hot.add(e_in)
            assert len(hot) == active.hot_rows  # never more hot rows than the tensor has, at any point
        assert hot == set(new.hot)
        assert len(set(swap.entering)) == swap.rows and len(set(swap.leaving)) == swap.rows


def test_same_placement_is_an_empty_plan_and_row_order_alone_is_too() -> None:
    active = _random_map(1)
    assert plan_swap(active, active).empty and plan_swap(active, active).bytes_moved == 0
    reordered = _map([list(reversed(lp.hot)) for lp in active.layers])
    assert reordered.content_hash != active.content_hash
    plan = plan_swap(active, reordered)
    assert plan.empty and plan.rows == 0 and plan.to_hash == reordered.content_hash


def test_bytes_and_summary() -> None:
    active = _map([[0, 1, 2, 3], [0, 1, 2, 3]], expert_bytes=1000)
    candidate = _map([[0, 1, 8, 9], [0, 1, 2, 10]], expert_bytes=1000)
    plan = plan_swap(active, candidate)
    assert plan.rows == 3 and plan.expert_bytes == 1000
    assert plan.bytes_moved == 2 * 3 * 1000  # one expert in and one out per swap
    assert plan.as_dict() == {"from_hash": active.content_hash, "to_hash": candidate.content_hash, "rows": 3,
                              "bytes_moved": 6000, "layers_touched": 2, "rows_per_layer": {"0": 2, "1": 1}}
    assert plan_swap(_map([[0, 1]]), _map([[0, 2]])).bytes_moved == 0  # expert size unknown: 0, not a guess


@pytest.mark.parametrize(("candidate", "fragment"), [
    (_map([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]), "hot_rows 4 -> 5"),
    (_map([[0, 1, 2, 3], [0, 1, 2, 3]], expert_bytes=7), "expert_bytes 0 -> 7"),
    (_map([[0, 1, 2, 3], [0, 1, 2, 3]], layer_ids=(0, 2)), "layer ids [0, 1] -> [0, 2]"),
    (_map([[0, 1, 2, 3]]), "num_layers 2 -> 1"),
    (_map([[0, 1, 2, 3], [0, 1, 2, 3]], top_k=2), "top_k 4 -> 2"),
])
def test_geometry_mismatch_is_refused_with_what_differs(candidate: ExpertMap, fragment: str) -> None:
    active = _map([[0, 1, 2, 3], [4, 5, 6, 7]], label="live")
    with pytest.raises(SwapPlanError) as info:
        plan_swap(active, candidate)
    message = str(info.value)
    assert fragment in message and "another geometry than the active map live" in message
    assert "cannot be applied in place" in message and "reboot" in message


# ---------------------------------------------------------------------------------------------------- the request


def test_apply_request_round_trip(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    args = apply_args(tmp_path / "cand.json", "sha256:" + "ab" * 32)
    token = write_hook_request(stats, "apply", args)
    req = read_hook_request(stats)
    assert req == HookRequest("apply", token, args) and token.startswith("apply-")
    assert parse_apply_args(req.args) == (tmp_path / "cand.json", "sha256:" + "ab" * 32)
    op, tok, got = req  # a 3-tuple, as the daemon side unpacks it
    assert (op, tok, got) == ("apply", token, args)
    assert json.loads(request_path(stats).read_text()) == {"op": "apply", "token": token, "args": args}
    # flush and reset carry no arguments
    write_hook_request(stats, "flush")
    assert read_hook_request(stats) == HookRequest("flush", read_hook_request(stats).token, {})
    assert A.HOOK_OPS == ("flush", "reset", "apply")


def test_apply_with_bad_arguments_is_still_read_so_that_it_can_be_refused(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    request_path(stats).write_text(json.dumps({"op": "apply", "token": "t1", "args": ["not", "an", "object"]}))
    assert read_hook_request(stats) == HookRequest("apply", "t1", {})  # kept (not dropped): the hook answers it
    request_path(stats).write_text(json.dumps({"op": "apply", "token": "t2"}))
    assert read_hook_request(stats) == HookRequest("apply", "t2", {})
    with pytest.raises(ValueError, match="must be a mapping"):
        write_hook_request(stats, "apply", ["x"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "fragment"), [
    ({}, "apply needs args.map"),
    ({"map": "", "hash": "sha256:x"}, "apply needs args.map"),
    ({"map": "relative/cand.json", "hash": "sha256:x"}, "must be an absolute path"),
    ({"map": "/abs/cand.json"}, "apply needs args.hash"),
    ({"map": "/abs/cand.json", "hash": "md5:1"}, "apply needs args.hash"),
    ({"map": 3, "hash": "sha256:x"}, "apply needs args.map"),
])
def test_parse_apply_args_says_what_is_wrong(args: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_apply_args(args)


def test_apply_result_round_trip_and_malformed() -> None:
    result = ApplyResult(token="apply-1", outcome="applied", map_hash="sha256:b", from_hash="sha256:a",
                         to_hash="sha256:b", rows=12, bytes_moved=4096, seconds=0.25, layers=3)
    assert ApplyResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    with pytest.raises(ValueError, match="outcome"):
        ApplyResult.from_json({"outcome": "maybe"})
    with pytest.raises(ValueError, match="malformed field"):
        ApplyResult.from_json({"outcome": "applied", "rows": "many"})
    with pytest.raises(ValueError, match="must be an object"):
        ApplyResult.from_json(["applied"])  # type: ignore[arg-type]
