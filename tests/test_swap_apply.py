"""Remap in place, the hook side, without an engine: pin mode's real state over real tensors, swapped by real requests.

Each layer is built the way pin mode builds it (:func:`pinsidecar_hook.rehome.rehome_layer` on a module with vLLM's
unquantized experts layout) and computed by the torch reference backend's split
(:func:`pinsidecar_hook.backends.torch_ref.split`), the backend whose split is bit-identical to its unsplit call on
any machine. So "the apply is right" can be stated exactly: after an apply, every layer's output has the same bits
as a fresh re-home with the candidate map, every expert's rows are its original bytes, and the tensors kept their
addresses (what captured CUDA graphs need; the GPU half is ``test_swap_gpu.py``, the engine half
``test_swap_engine.py``). A failed apply restores every byte; a refused one touches nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pinsidecar_hook import pin, swap
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.contract import (
    ApplyResult,
    ExpertMap,
    HookConfig,
    LayerPlacement,
    apply_args,
    load_stats,
    plan_swap,
    request_and_wait,
    request_path,
)
from pinsidecar_hook.count import CountState
from pinsidecar_hook.flusher import Flusher
from pinsidecar_hook.pin import LayerPin, ModelFacts, PinState
from pinsidecar_hook.rehome import MemoryLedger, rehome_layer

from pinsidecar.testing import hook_faults
from pinsidecar.testing.wait import wait_until

E, H, D, N, K = 16, 10, 32, 16, 4
LAYER_IDS = (0, 1, 2)
NAMES = ("w13_weight", "w2_weight")
EXPERT_BYTES = (2 * N * D + D * N) * 4  # fp32


def _weights(layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + layer_id)
    return torch.randn(E, 2 * N, D, generator=g) / 4, torch.randn(E, D, N, generator=g) / 4


def _map(seed: int, label: str, hot_rows: int = H, top_k: int = K, **meta: Any) -> ExpertMap:
    rng = random.Random(seed)
    layers = []
    for lid in LAYER_IDS:
        order = list(range(E))
        rng.shuffle(order)
        layers.append(LayerPlacement(lid, tuple(order[:hot_rows]), tuple(order[hot_rows:])))
    return ExpertMap(layer_ids=LAYER_IDS, num_experts=E, top_k=top_k, hot_rows=hot_rows, layers=tuple(layers),
                     label=label, expert_bytes=EXPERT_BYTES, predicted_cold_rate=seed / 1000, meta=dict(meta))


def _save(emap: ExpertMap, tmp_path: Path) -> Path:
    path = tmp_path / f"{emap.label}.json"
    emap.save(path)
    return path


def _state(emap: ExpertMap, map_path: Path, stats_path: Path | None = None, tp_size: int = 1) -> PinState:
    """Pin mode's state as attach builds it: every layer re-homed by ``emap`` through the production path."""
    layers = []
    for lid in emap.layer_ids:
        w13, w2 = _weights(lid)
        owner = torch.nn.Module()
        owner.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        owner.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        rows, hot_local, cold_local = emap.layer(lid).row_map(E)
        rehomed = rehome_layer(owner, list(NAMES), hot_local, cold_local, MemoryLedger())
        layers.append(LayerPin(
            layer_id=lid, name=f"model.layers.{lid}.mlp.experts", row_map=torch.tensor(rows, dtype=torch.int32),
            hot_rows=len(hot_local), cold_rows=len(cold_local), hot=rehomed.hot, cold=rehomed.cold,
            expert_counts=torch.zeros(E, dtype=torch.int64), cold_counts=torch.zeros(1, dtype=torch.int64),
            token_counts=torch.zeros(1, dtype=torch.int64), hot_bytes=rehomed.hot_bytes,
            cold_bytes=rehomed.cold_bytes, keepalive=list(rehomed.cold_host.values()),
            cold_host=dict(rehomed.cold_host)))
    facts = ModelFacts(layer_ids=LAYER_IDS, num_experts=E, top_k=K, first_tensors=NAMES, expert_bytes=EXPERT_BYTES,
                       names_by_layer={p.name: list(NAMES) for p in layers}, problems=())
    cfg = HookConfig(mode="pin", map_path=map_path, stats_path=stats_path, flush_interval_s=60.0)
    summary = {"tier_bytes": {"hbm": sum(p.hot_bytes for p in layers), "host": sum(p.cold_bytes for p in layers)},
               "peak_extra_total_bytes": 0, "map_hash": emap.content_hash, "label": emap.label}
    return PinState(emap=emap, layers=layers, backend="torch_ref", rank=0, tp_size=tp_size, summary=summary,
                    cfg=cfg, facts=facts)


