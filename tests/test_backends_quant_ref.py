"""Torch reference split over quantized experts: bit-identical to the unsplit call, for every format and map.

Each expert's weight is dequantized from its own rows of the per-expert tensors, so a split that mirrors every
per-expert tensor (weights, scales, zero points, g_idx, biases) gives the unsplit bits; one that forgets a scale
must not. Layers come from :mod:`pinsidecar.testing.quant` (random weights, quantized as checkpoints are), routing
from :func:`pinsidecar.testing.moe.routing_case`. CPU only, small geometries.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.kernels import partition_torch
from pinsidecar_hook.kernels.dequant import QuantScheme, dequant, dequant_expert, scheme_of

from pinsidecar.testing import moe, quant

E, H, INTER = 16, 256, 128  # int4 groups of 128 need H and INTER multiples of 128
FORMATS = {  # id -> (kind, builder options)
    "none": ("none", {}),
    "fp8_block": ("fp8_block", {}),
    "fp8_tensor": ("fp8_tensor", {}),
    "fp8_channel": ("fp8_channel", {}),
    "int4_sym": ("int4_group", {}),
    "int4_act_order_asym": ("int4_group", {"act_order": True, "symmetric": False}),
    "fp8_block_bias": ("fp8_block", {"bias": True}),
    "int4_bias": ("int4_group", {"act_order": True, "bias": True}),
}
# Relative Frobenius error of the dequantized weights against the float ones: fp8 e4m3 rounds to 3 mantissa bits
# (about 2.6 % here), int4 to 16 levels per group (about 11 %).
DEQUANT_TOLERANCE = {"none": 0.0, "fp8_block": 0.035, "fp8_tensor": 0.035, "fp8_channel": 0.035, "int4_group": 0.13}
COLD_FRACTIONS = (0.0, 0.25, 0.5, 1.0)
STEPS = ((1, 4), (17, 6), (64, 8))  # (tokens, top-k)


@functools.cache
def _layer(fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    kind, options = FORMATS[fmt]
    return quant.quantized_layer(kind, E, H, INTER, seed, torch.bfloat16, **options)


def _tiers(tensors, row_map, hot_rows):
    order = moe.experts_by_row(row_map)
    return quant.rehome_tensors(tensors, order[:hot_rows], order[hot_rows:])


def _hidden(tensors: dict[str, torch.Tensor]) -> int:
    if "w13_qweight" in tensors:
        return tensors["w13_qweight"].shape[1] * 8
    return tensors["w13_weight"].shape[2]


def _check_split_equals_unsplit(tensors, dtype, num_tokens, top_k, cold_fraction, adversarial, seed, impl="loop"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, _hidden(tensors), generator=g).to(dtype)
    ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, E, cold_fraction, adversarial, g)
    ref = torch_ref.unsplit(x, tensors, weights, ids, impl=impl)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    counts = torch.zeros(E, dtype=torch.int64)
    cold_count = torch.zeros(1, dtype=torch.int64)
    tokens = torch.zeros(1, dtype=torch.int64)
    out = torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows, counts, cold_count, token_counts=tokens,
                          impl=impl)
    case = f"T={num_tokens} k={top_k} cold={cold_fraction} adv={adversarial} {dtype}"
    assert out.dtype == dtype
    assert torch.isfinite(ref).all()
    assert torch.equal(out, ref), f"split != unsplit: {case}"
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E))
    assert int(cold_count) == int((row_map.to(torch.int64)[ids] >= hot_rows).sum())
    assert int(tokens) == num_tokens
    if adversarial and 0 < hot_rows < E and top_k >= 2:  # the case really straddles the tiers
        rows = row_map.to(torch.int64)[ids]
        assert bool(((rows < hot_rows).any(1) & (rows >= hot_rows).any(1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_split_bit_identical_to_unsplit(fmt: str, dtype: torch.dtype) -> None:
    tensors = _layer(fmt)
    maps = [(frac, adv) for frac in COLD_FRACTIONS for adv in ((False, True) if 0 < frac < 1 else (False,))]
    for i, ((frac, adversarial), (tokens, top_k)) in enumerate(itertools.product(maps, STEPS)):
        _check_split_equals_unsplit(tensors, dtype, tokens, top_k, frac, adversarial, seed=100 + i)


def test_split_bit_identical_with_ragged_fp8_blocks() -> None:
    """Sizes that are not multiples of 128 leave partial scale blocks at the edges (H=192, 2I=160)."""
    tensors = quant.quantized_layer("fp8_block", E, 192, 80, 4)
    assert tuple(tensors["w13_weight_scale_inv"].shape) == (E, 2, 2)
    assert tuple(tensors["w2_weight_scale_inv"].shape) == (E, 2, 1)
    for i, frac in enumerate(COLD_FRACTIONS):
        _check_split_equals_unsplit(tensors, torch.float32, 33, 8, frac, True, seed=200 + i)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel", "int4_act_order_asym"])
def test_grouped_mm_split_bit_identical_to_its_unsplit(fmt: str) -> None:
    """The grouped implementation dequantizes a tier whole: still the unsplit call's bits, close to the loop."""
    tensors = _layer(fmt)
    for i, frac in enumerate((0.0, 0.5, 1.0)):
        _check_split_equals_unsplit(tensors, torch.float32, 24, 6, frac, True, seed=300 + i, impl="grouped_mm")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, H, generator=g)
    ids, weights, _, _ = moe.routing_case(24, 6, E, 0.0, False, g)
    grouped = torch_ref.unsplit(x, tensors, weights, ids, impl="grouped_mm")
    loop = torch_ref.unsplit(x, tensors, weights, ids)
    assert (grouped - loop).norm() <= 1e-5 * loop.norm()


