"""The one-launch cache step (hook/pinsidecar_hook/kernels/cache_plan.py) against ExpertCache.plan, bit for bit.

Two caches start from the same state; one is stepped by the torch plan, the other by the Triton kernel under
Triton's interpreter (on CPU tensors), through the same random routing: skewed, with short reuse so that hits,
fills, full caches and evictions all happen, padded steps (``num_real`` below and above the batch) among them.
After every step the two must hold the same state (row map, slots, stamps, frequencies, counters, clock) and have
returned the same plan, and the tier maps the kernel keeps must equal the maps computed from the new row map.

The interpreter must be chosen before Triton is first imported in a process, so each check runs this file as a
script in a fresh process with ``TRITON_INTERPRET=1`` (``python tests/test_cache_plan_kernel.py CASES``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from pinsidecar_hook.backends.tiers import tier_expert_maps
from pinsidecar_hook.cache import ExpertCache
from pinsidecar_hook.kernels.fill import fill_pairs

_STATS = ("steps", "hits", "misses", "fills", "evictions", "full_steps", "padded_steps", "empty_steps", "max_pairs")


def _caches(rng: np.random.Generator, experts: int, slots: int, policy: str,
            device: str = "cpu", n: int = 2) -> tuple[ExpertCache, ...]:
    """``n`` caches with equal state over one row map: a random hot set, a few experts of another rank (-1), the
    rest cold after the slots."""
    perm = rng.permutation(experts)
    hot_n = int(rng.integers(0, experts // 3 + 1))
    remote_n = int(rng.integers(0, experts // 8 + 1))
    rows = np.full(experts + 2, -1, dtype=np.int64)
    rows[perm[:hot_n]] = np.arange(hot_n)
    cold = perm[hot_n + remote_n:]
    rows[cold] = hot_n + slots + np.arange(len(cold))
    return tuple(ExpertCache(torch.tensor(rows, dtype=torch.int32, device=device), hot_n, slots, policy,
                             torch.zeros(1, dtype=torch.int64, device=device)) for _ in range(n))


def _routing(rng: np.random.Generator, popularity: np.ndarray, tokens: int, top_k: int,
             previous: np.ndarray | None) -> np.ndarray:
    """``tokens`` rows of ``top_k`` distinct experts; a row repeats the row before it (across steps too) half the
    time."""
    out = np.empty((tokens, top_k), dtype=np.int64)
    for t in range(tokens):
        before = out[t - 1] if t else previous
        if before is not None and rng.random() < 0.5:
            out[t] = before
        else:
            out[t] = rng.choice(len(popularity), size=top_k, replace=False, p=popularity)
    return out


def _state(cache: ExpertCache) -> dict[str, list[int]]:
    e, k = cache.num_experts, cache.slots
    state = {"row_map": cache.row_map_ext[:e], "slot_expert": cache.slot_expert[:k], "slot_of": cache.slot_of[:e],
             "stamp": cache.stamp[:k], "clock": cache.clock, "hits": cache.hits, "misses": cache.misses,
             "fills": cache.fills, "evictions": cache.evictions}
    if cache.policy == "lfu":
        state["freq"] = cache.freq[:e]
    return {name: t.tolist() for name, t in state.items()}


def _compare(ref: ExpertCache, got: ExpertCache, ref_plan, got_plan, where: str) -> None:
    ref_state, got_state = _state(ref), _state(got)
    for name, want in ref_state.items():
        assert got_state[name] == want, f"{where}: {name} is {got_state[name]}, the torch plan's is {want}"
    # the whole plan: the first n_fill entries are the fills, the rest zeros (the copy reads only the fills)
    for name in ("n_fill", "dst_rows", "src_rows"):
        want, have = getattr(ref_plan, name).tolist(), getattr(got_plan, name).tolist()
        assert have == want, f"{where}: plan {name} {have}, torch {want}"


def _tiers(rng: np.random.Generator, cache: ExpertCache, device: str) -> tuple[dict, dict]:
    """Per-expert tensors for a cache's layer: a float tensor of whole 32-bit words and a byte tensor whose rows
    are not (the copy's two paths), slot rows zero, cold rows random."""
    hbm, cold = cache.hot_rows + cache.slots, int(cache.cold.sum())
    hot = {"w13_weight": torch.zeros(hbm, 3, 5, device=device), "w2_weight": torch.zeros(hbm, 7, dtype=torch.uint8,
                                                                                        device=device)}
    cold_t = {"w13_weight": torch.from_numpy(rng.standard_normal((cold, 3, 5)).astype(np.float32)).to(device),
              "w2_weight": torch.from_numpy(rng.integers(0, 255, (cold, 7)).astype(np.uint8)).to(device)}
    return hot, cold_t


def _check_fused(ref: ExpertCache, fused: ExpertCache, ref_plan, fused_plan, ids: torch.Tensor,
                 num_real: torch.Tensor | None, got_ids: tuple[torch.Tensor, torch.Tensor],
                 counts: dict[str, torch.Tensor], ref_counts: dict[str, torch.Tensor], tiers: tuple[dict, dict],
                 ref_tiers: tuple[dict, dict], where: str) -> None:
    """The fused step (plan, copy, partition in one launch) against the torch plan, fill_rows and partition."""
    from pinsidecar_hook.cache import fill_rows
    from pinsidecar_hook.kernels.partition import partition_torch

    _compare(ref, fused, ref_plan, fused_plan, where + " (fused)")
    fill_rows(ref_plan, *ref_tiers)
    want = partition_torch(ids, ref.row_map, ref.hot_rows + ref.slots, ref_counts["expert"], ref_counts["cold"],
                           num_real=num_real, token_counts=ref_counts["tokens"])
    for name, have, exp in zip(("hot_ids", "cold_ids"), got_ids, want, strict=True):
        assert have.tolist() == exp.tolist(), f"{where}: fused {name} {have.tolist()}, torch {exp.tolist()}"
    for name in ("expert", "cold", "tokens"):
        assert counts[name].tolist() == ref_counts[name].tolist(), f"{where}: fused {name} counts"
    for name in ("w13_weight", "w2_weight"):
        assert torch.equal(tiers[0][name], ref_tiers[0][name]), f"{where}: fused copy of {name}"


def run_cases(cases: list[dict]) -> dict[str, int]:
    """Step the caches through each case's routing and compare after every step (runs under the interpreter): the
    plan alone, and the fused step (plan, copies, partition) against the torch plan, fill_rows and partition."""
    from pinsidecar_hook.kernels import cache_plan

    stats = dict.fromkeys(_STATS, 0)
    started = time.monotonic()
    for n, case in enumerate(cases):
        print(f"case {n + 1}/{len(cases)} at {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        cache_plan._BLOCK_P = case.get("block_p", 1024)  # small blocks: the loops' carries across blocks
        cache_plan._SLOT_CHUNK = case.get("slot_chunk", 32)
        rng = np.random.default_rng(case["seed"])
        experts, slots, top_k, policy = case["experts"], case["slots"], case["top_k"], case["policy"]
        device = case.get("device", "cpu")
        ref, got, fused = _caches(rng, experts, slots, policy, device, n=3)
        hbm_rows = ref.hot_rows + slots
        tier_maps = tier_expert_maps(got.row_map, hbm_rows) if case.get("tier_maps") else None
        fused.tier_maps = tier_expert_maps(fused.row_map, hbm_rows) if case.get("tier_maps") else None
        tiers = _tiers(np.random.default_rng(case["seed"]), fused, device)
        ref_tiers = _tiers(np.random.default_rng(case["seed"]), ref, device)
        counts = {"expert": torch.zeros(experts, dtype=torch.int64, device=device),
                  "cold": torch.zeros(1, dtype=torch.int64, device=device),
                  "tokens": torch.zeros(1, dtype=torch.int64, device=device)}
        ref_counts = {name: t.clone() for name, t in counts.items()}
        popularity = rng.dirichlet(np.full(experts, 0.3))
        previous = None
        for step in range(case["steps"]):
            tokens = int(rng.integers(1, case["max_tokens"] + 1))
            ids = _routing(rng, popularity, tokens, top_k, previous)
            previous = ids[-1]
            topk = torch.from_numpy(ids).to(device, torch.int32 if step % 2 else torch.int64)
            if top_k == 1 and step % 3 == 0:
                topk = topk.reshape(-1)  # 1-D ids: one selection per token
            num_real = None
            if rng.random() < 0.3:
                num_real = torch.tensor([int(rng.integers(0, tokens + 3))], device=device)  # padding, none, past T
            real = tokens if num_real is None else min(tokens, int(num_real.item()))
            own = rng.random() < 0.25  # count the misses into a counter the call is given
            ref_misses = torch.full((1,), 7, dtype=torch.int64, device=device) if own else None
            got_misses = torch.full((1,), 7, dtype=torch.int64, device=device) if own else None
            # what the step must miss, to tell a full cache (more misses than free slots) from the state
            picked = torch.from_numpy(np.unique(ids[:real])).to(device)
            missed = int((ref.cold[picked] & (ref.slot_of[picked] < 0)).sum()) if real else 0
            fused_misses = got_misses.clone() if own else None
            ref_plan = ref.plan(topk, num_real, ref_misses)
            got_plan = cache_plan.plan_triton(got, topk, num_real, got_misses, tier_maps)
            where = f"case {case}, step {step}"
            _compare(ref, got, ref_plan, got_plan, where)
            fused_plan, out = cache_plan.step_triton(
                fused, topk, num_real, fused_misses, fused.tier_maps, fills=fill_pairs(*tiers), partition=True,
                expert_counts=counts["expert"], cold_counts=counts["cold"], token_counts=counts["tokens"])
            _check_fused(ref, fused, ref_plan, fused_plan, topk, num_real, (out.hot_ids, out.cold_ids), counts,
                         ref_counts, tiers, ref_tiers, where)
            assert not cache_plan._buffers_of(fused).sync.any(), f"{where}: a fill program's word not reset"
            if own:
                assert fused_misses.tolist() == ref_misses.tolist(), f"{where}: fused misses counter"
            if fused.tier_maps is not None:
                want = tier_expert_maps(fused.row_map, hbm_rows)
                assert all(torch.equal(a, b) for a, b in zip(fused.tier_maps, want, strict=True)), where
            if own:
                assert got_misses.tolist() == ref_misses.tolist(), f"{where}: misses counter"
            if tier_maps is not None:
                want = tier_expert_maps(got.row_map, hbm_rows)
                for name, have, exp in zip(("hot_map", "cold_map"), tier_maps, want, strict=True):
                    assert torch.equal(have, exp), f"{where}: {name} {have.tolist()}, from scratch {exp.tolist()}"
            stats["steps"] += 1
            stats["max_pairs"] = max(stats["max_pairs"], ids.size)
            stats["full_steps"] += int(ref_plan.n_fill.item()) < missed
            stats["padded_steps"] += real < tokens
            stats["empty_steps"] += real == 0
        for name in ("hits", "misses", "fills", "evictions"):
            stats[name] += int(getattr(ref, name).item())
    return stats


def _run(cases: list[dict]) -> dict[str, int]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _grid(policy: str) -> list[dict]:
    small = [
        # experts, slots, top_k, max tokens per step: slots fewer than, about, and more than a step's cold experts
        (16, 1, 1, 8), (16, 4, 4, 4), (16, 8, 1, 64), (64, 4, 8, 2), (64, 8, 4, 16), (64, 32, 8, 8),
        (160, 8, 8, 4), (160, 32, 1, 64),
    ]
    cases = [{"seed": seed, "experts": e, "slots": k, "top_k": top_k, "policy": policy, "steps": 24,
              "max_tokens": tokens, "tier_maps": bool(seed % 2)}
             for seed, (e, k, top_k, tokens) in enumerate(small + small)]
    # small blocks: the position loops and the slot comparison run over several blocks with carries
    cases.append({"seed": 100, "experts": 160, "slots": 32, "top_k": 8, "policy": policy, "steps": 24,
                  "max_tokens": 12, "tier_maps": True, "block_p": 16, "slot_chunk": 8})
    return cases


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_kernel_steps_a_cache_exactly_as_the_torch_plan_under_the_interpreter(policy: str) -> None:
    stats = _run(_grid(policy))
    # every transition happened: hits, fills into empty slots and with evictions, full caches, padding
    assert stats["steps"] == 17 * 24
    assert stats["hits"] > 0 and stats["fills"] > 0 and stats["evictions"] > 0, stats
    assert stats["full_steps"] > 0 and stats["padded_steps"] > 0 and stats["empty_steps"] > 0, stats


def test_the_kernel_handles_the_largest_cache_under_the_interpreter() -> None:
    """The limits' sizes: 1024 experts, 256 slots (the slot comparison in 8 chunks), a 2048-selection step (two
    position blocks)."""
    stats = _run([{"seed": 7, "experts": 1024, "slots": 256, "top_k": 8, "policy": policy, "steps": 6,
                   "max_tokens": 256, "tier_maps": True} for policy in ("lru", "lfu")])
    assert stats["fills"] > 256 and stats["evictions"] > 0 and stats["hits"] > 0, stats
    assert stats["max_pairs"] > 1024, stats


def test_a_cache_past_the_kernel_limits_is_refused_with_the_limit() -> None:
    from pinsidecar_hook.kernels.cache_plan import plan_triton

    def cache(experts: int, slots: int) -> ExpertCache:
        rows = torch.cat([slots + torch.arange(experts), torch.tensor([-1, -1])]).to(torch.int32)
        return ExpertCache(rows, 0, slots, "lru", torch.zeros(1, dtype=torch.int64))

    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 1024 experts"):
        plan_triton(cache(1025, 4), ids)
    with pytest.raises(ValueError, match="at most 256 cache slots"):
        plan_triton(cache(512, 257), ids)
    with pytest.raises(ValueError, match="at most 65536 selections"):
        plan_triton(cache(64, 4), torch.zeros(8193, 8, dtype=torch.int64))


def test_the_comparison_catches_a_one_step_difference() -> None:
    """Negative control of the checker itself: a stamp one tick off, or a plan row off, is reported."""
    rng = np.random.default_rng(0)
    ref, got = _caches(rng, 16, 4, "lru")
    ids = torch.tensor([[int(e)] for e in torch.nonzero(ref.cold[:16]).flatten()[:3]])
    ref_plan, got_plan = ref.plan(ids), got.plan(ids)
    _compare(ref, got, ref_plan, got_plan, "equal")
    got.stamp[0] += 1
    with pytest.raises(AssertionError, match="stamp"):
        _compare(ref, got, ref_plan, got_plan, "stamp off")
    got.stamp[0] -= 1
    got_plan.src_rows[0] += 1
    with pytest.raises(AssertionError, match="src_rows"):
        _compare(ref, got, ref_plan, got_plan, "plan off")


@pytest.mark.gpu
def test_the_kernel_matches_the_torch_plan_on_cuda_eagerly_and_replayed_from_a_captured_graph() -> None:
    """On the GPU: the same comparison without the interpreter (real atomics and barriers between the phases, the
    fill programs waiting on program 0), then the plan and the fused step captured once in a CUDA graph and
    replayed for each step with that step's ids copied in."""
    from pinsidecar_hook.kernels import cache_plan

    # every third case of the grid: Triton compiles a variant per launch shape, ~15 s a case on an H100
    cases = [dict(case, device="cuda") for policy in ("lru", "lfu") for case in _grid(policy)[::3]]
    cases += [{"seed": 7, "experts": 1024, "slots": 256, "top_k": 8, "policy": policy, "steps": 12,
               "max_tokens": 512, "tier_maps": True, "device": "cuda"} for policy in ("lru", "lfu")]
    stats = run_cases(cases)
    assert stats["evictions"] > 0 and stats["full_steps"] > 0 and stats["max_pairs"] > 1024, stats
    cache_plan._BLOCK_P, cache_plan._SLOT_CHUNK = 1024, 32
    for policy in ("lru", "lfu"):
        rng = np.random.default_rng(3)
        experts, slots, top_k, tokens = 160, 16, 8, 32
        ref, got, fused = _caches(rng, experts, slots, policy, "cuda", n=3)
        warm = _caches(np.random.default_rng(3), experts, slots, policy, "cuda")[0]
        hbm_rows = ref.hot_rows + slots
        tier_maps = tier_expert_maps(got.row_map, hbm_rows)
        fused.tier_maps = tier_expert_maps(fused.row_map, hbm_rows)
        tiers = _tiers(np.random.default_rng(3), fused, "cuda")
        ref_tiers = _tiers(np.random.default_rng(3), ref, "cuda")
        counts = {"expert": torch.zeros(experts, dtype=torch.int64, device="cuda"),
                  "cold": torch.zeros(1, dtype=torch.int64, device="cuda"),
                  "tokens": torch.zeros(1, dtype=torch.int64, device="cuda")}
        ref_counts = {name: t.clone() for name, t in counts.items()}
        static_ids = torch.zeros(tokens, top_k, dtype=torch.int32, device="cuda")
        static_real = torch.full((1,), tokens, dtype=torch.int64, device="cuda")
        cache_plan.plan_triton(warm, static_ids, static_real)  # compile, outside the capture
        warm_counts = {name: t.clone() for name, t in counts.items()}
        cache_plan.step_triton(warm, static_ids, static_real, fills=fill_pairs(*_tiers(rng, warm, "cuda")),
                               partition=True, expert_counts=warm_counts["expert"], cold_counts=warm_counts["cold"],
                               token_counts=warm_counts["tokens"])
        cache_plan._buffers_of(got)  # the plan's tensors exist before the capture
        cache_plan._buffers_of(fused)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got_plan = cache_plan.plan_triton(got, static_ids, static_real, None, tier_maps)
            fused_plan, out = cache_plan.step_triton(
                fused, static_ids, static_real, None, fused.tier_maps, fills=fill_pairs(*tiers), partition=True,
                expert_counts=counts["expert"], cold_counts=counts["cold"], token_counts=counts["tokens"])
        popularity = rng.dirichlet(np.full(experts, 0.3))
        previous = None
        for step in range(40):
            ids = _routing(rng, popularity, tokens, top_k, previous)
            previous = ids[-1]
            real = tokens if step % 4 else int(rng.integers(0, tokens + 1))
            static_ids.copy_(torch.from_numpy(ids))
            static_real.fill_(real)
            graph.replay()
            ref_plan = ref.plan(static_ids, static_real)
            _compare(ref, got, ref_plan, got_plan, f"graph, {policy}, step {step}")
            want = tier_expert_maps(got.row_map, hbm_rows)
            assert torch.equal(tier_maps[0], want[0]) and torch.equal(tier_maps[1], want[1]), step
            _check_fused(ref, fused, ref_plan, fused_plan, static_ids, static_real, (out.hot_ids, out.cold_ids),
                         counts, ref_counts, tiers, ref_tiers, f"graph, {policy}, step {step}")
            assert all(torch.equal(a, b) for a, b in zip(fused.tier_maps, want, strict=True)), step
            assert not cache_plan._buffers_of(fused).sync.any(), step  # every fill program's word reset
        assert int(ref.evictions.item()) > 0 and int(ref.hits.item()) > 0


if __name__ == "__main__":  # the interpreter side of _run
    print(json.dumps(run_cases(json.loads(sys.argv[1]))))
