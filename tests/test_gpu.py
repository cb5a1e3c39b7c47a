"""GPU checks of pin mode's kernels and the torch reference backend (run on the H200 through the device tool).

Skipped cleanly without CUDA (conftest). What they show:
- the compiled Triton partition and finalize agree bit for bit with their torch versions (same checks as the
  interpreter run in tests/test_kernels.py);
- the production device view of pinned host memory (:func:`pinsidecar_hook.rehome.device_view_of_pinned`, the one
  pin mode's re-homing uses) reads the host pages in place;
- a split call over hot weights in HBM and cold weights read in place from pinned host memory through that view
  is bit-identical to the unsplit call, for k = 1..8, tokens 1..4096, cold fractions 0..100 %, random and
  adversarial maps;
- partition + finalize replay inside a captured CUDA graph, follow a row map rewritten in place, and count exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pinsidecar.testing import moe

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 32
HIDDEN = 128
INTERMEDIATE = 64
TOKENS = (1, 2, 7, 64, 513, 4096)
COLD_FRACTIONS = (0.0, 0.1, 0.5, 0.9, 1.0)


def test_compiled_kernels_match_torch() -> None:
    from test_kernels import run_checks

    results = run_checks("cuda")
    assert len(results) == 87
    assert results["fma_is_fused"]
    assert all(results.values()), [k for k, v in results.items() if not v]


def _pinned_view(t: torch.Tensor) -> torch.Tensor:
    from pinsidecar_hook.rehome import device_view_of_pinned

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return device_view_of_pinned(host)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_device_view_of_pinned_reads_host_memory_in_place(dtype: torch.dtype) -> None:
    """Zero-copy: the view is a CUDA tensor at the host pages' address, and a later host write shows through."""
    from pinsidecar_hook.rehome import device_view_of_pinned

    host = torch.arange(3 * 5, dtype=torch.float32).view(3, 5).to(dtype).pin_memory()
    view = device_view_of_pinned(host)
    assert view.is_cuda and view.shape == host.shape and view.dtype == dtype
    assert torch.equal(view.cpu(), host)
    host[1, 2] = 7
    torch.cuda.synchronize()
    assert view[1, 2].item() == 7  # read over the bus, not a copy
    assert (view.float() * 2).sum().item() == (host.float() * 2).sum().item()  # usable by kernels
    empty = device_view_of_pinned(torch.empty(0, 4, dtype=dtype))  # an all-hot map's empty cold tier
    assert empty.is_cuda and empty.shape == (0, 4)
    with pytest.raises(ValueError, match="pinned"):
        device_view_of_pinned(torch.zeros(4))


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_split_bit_identical_on_gpu(num_tokens: int) -> None:
    from pinsidecar_hook.backends import torch_ref

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(num_tokens)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / 8).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / 8).to(torch.bfloat16).to(dev)
    failures = []
    for top_k, frac, adversarial in itertools.product(range(1, 9), COLD_FRACTIONS, (False, True)):
        x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
        ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, NUM_EXPERTS, frac, adversarial, g)
        ids, weights, row_map = ids.to(dev), weights.to(dev), row_map.to(dev)
        ref = torch_ref.unsplit(x, w13, w2, weights, ids)
        w13_hot, w13_cold = moe.rehome_weights(w13, row_map, hot_rows)
        w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
        # the cold tier really in pinned host memory, read over the bus through the production view
        w13_cold, w2_cold = (_pinned_view(t) for t in (w13_cold, w2_cold))
        counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=dev)
        cold = torch.zeros(1, dtype=torch.int64, device=dev)
        out = torch_ref.split(x, w13_hot, w2_hot, w13_cold, w2_cold, weights, ids, row_map, hot_rows, counts, cold)
        ok = torch.equal(out, ref)
        ok = ok and torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS))
        ok = ok and int(cold) == int((row_map.long()[ids] >= hot_rows).sum())
        if not ok:
            failures.append((top_k, frac, adversarial))
    assert not failures, f"T={num_tokens}: split != unsplit for (k, cold, adversarial) in {failures}"


