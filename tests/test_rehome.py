"""Re-homing one layer's per-expert tensors, and the per-rank row maps (tensor and expert parallel).

These run on plain modules shaped like vLLM's ``RoutedExperts`` (the engine-level re-homing is exercised by
``test_pin_cpu.py``): what is split, in which order, what the parameters point at afterwards, and the bounded
transient peak.
"""

from __future__ import annotations

import pytest
import torch
from pinsidecar_hook.contract import placement_row_map
from pinsidecar_hook.rehome import MemoryLedger, expert_tensor_names, memory_order, rehome_layer, tensor_bytes

E = 8


class FakeExperts(torch.nn.Module):
    """The attributes vLLM's RoutedExperts has: per-expert weights and biases, plus routing tables."""

    def __init__(self, num_experts: int = E) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.arange(num_experts * 6, dtype=torch.float32).view(num_experts, 3, 2),
                                             requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.arange(num_experts * 4, dtype=torch.bfloat16).view(num_experts, 2, 2),
                                            requires_grad=False)
        self.w13_bias = torch.nn.Parameter(torch.arange(num_experts * 3, dtype=torch.float32).view(num_experts, 3),
                                           requires_grad=False)
        self.not_per_expert = torch.nn.Parameter(torch.zeros(3, num_experts), requires_grad=False)
        self.register_buffer("_expert_map", torch.arange(num_experts, dtype=torch.int32), persistent=False)
        self.register_buffer("expert_mask", torch.ones(num_experts), persistent=False)


def test_expert_tensor_names_finds_weights_and_biases_not_routing_tables() -> None:
    assert expert_tensor_names(FakeExperts(), E) == ["w13_bias", "w13_weight", "w2_weight"]


def test_rehome_splits_rows_in_map_order_and_keeps_parameter_objects() -> None:
    layer = FakeExperts()
    original = {n: getattr(layer, n).detach().clone() for n in ("w13_weight", "w2_weight", "w13_bias")}
    bias_param = layer.w13_bias  # what vLLM's quant config holds a reference to
    hot, cold = [5, 0, 3], [7, 1, 2, 4, 6]
    out = rehome_layer(layer, ["w13_bias", "w13_weight", "w2_weight"], hot, cold, MemoryLedger())
    for name, full in original.items():
        assert torch.equal(out.hot[name], full[hot]), name
        assert torch.equal(out.cold[name], full[cold]), name
        assert torch.equal(getattr(layer, name), full[hot]), name  # the layer now holds only the hot rows
    assert layer.w13_bias is bias_param and bias_param.shape[0] == 3  # outside references follow
    assert out.hot_bytes == sum(tensor_bytes(t[hot]) for t in original.values())
    assert out.cold_bytes == sum(tensor_bytes(t[cold]) for t in original.values())
    assert torch.equal(layer.not_per_expert, torch.zeros(3, E))


def test_rehome_replaces_the_original_storage() -> None:
    layer = FakeExperts()
    ptr_before = layer.w13_weight.data_ptr()
    rehome_layer(layer, ["w13_weight"], [0, 1], list(range(2, E)), MemoryLedger())
    assert layer.w13_weight.data_ptr() != ptr_before
    assert all(t.data_ptr() != ptr_before for t in layer.parameters())