@dataclass
class Step:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


def _step(seed: int, tokens: int = 33) -> Step:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g)
    return Step(torch.randn(tokens, D, generator=g), ids, weights / weights.sum(1, keepdim=True))


def _forward(state: PinState, step: Step) -> list[torch.Tensor]:
    """One step through every layer, as the split invoke runs it in the engine (live counters included)."""
    return [torch_ref.split(step.x, p.hot["w13_weight"], p.hot["w2_weight"], p.cold["w13_weight"],
                            p.cold["w2_weight"], step.weights, step.ids, p.row_map, p.hot_rows, p.expert_counts,
                            p.cold_counts, token_counts=p.token_counts) for p in state.layers]


def _tensors(state: PinState) -> list[torch.Tensor]:
    return [t for p in state.layers for t in (*p.hot.values(), *p.cold.values(), p.row_map)]


def _clone(state: PinState) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _tensors(state)]


def _same(state: PinState, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_tensors(state), before, strict=True))


def _check_rows_hold_their_experts(state: PinState, emap: ExpertMap | None) -> None:
    """Every expert's rows are its original bytes, in the tier the map says (``None``: wherever its row map entry
    says, each row holding one expert: a valid placement, such as one between two batches of an apply)."""
    for p in state.layers:
        w = dict(zip(NAMES, _weights(p.layer_id), strict=True))
        rows = p.row_map.tolist()
        assert sorted(rows) == list(range(E)), (p.layer_id, rows)
        hot = set(emap.layer(p.layer_id).hot) if emap is not None else {e for e in range(E) if rows[e] < p.hot_rows}
        for e in range(E):
            assert (rows[e] < p.hot_rows) == (e in hot), (p.layer_id, e)
            for name in NAMES:
                got = p.hot[name][rows[e]] if rows[e] < p.hot_rows else p.cold[name][rows[e] - p.hot_rows]
                assert torch.equal(got, w[name][e]), (p.layer_id, e, name)


@pytest.fixture
def maps(tmp_path: Path) -> dict[str, Any]:
    a, b = _map(1, "a"), _map(2, "b")
    return {"a": a, "b": b, "a_path": _save(a, tmp_path), "b_path": _save(b, tmp_path)}


def _apply(state: PinState, path: Path, emap: ExpertMap, token: str = "apply-t") -> ApplyResult:
    return state.apply(apply_args(path, emap.content_hash), token)


# ---------------------------------------------------------------------------------------------------- applied


