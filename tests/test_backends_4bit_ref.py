"""Torch reference over the three 4-bit expert formats (mxfp4, nvfp4, AWQ int4): the dequantization is right, and
a split by any row map is bit-identical to the unsplit call.

(a) Each dequantizer is checked against an independent decode: hand-made bytes with known values (nibble 0x7 is
6.0, 0xF is -6.0, ue8m0 127 is 1.0, AWQ's word 0x76543210 holds columns [0, 4, 1, 5, 2, 6, 3, 7]) and a
pure-Python decode of one expert's random bytes. (b) The split equals the unsplit call bit for bit (torch.equal)
for maps with 0 %, part and 100 % of the experts cold and for adversarial maps whose every token straddles the
tiers, in fp32 and bf16. (c) Negative controls: a per-expert tensor (a block scale, nvfp4's global scale,
mxfp4's bias) whose cold rows come from other experts must change the output, so the bitwise checks can fail.
Layers are random bytes in vLLM 0.34's post-load layouts (:mod:`pinsidecar_hook.kernels.dequant`). CPU only.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.kernels.dequant import (
    AWQ_PACK_ORDER,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequant,
    dequant_expert,
    scheme_of,
)

from pinsidecar.testing import moe, quant

E, H = 8, 64
AWQ_GROUP = 32
# id -> (kind, intermediate size, builder options, activation)
FORMATS = {
    "mxfp4_gpt_oss": ("mxfp4", 64, {"bias": True}, "swigluoai"),
    "mxfp4_silu": ("mxfp4", 128, {}, "silu"),
    "nvfp4": ("nvfp4", 32, {"input_scales": True}, "silu"),
    "nvfp4_scale2_per_expert": ("nvfp4", 48, {"scale_2_shards": 1}, "silu"),
    "awq": ("int4_awq", 128, {}, "silu"),
    "awq_bias": ("int4_awq", 32, {"bias": True}, "silu"),
}
COLD_FRACTIONS = (0.0, 0.25, 0.5, 1.0)
STEPS = ((1, 2), (17, 3), (40, 4))  # (tokens, top-k)
AUTOAWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: nibble i of a word holds column order[i]


# --- layers: random bytes in vLLM's post-load layouts --------------------------------------------------------------

def _bias(g: torch.Generator, inter: int) -> dict[str, torch.Tensor]:
    return {"w13_bias": (torch.randn(E, 2 * inter, generator=g) / 4).to(torch.bfloat16),
            "w2_bias": (torch.randn(E, H, generator=g) / 4).to(torch.bfloat16)}


def _bytes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def mxfp4_layer(inter: int, seed: int, *, bias: bool = False) -> dict[str, torch.Tensor]:
    """gpt-oss's pre-swizzle tensors: packed e2m1 ``[E, N, K/2]``, ue8m0 bytes ``[E, N, K/32]`` near 2^-5."""
    g = torch.Generator().manual_seed(seed)
    layer = {"w13_weight": _bytes(g, E, 2 * inter, H // 2), "w2_weight": _bytes(g, E, H, inter // 2)}
    for side, (n, k) in {"w13": (2 * inter, H), "w2": (H, inter)}.items():
        layer[f"{side}_weight_scale"] = torch.randint(119, 125, (E, n, k // MXFP4_BLOCK), generator=g,
                                                      dtype=torch.int32).to(torch.uint8)
    return {**layer, **(_bias(g, inter) if bias else {})}


def nvfp4_layer(inter: int, seed: int, *, input_scales: bool = False,
                scale_2_shards: int = 2) -> dict[str, torch.Tensor]:
    """ModelOpt's loaded tensors: packed e2m1, e4m3 block scales ``[E, N, K/16]``, per-expert global scales
    ``w13_weight_scale_2 [E, 2]`` (or ``[E]``) and ``w2_weight_scale_2 [E]``, each expert's its own."""
    g = torch.Generator().manual_seed(seed)
    layer = {"w13_weight": _bytes(g, E, 2 * inter, H // 2), "w2_weight": _bytes(g, E, H, inter // 2)}
    for side, (n, k) in {"w13": (2 * inter, H), "w2": (H, inter)}.items():
        block = (torch.rand(E, n, k // NVFP4_BLOCK, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
        layer[f"{side}_weight_scale"] = block
    def global_scale(*shape: int) -> torch.Tensor:  # 2^-4 .. 2^-8 times a mantissa: distinct for every expert
        return 2.0 ** -torch.randint(4, 9, shape, generator=g).float() * (1 + torch.rand(*shape, generator=g))

    gs13 = global_scale(E, 2)
    layer["w13_weight_scale_2"] = gs13 if scale_2_shards == 2 else gs13[:, 0].contiguous()
    layer["w2_weight_scale_2"] = global_scale(E)
    if input_scales:
        layer["w13_input_scale"] = torch.rand(E, 2, generator=g) + 0.5
        layer["w2_input_scale"] = torch.rand(E, generator=g) + 0.5
    return layer


def _words(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)


def awq_layer(inter: int, seed: int, *, bias: bool = False) -> dict[str, torch.Tensor]:
    """AutoAWQ's tensors as ``AutoAWQMoEMethod`` loads them: ``qweight [E, K, N/8]``, ``scales [E, K/g, N]`` fp16,
    ``qzeros [E, K/g, N/8]``."""
    g = torch.Generator().manual_seed(seed)
    layer: dict[str, torch.Tensor] = {}
    for side, (n, k) in {"w13": (2 * inter, H), "w2": (H, inter)}.items():
        layer[f"{side}_qweight"] = _words(g, E, k, n // 8)
        layer[f"{side}_scales"] = ((torch.rand(E, k // AWQ_GROUP, n, generator=g) + 0.5) / (8 * k**0.5)).half()
        layer[f"{side}_qzeros"] = _words(g, E, k // AWQ_GROUP, n // 8)
    return {**layer, **(_bias(g, inter) if bias else {})}


_BUILDERS = {"mxfp4": mxfp4_layer, "nvfp4": nvfp4_layer, "int4_awq": awq_layer}


@functools.cache
def _layer(fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    kind, inter, options, _ = FORMATS[fmt]
    return _BUILDERS[kind](inter, seed, **options)


def _tiers(tensors, row_map, hot_rows):
    order = moe.experts_by_row(row_map)
    return quant.rehome_tensors(tensors, order[:hot_rows], order[hot_rows:])


# --- (a) the dequantization against an independent decode -----------------------------------------------------------

def _e2m1(nibble: int) -> float:
    """OCP e2m1 from its bits: sign (bit 3), a 2-bit exponent of bias 1, one mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign, exponent, mantissa = (nibble >> 3) & 1, (nibble >> 1) & 3, nibble & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def _decode_fp4_expert(weight: torch.Tensor, block_scales: list[list[float]], block: int) -> torch.Tensor:
    """One expert's ``[N, K/2]`` bytes, the low nibble first, times the given per-block scales: a Python loop."""
    rows = []
    for n, row in enumerate(weight.tolist()):
        values = [v for byte in row for v in (_e2m1(byte & 0xF), _e2m1(byte >> 4))]
        rows.append([v * block_scales[n][k // block] for k, v in enumerate(values)])
    return torch.tensor(rows, dtype=torch.float32)


def test_e2m1_and_ue8m0_hand_made_bytes() -> None:
    tensors = {n: torch.zeros_like(t) for n, t in mxfp4_layer(32, 0).items()}
    tensors["w13_weight_scale"][3].fill_(127)  # 2^0
    tensors["w13_weight_scale"][3, 1, 1] = 128  # 2^1 for k in [32, 64) of row 1
    tensors["w13_weight_scale"][3, 2, 0] = 125  # 2^-2
    tensors["w13_weight"][3, 0, :4] = torch.tensor([0x7F, 0x21, 0x5A, 0xC3], dtype=torch.uint8)
    tensors["w13_weight"][3, 1, 16] = 0x4B  # k = 32, 33: in the 2^1 block
    tensors["w13_weight"][3, 2, 0] = 0x06  # 4.0 * 2^-2
    w = dequant_expert(tensors, scheme_of(tensors), 3, "w13", torch.float32)
    assert w[0, :8].tolist() == [-6.0, 6.0, 0.5, 1.0, -1.0, 3.0, 1.5, -2.0]  # 0xC: sign, exponent 2, mantissa 0
    assert w[1, 32:34].tolist() == [-3.0, 4.0]  # 0xB = -1.5, 0x4 = 2.0, times 2
    assert w[2, :2].tolist() == [1.0, 0.0]
    assert int(torch.count_nonzero(w)) == 11  # nothing else: zero bytes are 0.0 at any scale
    assert not dequant_expert(tensors, scheme_of(tensors), 2, "w13", torch.float32).any()  # another expert's rows
    tensors["w2_weight_scale"][0, 0, 0] = 255  # e8m0's NaN
    tensors["w2_weight"][0, 0, 0] = 0x11
    assert torch.isnan(dequant_expert(tensors, scheme_of(tensors), 0, "w2", torch.float32)[0, 0])


@pytest.mark.parametrize("side", ["w13", "w2"])
def test_mxfp4_matches_a_python_decode(side: str) -> None:
    tensors = _layer("mxfp4_gpt_oss")
    e = 5
    scales = [[2.0 ** (s - 127) for s in row] for row in tensors[f"{side}_weight_scale"][e].tolist()]
    want = _decode_fp4_expert(tensors[f"{side}_weight"][e], scales, MXFP4_BLOCK)
    assert torch.equal(dequant_expert(tensors, scheme_of(tensors), e, side, torch.float32), want)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_scale2_per_expert"])
@pytest.mark.parametrize("side", ["w13", "w2"])
def test_nvfp4_matches_a_python_decode(fmt: str, side: str) -> None:
    tensors = _layer(fmt)
    e = 6
    block = tensors[f"{side}_weight_scale"][e].float()
    scale_2 = tensors[f"{side}_weight_scale_2"][e].float()
    n = block.shape[0]
    # w13's [2] (gate, up) per row half, else one scale for every row
    per_row = [float(scale_2[0 if r < n // 2 else 1]) if scale_2.numel() == 2 else float(scale_2) for r in range(n)]
    # vLLM's order: the e4m3 block scale times the global scale in fp32, then times the value
    scales = [[float(torch.tensor(b, dtype=torch.float32) * torch.tensor(per_row[r], dtype=torch.float32))
               for b in row] for r, row in enumerate(block.tolist())]
    want = _decode_fp4_expert(tensors[f"{side}_weight"][e], scales, NVFP4_BLOCK)
    assert torch.equal(dequant_expert(tensors, scheme_of(tensors), e, side, torch.float32), want)


def test_nvfp4_gate_and_up_rows_take_their_own_global_scale() -> None:
    tensors = {n: torch.zeros_like(t) for n, t in nvfp4_layer(32, 0).items()}
    tensors["w13_weight_scale"][2] = torch.tensor(0.5).to(torch.float8_e4m3fn)
    tensors["w13_weight_scale_2"][2] = torch.tensor([0.25, 4.0])
    tensors["w13_weight"][2, 0, 0] = 0x07  # gate row 0: 6.0, then 0.0
    tensors["w13_weight"][2, 32, 0] = 0xF0  # up row 0 (I = 32): 0.0, then -6.0
    w = dequant_expert(tensors, scheme_of(tensors), 2, "w13", torch.float32)
    assert w[0, :2].tolist() == [6.0 * 0.5 * 0.25, 0.0]
    assert w[32, :2].tolist() == [0.0, -6.0 * 0.5 * 4.0]
    assert int(torch.count_nonzero(w)) == 2


def _autoawq_pack(columns: list[int]) -> int:
    """AutoAWQ's packer for one int32 of eight output columns (nibble i holds column AUTOAWQ_PACK_ORDER[i])."""
    word = 0
    for i, col in enumerate(AUTOAWQ_PACK_ORDER):
        word |= columns[col] << (4 * i)
    return word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32


def test_awq_pack_order_and_zero_points_hand_made() -> None:
    assert _autoawq_pack([0, 4, 1, 5, 2, 6, 3, 7]) == 0x76543210  # AWQ_PACK_ORDER is the inverse of the packer's
    assert tuple(AUTOAWQ_PACK_ORDER[c] for c in AWQ_PACK_ORDER) == tuple(range(8))
    tensors = {n: torch.zeros_like(t) for n, t in awq_layer(32, 0).items()}
    tensors["w13_scales"][1].fill_(1.0)
    tensors["w13_scales"][1, 1, 8:16] = 0.5  # group 1 (k in [32, 64)), columns 8..15
    tensors["w13_qweight"][1, 0, 0] = 0x76543210
    tensors["w13_qweight"][1, 40, 1] = _autoawq_pack(list(range(8, 16)))  # a negative int32: the top nibble is 15
    tensors["w13_qzeros"][1, 1, 1] = _autoawq_pack([8] * 8)  # zero point 8 as stored (no +1, unlike GPTQ)
    w = dequant_expert(tensors, scheme_of(tensors), 1, "w13", torch.float32)  # [2I, H] = [N, K]
    assert w[:8, 0].tolist() == [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    assert w[8:16, 40].tolist() == [(v - 8) * 0.5 for v in range(8, 16)]
    others = [k for k in range(32, 64) if k != 40]  # the group's zero point applies to its every input row
    assert bool((w[8:16, others] == -4.0).all())
    assert int(torch.count_nonzero(w)) == 7 + 7 + 8 * len(others)  # nothing else: group 0 has zero point 0


def test_awq_matches_a_python_decode() -> None:
    tensors = _layer("awq")
    e, side = 4, "w2"
    qweight, qzeros = tensors[f"{side}_qweight"][e].tolist(), tensors[f"{side}_qzeros"][e].tolist()
    scales = tensors[f"{side}_scales"][e].float().tolist()

    def nibble(words: list[int], col: int) -> int:  # column col of a row packed by AutoAWQ
        word = words[col // 8] & 0xFFFFFFFF
        return (word >> (4 * AUTOAWQ_PACK_ORDER.index(col % 8))) & 0xF

    k_dim, n_dim = len(qweight), len(scales[0])
    want = torch.tensor([[(nibble(qweight[k], n) - nibble(qzeros[k // AWQ_GROUP], n)) * scales[k // AWQ_GROUP][n]
                          for k in range(k_dim)] for n in range(n_dim)], dtype=torch.float32)
    assert torch.equal(dequant_expert(tensors, scheme_of(tensors), e, side, torch.float32), want)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_scheme_and_per_expert_dequant(fmt: str) -> None:
    kind, inter, options, _ = FORMATS[fmt]
    tensors = _layer(fmt)
    scheme = scheme_of(tensors)
    assert scheme.kind == kind and scheme.bias == bool(options.get("bias"))
    assert set(scheme.per_expert) == set(tensors)  # every tensor is per-expert (nvfp4's input scales included)
    assert scheme.shared == ()
    if kind == "int4_awq":
        assert scheme.group_size == AWQ_GROUP
    for side, shape in {"w13": (E, 2 * inter, H), "w2": (E, H, inter)}.items():
        dense = dequant(tensors, scheme, side, torch.float32)
        assert dense.shape == shape and torch.isfinite(dense).all() and dense.abs().max() > 0
        for e in (0, 3, E - 1):  # one expert alone has the bits of its row of the whole layer
            assert torch.equal(dequant_expert(tensors, scheme, e, side, torch.float32), dense[e])
            one = {name: t[e : e + 1] for name, t in tensors.items()}
            assert torch.equal(dequant(one, scheme_of(one), side, torch.float32)[0], dense[e])


# --- the gpt-oss activation --------------------------------------------------------------------------------------

def _swigluoai_vllm(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """vLLM 0.34's SwigluOAIAndMul.forward_native (model_executor/layers/activation.py:486-493), copied."""
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def test_swigluoai_is_vllms_on_interleaved_rows() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(16, 64, generator=g) * 6  # past the clamp limit too
    assert torch.equal(torch_ref.swigluoai_and_mul(h), _swigluoai_vllm(h))
    hb = h.to(torch.bfloat16)
    assert torch.equal(torch_ref.swigluoai_and_mul(hb), _swigluoai_vllm(hb.float()).to(torch.bfloat16))
    row = torch.tensor([[1.0, 2.0, 10.0, -10.0]])  # (gate 1, up 2), (gate 10 -> 7, up -10 -> -7)
    assert torch.allclose(torch_ref.swigluoai_and_mul(row),
                          torch.tensor([[3 * torch.sigmoid(torch.tensor(1.702)).item(),
                                         -6 * 7 * torch.sigmoid(torch.tensor(7 * 1.702)).item()]]))
    # the interleaved pairing differs from the [gate | up] halves
    assert not torch.equal(torch_ref.swigluoai_and_mul(h), _swigluoai_vllm(torch.cat([h[:, 0::2], h[:, 1::2]], 1)))


def test_activation_option_keeps_silu_the_default_and_refuses_the_rest() -> None:
    tensors = _layer("mxfp4_silu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=g)
    ids, weights, _, _ = moe.routing_case(9, 3, E, 0.0, False, g)
    silu = torch_ref.unsplit(x, tensors, weights, ids)
    assert torch.equal(torch_ref.unsplit(x, tensors, weights, ids, activation="silu"), silu)
    assert not torch.equal(torch_ref.unsplit(x, tensors, weights, ids, activation="swigluoai"), silu)
    with pytest.raises(ValueError, match="activation must be one of"):
        torch_ref.unsplit(x, tensors, weights, ids, activation="gelu")
    with pytest.raises(ValueError, match="impl='loop' only"):
        torch_ref.unsplit(x, tensors, weights, ids, impl="grouped_mm", activation="swigluoai")


# --- (b) split == unsplit, bit for bit ---------------------------------------------------------------------------

def _check_split_equals_unsplit(fmt, dtype, num_tokens, top_k, cold_fraction, adversarial, seed):
    tensors, activation = _layer(fmt), FORMATS[fmt][3]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=g).to(dtype)
    ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, E, cold_fraction, adversarial, g)
    ref = torch_ref.unsplit(x, tensors, weights, ids, activation=activation)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    out = torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows, activation=activation)
    case = f"{fmt} T={num_tokens} k={top_k} cold={cold_fraction} adv={adversarial} {dtype}"
    assert out.dtype == dtype
    assert torch.isfinite(ref).all() and ref.abs().max() > 0, case
    assert torch.equal(out, ref), f"split != unsplit: {case}"
    if adversarial and 0 < hot_rows < E:  # the case really straddles the tiers
        rows = row_map.to(torch.int64)[ids]
        assert bool(((rows < hot_rows).any(1) & (rows >= hot_rows).any(1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_split_bit_identical_to_unsplit(fmt: str, dtype: torch.dtype) -> None:
    maps = [(frac, adv) for frac in COLD_FRACTIONS for adv in ((False, True) if 0 < frac < 1 else (False,))]
    for i, ((frac, adversarial), (tokens, top_k)) in enumerate(itertools.product(maps, STEPS)):
        _check_split_equals_unsplit(fmt, dtype, tokens, top_k, frac, adversarial, seed=100 + i)


@pytest.mark.parametrize("fmt", ["mxfp4_gpt_oss", "nvfp4", "awq_bias"])
def test_every_map_gives_the_same_bits(fmt: str) -> None:
    tensors, activation = _layer(fmt), FORMATS[fmt][3]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, H, generator=g).to(torch.bfloat16)
    ids, weights, _, _ = moe.routing_case(33, 4, E, 0.0, False, g)
    outs = []
    for frac in (0.0, 1.0, 0.25, 0.75, 0.5):
        perm = torch.randperm(E, generator=g)
        hot_rows = E - round(E * frac)
        hot, cold = quant.rehome_tensors(tensors, perm[:hot_rows], perm[hot_rows:])
        row_map = moe.row_map_tensor(E, perm[:hot_rows].tolist(), perm[hot_rows:].tolist())
        outs.append(torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows, activation=activation))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_nvfp4_input_scales_are_split_with_their_rows() -> None:
    """Per-expert activation scales are not applied, but they are per-expert data: each tier holds its own
    experts' rows, and a 0-d scalar stays shared."""
    tensors = _layer("nvfp4")
    hot, cold = quant.rehome_tensors(tensors, [5, 1, 2], [0, 7, 3, 4, 6])
    for name in ("w13_input_scale", "w2_input_scale"):
        assert torch.equal(hot[name], tensors[name][[5, 1, 2]])
        assert torch.equal(cold[name], tensors[name][[0, 7, 3, 4, 6]])
    assert scheme_of(hot) == scheme_of(cold) == scheme_of(tensors)
    assert scheme_of(tensors).input_scales
    one_expert = {n: t[2:3] for n, t in tensors.items()}  # a tier of one keeps [1, 2] / [1]: still per-expert
    assert scheme_of(one_expert) == scheme_of(tensors)
    shared = {**{n: t for n, t in tensors.items() if "input_scale" not in n},
              "w13_input_scale": torch.tensor(0.5), "w2_input_scale": torch.tensor(0.25)}
    scheme = scheme_of(shared)
    assert not scheme.input_scales and scheme.shared == ("w13_input_scale", "w2_input_scale")
    hot, cold = quant.rehome_tensors(shared, [0, 1], [2, 3])
    assert hot["w13_input_scale"] is shared["w13_input_scale"] is cold["w13_input_scale"]


# --- (c) negative controls ---------------------------------------------------------------------------------------

def _diverges(fmt: str, name: str, corrupt) -> None:
    tensors, activation = _layer(fmt), FORMATS[fmt][3]
    g = torch.Generator().manual_seed(21)
    x = torch.randn(32, H, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(32, 2, E, 0.5, False, g)
    ref = torch_ref.unsplit(x, tensors, weights, ids, activation=activation)
    hot, cold = _tiers(tensors, row_map, hot_rows)
    assert torch.equal(torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows, activation=activation), ref)
    cold_experts = moe.experts_by_row(row_map)[hot_rows:]
    cold[name] = corrupt(tensors[name], cold[name], cold_experts)
    out = torch_ref.split(x, hot, cold, weights, ids, row_map, hot_rows, activation=activation)
    assert not torch.equal(out, ref), f"{fmt}: {name} from the wrong experts went unnoticed"
    hot_only = (row_map.to(torch.int64)[ids] < hot_rows).all(1)  # tokens routed to hot experts only still agree
    assert hot_only.any() and not hot_only.all()
    assert torch.equal(out[hot_only], ref[hot_only])


def _swap_two_rows(_full, rows, _experts):
    swapped = rows.clone()
    swapped[[0, 1]] = rows[[1, 0]]
    assert not torch.equal(swapped, rows)
    return swapped


def _left_unsplit(full, rows, _experts):
    """The tier's rows taken as if the tensor had not been re-homed: the first C experts' rows, in expert order."""
    wrong = full[: rows.shape[0]].clone()
    assert not torch.equal(wrong, rows)
    return wrong


def _from_other_experts(full, _rows, experts):
    return full.index_select(0, torch.roll(experts, 1))


NEGATIVE = [
    ("mxfp4_gpt_oss", "w13_weight_scale", _swap_two_rows),
    ("mxfp4_gpt_oss", "w2_weight_scale", _swap_two_rows),
    ("mxfp4_gpt_oss", "w13_bias", _from_other_experts),
    ("mxfp4_gpt_oss", "w2_bias", _swap_two_rows),
    ("nvfp4", "w13_weight_scale", _swap_two_rows),
    ("nvfp4", "w2_weight_scale", _swap_two_rows),
    ("nvfp4", "w13_weight_scale_2", _left_unsplit),
    ("nvfp4", "w2_weight_scale_2", _left_unsplit),
    ("nvfp4_scale2_per_expert", "w13_weight_scale_2", _from_other_experts),
    ("awq", "w13_scales", _swap_two_rows),
    ("awq", "w2_qzeros", _swap_two_rows),
    ("awq_bias", "w13_bias", _from_other_experts),
]


@pytest.mark.parametrize(("fmt", "name", "corrupt"), NEGATIVE,
                         ids=[f"{f}-{n}-{c.__name__.strip('_')}" for f, n, c in NEGATIVE])
def test_a_tensor_from_the_wrong_experts_diverges(fmt: str, name: str, corrupt) -> None:
    """Negative control: the weights split by the map but one per-expert tensor's cold rows taken from other
    experts must change the output (and only the cold tokens'), so the bitwise checks above can fail."""
    _diverges(fmt, name, corrupt)


def test_mxfp4_gate_up_interleave_matters() -> None:
    """Negative control for the activation: the gpt-oss layer read as [gate | up] halves computes another
    function, so the reference is not silently indifferent to the row order."""
    tensors = _layer("mxfp4_gpt_oss")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, H, generator=g)
    ids, weights, _, _ = moe.routing_case(8, 2, E, 0.0, False, g)
    assert not torch.equal(torch_ref.unsplit(x, tensors, weights, ids, activation="swigluoai"),
                           torch_ref.unsplit(x, tensors, weights, ids))


# --- refusals -----------------------------------------------------------------------------------------------------

def _with(fmt: str, **changes) -> dict[str, torch.Tensor]:
    tensors = dict(_layer(fmt))
    for name, t in changes.items():
        if t is None:
            tensors.pop(name)
        else:
            tensors[name] = t
    return tensors


REFUSALS = [
    ("mxfp4_k_not_32", lambda: {**mxfp4_layer(32, 0), "w13_weight": torch.zeros(E, 64, 24, dtype=torch.uint8),
                                "w13_weight_scale": torch.zeros(E, 64, 0, dtype=torch.uint8),
                                "w2_weight": torch.zeros(E, 48, 16, dtype=torch.uint8),
                                "w2_weight_scale": torch.zeros(E, 48, 1, dtype=torch.uint8)},
     r"w13_weight \(shape \(8, 64, 24\), dtype torch\.uint8\): mxfp4 needs its input dim K = H = 48 to be a "
     r"multiple of 32 \(one ue8m0 exponent per 32"),
    ("nvfp4_i_not_16", lambda: _with("nvfp4_scale2_per_expert", w2_weight=torch.zeros(E, H, 20, dtype=torch.uint8),
                                     w13_weight=torch.zeros(E, 80, H // 2, dtype=torch.uint8)),
     r"w2_weight \(shape \(8, 64, 20\), dtype torch\.uint8\): nvfp4 needs its input dim K = I = 40 to be a multiple "
     r"of 16 \(one e4m3 block scale per 16"),
    ("mxfp4_scale_block", lambda: _with("mxfp4_silu", w2_weight_scale=torch.zeros(E, H, 8, dtype=torch.uint8)),
     r"w2_weight_scale \(shape \(8, 64, 8\), dtype torch\.uint8\): expected shape \(8, 64, 4\)"),
    ("mxfp4_scale_dtype", lambda: _with("mxfp4_silu", w13_weight_scale=torch.ones(E, 256, 2)),
     r"w13_weight_scale \(shape \(8, 256, 2\), dtype torch\.float32\): expected shape \(8, 256, 2\), dtype "
     r"torch\.uint8"),
    ("nvfp4_missing_scale_2", lambda: _with("nvfp4", w2_weight_scale_2=None),
     r"'nvfp4' lacks \['w2_weight_scale_2'\]"),
    ("nvfp4_scale_2_shape", lambda: _with("nvfp4", w13_weight_scale_2=torch.ones(E, 3)),
     r"w13_weight_scale_2 \(shape \(8, 3\), dtype torch\.float32\): expected shape \(8, 2\)"),
    ("nvfp4_input_scale_one_side", lambda: _with("nvfp4", w2_input_scale=None), "for one side only"),
    ("nvfp4_input_scale_shape", lambda: _with("nvfp4", w2_input_scale=torch.ones(E + 1)),
     r"w2_input_scale \(shape \(9,\), dtype torch\.float32\): expected shape \(8,\)"),
    ("mxfp4_per_expert_input_scale", lambda: _with("mxfp4_silu", w13_input_scale=torch.ones(E),
                                                   w2_input_scale=torch.ones(E)),
     r"w13_input_scale \(shape \(8,\).*must be a scalar"),
    ("mxfp4_plus_qzeros", lambda: _with("mxfp4_silu", w13_qzeros=torch.zeros(E, 2, 32, dtype=torch.int32)),
     "more than one quantization format"),
    ("awq_qzeros_missing", lambda: _with("awq", w2_qzeros=None), r"'int4_awq' lacks \['w2_qzeros'\]"),
    ("awq_qzeros_shape", lambda: _with("awq", w13_qzeros=torch.zeros(E, 2, 16, dtype=torch.int32)),
     r"w13_qzeros \(shape \(8, 2, 16\), dtype torch\.int32\): expected shape \(8, 2, 32\)"),
    ("awq_w2_shape", lambda: _with("awq", w2_qweight=torch.zeros(E, 128, 4, dtype=torch.int32)),
     r"w2_qweight \(shape \(8, 128, 4\), dtype torch\.int32\): expected shape \(8, 128, 8\)"),
    ("awq_g_idx", lambda: _with("awq", w13_g_idx=torch.zeros(E, H, dtype=torch.int32),
                                w2_g_idx=torch.zeros(E, 128, dtype=torch.int32)),
     r"w13_g_idx .*do not belong to a 'int4_awq' layer"),
]


@pytest.mark.parametrize(("build", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_scheme_of_refuses_a_wrong_geometry_naming_the_tensor(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        scheme_of(build())