def test_partition_and_finalize_in_cuda_graph_follow_the_map() -> None:
    """Capture partition (with counters) + finalize once; replays follow new routing and a row map rewritten in
    place (a remap of the same geometry needs no re-capture), and the counters count every replay exactly."""
    from pinsidecar_hook.kernels import finalize, finalize_torch, partition, partition_torch

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    num_tokens, top_k, num_experts, hot_rows, hidden = 16, 6, 64, 40, 256
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g).to(dev)
    weights = torch.rand(num_tokens, top_k, generator=g).to(dev)
    rows = torch.randn(num_tokens, top_k, hidden, generator=g).to(torch.bfloat16).to(dev)
    row_map = torch.randperm(num_experts, generator=g).to(torch.int32).to(dev)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    cold = torch.zeros(1, dtype=torch.int64, device=dev)

    def step():
        hot_ids, cold_ids = partition(ids, row_map, hot_rows, counts, cold)
        return hot_ids, cold_ids, finalize(rows, weights, hot_ids=hot_ids, cold_ids=cold_ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    counts.zero_()
    cold.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hot_ids, cold_ids, out = step()
    ref_counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    ref_cold = torch.zeros(1, dtype=torch.int64, device=dev)
    replays = 5
    for i in range(replays):
        ids.copy_(torch.randint(0, num_experts, (num_tokens, top_k), generator=g).to(dev))
        if i == 2:
            row_map.copy_(torch.randperm(num_experts, generator=g).to(torch.int32).to(dev))  # remap in place
        graph.replay()
        want_hot, want_cold = partition_torch(ids, row_map, hot_rows, ref_counts, ref_cold)
        assert torch.equal(hot_ids, want_hot) and torch.equal(cold_ids, want_cold)
        assert torch.equal(out, finalize_torch(rows, weights, hot_ids=want_hot, cold_ids=want_cold))
    torch.cuda.synchronize()
    assert torch.equal(counts, ref_counts) and torch.equal(cold, ref_cold)
    assert int(counts.sum()) == replays * num_tokens * top_k  # exact: replays x tokens x k


def test_padding_mask_in_cuda_graph_counts_only_real_rows() -> None:
    """CUDA graphs pad a batch to the captured size. Pin mode's partition and count mode's capture callback,
    captured at 8 rows, replayed with the worker's real-token scalar at 3, 8, 5 and 0: only the real rows count."""
    from types import SimpleNamespace

    from pinsidecar_hook.count import CountState
    from pinsidecar_hook.kernels import partition

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    rows, top_k, num_experts, hot_rows = 8, 8, 128, 99
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(rows)]).to(torch.int32).to(dev)
    row_map = torch.randperm(num_experts, generator=g).to(torch.int32).to(dev)
    real = torch.full((1,), rows, dtype=torch.int64, device=dev)
    counts, cold, tokens = (torch.zeros(n, dtype=torch.int64, device=dev) for n in (num_experts, 1, 1))
    state = CountState([0], SimpleNamespace(workload=""), num_experts, top_k, dev, writer=False, meta={},
                       model_info=None, real_tokens=real)
    capture = state.capture_fn(0, None)

    def step() -> None:
        partition(ids, row_map, hot_rows, counts, cold, num_real=real, token_counts=tokens)
        capture(ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n in (3, 8, 5, 0):
        for t in (counts, cold, tokens, *state.counts, *state.tokens):
            t.zero_()
        real.fill_(n)  # what the execute_model wrapper does before each step, on the same stream
        graph.replay()
        torch.cuda.synchronize()
        want = torch.bincount(ids[:n].reshape(-1).long(), minlength=num_experts)
        assert torch.equal(counts, want) and torch.equal(state.counts[0], want), n
        assert int(tokens) == n and int(state.tokens[0]) == n
        assert int(cold) == int((row_map.long()[ids[:n].long()] >= hot_rows).sum())
