"""Remap in place on a CUDA GPU: the cold tier in pinned host memory behind the production device view, the hot tier
in HBM, pin mode's real state and apply. Skipped cleanly without CUDA (conftest); runs on the H200 through the
device tool (bench/results/swap_h200.json holds the reference-geometry figures of ``bench/swap_gpu.py``).

What they show:
- an apply on CUDA gives, bit for bit, the outputs of a fresh re-home with the new map (two experts
  implementations), every expert's rows hold its original bytes in the tier the map says, and no tensor moved;
- a forward captured in a CUDA graph *before* the apply, replayed after it, computes the new placement (and its
  live cold counter follows the new row map): the graph reads the same addresses, whose contents changed;
- a failed apply (an injected fault) restores every byte on the device and in pinned host memory;
- the ordering matters and the control proves it: the row map flipped and a forward run on another stream while
  the copies are still in flight gives other bits; the same forward waiting for the copy stream does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

# 64 experts of 12.6 MB (hidden 2048, intermediate 1024, bf16), 24 cold: a layer's swaps keep the host link busy
# for tens of milliseconds, long enough for the negative control's forward to overtake them.
GEO = {"experts": 64, "top_k": 6, "hidden": 2048, "intermediate": 1024, "layers": 2, "cold": 24}


@pytest.fixture(scope="module")
def bench() -> Any:
    from bench import swap_gpu

    return swap_gpu


@pytest.fixture
def setup(bench: Any, tmp_path: Path) -> dict[str, Any]:
    base = bench.random_map(GEO, 1, "base")
    base.save(tmp_path / "base.json")
    full = bench.moved_map(base, GEO["cold"], seed=5, label="every-cold")
    full.save(tmp_path / "full.json")
    state = bench.build_state(GEO, base, tmp_path / "base.json", torch.device("cuda"))
    return {"base": base, "full": full, "state": state, "dir": tmp_path}


def _tensors(state: Any) -> list[torch.Tensor]:
    return [t for p in state.layers for t in (*p.hot.values(), *p.cold_host.values(), p.row_map)]


@pytest.mark.parametrize("impl", ["triton", "loop"])
def test_apply_on_cuda_equals_a_fresh_rehome_and_keeps_addresses(bench: Any, setup: dict[str, Any],
                                                                  impl: str) -> None:
    from pinsidecar_hook.contract import apply_args, plan_swap

    state, base, full, tmp = setup["state"], setup["base"], setup["full"], setup["dir"]
    dev = torch.device("cuda")
    plan = plan_swap(base, full)
    focus = [list(s.entering) + list(s.leaving) for s in plan.layers]
    steps = [bench.make_step(GEO, t, t, dev, torch.bfloat16, focus if moved else None)
             for t in (1, 16, 64) for moved in (False, True)]
    before = [bench.forward(state, s, impl, counters=False) for s in steps]
    addresses = [t.data_ptr() for t in _tensors(state)]
    result = state.apply(apply_args(tmp / "full.json", full.content_hash), "apply-gpu")
    assert result.outcome == "applied", result.reason
    assert result.rows == plan.rows == GEO["cold"] * GEO["layers"] and result.bytes_moved == plan.bytes_moved
    assert [t.data_ptr() for t in _tensors(state)] == addresses
    good, total = bench.rows_hold_their_experts(state, GEO, dev)
    assert good == total == GEO["experts"] * GEO["layers"]
    fresh = bench.build_state(GEO, full, tmp / "full.json", dev)
    for step, old in zip(steps, before, strict=True):
        after = bench.forward(state, step, impl, counters=False)
        expected = bench.forward(fresh, step, impl, counters=False)
        for a, e, o in zip(after, expected, old, strict=True):
            assert torch.equal(a, e) and torch.equal(a, o)


def test_graph_captured_before_the_apply_replays_the_new_placement(bench: Any, setup: dict[str, Any]) -> None:
    doc = bench.graph_section(setup["state"], GEO, torch.device("cuda"), torch.bfloat16, "triton", setup["dir"],
                              setup["base"], setup["full"])
    assert doc["replay_after_apply_vs_fresh_rehome"] == f"{GEO['layers']}/{GEO['layers']}"
    assert doc["cold_counter_follows_row_map"], doc
    assert doc["cold_selections_before"] != doc["cold_selections_after"]  # the counter really saw the flip


def test_failed_apply_on_cuda_restores_every_byte(bench: Any, setup: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from pinsidecar_hook.contract import apply_args

    from pinsidecar.testing import hook_faults

    state, full = setup["state"], setup["full"]
    before = [t.clone() for t in _tensors(state)]
    hook_faults.inject(monkeypatch, fail_after_layers=1)
    result = state.apply(apply_args(setup["dir"] / "full.json", full.content_hash), "apply-fail")
    assert result.outcome == "failed" and "rolled back" in result.reason and result.layers == 1
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(state), before, strict=True))
    assert state.emap is setup["base"]


def test_ordering_negative_control(bench: Any, setup: dict[str, Any]) -> None:
    """Without the wait, the flipped row map sends the forward to rows whose copies are still queued: other bits.
    With it, the same forward is right. So the in-order apply's identity is not an accident of timing."""
    args = (setup["state"], GEO, torch.device("cuda"), torch.bfloat16, "triton", setup["full"])
    unordered = bench.ordering_control(*args, wait=False)
    assert unordered["forward_finished_before_copies"], unordered  # the control really raced the copies
    assert unordered["diverged"], unordered
    assert unordered["after_copies_settled_right"] and unordered["restored_right"]
    ordered = bench.ordering_control(*args, wait=True)
    assert not ordered["diverged"] and not ordered["forward_finished_before_copies"], ordered
    assert ordered["restored_right"]
