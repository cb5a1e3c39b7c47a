"""Remap in place in bounded batches: the apply gives the step lock back between batches, and steps run between them.

The split is bit-identical to the unsplit call for any placement, and each pair swap (entering expert into the hot
row of the leaving one, leaving expert into the entering one's cold row) is self-contained: after its copies land,
flipping only its two row-map entries gives a valid placement. So a step between two batches may serve a
half-applied remap and still give the reference bits. What is shown here, on pin mode's real state over CPU
tensors (the scaffolding of ``test_swap_apply.py``):

- a tiny hold budget gives one pair per batch, and the end state (tiers and row maps) is bit for bit that of the
  unbatched apply, its outputs those of a fresh re-home with the candidate;
- steps run between the batches (counted by the step clock, not timed), and every one of them gives the
  reference bits; no step waits long for the lock;
- the negative control: the same batches with each pair's row-map entries flipped *before* its copies give other
  bits, so the checks above do depend on the order;
- a failure in a later batch (an injected fault, a refresher, a prefetch outside the lock) rolls every batch back.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pinsidecar_hook import swap
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.contract import ApplyResult, apply_args, apply_hold_budget_s, apply_ordering, plan_swap
from pinsidecar_hook.pin import PinState
from test_swap_apply import (  # the scaffolding: pin mode's state built by the production re-home
    EXPERT_BYTES,
    LAYER_IDS,
    _check_rows_hold_their_experts,
    _clone,
    _forward,
    _map,
    _same,
    _save,
    _state,
    _step,
    _tensors,
    _weights,
)


@pytest.fixture
def maps(tmp_path: Path) -> dict[str, Any]:
    """Maps a and b of ``test_swap_apply``, and their files."""
    a, b = _map(1, "a"), _map(2, "b")
    return {"a": a, "b": b, "a_path": _save(a, tmp_path), "b_path": _save(b, tmp_path)}


def _plan_rows(m: dict[str, Any]) -> int:
    return plan_swap(m["a"], m["b"]).rows


def _swap(state: PinState, m: dict[str, Any], **kwargs: Any) -> swap.SwapStats:
    """Apply map b to ``state`` (at map a) through :func:`swap.swap_layers`, with the state's lock and clock."""
    return swap.swap_layers(state.layers, plan_swap(m["a"], m["b"]), state.step_lock, clock=state.step_clock,
                            on_done=lambda: state.adopt(m["b"], m["b_path"]), **kwargs)


def _internal(state: PinState, m: dict[str, Any], **kwargs: Any) -> swap._Apply:
    """The internal batch runner, for what only a test may ask of it (the negative control)."""
    settings: dict[str, Any] = {"clock": None, "hold_budget_s": 0.0, "staging_bytes": swap.STAGING_BYTES,
                                "idle_s": 0.0, "stall_s": None, "fail_after_layers": None, **kwargs}
    return swap._Apply(swap._resolve(state.layers, plan_swap(m["a"], m["b"])), state.step_lock, **settings)


# ---------------------------------------------------------------------------------------------------- the end state


@pytest.mark.parametrize(("budget", "staging"), [(0.0, swap.STAGING_BYTES), (0.0, 0), (0.0, 2 * EXPERT_BYTES),
                                                 (math.inf, 2 * EXPERT_BYTES), (0.002, swap.STAGING_BYTES)],
                         ids=["one-pair-batches", "no-prefetch", "two-slots", "one-batch-two-slots", "2ms"])
def test_batched_apply_ends_where_the_unbatched_one_does(maps: dict[str, Any], budget: float, staging: int) -> None:
    reference = _state(maps["a"], maps["a_path"])
    _swap(reference, maps, hold_budget_s=math.inf)  # the old behaviour: one hold
    state = _state(maps["a"], maps["a_path"])
    stats = _swap(state, maps, hold_budget_s=budget, staging_bytes=staging, idle_s=0.0)

    rows = _plan_rows(maps)
    assert stats.rows == rows and stats.layers == len(LAYER_IDS) and len(stats.holds) == stats.batches
    if budget == 0.0:
        assert stats.batches == rows  # at least one pair per batch, and no more with no budget
    if math.isinf(budget):
        assert stats.batches == 1
    assert stats.bytes_moved == 2 * rows * EXPERT_BYTES and stats.link_GBps > 0
    assert stats.staging_bytes <= max(staging, 0) + EXPERT_BYTES  # the slots, plus one outgoing row
    assert math.isclose(stats.seconds, sum(stats.holds)) and stats.hold_max_s == max(stats.holds)
    # bit for bit the unbatched apply's tiers and row maps, and the candidate's placement
    assert all(torch.equal(x, y) for x, y in zip(_tensors(state), _tensors(reference), strict=True))
    assert state.emap.content_hash == maps["b"].content_hash
    _check_rows_hold_their_experts(state, maps["b"])
    fresh = _state(maps["b"], maps["b_path"])
    step = _step(21)
    for got, want in zip(_forward(state, step), _forward(fresh, step), strict=True):
        assert torch.equal(got, want)