def test_biases_need_the_loop() -> None:
    x = torch.randn(4, H)
    ids, weights, _, _ = moe.routing_case(4, 4, E, 0.0, False, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="impl='loop' only"):
        torch_ref.unsplit(x, _layer("fp8_block_bias"), weights, ids, impl="grouped_mm")


def test_every_map_gives_the_same_bits() -> None:
    tensors = _layer("int4_act_order_asym")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, H, generator=g).to(torch.bfloat16)
    ids, weights, _, _ = moe.routing_case(33, 8, E, 0.0, False, g)
    outs = []
    for frac in (0.0, 1.0, 0.25, 0.75):
        perm = torch.randperm(E, generator=g)
        hot_rows = E - round(E * frac)
        hot, cold = quant.rehome_tensors(tensors, perm[:hot_rows], perm[hot_rows:])
        row_map = moe.row_map_tensor(E, perm[:hot_rows].tolist(), perm[hot_rows:].tolist())
        outs.append(torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantized_weights_are_close_to_the_float_ones_and_per_expert(fmt: str) -> None:
    kind, options = FORMATS[fmt]
    tensors = _layer(fmt)
    scheme = scheme_of(tensors)
    assert scheme.kind == kind
    original = quant.float_layer(E, H, INTER, 0, torch.bfloat16, bias=bool(options.get("bias")))
    for side in ("w13", "w2"):
        dense = dequant(tensors, scheme, side, torch.float32)
        w = original[f"{side}_weight"].float()
        assert dense.shape == w.shape
        err = float((dense - w).norm() / w.norm())
        assert err <= DEQUANT_TOLERANCE[kind], f"{fmt} {side}: relative error {err:.4f}"
        if kind != "none":
            assert err > 0  # really quantized
        for e in (0, 5, E - 1):  # one expert alone has the bits of its row of the whole layer
            assert torch.equal(dequant_expert(tensors, scheme, e, side, torch.float32), dense[e])
            one = {name: t[e : e + 1] for name, t in tensors.items()}
            assert torch.equal(dequant(one, scheme_of(one), side, torch.float32)[0], dense[e])


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "fp8_channel", "int4_sym", "int4_bias"])
def test_quantized_layer_output_is_close_to_the_float_layer(fmt: str) -> None:
    """The dequantized weights are wired into the right GEMMs: the layer's output tracks the float layer's."""
    kind, options = FORMATS[fmt]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(32, H, generator=g)
    ids, weights, _, _ = moe.routing_case(32, 8, E, 0.0, False, g)
    original = {n: t.float() for n, t in quant.float_layer(E, H, INTER, 0, bias=bool(options.get("bias"))).items()}
    want = torch_ref.unsplit(x, original, weights, ids)
    got = torch_ref.unsplit(x, _layer(fmt), weights, ids)
    err = float((got - want).norm() / want.norm())
    assert err <= 2 * DEQUANT_TOLERANCE[kind], f"{fmt}: relative output error {err:.4f}"


