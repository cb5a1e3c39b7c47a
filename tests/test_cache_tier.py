"""The cache tier's step (hook/pinsidecar_hook/cache.py) against the simulator's model, bit identity, and the fill.

The engine's cache and ``pinsidecar placement simulate`` must be one model: the map builder and the drift watch
predict the cold rate with the simulator, and the engine's live cold rate is compared with that prediction. So
the first test replays random traces through both, step by step, and asks for the same misses exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from pinsidecar_hook.backends.cpu import finalize_rows
from pinsidecar_hook.cache import ExpertCache
from pinsidecar_hook.contract import RoutingTrace

from pinsidecar.placement.simulate import HotRanking, simulate


def _trace(rng: np.random.Generator, tokens: int, layers: int, experts: int, top_k: int,
           repeat: float) -> np.ndarray:
    """Skewed routing with short reuse: a token repeats the previous token's picks with probability ``repeat``."""
    popularity = rng.dirichlet(np.full(experts, 0.3), size=layers)
    out = np.empty((tokens, layers, top_k), dtype=np.int64)
    for layer in range(layers):
        for t in range(tokens):
            if t and rng.random() < repeat:
                out[t, layer] = out[t - 1, layer]
            else:
                out[t, layer] = rng.choice(experts, size=top_k, replace=False, p=popularity[layer])
    return out


