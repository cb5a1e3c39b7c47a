"""The 4-bit twins of the demo model (``pinsidecar demo-model DIR --quant awq-int4|nvfp4|mxfp4``).

Each quantizer is checked with independent code here, in plain torch: hand-computed bytes for a few values, and a
round trip (quantize, then dequantize the way vLLM reads the format) close to the bf16 weights. Each written
checkpoint is checked against the names, shapes and dtypes vLLM 0.34's loader expects, written below as data
(read from /work/vllm-src/0.34: ``models/gpt_oss.py`` and ``quantization/mxfp4.py`` for gpt-oss;
``quantization/modelopt.py`` ``ModelOptNvFp4FusedMoE.create_weights`` for NVFP4; ``quantization/auto_awq.py``
``AutoAWQMoEMethod.create_weights`` for AWQ), and transformers must parse each config.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from pinsidecar.cli import main
from pinsidecar.demo import model as dm
from pinsidecar.demo import quant as dq
from pinsidecar.demo import quant_fp4 as fp4

# hidden and expert intermediate on the 128 grid (AWQ's groups); small enough to write in about a second.
GEO = dict(hidden=256, layers=2, experts=16, top_k=4, expert_intermediate=128)
H, INTER, E, L = GEO["hidden"], GEO["expert_intermediate"], GEO["experts"], GEO["layers"]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        assert set(json.loads(index.read_text())["weight_map"]) == set(out)
    return out


@pytest.fixture(scope="module")
def twins(demo_model_factory: Callable[..., Path]) -> dict[str, Path]:
    return {q: demo_model_factory(geometry=GEO, quant=None if q == "bf16" else q)
            for q in ("bf16", "awq-int4", "nvfp4", "mxfp4")}


# ------------------------------------------------------------------------------------------------------ e2m1


def _decode(code: int) -> float:
    """Independent e2m1 decode: sign bit 3, exponent bits 2..1, mantissa bit 0 (bias 1; exponent 0 subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def test_e2m1_codes_round_to_nearest_with_ties_to_even() -> None:
    assert [_decode(c) for c in range(8)] == E2M1
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0, -1.0, -0.1, -6.0])
    # 0.25 -> 0 (code 0 even), 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0;
    # above 6 saturates; a negative that rounds to zero is +0 (code 0).
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, 0.0, -6.0]
    codes = fp4.e2m1_codes(x)
    assert [_decode(int(c)) for c in codes] == want
    assert int(codes[-3]) == 0b1010 and int(codes[-2]) == 0  # -1.0: sign | exponent 1, mantissa 0


def test_fp4_packs_the_first_element_into_the_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]  # vLLM's break_fp4_bytes: low nibble first
    assert torch.equal(fp4.unpack_fp4(packed), codes)


# ------------------------------------------------------------------------------------------------------ MXFP4


def _dequant_mxfp4_independent(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's reference: lut[blk & 0xF] to even positions, lut[blk >> 4] to odd, times 2**(scale - 127)."""
    lut = torch.tensor([_decode(c) for c in range(16)])
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_hand_checked_block() -> None:
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, -0.5, 0.26, 1.6])  # amax 1.6: floor(log2 1.6) - 2 = -2, scale 0.25
    blocks, scales = fp4.quantize_mxfp4(w)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (1, 1, 16)
    assert scales.tolist() == [[127 - 2]]
    # /0.25: 4.0 (code 6), -2.0 (code 12), 1.04 -> 1.0 (code 2), 6.4 -> 6 saturated (code 7)
    assert blocks[0, 0, :2].tolist() == [0x6 | (0xC << 4), 0x2 | (0x7 << 4)]
    assert blocks[0, 0, 2:].tolist() == [0] * 14
    assert _dequant_mxfp4_independent(blocks, scales)[0, :4].tolist() == [1.0, -0.5, 0.25, 1.5]
    # An all-zero block: the smallest exponent, zero codes.
    b0, s0 = fp4.quantize_mxfp4(torch.zeros(2, 64))
    assert s0.tolist() == [[0, 0], [0, 0]] and int(b0.abs().sum()) == 0


def test_mxfp4_round_trip_is_close() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * 0.05
    w[:, 64:96] *= 30.0  # blocks with other ranges get other exponents
    blocks, scales = fp4.quantize_mxfp4(w)
    deq = _dequant_mxfp4_independent(blocks, scales)
    assert torch.equal(deq, fp4.dequantize_mxfp4(blocks, scales))
    # Per block: e2m1's spacing is at most 2 * 2**e (between 4 and 6), so |error| <= 2**e, and 2**e <= amax / 4.
    amax = w.reshape(96, 8, 32).abs().amax(-1, keepdim=True)
    err = (deq - w).reshape(96, 8, 32).abs()
    assert (err <= amax / 4 + 1e-7).all()
    assert float((deq - w).norm() / w.norm()) < 0.15