NEGATIVE = [
    ("fp8_block", "w13_weight_scale_inv"),
    ("fp8_block", "w2_weight_scale_inv"),
    ("fp8_tensor", "w13_weight_scale"),
    ("fp8_channel", "w2_weight_scale"),
    ("int4_act_order_asym", "w13_scales"),
    ("int4_act_order_asym", "w13_qzeros"),
    ("int4_act_order_asym", "w13_g_idx"),
    ("int4_act_order_asym", "w2_scales"),
    ("fp8_block_bias", "w13_bias"),
    ("int4_bias", "w2_bias"),
]


@pytest.mark.parametrize(("fmt", "name"), NEGATIVE)
def test_a_tensor_left_unsplit_diverges(fmt: str, name: str) -> None:
    """Negative control: the weights split by the map but one per-expert tensor's cold rows taken from other
    experts (as if it had not been re-homed) must change the output, so the bitwise checks above can fail."""
    tensors = _layer(fmt)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(32, H, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(32, 3, E, 0.5, False, g)
    ref = torch_ref.unsplit(x, tensors, weights, ids)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    assert torch.equal(torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows), ref)
    cold_experts = moe.experts_by_row(row_map)[hot_rows:]
    cold[name] = tensors[name].index_select(0, torch.roll(cold_experts, 1))  # each cold row: another expert's
    out = torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows)
    assert not torch.equal(out, ref)
    hot_only = (row_map.to(torch.int64)[ids] < hot_rows).all(1)  # tokens routed to hot experts only still agree
    assert hot_only.any() and not hot_only.all()
    assert torch.equal(out[hot_only], ref[hot_only])


def test_int4_symmetric_zero_and_sequential_groups_are_the_defaults() -> None:
    """Without qzeros the zero point is 8 (stored 7 + 1), without g_idx the groups are sequential: a symmetric,
    sequential layer dequantizes to the same bits with or without them."""
    tensors = _layer("int4_sym")
    assert int(tensors["w13_qzeros"][0, 0, 0]) == 0x77777777  # every nibble 7: z = 8 after the +1
    bare = {n: t for n, t in tensors.items() if not n.endswith(("_qzeros", "_g_idx"))}
    full_scheme, bare_scheme = scheme_of(tensors), scheme_of(bare)
    assert (full_scheme.zeros, full_scheme.g_idx, bare_scheme.zeros, bare_scheme.g_idx) == (True, True, False, False)
    for side in ("w13", "w2"):
        assert torch.equal(dequant(tensors, full_scheme, side, torch.float32),
                           dequant(bare, bare_scheme, side, torch.float32))


def test_scheme_of_refuses_an_unknown_per_expert_tensor_naming_it() -> None:
    tensors = {**_layer("fp8_block"), "w13_weight_zero_point": torch.zeros(E, 4)}
    with pytest.raises(ValueError, match=r"w13_weight_zero_point \(shape \(16, 4\), dtype torch\.float32\)"):
        scheme_of(tensors)
    with pytest.raises(ValueError, match="w13_weight_zero_point"):
        quant.rehome_tensors(tensors, range(8), range(8, E))
    with pytest.raises(ValueError, match=r"global_scale \(shape \(\), dtype torch\.float32\)"):
        scheme_of({**_layer("none"), "global_scale": torch.tensor(1.0)})  # an unknown scalar is refused too