@pytest.mark.parametrize("slots", [0, 2])
def test_rows_keep_the_tensors_memory_order(slots: int) -> None:
    """A kernel may read a per-expert tensor through a transposed view by its strides (triton_kernels keeps the
    swizzled MXFP4 weights as ``data.mT``): each tier keeps that memory order, so the same strides address it."""
    layer = FakeExperts()
    stored = torch.arange(E * 3 * 5, dtype=torch.float32).view(E, 3, 5)
    layer.w13_weight = torch.nn.Parameter(stored.transpose(1, 2), requires_grad=False)  # [E, 5, 3], strides (15, 1, 5)
    full = layer.w13_weight.detach().clone()
    assert memory_order(layer.w13_weight) == (0, 2, 1)
    hot, cold = [5, 0, 3], [7, 1, 2, 4, 6]
    out = rehome_layer(layer, ["w13_weight"], hot, cold, MemoryLedger(), slot_rows=slots)
    for tier, rows in ((out.hot, hot), (out.cold, cold), (out.cold_host, cold)):
        t = tier["w13_weight"]
        assert t.shape[1:] == (5, 3) and t.stride()[1:] == (1, 5), t.stride()  # the original's inner strides
        assert torch.equal(t[: len(rows)], full[rows])
    assert out.hot["w13_weight"].shape[0] == len(hot) + slots
    assert memory_order(layer.w2_weight) == (0, 1, 2)  # contiguous: copied as before
    broadcast = torch.zeros(3, 1).expand(3, 4)  # not dense: copied contiguous rather than guessed at
    assert memory_order(broadcast) == (0, 1)


@pytest.mark.parametrize("hot_count", [0, 3, E])
def test_all_hot_and_all_cold_layers(hot_count: int) -> None:
    layer = FakeExperts()
    full = layer.w2_weight.detach().clone()
    order = [4, 6, 1, 0, 7, 2, 3, 5]
    out = rehome_layer(layer, ["w2_weight"], order[:hot_count], order[hot_count:], MemoryLedger())
    assert out.hot["w2_weight"].shape[0] == hot_count and out.cold["w2_weight"].shape[0] == E - hot_count
    assert torch.equal(torch.cat([out.hot["w2_weight"], out.cold["w2_weight"]]), full[order])


def test_peak_is_bounded_by_one_layer_not_the_model() -> None:
    layers = [FakeExperts() for _ in range(6)]
    names = ["w13_bias", "w13_weight", "w2_weight"]
    per_layer = sum(tensor_bytes(getattr(layers[0], n)) for n in names)
    ledger = MemoryLedger()
    cold_total = 0
    for layer in layers:
        cold_total += rehome_layer(layer, names, [0, 1, 2, 3], [4, 5, 6, 7], ledger).cold_bytes
    # On the CPU engine both tiers are host memory: one tensor's copies exist next to its original until the
    # original goes, so the extra ever held is at most one layer's worth, however many layers there are.
    assert 0 < ledger.peak_total <= per_layer
    assert ledger.current["host"] == 0  # hot + cold replaced the originals byte for byte
    assert cold_total > 0


def test_row_map_without_expert_parallel() -> None:
    rows, hot_local, cold_local = placement_row_map((3, 1), (0, 2), 4)
    assert rows == [2, 1, 3, 0] and hot_local == [3, 1] and cold_local == [0, 2]


def test_row_map_tensor_parallel_ranks_apply_the_same_map() -> None:
    # TP: every rank holds every expert (a shard of each), so every rank gets the identical row map.
    maps = [placement_row_map((5, 2, 7), (0, 1, 3, 4, 6), 8) for _rank in range(2)]
    assert maps[0] == maps[1]


def test_row_map_expert_parallel_maps_only_local_experts() -> None:
    # EP over 2 ranks, 8 experts: rank 0 holds globals 0..3 (local 0..3), rank 1 globals 4..7 (local 0..3).
    hot, cold = (6, 1, 4, 2), (0, 3, 5, 7)
    ep_maps = [[0, 1, 2, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 0, 1, 2, 3]]
    (rows0, hot0, cold0), (rows1, hot1, cold1) = (placement_row_map(hot, cold, 8, m) for m in ep_maps)
    assert hot0 == [1, 2] and cold0 == [0, 3]  # local ids, in the map's order
    assert rows0 == [2, 0, 1, 3, -1, -1, -1, -1]
    assert hot1 == [2, 0] and cold1 == [1, 3]
    assert rows1 == [-1, -1, -1, -1, 1, 2, 0, 3]
    # every global expert has a row on exactly one rank
    assert all((a >= 0) != (b >= 0) for a, b in zip(rows0, rows1, strict=True))