def test_apply_equals_a_fresh_rehome_bit_for_bit_and_keeps_addresses(maps: dict[str, Any]) -> None:
    a, b = maps["a"], maps["b"]
    state = _state(a, maps["a_path"])
    step = _step(7)
    before_outputs = _forward(state, step)
    counts_before = [p.expert_counts.clone() for p in state.layers]
    addresses = [t.data_ptr() for t in _tensors(state)]
    objects = [id(t) for t in _tensors(state)]

    result = _apply(state, maps["b_path"], b)

    plan = plan_swap(a, b)
    assert result.outcome == "applied", result.reason
    assert (result.map_hash, result.from_hash, result.to_hash) == (b.content_hash, a.content_hash, b.content_hash)
    assert result.rows == plan.rows > 0 and result.layers == sum(1 for x in plan.layers if x.rows)
    assert result.bytes_moved == plan.bytes_moved == 2 * plan.rows * EXPERT_BYTES
    assert result.seconds >= 0 and result.token == "apply-t"
    assert state.emap is not a and state.emap.content_hash == b.content_hash and state.map_path == maps["b_path"]
    # the same tensors at the same addresses: captured graphs, compiled constants and backends all follow
    assert [t.data_ptr() for t in _tensors(state)] == addresses and [id(t) for t in _tensors(state)] == objects
    _check_rows_hold_their_experts(state, b)
    # counters are not reset by an apply (readers would take that for a restart)
    assert all(torch.equal(p.expert_counts, c) for p, c in zip(state.layers, counts_before, strict=True))

    fresh = _state(b, maps["b_path"])
    after = _forward(state, step)
    expected = _forward(fresh, step)
    for layer, (got, want, old) in enumerate(zip(after, expected, before_outputs, strict=True)):
        assert torch.equal(got, want), f"layer {layer}: apply != fresh re-home with the candidate"
        assert torch.equal(got, old)  # and the placement never changes the bits (the split's guarantee)
        w13, w2 = _weights(LAYER_IDS[layer])
        assert torch.equal(got, torch_ref.unsplit(step.x, w13, w2, step.weights, step.ids))
    # the live cold counts now follow the candidate's placement, exactly as the fresh engine counts them
    for p, q in zip(state.layers, fresh.layers, strict=True):
        assert int(p.cold_counts) - int(counts_cold_of(p, a, step)) == int(q.cold_counts)


def counts_cold_of(layer: LayerPin, emap: ExpertMap, step: Step) -> int:
    """Cold selections the first (pre-apply) forward counted on ``layer`` under ``emap``."""
    cold = set(emap.layer(layer.layer_id).cold)
    return sum(1 for e in step.ids.reshape(-1).tolist() if e in cold)


def test_twenty_alternating_applies_keep_every_address_and_bit(maps: dict[str, Any]) -> None:
    state = _state(maps["a"], maps["a_path"])
    step = _step(3)
    reference = _forward(state, step)
    addresses = [t.data_ptr() for t in _tensors(state)]
    for i in range(20):
        target, path = (maps["b"], maps["b_path"]) if i % 2 == 0 else (maps["a"], maps["a_path"])
        assert _apply(state, path, target, f"apply-{i}").outcome == "applied"
        assert state.emap.content_hash == target.content_hash
    _check_rows_hold_their_experts(state, maps["a"])
    assert [t.data_ptr() for t in _tensors(state)] == addresses
    assert all(torch.equal(x, y) for x, y in zip(_forward(state, step), reference, strict=True))


def test_same_hot_sets_apply_with_no_row_moves(maps: dict[str, Any], tmp_path: Path) -> None:
    a = maps["a"]
    state = _state(a, maps["a_path"])
    before = _clone(state)
    result = _apply(state, maps["a_path"], a)
    assert result.outcome == "applied" and result.rows == 0 and result.reason == "already serving this map"
    reordered = ExpertMap(layer_ids=a.layer_ids, num_experts=E, top_k=K, hot_rows=H, expert_bytes=EXPERT_BYTES,
                          label="a-reordered", layers=tuple(LayerPlacement(lp.layer_id, tuple(reversed(lp.hot)),
                                                                           lp.cold) for lp in a.layers))
    result = _apply(state, _save(reordered, tmp_path), reordered)
    assert result.outcome == "applied" and result.rows == 0 and "no row moves" in result.reason
    assert state.emap.content_hash == reordered.content_hash and _same(state, before)


# ---------------------------------------------------------------------------------------------------- failed