def test_a_shared_scalar_passes_unsplit_to_both_tiers() -> None:
    shared = {"w13_input_scale": torch.tensor(0.5), "w2_input_scale": torch.tensor([0.25])}
    tensors = {**_layer("fp8_tensor"), **shared}
    scheme = scheme_of(tensors)
    assert scheme.kind == "fp8_tensor" and scheme.shared == ("w13_input_scale", "w2_input_scale")
    assert not set(scheme.shared) & set(scheme.per_expert)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, H, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(20, 4, E, 0.5, True, g)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    for name, t in shared.items():
        assert hot[name] is t and cold[name] is t
    assert hot["w13_weight"].shape[0] == hot_rows and cold["w13_weight"].shape[0] == E - hot_rows
    out = torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows)
    ref = torch_ref.unsplit(x, tensors, weights, ids)
    assert torch.equal(out, ref)
    assert torch.equal(ref, torch_ref.unsplit(x, _layer("fp8_tensor"), weights, ids))  # weight-dequant only
    with pytest.raises(ValueError, match=r"w13_input_scale \(shape \(16,\).*must be a scalar"):
        scheme_of({**_layer("fp8_tensor"), "w13_input_scale": torch.ones(E)})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("w2_weight_scale_inv"), r"lacks \['w2_weight_scale_inv'\]"),
        (lambda t: t.update(w13_weight_scale_inv=torch.ones(E, 4, 4)),
         r"w13_weight_scale_inv \(shape \(16, 4, 4\).*expected shape \(16, 2, 2\)"),
        (lambda t: t.update(w13_qzeros=torch.zeros(E, 2, 32, dtype=torch.int32)), "more than one quantization format"),
        (lambda t: t.update(w13_bias=torch.zeros(E, 2 * INTER)), r"lacks \['w2_bias'\]"),
        (lambda t: t.update(w2_weight=t["w2_weight"][:, :, :64]), r"w2_weight \(shape \(16, 256, 64\)"),
    ],
    ids=["missing-scale", "wrong-block-shape", "mixed-formats", "one-bias", "w2-mismatch"],
)
def test_scheme_of_refuses_what_does_not_fit(change, message) -> None:
    tensors = dict(_layer("fp8_block"))
    change(tensors)
    with pytest.raises(ValueError, match=message):
        scheme_of(tensors)