def test_device_view_of_pinned_refuses_pageable_memory() -> None:
    """The one device view of host memory (production and GPU tests) reads pinned pages only; the GPU tests
    (``test_gpu.py``) check the view itself."""
    from pinsidecar_hook.rehome import device_view_of_pinned

    with pytest.raises(ValueError, match="pinned host memory"):
        device_view_of_pinned(torch.zeros(4))


def _quantized_owner() -> torch.nn.Module:
    """A layer as vLLM 0.26 holds a Marlin GPTQ one: packed weights with a second name, scales, empty act-order
    indices, a routing table, a shared input scale."""
    owner = torch.nn.Module()
    owner.w13_qweight = torch.nn.Parameter(torch.zeros(E, 16, 8, dtype=torch.int32), requires_grad=False)
    owner.w2_qweight = torch.nn.Parameter(torch.zeros(E, 8, 16, dtype=torch.int32), requires_grad=False)
    owner.w13_weight = owner.w13_qweight  # Marlin: the modular kernel reads w13_weight
    owner.w2_weight = owner.w2_qweight
    owner.w13_scales = torch.nn.Parameter(torch.ones(E, 2, 16, dtype=torch.float16), requires_grad=False)
    owner.w13_g_idx = torch.nn.Parameter(torch.zeros(E, 0, dtype=torch.int32), requires_grad=False)
    owner.w13_input_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    owner.register_buffer("expert_mask", torch.ones(E + 1))
    return owner


def test_every_tensor_of_a_layer_gets_a_fate() -> None:
    from pinsidecar_hook.rehome import plan_layer_tensors

    owner = _quantized_owner()
    known = ("w13_qweight", "w2_qweight", "w13_weight", "w2_weight", "w13_scales", "w13_g_idx")
    fates = {f.name: f for f in plan_layer_tensors(owner, E, known, ())}
    assert {n: f.fate for n, f in fates.items()} == {
        "w13_qweight": "split", "w2_qweight": "split", "w13_weight": "alias", "w2_weight": "alias",
        "w13_scales": "split", "w13_g_idx": "split", "w13_input_scale": "shared", "expert_mask": "routing"}
    assert fates["w13_weight"].alias_of == "w13_qweight"
    assert fates["w13_scales"].describe() == f"w13_scales [{E}x2x16] float16: split"


def test_a_tensor_the_backend_does_not_know_is_refused_with_its_name_shape_and_dtype() -> None:
    from pinsidecar_hook.rehome import plan_layer_tensors

    owner = _quantized_owner()
    owner.w13_qzeros = torch.nn.Parameter(torch.zeros(E, 2, 2, dtype=torch.int32), requires_grad=False)
    owner.w13_weight_scale_2 = torch.nn.Parameter(torch.ones(3, 5), requires_grad=False)  # not per expert, not known
    fates = {f.name: f for f in plan_layer_tensors(owner, E, ("w13_qweight", "w2_qweight", "w13_scales",
                                                               "w13_g_idx"), ())}
    assert fates["w13_qzeros"].fate == "unknown"
    assert fates["w13_qzeros"].describe() == (f"w13_qzeros [{E}x2x2] int32: unknown (per-expert, not split by this "
                                              "backend)")
    assert fates["w13_weight_scale_2"].fate == "unknown"
    assert "not per-expert and not known to be shared" in fates["w13_weight_scale_2"].describe()


def test_rehome_gives_an_alias_the_tensors_of_its_parameter() -> None:
    owner = _quantized_owner()
    hot, cold = [0, 2, 4], [1, 3, 5, 6, 7]
    re = rehome_layer(owner, ["w13_qweight", "w13_scales"], hot, cold, MemoryLedger(),
                      aliases={"w13_weight": "w13_qweight"})
    assert re.hot["w13_weight"] is re.hot["w13_qweight"] is owner.w13_weight
    assert re.cold["w13_weight"] is re.cold["w13_qweight"] and owner.w13_weight.shape[0] == 3
    assert re.hot_bytes == sum(tensor_bytes(re.hot[n]) for n in ("w13_qweight", "w13_scales"))  # counted once