@pytest.mark.parametrize("after", [0, 1, 2])
def test_failed_apply_swaps_everything_back(maps: dict[str, Any], monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    hook_faults.inject(monkeypatch, fail_after_layers=after)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "failed" and f"fail_after_layers={after}" in result.reason
    assert "rolled back" in result.reason and result.layers == after
    assert result.map_hash == maps["a"].content_hash and result.to_hash == maps["b"].content_hash
    assert _same(state, before), "a failed apply must leave every byte as it was"
    assert state.emap is maps["a"] and state.map_path == maps["a_path"]
    _check_rows_hold_their_experts(state, maps["a"])
    monkeypatch.undo()
    assert _apply(state, maps["b_path"], maps["b"]).outcome == "applied"  # and the next apply works


def test_an_exception_inside_a_layer_rolls_back_flips_and_refreshers(maps: dict[str, Any]) -> None:
    """Not an injected fault: a backend's row-map refresher raising in the last layer, after the earlier layers' rows
    moved and their refreshers ran. Everything comes back, and the earlier refreshers see the restored map."""
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    seen: list[tuple[int, list[int]]] = []
    for p in state.layers[:-1]:
        p.row_map_listeners.append(lambda p=p: seen.append((p.layer_id, p.row_map.tolist())))

    calls = []

    def broken_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refresher broke")

    state.layers[-1].row_map_listeners.append(broken_once)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "failed" and result.reason == "RuntimeError: refresher broke (rolled back)"
    assert _same(state, before)
    # each earlier refresher ran on its flip (once per batch that touched its layer) and once on the restore, the
    # last time with the old map
    last = dict(seen)
    assert all(sum(lid == p.layer_id for lid, _ in seen) >= 2 for p in state.layers[:-1]) and len(calls) == 2
    assert all(last[p.layer_id] == p.row_map.tolist() for p in state.layers[:-1])


def test_a_swap_back_that_fails_says_so(maps: dict[str, Any]) -> None:
    """If even the roll-back raises, the answer must not claim the old map serves whole: reboot."""
    state = _state(maps["a"], maps["a_path"])

    def broken() -> None:
        raise RuntimeError("refresher broke")

    state.layers[-1].row_map_listeners.append(broken)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "failed" and "SWAP-BACK FAILED" in result.reason and "reboot" in result.reason


def test_a_copy_that_raises_mid_row_puts_the_row_back() -> None:
    hot = torch.arange(12.0).view(3, 4)
    cold = -torch.arange(8.0).view(2, 4)
    hot0, cold0 = hot.clone(), cold.clone()
    stage = torch.empty(1, 4)
    swap._swap_row(hot, cold, stage, 1, 0)
    assert torch.equal(hot[1], cold0[0]) and torch.equal(cold[0], hot0[1])
    swap._swap_row(hot, cold, stage, 1, 0)  # its own inverse
    assert torch.equal(hot, hot0) and torch.equal(cold, cold0)
    bad_cold = torch.zeros(2, 5)  # a row that cannot be copied into a hot row: the second copy raises
    with pytest.raises(RuntimeError):
        swap._swap_row(hot, bad_cold, stage, 2, 1)
    assert torch.equal(hot, hot0)


# ---------------------------------------------------------------------------------------------------- refused


def _other_top_k(tmp_path: Path) -> tuple[dict[str, Any], str]:
    m = _map(5, "topk2", top_k=2)
    return apply_args(_save(m, tmp_path), m.content_hash), "top_k: map has 2, model has 4"


def _other_geometry(tmp_path: Path) -> tuple[dict[str, Any], str]:
    m = _map(5, "h9", hot_rows=9)
    return apply_args(_save(m, tmp_path), m.content_hash), "hot_rows 10 -> 9"


def _other_tensors(tmp_path: Path) -> tuple[dict[str, Any], str]:
    m = _map(5, "scales", expert_tensors=["w13_weight", "w13_scale", "w2_weight"])
    return apply_args(_save(m, tmp_path), m.content_hash), "per-expert tensors: map was built for"


def _wrong_hash(tmp_path: Path) -> tuple[dict[str, Any], str]:
    m = _map(5, "c")
    return apply_args(_save(m, tmp_path), "sha256:" + "0" * 64), "the request asked for sha256:0000"


def _missing(tmp_path: Path) -> tuple[dict[str, Any], str]:
    return apply_args(tmp_path / "nope.json", "sha256:" + "0" * 64), "cannot read the candidate map"


def _corrupt(tmp_path: Path) -> tuple[dict[str, Any], str]:
    path = tmp_path / "corrupt.json"
    path.write_text("{not json")
    return apply_args(path, "sha256:" + "0" * 64), "cannot read the candidate map"


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda tmp: ({}, ""), "malformed apply request: apply needs args.map"),
    (lambda tmp: ({"map": "cand.json", "hash": "sha256:1"}, ""), "must be an absolute path"),
    (_missing, ""), (_corrupt, ""), (_wrong_hash, ""), (_other_top_k, ""), (_other_geometry, ""),
    (_other_tensors, ""),
], ids=["empty", "relative", "missing", "corrupt", "hash", "top_k", "geometry", "tensors"])
def test_refused_applies_touch_nothing(maps: dict[str, Any], tmp_path: Path, make: Any, fragment: str) -> None:
    args, expected = make(tmp_path)
    expected = expected or fragment
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    result = state.apply(args, "apply-r")
    assert result.outcome == "refused" and expected in result.reason, result.reason
    assert result.map_hash == maps["a"].content_hash and result.rows == 0 and result.bytes_moved == 0
    assert _same(state, before) and state.emap is maps["a"] and state.map_path == maps["a_path"]