def _cache(hot: np.ndarray, experts: int, slots: int, policy: str) -> ExpertCache:
    """One layer's cache over a row map with ``hot`` (ids) in rows 0..H-1 and the rest cold after the slots."""
    h = len(hot)
    rows = np.empty(experts + 2, dtype=np.int64)
    cold = [e for e in range(experts) if e not in set(hot.tolist())]
    rows[hot] = np.arange(h)
    rows[cold] = h + slots + np.arange(len(cold))
    rows[experts:] = -1
    return ExpertCache(torch.tensor(rows, dtype=torch.int32), h, slots, policy, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_engine_step_and_the_simulator_count_the_same_misses(policy: str, batch: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts, top_k, layers, tokens = 24, 4, 2, 240
    train = RoutingTrace(experts=_trace(rng, tokens, layers, experts, top_k, 0.6).astype(np.uint16),
                         num_experts=experts)
    test = _trace(rng, tokens, layers, experts, top_k, 0.7)
    ranking = HotRanking.from_counts(train.counts(), "train")
    for hbm_rows, slots in [(8, 4), (6, 6), (5, 1), (10, 3)]:
        sim = simulate(RoutingTrace(experts=test.astype(np.uint16), num_experts=experts), ranking, hbm_rows, slots,
                       policy, batch)
        misses = hits = fills = 0
        hot_sets = ranking.hot_mask(hbm_rows - slots)
        for layer in range(layers):
            cache = _cache(np.flatnonzero(hot_sets[layer]), experts, slots, policy)
            for start in range(0, tokens, batch):
                cache.plan(torch.from_numpy(test[start:start + batch, layer]))
            misses += int(cache.misses.item())
            hits += int(cache.hits.item())
            fills += int(cache.fills.item())
        cold_selections = int((~np.take_along_axis(hot_sets[:, None, :].repeat(tokens, 1),
                                                   test.transpose(1, 0, 2), 2)).sum())
        assert misses == sim.misses, (hbm_rows, slots)
        assert hits + misses == cold_selections  # every cold selection is a hit or a miss
        assert fills <= sim.host_fetches  # a fetch is filled unless no slot could take it
        assert hits > 0


def _layer(seed: int, experts: int = 12, hidden: int = 16, inter: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w13_weight": torch.randn(experts, 2 * inter, hidden, generator=g),
            "w2_weight": torch.randn(experts, hidden, inter, generator=g)}


def _rows(x: torch.Tensor, ids: torch.Tensor, row_map: torch.Tensor, hot_rows: int,
          hot: dict[str, torch.Tensor], cold: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-(token, slot) expert rows computed from whichever tier the row map says (a tiny SiLU-GLU MLP)."""
    out = []
    for t in range(ids.shape[0]):
        for e in ids[t].tolist():
            row = int(row_map[e])
            tier, i = (hot, row) if row < hot_rows else (cold, row - hot_rows)
            gate_up = tier["w13_weight"][i] @ x[t]
            gate, up = gate_up.chunk(2)
            out.append(tier["w2_weight"][i] @ (torch.nn.functional.silu(gate) * up))
    return torch.stack(out)


def test_a_cached_step_is_bit_identical_and_a_flip_before_its_copy_diverges() -> None:
    experts, top_k, slots = 12, 3, 4
    weights = _layer(0)
    hot_ids = np.array([0, 1, 2, 3])
    h = len(hot_ids)
    cold_ids = [e for e in range(experts) if e not in hot_ids]
    # HBM tier: hot rows then slots (left zero until filled); host tier: the cold experts
    hot = {n: torch.cat([w[hot_ids], torch.zeros_like(w[:slots])]) for n, w in weights.items()}
    cold = {n: w[cold_ids].clone() for n, w in weights.items()}
    cache = _cache(hot_ids, experts, slots, "lru")
    plain_map = cache.row_map.clone()  # no cache: every cold expert read from host
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g)
    weights_k = torch.rand(5, top_k, generator=g)
    filled_any = False
    for step in range(6):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(5)])
        reference = finalize_rows(_rows(x, ids, plain_map, h + slots, hot, cold), weights_k, torch.empty(5, 16))
        before = int(cache.fills.item())
        cache.step(ids, hot, cold)
        filled_any |= int(cache.fills.item()) > before
        out = finalize_rows(_rows(x, ids, cache.row_map, h + slots, hot, cold), weights_k, torch.empty(5, 16))
        assert torch.equal(out, reference), f"step {step}: the cached step's output differs from the uncached one"
    assert filled_any and int(cache.hits.item()) >= 0
    # negative control: the row map flipped to the slots, the rows not copied
    stale = _cache(hot_ids, experts, slots, "lru")
    hot_stale = {n: t.clone() for n, t in hot.items()}
    for t in hot_stale.values():
        t[h:].zero_()
    ids = torch.tensor([[4, 5, 6]] * 5)
    reference = finalize_rows(_rows(x, ids, plain_map, h + slots, hot, cold), weights_k, torch.empty(5, 16))
    stale.plan(ids)  # no fill_rows
    out = finalize_rows(_rows(x, ids, stale.row_map, h + slots, hot_stale, cold), weights_k, torch.empty(5, 16))
    assert not torch.equal(out, reference)


def test_a_full_cache_reads_the_rest_of_a_step_in_place_and_never_evicts_what_the_step_uses() -> None:
    cache = _cache(np.array([0]), 10, 2, "lru")
    cache.plan(torch.tensor([[1, 2]]))  # both fill
    assert int(cache.fills.item()) == 2 and int(cache.misses.item()) == 2
    cache.plan(torch.tensor([[1, 3], [2, 4]]))  # 1 and 2 are used by this step: 3 and 4 cannot take their slots
    assert int(cache.fills.item()) == 2 and int(cache.hits.item()) == 2 and int(cache.misses.item()) == 4
    assert int(cache.evictions.item()) == 0
    rows = cache.row_map.tolist()
    assert sorted(rows[1:3]) == [1, 2] and rows[3] >= 3 and rows[4] >= 3
    cache.plan(torch.tensor([[3, 1]]))  # 2 is the least recently used unused slot
    assert cache.row_map.tolist()[3] in (1, 2) and cache.row_map.tolist()[2] >= 3
    assert int(cache.evictions.item()) == 1


def test_padding_rows_of_a_captured_batch_neither_count_nor_fill() -> None:
    cache = _cache(np.array([0]), 10, 2, "lru")
    cache.plan(torch.tensor([[1, 2], [3, 4], [5, 6]]), num_real=torch.tensor([1]))
    assert int(cache.misses.item()) == 2 and int(cache.fills.item()) == 2
    assert cache.row_map.tolist()[3] >= 3


def test_the_triton_fill_copies_only_the_counted_rows_under_the_interpreter() -> None:
    """The CUDA fill kernel, run by Triton's interpreter on CPU tensors (in a fresh process: the variable must be
    set before Triton is imported)."""
    code = textwrap.dedent("""
        import torch
        from pinsidecar_hook.kernels.fill import fill_rows_cuda, fill_rows_reference
        for dtype in (torch.bfloat16, torch.float32, torch.uint8):
            src = (torch.arange(5 * 3 * 7) % 251).reshape(5, 3, 7).to(dtype)
            dst = torch.zeros(4, 3, 7, dtype=dtype)
            ref = dst.clone()
            args = (torch.tensor([2, 0, 3]), torch.tensor([4, 1, 0]), torch.tensor([2]))
            fill_rows_cuda(dst, src, *args)
            fill_rows_reference(ref, src, *args)
            assert torch.equal(dst, ref), dtype
            assert torch.equal(dst[2], src[4]) and torch.equal(dst[0], src[1]) and not dst[3].any()
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