def test_scheme_of_refuses_marlin_layouts_and_surplus_tensors() -> None:
    tensors = dict(_layer("int4_sym"))
    marlin = {**tensors, "w13_qweight": torch.zeros(E, H // 16, 4 * INTER, dtype=torch.int32),
              "w2_qweight": torch.zeros(E, INTER // 16, 2 * H, dtype=torch.int32)}  # Marlin's repacked shapes
    with pytest.raises(ValueError, match="w2_qweight"):
        scheme_of(marlin)
    with pytest.raises(ValueError, match=r"w13_weight .*do not belong to a 'int4_group' layer"):
        scheme_of({**tensors, "w13_weight": torch.zeros(E, 2 * INTER, H)})
    with pytest.raises(ValueError, match="one side only"):
        scheme_of({n: t for n, t in tensors.items() if n != "w2_g_idx"})
    with pytest.raises(ValueError, match="kind must be one of"):
        QuantScheme("int8")


def test_expert_parallel_rank_matches_unsplit_with_expert_map() -> None:
    """A rank holding half the experts: the other experts are in neither tier (row map -1), and the split equals
    the unsplit call over the rank's rows with vLLM's expert_map."""
    tensors = _layer("int4_act_order_asym")
    local = torch.arange(0, E, 2)
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(local.numel(), dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, H, generator=g)
    ids, weights, _, _ = moe.routing_case(40, 6, E, 0.0, False, g)
    ref = torch_ref.unsplit(x, {n: t[local] for n, t in tensors.items()}, weights, ids, expert_map)
    hot_ids, cold_ids = local[[1, 3, 4]], local[[0, 2, 5, 6, 7]]
    hot, cold = quant.rehome_tensors(tensors, hot_ids, cold_ids)
    row_map = moe.row_map_tensor(E, hot_ids.tolist(), cold_ids.tolist())
    assert torch.equal(torch_ref.split(x, hot, cold, weights, ids, row_map, len(hot_ids)), ref)
    assert not torch.equal(ref, torch_ref.unsplit(x, tensors, weights, ids))  # the non-local slots mattered


def _apply_args(x, weights, ids, a1q_scale=None) -> dict:
    return dict(output=torch.empty_like(x, dtype=torch.float32), hidden_states=x, w1=None, w2=None,
                topk_weights=weights, topk_ids=ids, activation="silu", global_num_experts=E, expert_map=None,
                a1q_scale=a1q_scale, a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=False)


@pytest.mark.parametrize("fmt", ["fp8_block", "int4_bias"])
def test_the_split_passes_every_per_expert_tensor(fmt: str) -> None:
    tensors = _layer(fmt)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, H, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(12, 4, E, 0.5, True, g)
    layer = moe.SplitLayerStub(*_tiers(tensors, row_map, hot_rows), row_map, hot_rows)
    apply = torch_ref.TorchRefSplit(object(), layer).apply
    args = _apply_args(x, weights, ids)
    apply(**args)
    assert torch.equal(args["output"], torch_ref.unsplit(x, tensors, weights, ids))
    assert int(layer.token_counts) == 12
    assert torch.equal(layer.expert_counts, torch.bincount(ids.reshape(-1), minlength=E))
    assert int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())
    with pytest.raises(RuntimeError, match="does not model activation quantization"):
        apply(**_apply_args(x, weights, ids, a1q_scale=torch.ones(12, 1)))
    with pytest.raises(RuntimeError, match="does not model activation quantization"):
        apply(**_apply_args(x.to(torch.float8_e4m3fn), weights, ids))


def test_the_split_refuses_tiers_it_cannot_split() -> None:
    tensors = _layer("fp8_block")
    _, _, row_map, hot_rows = moe.routing_case(1, 1, E, 0.5, False, torch.Generator().manual_seed(2))
    layer = moe.SplitLayerStub(*_tiers(tensors, row_map, hot_rows), row_map, hot_rows)
    layer.cold.pop("w13_weight_scale_inv")
    with pytest.raises(ValueError, match="lacks"):
        torch_ref.TorchRefSplit(object(), layer)
    layer = moe.SplitLayerStub(*_tiers(tensors, row_map, hot_rows), row_map, hot_rows)
    layer.hot["w13_awq_zeros"] = torch.zeros(hot_rows, 3, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"w13_awq_zeros \(shape \(8, 3\), dtype torch\.int8\)"):
        torch_ref.TorchRefSplit(object(), layer)
    assert set(torch_ref.REQUIRED_TENSORS) <= set(torch_ref.SPLIT_TENSORS)
    assert {"w13_weight_scale_inv", "w13_qweight", "w13_qzeros", "w13_g_idx", "w2_bias"} <= set(
        torch_ref.SPLIT_TENSORS)


def test_the_mapping_form_of_an_unquantized_layer_is_the_tensor_form() -> None:
    """``unsplit(x, tensors, ...)`` / ``split(x, hot, cold, ...)`` over ``w13_weight``/``w2_weight`` give the bits of
    the original ``unsplit(x, w13, w2, ...)`` / ``split(x, w13_hot, w2_hot, w13_cold, w2_cold, ...)``."""
    tensors = _layer("none")
    g = torch.Generator().manual_seed(12)
    x = torch.randn(24, H, generator=g).to(torch.bfloat16)
    ids, weights, row_map, hot_rows = moe.routing_case(24, 6, E, 0.5, True, g)
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    ref = torch_ref.unsplit(x, w13, w2, weights, ids)
    assert torch.equal(torch_ref.unsplit(x, tensors, weights, ids), ref)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    legacy = torch_ref.split(x, hot["w13_weight"], hot["w2_weight"], cold["w13_weight"], cold["w2_weight"], weights,
                             ids, row_map, hot_rows)
    assert torch.equal(legacy, ref)
    assert torch.equal(torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows), ref)


def test_each_tier_computes_only_its_own_slots() -> None:
    tensors = _layer("int4_act_order_asym")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(20, H, generator=g)
    ids, _, row_map, hot_rows = moe.routing_case(20, 4, E, 0.5, True, g)
    hot_ids, cold_ids = partition_torch(ids, row_map, hot_rows)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    nan = torch.full((20, 4, H), float("nan"))
    hot_only = torch_ref.tier_rows(x, hot, hot_ids, out=nan.clone())
    assert torch.equal(torch.isnan(hot_only).all(-1), hot_ids < 0)  # cold slots untouched
    cold_only = torch_ref.tier_rows(x, cold, cold_ids, out=nan.clone())
    assert torch.equal(torch.isnan(cold_only).all(-1), cold_ids < 0)
    assert not torch.isnan(hot_only[hot_ids >= 0]).any() and not torch.isnan(cold_only[cold_ids >= 0]).any()


def test_the_layer_builder_refuses_a_kind_it_does_not_build() -> None:
    """The reference reads more kinds than this builder writes (the 4-bit ones have builders in
    test_backends_4bit_ref.py): asking it for one must fail, not hand back a layer in another format."""
    for kind in ("mxfp4", "nvfp4", "int4_awq"):
        with pytest.raises(ValueError, match=f"got '{kind}'"):
            quant.quantized_layer(kind, 4, 64, 64, seed=0)