def test_tensor_parallel_and_expert_parallel_are_refused(maps: dict[str, Any]) -> None:
    state = _state(maps["a"], maps["a_path"], tp_size=2)
    before = _clone(state)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "refused" and "in-place apply needs one worker" in result.reason
    assert "reboot instead" in result.reason and _same(state, before)
    state = _state(maps["a"], maps["a_path"])
    state.layers[1].row_map[int(maps["a"].layers[1].cold[0])] = -1  # an expert on another rank
    before = _clone(state)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "refused" and "expert parallel" in result.reason and _same(state, before)


def test_row_maps_that_disagree_with_the_active_map_are_refused(maps: dict[str, Any], tmp_path: Path) -> None:
    state = _state(maps["a"], maps["a_path"])
    state.emap = _map(9, "claims")  # what the state believes is not what its row maps hold
    before = _clone(state)
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "refused" and "does not match the active map" in result.reason and _same(state, before)


def test_a_state_without_model_facts_refuses(maps: dict[str, Any]) -> None:
    state = _state(maps["a"], maps["a_path"])
    state.facts = None
    result = _apply(state, maps["b_path"], maps["b"])
    assert result.outcome == "refused" and "no model facts" in result.reason


# ---------------------------------------------------------------------------------------------------- step lock


def test_apply_runs_between_steps(maps: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The apply waits for a running step; a step that comes while a batch holds the lock waits for that batch
    (here stalled after the first layer) and then runs on a valid intermediate placement: the first layer's rows
    already moved, the others not yet, every row holding its expert; the map is adopted after the last batch."""
    state = _state(maps["a"], maps["a_path"])
    monkeypatch.setattr(pin, "_state", state)
    hook_faults.inject(monkeypatch, stall_s=0.6)
    results: list[ApplyResult] = []
    step_started = threading.Event()
    release_step = threading.Event()

    def step() -> None:  # a step in progress when the apply is asked for
        with pin.step_guard():
            step_started.set()
            release_step.wait(5)

    stepper = threading.Thread(target=step)
    stepper.start()
    step_started.wait(5)
    applier = threading.Thread(target=lambda: results.append(_apply(state, maps["b_path"], maps["b"])))
    applier.start()
    time.sleep(0.3)
    assert not results and state.emap is maps["a"]  # the apply waits for the step to end
    assert all(p.row_map.tolist() == maps["a"].layer(p.layer_id).row_map(E).rows for p in state.layers)
    release_step.set()
    stepper.join(5)
    time.sleep(0.2)  # the apply now holds the lock (stalled after its first layer)
    t0 = time.perf_counter()
    with pin.step_guard():  # the next step: between two batches, never inside one
        waited = time.perf_counter() - t0
        if not results:  # (a very slow box may have finished the apply meanwhile)
            assert state.emap is maps["a"]
            assert set(state.layers[0].row_map[list(maps["b"].layers[0].hot)].tolist()) == set(range(H))
        _check_rows_hold_their_experts(state, None)
    applier.join(5)
    assert results and results[0].outcome == "applied"
    assert state.emap.content_hash == maps["b"].content_hash
    _check_rows_hold_their_experts(state, maps["b"])
    assert waited > 0.2 and results[0].seconds >= 0.6 and results[0].hold_max_s >= 0.6


def test_pin_mode_wraps_execute_model_in_its_step_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    from pinsidecar_hook import modes, vllm_seam

    seen: dict[str, Any] = {}
    monkeypatch.setattr(vllm_seam, "patch_workers",
                        lambda on_loaded, on_ready, step_guard=None: seen.update(step_guard=step_guard))
    modes.install(HookConfig(mode="pin", map_path=Path("/m.json")))
    assert seen["step_guard"] is pin.step_guard


# ---------------------------------------------------------------------------------------------------- requests


def test_apply_request_through_the_side_thread(maps: dict[str, Any], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    state = _state(maps["a"], maps["a_path"], stats_path=stats)
    _forward(state, _step(1))
    flusher = state.make_flusher()
    flusher.start()
    try:
        before = request_and_wait(stats, "flush", load_stats, timeout_s=10)
        assert before.map_hash == maps["a"].content_hash and "apply" not in before.meta
        snap = request_and_wait(stats, "apply", load_stats, timeout_s=10,
                                args=apply_args(maps["b_path"], maps["b"].content_hash))
        answer = ApplyResult.from_json(snap.meta["apply"])
        assert answer.outcome == "applied" and answer.token == snap.flush_token and answer.rows > 0
        assert snap.map_hash == maps["b"].content_hash and snap.map_label == "b"
        assert snap.meta["predicted_cold_rate"] == maps["b"].predicted_cold_rate
        assert snap.meta["map_path"] == str(maps["b_path"]) and not snap.meta["map_changed_on_disk"]
        assert snap.tokens == before.tokens and snap.selections == before.selections  # not reset
        later = request_and_wait(stats, "flush", load_stats, timeout_s=10)
        assert later.meta["apply"] == snap.meta["apply"]  # kept until the next apply
        # a malformed apply gets an answer, not a timeout
        refused = request_and_wait(stats, "apply", load_stats, timeout_s=10, args={"map": "x.json"})
        answer = ApplyResult.from_json(refused.meta["apply"])
        assert answer.outcome == "refused" and "absolute path" in answer.reason
        assert refused.map_hash == maps["b"].content_hash
        wait_until(lambda: not request_path(stats).exists(), "the request file removed", 5.0, step_s=0.05)
    finally:
        flusher.stop()


def test_hand_written_apply_with_non_object_args_is_answered(maps: dict[str, Any], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    state = _state(maps["a"], maps["a_path"], stats_path=stats)
    flusher = state.make_flusher()
    request_path(stats).write_text(json.dumps({"op": "apply", "token": "apply-x", "args": [1, 2]}))
    assert flusher.serve_request()
    snap = load_stats(stats)
    assert snap.flush_token == "apply-x" and snap.meta["apply"]["outcome"] == "refused"
    assert "apply needs args.map" in snap.meta["apply"]["reason"]


def test_an_apply_that_was_served_is_not_served_twice(maps: dict[str, Any], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    state = _state(maps["a"], maps["a_path"], stats_path=stats)
    flusher = state.make_flusher()
    request = {"op": "apply", "token": "apply-once", "args": apply_args(maps["b_path"], maps["b"].content_hash)}
    request_path(stats).write_text(json.dumps(request))
    assert flusher.serve_request() and state.emap.content_hash == maps["b"].content_hash
    assert _apply(state, maps["a_path"], maps["a"]).outcome == "applied"  # back to a, directly
    request_path(stats).write_text(json.dumps(request))  # its file could not be removed, say
    assert not flusher.serve_request() and state.emap.content_hash == maps["a"].content_hash


def test_count_mode_refuses_apply(tmp_path: Path) -> None:
    from pinsidecar_hook.contract import ModelInfo, load_counts

    counts = tmp_path / "counts.json"
    state = CountState([0, 1], HookConfig(mode="count", counts_path=counts, flush_interval_s=60.0), 8, 2,
                       torch.device("cpu"), writer=True, meta={}, model_info=ModelInfo())
    flusher = Flusher(state, counts, interval_s=60.0, name="count", what="counts", write_error_key="counts_write")
    flusher.start()
    try:
        art = request_and_wait(counts, "apply", load_counts, timeout_s=10,
                               args=apply_args(tmp_path / "m.json", "sha256:" + "1" * 64))
    finally:
        flusher.stop()
    answer = ApplyResult.from_json(art.meta["apply"])
    assert answer.outcome == "refused" and answer.reason == "count mode has no map to apply"


def test_one_log_line_per_apply(maps: dict[str, Any]) -> None:
    state = _state(maps["a"], maps["a_path"])
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("pinsidecar_hook")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        _apply(state, maps["b_path"], maps["b"])
        state.apply({}, "apply-bad")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 2, lines
    assert "applied map" in lines[0] and "rows swapped in" in lines[0] and "step lock held" in lines[0]
    assert "apply apply-bad refused: malformed apply request" in lines[1]


def test_triton_tier_maps_follow_an_apply_and_its_roll_back(maps: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``triton_experts`` split derives its tier maps from the row map at attach; an apply refreshes them in
    place (same tensors: a captured graph reads them by address), and a roll-back refreshes them back."""
    from pinsidecar_hook.backends import triton_experts as te
    from pinsidecar_hook.backends.tiers import tier_expert_maps

    @dataclasses.dataclass
    class Desc:
        scale: Any = None

    @dataclasses.dataclass
    class QuantConfig:
        _w1: Desc
        _w2: Desc

    class Experts:  # a Python class: the split builds its tier objects as subclasses of vLLM's experts class
        quant_config = QuantConfig(Desc(), Desc())

    experts = Experts()
    state = _state(maps["a"], maps["a_path"])
    splits = []
    for p in state.layers:
        split = te.TritonExpertsSplit(experts, p, fused_finalize=False, naive_rule=None, config_fn=lambda *a: None,
                                      override_fn=lambda c: contextlib.nullcontext())
        p.row_map_listeners.append(split.refresh)  # what pin.attach registers
        splits.append(split)
    addresses = [(s.hot_map.data_ptr(), s.cold_map.data_ptr()) for s in splits]

    def follows() -> bool:
        return all(torch.equal(s.hot_map, tier_expert_maps(s.layer.row_map, s.layer.hot_rows)[0])
                   and torch.equal(s.cold_map, tier_expert_maps(s.layer.row_map, s.layer.hot_rows)[1])
                   for s in splits)

    assert _apply(state, maps["b_path"], maps["b"]).outcome == "applied" and follows()
    b_maps = [(s.hot_map.clone(), s.cold_map.clone()) for s in splits]
    hook_faults.inject(monkeypatch, fail_after_layers=2)
    assert _apply(state, maps["a_path"], maps["a"]).outcome == "failed" and follows()
    assert all(torch.equal(s.hot_map, h) and torch.equal(s.cold_map, c) for s, (h, c) in zip(splits, b_maps,
                                                                                             strict=True))
    assert [(s.hot_map.data_ptr(), s.cold_map.data_ptr()) for s in splits] == addresses
