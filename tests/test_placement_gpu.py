"""GPU checks behind the placement benchmark (bench/placement.py): the cold tier's device view and the two-tier split.

Skipped cleanly without CUDA (conftest). What they show, on the H200 through the device tool:
- the production device view of pinned host memory (:func:`pinsidecar_hook.rehome.device_view_of_pinned`) reads
  the same bits as its host copy, through a copy and through a kernel;
- it survives CUDA graph capture and replay, and a replayed graph reads the host pages as they are *now* (in place,
  not a snapshot taken at capture);
- re-homing a layer (:func:`pinsidecar_hook.rehome.rehome_layer`) frees the originals: ``torch.cuda.mem_get_info``
  gets the cold bytes back;
- the grouped experts calls (:mod:`pinsidecar_hook.kernels.grouped`) compute what the loop computes, and give the
  same bits from HBM and from the device view;
- the split with the cold call on a side stream (overlap) is bit-identical to the serial split and to the unsplit
  call, eagerly and replayed from a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from pinsidecar.testing import moe

pytestmark = pytest.mark.gpu

E, D, N, K = 32, 512, 256, 6


def _pinned(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pinsidecar_hook.rehome import device_view_of_pinned

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.cpu())
    return host, device_view_of_pinned(host)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn((E, 2 * N, D), generator=g, device="cuda", dtype=torch.bfloat16) / 16
    w2 = torch.randn((E, D, N), generator=g, device="cuda", dtype=torch.bfloat16) / 16
    return w13, w2


def _impls() -> list[str]:
    from pinsidecar_hook.kernels import grouped

    return ["triton"] + (["grouped_mm"] if grouped.grouped_mm_available() else [])


def test_device_view_reads_the_host_bits() -> None:
    src = torch.randn(1 << 22, device="cuda").to(torch.bfloat16)
    host, view = _pinned(src)
    assert view.is_cuda and view.data_ptr() != 0
    assert torch.equal(view.cpu(), host)  # read back over the bus
    assert torch.equal(view.clone(), src)  # read by a kernel on the device
    assert torch.equal((view.float() * 1).to(torch.bfloat16), src)


def test_device_view_survives_graph_capture_and_replay_reading_in_place() -> None:
    from pinsidecar_hook.kernels import grouped

    w13, w2 = _weights(1)
    _host13, view13 = _pinned(w13)
    host2, view2 = _pinned(w2)
    x = torch.randn((4, D), device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, E, (4, K), device="cuda")
    out = torch.empty((4 * K + 1, D), device="cuda", dtype=torch.bfloat16)
    copy = torch.empty_like(w2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped.grouped_experts(x, view13, view2, ids, out, "triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped.grouped_experts(x, view13, view2, ids, out, "triton")
        copy.copy_(view2)
    expected = torch.empty_like(out)
    grouped.grouped_experts(x, w13, w2, ids, expected, "triton")
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:-1], expected[:-1])
        assert torch.equal(copy, w2)
    host2.mul_(2)  # rewrite the host pages: the replayed graph must read the new bits
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(copy, w2 * 2)
    assert not torch.equal(out[:-1], expected[:-1])


def test_rehoming_frees_the_originals_hbm() -> None:
    from pinsidecar_hook.rehome import MemoryLedger, rehome_layer

    owner = torch.nn.Module()
    big_e = 64
    owner.w13_weight = torch.nn.Parameter(torch.randn((big_e, 2 * 1024, 4096), device="cuda", dtype=torch.bfloat16),
                                          requires_grad=False)
    owner.w2_weight = torch.nn.Parameter(torch.randn((big_e, 4096, 1024), device="cuda", dtype=torch.bfloat16),
                                         requires_grad=False)
    w2_copy = owner.w2_weight.detach().clone()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    hot, cold = list(range(0, big_e, 2)), list(range(1, big_e, 2))
    moved = rehome_layer(owner, ["w13_weight", "w2_weight"], hot, cold, MemoryLedger())
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    assert moved.cold_bytes == 3 * 1024 * 4096 * 2 * len(cold)
    returned = free_after - free_before
    assert returned >= 0.95 * moved.cold_bytes, (returned, moved.cold_bytes)
    assert torch.equal(moved.cold["w2_weight"], w2_copy[cold])  # the cold rows are read back from host memory
    assert torch.equal(owner.w2_weight, w2_copy[hot])


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_grouped_calls_match_the_loop_and_read_both_tiers_alike(impl: str) -> None:
    from pinsidecar_hook.backends import torch_ref
    from pinsidecar_hook.kernels import grouped

    if impl not in _impls():
        pytest.skip("torch._grouped_mm is missing in this torch")
    w13, w2 = _weights(2)
    _, v13 = _pinned(w13)
    _, v2 = _pinned(w2)
    for tokens in (1, 6, 16, 100):
        x = torch.randn((tokens, D), device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)])
        ids[0, 0] = -1  # a slot on no row of this call
        loop = torch_ref.expert_rows(x, w13, w2, ids).reshape(tokens * K, D).float()
        hbm = torch.full((tokens * K + 1, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        uva = hbm.clone()
        grouped.grouped_experts(x, w13, w2, ids, hbm, impl)
        grouped.grouped_experts(x, v13, v2, ids, uva, impl)
        live = (ids.reshape(-1) >= 0)
        assert torch.equal(hbm[:-1][live], uva[:-1][live])
        assert not hbm[:-1][live].isnan().any()
        rel = (hbm[:-1][live].float() - loop[live]).norm() / loop[live].norm()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("impl", ["triton", "grouped_mm", "loop"])
def test_overlapped_split_is_bit_identical_and_capturable(impl: str) -> None:
    from pinsidecar_hook.backends import torch_ref

    if impl != "loop" and impl not in _impls():
        pytest.skip("torch._grouped_mm is missing in this torch")
    w13, w2 = _weights(3)
    g = torch.Generator().manual_seed(5)
    for cold_fraction in (0.0, 0.25, 0.9, 1.0):
        ids, weights, row_map, hot_rows = moe.routing_case(16, K, E, cold_fraction, True, g)
        ids, weights, row_map = ids.cuda(), weights.cuda(), row_map.cuda()
        x = torch.randn((16, D), device="cuda").to(torch.bfloat16)
        h13, c13 = moe.rehome_weights(w13, row_map, hot_rows)
        h2, c2 = moe.rehome_weights(w2, row_map, hot_rows)
        if c13.shape[0]:
            (_, c13), (_, c2) = _pinned(c13), _pinned(c2)
        ref = torch_ref.unsplit(x, w13, w2, weights, ids, impl=impl)
        args = (x, h13, h2, c13, c2, weights, ids, row_map, hot_rows)
        serial = torch_ref.split(*args, impl=impl, overlap=False)
        overlap = torch_ref.split(*args, impl=impl, overlap=True)
        torch.cuda.synchronize()
        assert torch.equal(serial, ref)
        assert torch.equal(overlap, ref)
        if impl == "loop":
            continue  # the loop syncs with the host: not capturable
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch_ref.split(*args, impl=impl, overlap=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch_ref.split(*args, impl=impl, overlap=True)
        for _ in range(3):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, ref)

