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

import numpy as np
import pytest
import torch
from pinsidecar_hook.backends.triton_experts import tier_expert_maps
from pinsidecar_hook.cache import ExpertCache

_STATS = ("steps", "hits", "misses", "fills", "evictions", "full_steps", "padded_steps", "empty_steps", "max_pairs")


def _caches(rng: np.random.Generator, experts: int, slots: int, policy: str,
            device: str = "cpu") -> tuple[ExpertCache, ExpertCache]:
    """Two caches with equal state over one row map: a random hot set, a few experts of another rank (-1), the
    rest cold after the slots."""
    perm = rng.permutation(experts)
    hot_n = int(rng.integers(0, experts // 3 + 1))
    remote_n = int(rng.integers(0, experts // 8 + 1))
    rows = np.full(experts + 2, -1, dtype=np.int64)
    rows[perm[:hot_n]] = np.arange(hot_n)
    cold = perm[hot_n + remote_n:]
    rows[cold] = hot_n + slots + np.arange(len(cold))
    return tuple(ExpertCache(torch.tensor(rows, dtype=torch.int32, device=device), hot_n, slots, policy,
                             torch.zeros(1, dtype=torch.int64, device=device)) for _ in range(2))


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


def run_cases(cases: list[dict]) -> dict[str, int]:
    """Step both caches through each case's routing and compare after every step (runs under the interpreter)."""
    from pinsidecar_hook.kernels import cache_plan

    stats = dict.fromkeys(_STATS, 0)
    for case in cases:
        cache_plan._BLOCK_P = case.get("block_p", 1024)  # small blocks: the loops' carries across blocks
        cache_plan._SLOT_CHUNK = case.get("slot_chunk", 32)
        rng = np.random.default_rng(case["seed"])
        experts, slots, top_k, policy = case["experts"], case["slots"], case["top_k"], case["policy"]
        device = case.get("device", "cpu")
        ref, got = _caches(rng, experts, slots, policy, device)
        hbm_rows = ref.hot_rows + slots
        tier_maps = tier_expert_maps(got.row_map, hbm_rows) if case.get("tier_maps") else None
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
            ref_plan = ref.plan(topk, num_real, ref_misses)
            got_plan = cache_plan.plan_triton(got, topk, num_real, got_misses, tier_maps)
            where = f"case {case}, step {step}"
            _compare(ref, got, ref_plan, got_plan, where)
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
    """On the GPU: the same comparison without the interpreter (real atomics and barriers between the phases), then
    the kernel captured once in a CUDA graph and replayed for each step with that step's ids copied in."""
    from pinsidecar_hook.kernels import cache_plan

    cases = [dict(case, device="cuda") for policy in ("lru", "lfu") for case in _grid(policy)]
    cases += [{"seed": 7, "experts": 1024, "slots": 256, "top_k": 8, "policy": policy, "steps": 12,
               "max_tokens": 512, "tier_maps": True, "device": "cuda"} for policy in ("lru", "lfu")]
    stats = run_cases(cases)
    assert stats["evictions"] > 0 and stats["full_steps"] > 0 and stats["max_pairs"] > 1024, stats
    cache_plan._BLOCK_P, cache_plan._SLOT_CHUNK = 1024, 32
    for policy in ("lru", "lfu"):
        rng = np.random.default_rng(3)
        experts, slots, top_k, tokens = 160, 16, 8, 32
        ref, got = _caches(rng, experts, slots, policy, "cuda")
        warm = _caches(np.random.default_rng(3), experts, slots, policy, "cuda")[0]
        hbm_rows = ref.hot_rows + slots
        tier_maps = tier_expert_maps(got.row_map, hbm_rows)
        static_ids = torch.zeros(tokens, top_k, dtype=torch.int32, device="cuda")
        static_real = torch.full((1,), tokens, dtype=torch.int64, device="cuda")
        cache_plan.plan_triton(warm, static_ids, static_real)  # compile, outside the capture
        cache_plan._buffers_of(got)  # the plan's tensors exist before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got_plan = cache_plan.plan_triton(got, static_ids, static_real, None, tier_maps)
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
        assert int(ref.evictions.item()) > 0 and int(ref.hits.item()) > 0


if __name__ == "__main__":  # the interpreter side of _run
    print(json.dumps(run_cases(json.loads(sys.argv[1]))))