# ------------------------------------------------------------------------------------------------------ NVFP4


def test_nvfp4_hand_checked_block() -> None:
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([6.0, -3.0, 0.4])
    w[0, 16] = 0.5  # the second block: amax 0.5
    t = fp4.quantize_nvfp4(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "weight": (torch.uint8, (1, 16)), "weight_scale": (torch.float8_e4m3fn, (1, 2)),
        "weight_scale_2": (torch.float32, ())}
    s2 = 6.0 / (6 * 448)
    assert float(t["weight_scale_2"]) == pytest.approx(s2, rel=1e-7)
    # block 0: amax / 6 / s2 = 448 exactly (e4m3's max); block 1: 0.5 / 6 / s2 = 37.33 -> e4m3 36 (step 4 at 32..64)
    assert t["weight_scale"].float().tolist() == [[448.0, 36.0]]
    # block 0 decodes with 448 * s2 = 1.0: 6 -> code 7, -3 -> code 13, 0.4 -> 0.5 (code 1)
    assert t["weight"][0, :2].tolist() == [0x7 | (0xD << 4), 0x1]
    deq = fp4.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    assert deq[0, :3].tolist() == pytest.approx([6.0, -3.0, 0.5])
    assert float(deq[0, 16]) == pytest.approx(6.0 * 36 * s2)  # 0.5 / (36 * s2) = 6.2: saturates to 6


def test_nvfp4_round_trip_is_close() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen) * 0.05
    w[:, :16] *= 0.01  # a block far below the tensor's amax still gets its own e4m3 scale
    t = fp4.quantize_nvfp4(w)
    lut = torch.tensor([_decode(c) for c in range(16)])
    codes = torch.stack(((t["weight"] & 0xF).long(), (t["weight"] >> 4).long()), -1).reshape(64, 256)
    deq = lut[codes] * t["weight_scale"].float().repeat_interleave(16, dim=1) * t["weight_scale_2"]
    assert torch.equal(deq, fp4.dequantize_nvfp4(**t))
    blocks = w.reshape(64, 16, 16).abs().amax(-1, keepdim=True)
    err = (deq - w).reshape(64, 16, 16).abs()
    assert (err <= blocks / 3 * 1.07 + 1e-7).all()  # half of e2m1's widest step (2, of 6), e4m3 scale rounding
    assert float((deq - w).norm() / w.norm()) < 0.15
    assert float((deq[:, :16] - w[:, :16]).norm() / w[:, :16].norm()) < 0.15


# ------------------------------------------------------------------------------------------------------ AWQ


REVERSE_AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # vLLM auto_awq.py: column j sits in nibble slot REVERSE[j]


def _unpack_awq_like_vllm(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64) & 0xFFFFFFFF
    slots = torch.stack([(p >> (4 * s)) & 0xF for s in range(8)], dim=-1)  # [rows, out/8, slot]
    return slots[..., REVERSE_AWQ_ORDER].reshape(packed.shape[0], -1)


def test_awq_packs_in_awq_order() -> None:
    values = torch.arange(8, dtype=torch.int32).reshape(1, 8) + 1  # column j holds j + 1
    packed = int(dq.pack_awq_int4(values)[0, 0]) & 0xFFFFFFFF
    # AutoAWQ: slot i holds column [0, 2, 4, 6, 1, 3, 5, 7][i], so the nibbles low to high are 1 3 5 7 2 4 6 8
    assert [(packed >> (4 * i)) & 0xF for i in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]
    assert packed == 0x86427531
    assert _unpack_awq_like_vllm(dq.pack_awq_int4(values)).tolist() == values.tolist()


