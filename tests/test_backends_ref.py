"""Torch reference experts backend: a split call is bit-identical to the unsplit call, for every map.

Runs on the CPU here (CI) and, through tests/test_gpu.py, on the H200. The CPU grid runs in fp32 (bf16 GEMMs on
this CPU compile one kernel per shape and are slow); a bf16 subset runs too. Both paths end in the shared finalize.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.kernels import partition_torch

from pinsidecar.testing import moe

NUM_EXPERTS = 16
HIDDEN = 32
INTERMEDIATE = 16
COLD_FRACTIONS = (0.0, 0.1, 0.5, 0.9, 1.0)


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / 4).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / 4).to(dtype)
    return w13, w2


def _check_split_equals_unsplit(dtype, num_tokens, top_k, cold_fraction, adversarial, seed):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = _weights(dtype)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    ids, weights, row_map, hot_rows = moe.routing_case(
        num_tokens, top_k, NUM_EXPERTS, cold_fraction, adversarial, g
    )
    ref = torch_ref.unsplit(x, w13, w2, weights, ids)
    w13_hot, w13_cold = moe.rehome_weights(w13, row_map, hot_rows)
    w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    cold = torch.zeros(1, dtype=torch.int64)
    out = torch_ref.split(x, w13_hot, w2_hot, w13_cold, w2_cold, weights, ids, row_map, hot_rows, counts, cold)
    assert out.dtype == dtype
    assert torch.equal(out, ref), f"split != unsplit: T={num_tokens} k={top_k} cold={cold_fraction} adv={adversarial}"
    # live counts are exact
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS))
    assert int(cold) == int((row_map.to(torch.int64)[ids] >= hot_rows).sum())
    if adversarial and 0 < hot_rows < NUM_EXPERTS and top_k >= 2:  # the case really straddles the tiers
        rows = row_map.to(torch.int64)[ids]
        assert bool(((rows < hot_rows).any(1) & (rows >= hot_rows).any(1)).all())


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64])
@pytest.mark.parametrize("top_k", list(range(1, 9)))
def test_split_bit_identical_fp32_grid(num_tokens: int, top_k: int) -> None:
    for i, (frac, adversarial) in enumerate(itertools.product(COLD_FRACTIONS, (False, True))):
        _check_split_equals_unsplit(torch.float32, num_tokens, top_k, frac, adversarial, seed=1000 * top_k + i)


@pytest.mark.parametrize(("num_tokens", "top_k"), [(7, 1), (64, 6), (513, 8)])
@pytest.mark.parametrize("cold_fraction", [0.0, 0.5, 1.0])
def test_split_bit_identical_bf16(num_tokens: int, top_k: int, cold_fraction: float) -> None:
    _check_split_equals_unsplit(torch.bfloat16, num_tokens, top_k, cold_fraction, adversarial=True, seed=7)


def test_every_map_gives_the_same_bits() -> None:
    """Placement invariance across maps: all-hot, all-cold and several random maps give one result."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = _weights(torch.bfloat16)
    x = torch.randn(33, HIDDEN, generator=g).to(torch.bfloat16)
    ids, weights, _, _ = moe.routing_case(33, 8, NUM_EXPERTS, 0.0, False, g)
    outs = []
    for frac in (0.0, 1.0, 0.25, 0.5, 0.75):
        for _ in range(2):
            perm = torch.randperm(NUM_EXPERTS, generator=g)
            hot_rows = NUM_EXPERTS - round(NUM_EXPERTS * frac)
            row_map = moe.row_map_tensor(NUM_EXPERTS, perm[:hot_rows].tolist(), perm[hot_rows:].tolist())
            w13_hot, w13_cold = moe.rehome_weights(w13, row_map, hot_rows)
            w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
            outs.append(torch_ref.split(x, w13_hot, w2_hot, w13_cold, w2_cold, weights, ids, row_map, hot_rows))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_expert_parallel_rank_matches_unsplit_with_expert_map() -> None:
    """A rank holding half the experts: row map -1 for the others; equals the unsplit call with vLLM's
    expert_map, where other ranks' slots contribute nothing."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = _weights(torch.float32)
    local_experts = list(range(0, NUM_EXPERTS, 2))
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    expert_map[local_experts] = torch.arange(len(local_experts), dtype=torch.int32)
    w13_local, w2_local = w13[local_experts], w2[local_experts]
    x = torch.randn(40, HIDDEN, generator=g)
    ids, weights, _, _ = moe.routing_case(40, 6, NUM_EXPERTS, 0.0, False, g)
    ref = torch_ref.unsplit(x, w13_local, w2_local, weights, ids, expert_map=expert_map)
    # row map over *local* rows: local row i of this rank -> hot or cold
    hot_local = [1, 3, 4]
    cold_local = [i for i in range(len(local_experts)) if i not in hot_local]
    row_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    for r, i in enumerate(hot_local + cold_local):
        row_map[local_experts[i]] = r
    hot_rows = len(hot_local)
    order = torch.tensor(hot_local + cold_local)
    out = torch_ref.split(
        x, w13_local[order[:hot_rows]], w2_local[order[:hot_rows]], w13_local[order[hot_rows:]],
        w2_local[order[hot_rows:]], weights, ids, row_map, hot_rows,
    )
    assert torch.equal(out, ref)
    assert not torch.equal(ref, torch_ref.unsplit(x, w13, w2, weights, ids))  # the non-local slots mattered


def test_each_tier_computes_only_its_own_slots() -> None:
    """The hot call computes hot slots only and the cold call cold slots only: no slot is computed twice."""
    g = torch.Generator().manual_seed(9)
    w13, w2 = _weights(torch.float32)
    x = torch.randn(20, HIDDEN, generator=g)
    ids, _, row_map, hot_rows = moe.routing_case(20, 4, NUM_EXPERTS, 0.5, True, g)
    hot_ids, cold_ids = partition_torch(ids, row_map, hot_rows)
    w13_hot, w13_cold = moe.rehome_weights(w13, row_map, hot_rows)
    w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
    nan = torch.full((20, 4, HIDDEN), float("nan"))
    hot_only = torch_ref.expert_rows(x, w13_hot, w2_hot, hot_ids, out=nan.clone())
    assert torch.equal(torch.isnan(hot_only).all(-1), hot_ids < 0)  # cold slots untouched
    cold_only = torch_ref.expert_rows(x, w13_cold, w2_cold, cold_ids, out=nan.clone())
    assert torch.equal(torch.isnan(cold_only).all(-1), cold_ids < 0)


def test_rehome_weights_puts_each_expert_in_its_row() -> None:
    w = torch.arange(6).reshape(6, 1).float()
    row_map = torch.tensor([3, -1, 0, 2, 1, -1], dtype=torch.int32)
    hot, cold = moe.rehome_weights(w, row_map, 2)
    assert hot.flatten().tolist() == [2.0, 4.0]
    assert cold.flatten().tolist() == [3.0, 0.0]
    with pytest.raises(ValueError, match="listed twice"):
        moe.row_map_tensor(4, [0, 1], [1])


def _vllm_apply_args(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str = "silu",
                     on_input: bool = False) -> dict:
    return dict(output=torch.empty_like(x), hidden_states=x, w1=None, w2=None, topk_weights=weights, topk_ids=ids,
                activation=activation, global_num_experts=NUM_EXPERTS, expert_map=None, a1q_scale=None,
                a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=on_input)


def test_the_split_stands_in_for_the_experts_apply_and_counts() -> None:
    """The registry's contract (pinsidecar_hook.backends.base.SplitBackend): TorchRefSplit(experts, layer).apply is a
    function with vLLM's experts ``apply`` signature that writes the unsplit result into ``output``."""
    g = torch.Generator().manual_seed(11)
    w13, w2 = _weights(torch.float32)
    x = torch.randn(12, HIDDEN, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(12, 4, NUM_EXPERTS, 0.5, True, g)
    layer = moe.SplitLayerStub.from_tensors({"w13_weight": w13, "w2_weight": w2}, row_map, hot_rows)
    apply = torch_ref.TorchRefSplit(object(), layer).apply
    args = _vllm_apply_args(x, weights, ids)
    apply(**args)
    assert torch.equal(args["output"], torch_ref.unsplit(x, w13, w2, weights, ids))
    assert int(layer.token_counts) == 12 and int(layer.expert_counts.sum()) == 12 * 4
    assert int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())
    with pytest.raises(RuntimeError, match="SiLU-and-mul"):
        apply(**_vllm_apply_args(x, weights, ids, activation="gelu"))