def test_a_long_drain_is_not_charged_to_the_batch_budget(maps: dict[str, Any], monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Host order: a batch first waits for the step still on the device (the drain). That wait is as long whether
    the batch then copies one pair or twenty, so the budget bounds the copies after it. Charged to the budget, a
    step longer than the budget made every batch one pair (an H100 under 16 streams: 997 batches for 1024 rows)."""
    drain_s, budget_s = 0.03, 0.01
    monkeypatch.setattr(swap._Apply, "_drain", lambda self: time.sleep(drain_s))  # a step 30 ms long on the device
    state = _state(maps["a"], maps["a_path"])
    stats = _swap(state, maps, hold_budget_s=budget_s, idle_s=0.0, ordering="host")
    rows = _plan_rows(maps)
    assert stats.rows == rows and stats.stream_batches == 0
    assert min(stats.drains) >= drain_s and stats.hold_max_s >= drain_s
    assert stats.batches < rows / 2, f"{stats.batches} batches for {rows} rows: the drain was charged to the budget"
    assert max(h - d for h, d in zip(stats.holds, stats.drains, strict=True)) < drain_s + budget_s
    _check_rows_hold_their_experts(state, maps["b"])


def test_apply_request_reports_its_batches(maps: dict[str, Any]) -> None:
    """Through the request (``hold_ms`` 0: one pair per batch) and the answer, and an answer file of before
    batching still reads."""
    state = _state(maps["a"], maps["a_path"])
    result = state.apply(apply_args(maps["b_path"], maps["b"].content_hash, hold_ms=0), "apply-b")
    assert result.outcome == "applied" and result.batches == result.rows == _plan_rows(maps)
    assert result.hold_budget_s == 0.0 and 0 < result.hold_max_s <= result.seconds <= result.wall_s
    assert result.link_GBps > 0 and 0 <= result.drain_max_s <= result.hold_max_s
    # the CPU has no stream: every batch is ordered by host syncs, and its copies' time is its device time
    assert result.stream_batches == 0 and 0 < result.device_max_s <= result.hold_max_s
    assert ApplyResult.from_json(result.to_json()) == result
    old = {k: v for k, v in result.to_json().items() if k not in ("batches", "hold_max_s", "hold_budget_s",
                                                                    "wall_s", "link_GBps", "drain_max_s",
                                                                    "stream_batches", "device_max_s")}
    assert ApplyResult.from_json(old).batches == 0 and ApplyResult.from_json(old).drain_max_s == 0.0
    assert ApplyResult.from_json(old).stream_batches == 0 and ApplyResult.from_json(old).device_max_s == 0.0
    wrong = state.apply(apply_args(maps["a_path"], maps["a"].content_hash), "apply-a", ordering="device")
    assert wrong.outcome == "refused" and "ordering must be one of ('host', 'stream')" in wrong.reason
    assert state.emap.content_hash == maps["b"].content_hash  # refused before anything moved
    unbounded = state.apply(apply_args(maps["a_path"], maps["a"].content_hash), "apply-a", hold_budget_s=math.inf)
    assert unbounded.outcome == "applied" and unbounded.batches == 1 and unbounded.hold_budget_s == 0.0


@pytest.mark.parametrize("hold_ms", [-1, "5", True, float("nan")])
def test_a_malformed_hold_budget_is_refused(maps: dict[str, Any], hold_ms: Any) -> None:
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    args = {**apply_args(maps["b_path"], maps["b"].content_hash), "hold_ms": hold_ms}
    with pytest.raises(ValueError, match="hold_ms"):
        apply_hold_budget_s(args)
    result = state.apply(args, "apply-bad")
    assert result.outcome == "refused" and "hold_ms" in result.reason and _same(state, before)


@pytest.mark.parametrize("ordering", ["device", "", 1, ["stream"]])
def test_a_malformed_ordering_is_refused(maps: dict[str, Any], ordering: Any) -> None:
    """The daemon's ``[remap] apply_ordering`` travels in the request; a value the hook does not know is refused
    with the request's field named, before anything moves."""
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    args = {**apply_args(maps["b_path"], maps["b"].content_hash), "ordering": ordering}
    with pytest.raises(ValueError, match=r"args\.ordering must be one of host, stream"):
        apply_ordering(args)
    with pytest.raises(ValueError, match=r"args\.ordering"):
        apply_args(maps["b_path"], maps["b"].content_hash, ordering=ordering)
    result = state.apply(args, "apply-bad")
    assert result.outcome == "refused" and "args.ordering" in result.reason and _same(state, before)


def test_the_requested_ordering_is_served_and_the_cpu_falls_back_to_host(maps: dict[str, Any]) -> None:
    """``ordering`` "stream" in the request reaches the batches; on the CPU there is no stream, so every batch is
    ordered by host syncs, and the outcome equals the host order's."""
    state = _state(maps["a"], maps["a_path"])
    args = apply_args(maps["b_path"], maps["b"].content_hash, hold_ms=0, ordering="stream")
    assert args["ordering"] == "stream" and apply_ordering(args) == "stream"
    assert apply_ordering(apply_args(maps["b_path"], maps["b"].content_hash)) is None
    result = state.apply(args, "apply-b")
    assert result.outcome == "applied" and result.batches == result.rows == _plan_rows(maps)
    assert result.stream_batches == 0
    host = _state(maps["a"], maps["a_path"])
    assert host.apply(apply_args(maps["b_path"], maps["b"].content_hash, hold_ms=0), "apply-b").outcome == "applied"
    assert _same(state, _clone(host))


# ---------------------------------------------------------------------------------------------------- while serving


def test_steps_between_batches_serve_the_reference_bits(maps: dict[str, Any]) -> None:
    state = _state(maps["a"], maps["a_path"])
    step = _step(5)
    reference = _forward(state, step)
    for layer, out in zip(state.layers, reference, strict=True):  # which is the unsplit call's
        w13, w2 = _weights(layer.layer_id)
        assert torch.equal(out, torch_ref.unsplit(step.x, w13, w2, step.weights, step.ids))
    finished = threading.Event()
    waits: list[float] = []
    mismatches: list[int] = []
    placements_checked = []

    def stepping() -> None:
        while not finished.is_set():
            asked = time.perf_counter()
            with state.step_guard():
                waits.append(time.perf_counter() - asked)
                outs = _forward(state, step)
                mismatches.append(sum(not torch.equal(o, r) for o, r in zip(outs, reference, strict=True)))
                if len(placements_checked) < 5:
                    _check_rows_hold_their_experts(state, None)
                    placements_checked.append(True)

    stepper = threading.Thread(target=stepping)
    stepper.start()
    try:
        while state.step_clock.steps < 2:  # serving before the apply
            time.sleep(0.001)
        # idle_s long: on this busy box a step may take a while to come; the engine is never idle here
        stats = _swap(state, maps, hold_budget_s=0.0, idle_s=5.0)
    finally:
        finished.set()
        stepper.join(10)
    assert stats.batches == _plan_rows(maps) > 10
    # a step ended between every two batches (the clock's count when each batch took the lock went up)
    assert all(later > earlier for earlier, later in zip(stats.batch_steps, stats.batch_steps[1:], strict=False))
    assert stats.steps_during >= stats.batches - 1
    assert not any(mismatches) and len(mismatches) >= stats.batches and placements_checked
    # no step waited for much more than a batch (generous slack: 2 cores shared with other work)
    assert max(waits) < 1.0, max(waits)
    _check_rows_hold_their_experts(state, maps["b"])


def test_a_step_inside_a_step_does_not_wait_for_an_asking_batch(maps: dict[str, Any]) -> None:
    """A re-entrant step (the SIGTERM handler on the main thread, mid-step) must not wait for a batch that waits
    for the lock this very thread holds."""
    state = _state(maps["a"], maps["a_path"])
    state.step_clock.yield_s = 5.0
    got_lock = threading.Event()

    def batch() -> None:
        with state.step_clock.holding(state.step_lock):
            got_lock.set()

    with state.step_guard():
        applier = threading.Thread(target=batch)
        applier.start()
        while not state.step_clock._asking:
            time.sleep(0.001)
        t0 = time.perf_counter()
        with state.step_guard():
            nested = time.perf_counter() - t0
        assert not got_lock.is_set()
    applier.join(5)
    assert got_lock.is_set() and nested < 1.0 and state.step_clock.steps == 1  # the nested one is no step


# ---------------------------------------------------------------------------------------------------- the order


@pytest.mark.parametrize("flip_first", [False, True], ids=["copies-then-flip", "flip-before-copies"])
def test_negative_control_a_flip_before_its_copies_diverges(maps: dict[str, Any], flip_first: bool) -> None:
    """A refresher runs right after each flip: a forward there sees what a step would see if the row map
    landed first. In the apply's order it sees the reference bits; with the flip first, other bits."""
    state = _state(maps["a"], maps["a_path"])
    step = _step(9, tokens=8)  # small: a forward per flip
    reference = _forward(state, step)
    seen: list[bool] = []
    for p in state.layers:
        p.row_map_listeners.append(lambda: seen.append(all(
            torch.equal(o, r) for o, r in zip(_forward(state, step), reference, strict=True))))
    _internal(state, maps).run(None, flip_first=flip_first)
    assert len(seen) >= _plan_rows(maps)
    if flip_first:
        assert not all(seen), "a row map flipped before its copies must send tokens to the wrong rows"
    else:
        assert all(seen)
    _check_rows_hold_their_experts(state, maps["b"])  # and once the copies landed, the placement is whole


# ---------------------------------------------------------------------------------------------------- failure


@pytest.mark.parametrize("how", ["hook", "refresher", "prefetch"])
def test_a_failure_in_a_later_batch_rolls_every_batch_back(maps: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                           how: str) -> None:
    state = _state(maps["a"], maps["a_path"])
    before = _clone(state)
    kwargs: dict[str, Any] = {"hold_budget_s": 0.0, "idle_s": 0.0}
    if how == "hook":
        kwargs["fail_after_layers"] = 2
    elif how == "refresher":
        calls = []

        def broken_later() -> None:
            calls.append(1)
            if len(calls) == 3:  # the third batch that touches the last layer
                raise RuntimeError("refresher broke")

        state.layers[-1].row_map_listeners.append(broken_later)
    else:
        real = swap._Apply._prefetch
        prefetches = []

        def broken_prefetch(self: swap._Apply) -> None:  # outside the lock, after some batches
            prefetches.append(1)
            if len(prefetches) == 6:
                raise OSError("prefetch broke")
            real(self)

        monkeypatch.setattr(swap._Apply, "_prefetch", broken_prefetch)
    with pytest.raises(swap.SwapFailed) as failed:
        _swap(state, maps, **kwargs)
    assert failed.value.rolled_back and "rolled back" in str(failed.value)
    assert failed.value.stats.batches > 3 and failed.value.stats.rows > 3
    assert _same(state, before), "every batch's rows and row-map entries must be back"
    assert state.emap is maps["a"]
    _check_rows_hold_their_experts(state, maps["a"])


@pytest.mark.parametrize("fails", [False, True], ids=["applied", "failed"])
def test_an_apply_runs_under_a_short_gil_switch_interval_and_puts_python_s_back(maps: dict[str, Any],
                                                                                   fails: bool) -> None:
    """While an apply runs, a handoff of the GIL (after every torch call) waits at most the short interval, not
    Python's 5 ms; after it, applied or failed, the process has its old interval again."""
    state = _state(maps["a"], maps["a_path"])
    seen: list[float] = []
    state.layers[0].row_map_listeners.append(lambda: seen.append(sys.getswitchinterval()))
    old = sys.getswitchinterval()
    kwargs: dict[str, Any] = {"hold_budget_s": 0.0, "idle_s": 0.0, "fail_after_layers": 2 if fails else None}
    if fails:
        with pytest.raises(swap.SwapFailed) as failed:
            _swap(state, maps, **kwargs)
        stats = failed.value.stats
    else:
        stats = _swap(state, maps, **kwargs)
    short = pytest.approx(swap.SWITCH_INTERVAL_S, rel=1e-6)  # CPython keeps it in whole microseconds
    assert seen and all(v == short for v in seen) and stats.switch_interval_s == short
    assert sys.getswitchinterval() == old
    # None leaves Python's interval alone (the benchmark's comparison phase)
    seen.clear()
    untouched = _state(maps["a"], maps["a_path"])
    untouched.layers[0].row_map_listeners.append(lambda: seen.append(sys.getswitchinterval()))
    _swap(untouched, maps, hold_budget_s=0.0, idle_s=0.0, switch_interval_s=None)
    assert seen and set(seen) == {old}