def test_awq_round_trip_under_vllms_unpacking() -> None:
    gen = torch.Generator().manual_seed(2)
    out_f, in_f = 64, 256
    w = torch.randn(out_f, in_f, generator=gen) * 0.03 + 0.01  # not centred: the zero point matters
    w[:, 128:] *= 8.0
    t = dq.quantize_awq_int4(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "qweight": (torch.int32, (in_f, out_f // 8)), "qzeros": (torch.int32, (in_f // 128, out_f // 8)),
        "scales": (torch.float16, (in_f // 128, out_f))}
    q, z = _unpack_awq_like_vllm(t["qweight"]), _unpack_awq_like_vllm(t["qzeros"])
    scales = t["scales"].float()
    groups = torch.arange(in_f) // 128
    deq = (q - z[groups]).float() * scales[groups]  # [in, out]
    # AutoAWQ's quantizer: scale = (max - min) / 15 per group and output channel; within half a step.
    wt = w.t().reshape(2, 128, out_f)
    torch.testing.assert_close(scales, ((wt.amax(1) - wt.amin(1)) / 15).half().float())
    assert ((deq - w.t()).abs() <= scales[groups] * 0.5 + 1e-4).all()
    assert float((deq - w.t()).norm() / w.norm()) < 0.1


# ------------------------------------------------------------------------------------------------------ checkpoints

# vLLM 0.34's expectations, per checkpoint tensor name pattern (N: layer, X: expert): dtype and shape. AWQ:
# AutoAWQMoEMethod.create_weights allocates w13_qweight [E, H, 2I/8], w2_qweight [E, I, H/8], scales [E, H/128,
# 2I] / [E, I/128, H] fp16, qzeros [E, H/128, 2I/8] / [E, I/128, H/8]; per expert and shard that is below.
AWQ_EXPERT = {
    "gate_proj.qweight": (torch.int32, (H, INTER // 8)), "gate_proj.qzeros": (torch.int32, (H // 128, INTER // 8)),
    "gate_proj.scales": (torch.float16, (H // 128, INTER)),
    "up_proj.qweight": (torch.int32, (H, INTER // 8)), "up_proj.qzeros": (torch.int32, (H // 128, INTER // 8)),
    "up_proj.scales": (torch.float16, (H // 128, INTER)),
    "down_proj.qweight": (torch.int32, (INTER, H // 8)), "down_proj.qzeros": (torch.int32, (INTER // 128, H // 8)),
    "down_proj.scales": (torch.float16, (INTER // 128, H)),
}
# ModelOptNvFp4FusedMoE.create_weights: w13_weight [E, 2I, H/2] uint8, w13_weight_scale [E, 2I, H/16] e4m3,
# w13_weight_scale_2 [E, 2] f32, w13_input_scale [E, 2] f32; w2 the same with [E, H, I/2], [E, H, I/16], [E], [E].
NVFP4_EXPERT = {
    **{f"{p}.{k}": v for p in ("gate_proj", "up_proj") for k, v in {
        "weight": (torch.uint8, (INTER, H // 2)), "weight_scale": (torch.float8_e4m3fn, (INTER, H // 16)),
        "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}.items()},
    "down_proj.weight": (torch.uint8, (H, INTER // 2)),
    "down_proj.weight_scale": (torch.float8_e4m3fn, (H, INTER // 16)),
    "down_proj.weight_scale_2": (torch.float32, ()), "down_proj.input_scale": (torch.float32, ()),
}
# gpt_oss.py (hf_to_vllm_mapper, _load_weights_mxfp4) and mxfp4.py (GptOssMxfp4MoEMethod.create_weights).
GPT_OSS_LAYER = {
    "input_layernorm.weight": (torch.bfloat16, (H,)), "post_attention_layernorm.weight": (torch.bfloat16, (H,)),
    "self_attn.q_proj.weight": (torch.bfloat16, (8 * 32, H)), "self_attn.q_proj.bias": (torch.bfloat16, (8 * 32,)),
    "self_attn.k_proj.weight": (torch.bfloat16, (2 * 32, H)), "self_attn.k_proj.bias": (torch.bfloat16, (2 * 32,)),
    "self_attn.v_proj.weight": (torch.bfloat16, (2 * 32, H)), "self_attn.v_proj.bias": (torch.bfloat16, (2 * 32,)),
    "self_attn.o_proj.weight": (torch.bfloat16, (H, 8 * 32)), "self_attn.o_proj.bias": (torch.bfloat16, (H,)),
    "self_attn.sinks": (torch.bfloat16, (8,)),
    "mlp.router.weight": (torch.bfloat16, (E, H)), "mlp.router.bias": (torch.bfloat16, (E,)),
    "mlp.experts.gate_up_proj_blocks": (torch.uint8, (E, 2 * INTER, H // 32, 16)),
    "mlp.experts.gate_up_proj_scales": (torch.uint8, (E, 2 * INTER, H // 32)),
    "mlp.experts.gate_up_proj_bias": (torch.bfloat16, (E, 2 * INTER)),
    "mlp.experts.down_proj_blocks": (torch.uint8, (E, H, INTER // 32, 16)),
    "mlp.experts.down_proj_scales": (torch.uint8, (E, H, INTER // 32)),
    "mlp.experts.down_proj_bias": (torch.bfloat16, (E, H)),
}
GPT_OSS_TOP = {"model.embed_tokens.weight": (torch.bfloat16, (dm.VOCAB_SIZE, H)),
               "model.norm.weight": (torch.bfloat16, (H,)), "lm_head.weight": (torch.bfloat16, (dm.VOCAB_SIZE, H))}


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def _expected_qwen_twin(bf16: dict[str, torch.Tensor], expert: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                        ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    want = {k: v for k, v in _layout(bf16).items() if ".mlp.experts." not in k}
    for n in range(L):
        for x in range(E):
            want.update({f"model.layers.{n}.mlp.experts.{x}.{k}": v for k, v in expert.items()})
    return want


def test_awq_twin_has_exactly_vllms_tensors_and_config(twins: dict[str, Path]) -> None:
    bf16, awq = _tensors(twins["bf16"]), _tensors(twins["awq-int4"])
    assert _layout(awq) == _expected_qwen_twin(bf16, AWQ_EXPERT)
    for name, t in bf16.items():  # router, attention, norms, embeddings, head: the bf16 twin's bytes
        if ".mlp.experts." not in name:
            assert torch.equal(awq[name], t), name
    p = "model.layers.1.mlp.experts.3.up_proj"
    q, z = _unpack_awq_like_vllm(awq[p + ".qweight"]), _unpack_awq_like_vllm(awq[p + ".qzeros"])
    scales = awq[p + ".scales"].float()
    groups = torch.arange(H) // 128
    deq = ((q - z[groups]).float() * scales[groups]).t()
    w = bf16[p + ".weight"].float()
    assert float((deq - w).abs().max()) <= float(scales.max()) * 0.5 + 1e-4
    qc = json.loads((twins["awq-int4"] / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": ["self_attn", "mlp.gate"]}
    # vLLM skips by substring (auto_awq.py is_layer_skipped, match_mode="substring"): attention and router, no expert.
    for prefix, skipped in (("model.layers.0.self_attn.qkv_proj", True), ("model.layers.1.self_attn.o_proj", True),
                            ("model.layers.1.mlp.gate", True), ("model.layers.0.mlp.experts", False)):
        assert any(m in prefix for m in qc["modules_to_not_convert"]) is skipped, prefix


def test_nvfp4_twin_has_exactly_vllms_tensors_and_configs(twins: dict[str, Path]) -> None:
    from fnmatch import fnmatch

    bf16, nv = _tensors(twins["bf16"]), _tensors(twins["nvfp4"])
    assert _layout(nv) == _expected_qwen_twin(bf16, NVFP4_EXPERT)
    for name, t in bf16.items():
        if ".mlp.experts." not in name:
            assert torch.equal(nv[name], t), name
    for x in (0, 7):
        p = f"model.layers.0.mlp.experts.{x}."
        # gate and up share the global and input scales vLLM fuses them under
        assert float(nv[p + "gate_proj.weight_scale_2"]) == float(nv[p + "up_proj.weight_scale_2"])
        assert float(nv[p + "gate_proj.input_scale"]) == pytest.approx(H ** 0.5 / (6 * 448))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = bf16[p + proj + ".weight"].float()
            deq = fp4.dequantize_nvfp4(nv[p + proj + ".weight"], nv[p + proj + ".weight_scale"],
                                       nv[p + proj + ".weight_scale_2"])
            assert float((deq - w).norm() / w.norm()) < 0.15, proj
    qc = json.loads((twins["nvfp4"] / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    assert all(g["input_activations"] is not None for g in qc["config_groups"].values())  # W4A4, not W4A16
    legacy = json.loads((twins["nvfp4"] / "hf_quant_config.json").read_text())["quantization"]
    assert {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(legacy)
    assert legacy["exclude_modules"] == qc["ignore"] and legacy["quant_algo"] == "NVFP4"

    def excluded(prefix: str) -> bool:  # ModelOptQuantConfigBase.is_layer_excluded: exact, substring, wildcard
        return any(prefix == m or m in prefix or fnmatch(prefix, m) for m in qc["ignore"])

    for n in range(L):
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate"):
            assert excluded(f"model.layers.{n}.{m}")
        assert not excluded(f"model.layers.{n}.mlp.experts")
    assert excluded("lm_head")


def test_mxfp4_twin_is_a_gpt_oss_checkpoint_vllm_reads(twins: dict[str, Path]) -> None:
    bf16, oss = _tensors(twins["bf16"]), _tensors(twins["mxfp4"])
    want = dict(GPT_OSS_TOP)
    for n in range(L):
        want.update({f"model.layers.{n}.{k}": v for k, v in GPT_OSS_LAYER.items()})
    assert _layout(oss) == want
    cfg = json.loads((twins["mxfp4"] / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["GptOssForCausalLM"], "gpt_oss")
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["experts_per_token"]) == (E, 4, 4)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (H, INTER, 32)
    assert cfg["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]}
    rp = cfg["rope_parameters"]  # what vLLM's OAIAttention reads
    assert {"rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"} <= set(rp)
    # Router and dense tensors are the bf16 demo model's; experts decode to its weights, gate/up interleaved.
    p = "model.layers.1."
    assert torch.equal(oss[p + "mlp.router.weight"], bf16[p + "mlp.gate.weight"])
    assert torch.equal(oss["lm_head.weight"], bf16["lm_head.weight"])
    gate_up = _dequant_mxfp4_independent(oss[p + "mlp.experts.gate_up_proj_blocks"],
                                         oss[p + "mlp.experts.gate_up_proj_scales"])  # [E, 2I, H]
    down = _dequant_mxfp4_independent(oss[p + "mlp.experts.down_proj_blocks"],
                                      oss[p + "mlp.experts.down_proj_scales"])  # [E, H, INTER]
    for x in (0, 9):
        for got, name in ((gate_up[x, 0::2], "gate_proj"), (gate_up[x, 1::2], "up_proj"), (down[x], "down_proj")):
            w = bf16[f"{p}mlp.experts.{x}.{name}.weight"].float()
            assert float((got - w).norm() / w.norm()) < 0.15, name
    assert float(down[:, dm.DOMAIN_DIM].abs().max()) == 0.0  # experts still never write the domain coordinate


@pytest.mark.parametrize("quant", ["awq-int4", "nvfp4", "mxfp4"])
def test_transformers_parses_the_config(twins: dict[str, Path], quant: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(twins[quant]))
    assert cfg.model_type == ("gpt_oss" if quant == "mxfp4" else "qwen3_moe")
    assert cfg.hidden_size == H and cfg.num_hidden_layers == L
    qc = cfg.quantization_config if isinstance(cfg.quantization_config, dict) else cfg.quantization_config.to_dict()
    assert qc["quant_method"] == {"awq-int4": "awq", "nvfp4": "modelopt", "mxfp4": "mxfp4"}[quant]
    if quant == "mxfp4":
        assert cfg.num_local_experts == E and cfg.num_experts_per_tok == 4
        assert cfg.layer_types == ["sliding_attention", "full_attention"]


def test_nvfp4_fits_the_default_geometry_and_mxfp4_too(demo_model_factory: Callable[..., Path]) -> None:
    # Blocks of 16 and 32 fit hidden 128 / intermediate 64; the NVFP4 twin quantizes the default model's experts.
    nv = demo_model_factory(quant="nvfp4")
    assert (nv / "hf_quant_config.json").is_file()
    plain, quant = _tensors(demo_model_factory()), _tensors(nv)
    assert torch.equal(plain["model.layers.2.mlp.gate.weight"], quant["model.layers.2.mlp.gate.weight"])
    assert quant["model.layers.2.mlp.experts.5.down_proj.weight"].shape == (128, 32)


def test_cli_writes_and_reports_each_format(tmp_path: Path, twins: dict[str, Path]) -> None:
    runner = CliRunner()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in GEO.items()]
    for quant in ("awq-int4", "nvfp4", "mxfp4"):
        result = runner.invoke(main, ["demo-model", str(tmp_path / quant), *args, "--quant", quant, "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["quant"] == quant and payload["digest"] == dm.weights_digest(twins[quant])
        assert (payload["num_experts"], payload["expert_intermediate"], payload["top_k"]) == (E, INTER, 4)
        assert payload["model_type"] == ("gpt_oss" if quant == "mxfp4" else "qwen3_moe")


@pytest.mark.parametrize(("quant", "geometry", "flag"), [
    ("awq-int4", {}, r"multiples of 128.*--expert-intermediate 128"),
    ("nvfp4", {"hidden": 136}, r"blocks of 16.*multiples of 16.*--hidden 144"),
    ("mxfp4", {"hidden": 272, "expert_intermediate": 80}, r"MX blocks of 32.*--hidden 288 --expert-intermediate 96"),
])
def test_bad_geometry_names_the_flag(tmp_path: Path, quant: str, geometry: dict[str, int], flag: str) -> None:
    runner = CliRunner()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in geometry.items()]
    result = runner.invoke(main, ["demo-model", str(tmp_path / "m"), *args, "--quant", quant])
    assert result.exit_code == 2 and re.search(flag, result.stderr), result.stderr
    assert not (tmp_path / "m").exists()
