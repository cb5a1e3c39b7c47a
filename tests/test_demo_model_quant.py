"""Quantized twins of the demo model (``pinsidecar demo-model DIR --quant fp8-block|gptq-int4``).

The quantizers are checked against the conventions vLLM reads, with independent code here: FP8 block scales are
the dequant multipliers of 128x128 tiles; GPTQ's packed nibbles, unpacked LSB-first along the input dimension and
read as uint4b8 (value - 8) times the group scale, give back the quantized values. The written checkpoint is the
bf16 twin with only the routed experts replaced: everything else byte for byte the same, the experts close to it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from pinsidecar.cli import main
from pinsidecar.demo import model as dm
from pinsidecar.demo import quant as dq

# Small enough to write in about a second; hidden and expert intermediate on the 128 grid.
GEO = dict(hidden=256, layers=2, experts=16, top_k=4, expert_intermediate=128)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


@pytest.fixture(scope="module")
def twins(demo_model_factory: Callable[..., Path]) -> dict[str, Path]:
    """The bf16 model and its quantized twins, one geometry (the factory's: shared with the other twin tests)."""
    return {q: demo_model_factory(geometry=GEO, quant=None if q == "bf16" else q)
            for q in ("bf16", "fp8-block", "gptq-int4")}


# ------------------------------------------------------------------------------------------------- FP8 block


def _blockwise_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    rows = [w[i:i + block] for i in range(0, w.shape[0], block)]
    return torch.tensor([[float(r[:, j:j + block].abs().max()) for j in range(0, w.shape[1], block)] for r in rows])


def test_fp8_block_scales_are_dequant_multipliers_of_each_tile() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * 0.05  # not multiples of 128: edge tiles are partial
    w[:, 130:] *= 40.0  # tiles with different ranges get different scales
    w[:, 0] = 0.0
    q, scale_inv = dq.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == (3, 2)  # ceil(300/128), ceil(200/128)
    torch.testing.assert_close(scale_inv, _blockwise_amax(w, 128) / dq.FP8_E4M3_MAX)
    deq = dq.dequantize_fp8_block(q, scale_inv)
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of every value, per tile.
    tile_err = _blockwise_amax(deq - w, 128)
    assert (tile_err <= _blockwise_amax(w, 128) / 16).all()
    # The largest value of each tile lands on 448 exactly; zeros stay zeros.
    assert float(q[:128, :128].float().abs().max()) == dq.FP8_E4M3_MAX
    assert float(deq[:, 0].abs().max()) == 0.0


def test_fp8_block_refuses_a_non_matrix() -> None:
    with pytest.raises(ValueError, match="2-D"):
        dq.quantize_fp8_block(torch.zeros(2, 3, 4))


# ------------------------------------------------------------------------------------------------- GPTQ int4


def _unpack_lsb_first(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Independent unpacking, vLLM's convention: 8 nibbles per int32 along ``dim``, the first in bits 0..3."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(p >> (4 * j)) & 0xF for j in range(8)], dim=dim + 1)  # [..., n, 8, ...]
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape)


def _dequant_gptq_like_vllm(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[in, out] float32: (nibble - 8) * scale of the channel's group (uint4b8, symmetric: qzeros not read)."""
    ints = _unpack_lsb_first(t["qweight"], dim=0)  # [in, out]
    scales = t["scales"].float()[t["g_idx"].long()]  # g_idx maps each input channel to its group
    return (ints - 8).float() * scales


def test_gptq_int4_round_trips_under_vllms_unpacking() -> None:
    gen = torch.Generator().manual_seed(1)
    out_f, in_f = 64, 384
    w = torch.randn(out_f, in_f, generator=gen) * 0.03
    w[:, 128:256] *= 10.0  # groups with different ranges
    t = dq.quantize_gptq_int4(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "qweight": (torch.int32, (in_f // 8, out_f)),
        "qzeros": (torch.int32, (in_f // 128, out_f // 8)),
        "scales": (torch.float16, (in_f // 128, out_f)),
        "g_idx": (torch.int32, (in_f,)),
    }
    assert t["g_idx"].tolist() == [i // 128 for i in range(in_f)]
    # AutoGPTQ stores the zero point minus one: 8 - 1 = 7 in every nibble.
    assert set(_unpack_lsb_first(t["qzeros"], dim=1).unique().tolist()) == {7}
    # The quantized values, computed here from the stored scales: round to nearest, bias 8, clamp to 0..15.
    scale_per_channel = t["scales"].float()[t["g_idx"].long()]  # [in, out]
    expected = torch.clamp(torch.round(w.t() / scale_per_channel) + 8, 0, 15)
    assert torch.equal(_unpack_lsb_first(t["qweight"], dim=0), expected.to(torch.int64))
    # Scales follow AutoGPTQ's symmetric quantizer (2 * amax / 15 per group and output channel)...
    amax = w.t().reshape(3, 128, out_f).abs().amax(dim=1)
    torch.testing.assert_close(t["scales"].float(), (2 * amax / 15).half().float())
    # ...so dequantizing gives w back within half a step (a step more where the top value is clamped to 7).
    deq = _dequant_gptq_like_vllm(t)
    assert ((deq - w.t()).abs() <= scale_per_channel * 1.0 + 1e-6).all()
    assert float((deq - w.t()).abs().mean()) < float(scale_per_channel.mean()) * 0.3


def test_gptq_int4_packs_the_first_channel_into_the_lowest_nibble() -> None:
    # One output channel, one group: channel k gets a value that quantizes to k % 16 exactly.
    scale = 0.5
    codes = torch.tensor([k % 16 for k in range(128)], dtype=torch.float32)
    codes[0] = 0  # amax = 8 * scale -> stored scale 2 * 4 / 15, not 0.5; quantize against the stored one
    w = ((codes - 8) * scale).reshape(1, 128).repeat(8, 1)  # out must be a multiple of 8
    t = dq.quantize_gptq_int4(w)
    first = int(t["qweight"][0, 0]) & 0xFFFFFFFF
    nibbles = [(first >> (4 * j)) & 0xF for j in range(8)]
    stored = float(t["scales"][0, 0])
    assert nibbles == [min(15, round(float(c - 8) * scale / stored) + 8) for c in codes[:8]]


def test_gptq_refuses_sizes_off_the_group() -> None:
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        dq.quantize_gptq_int4(torch.zeros(8, 100))


# ------------------------------------------------------------------------------------------------- checkpoints


def test_fp8_twin_keeps_everything_but_the_experts_and_vllms_config(twins: dict[str, Path]) -> None:
    bf16, fp8 = _tensors(twins["bf16"]), _tensors(twins["fp8-block"])
    experts = [n for n in bf16 if ".mlp.experts." in n]
    assert len(experts) == GEO["layers"] * GEO["experts"] * 3
    for name, t in bf16.items():
        if name in experts:
            prefix = name.removesuffix(".weight")
            q, s = fp8[name], fp8[prefix + ".weight_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert tuple(s.shape) == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            ref = t.float()
            err = (dq.dequantize_fp8_block(q, s) - ref).abs().max()
            assert float(err) <= float(ref.abs().max()) / 16
        else:  # router, attention, norms, embeddings, head: the bf16 twin's bytes, so routing is identical
            assert fp8[name].dtype == torch.bfloat16 and torch.equal(fp8[name], t), name
    assert len(fp8) == len(bf16) + len(experts)
    cfg = json.loads((twins["fp8-block"] / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == (
        "fp8", "e4m3", "dynamic", [128, 128])
    # vLLM matches exact prefixes: every dense Linear of every layer, and no expert.
    skipped = set(qc["modules_to_not_convert"])
    for layer in range(GEO["layers"]):
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate"):
            assert f"model.layers.{layer}.{m}" in skipped
    assert not [s for s in skipped if "experts" in s]
    info = json.loads((twins["fp8-block"] / "pinsidecar_demo.json").read_text())
    assert info["quant"]["method"] == "fp8-block" and info["quant"]["quantization_config"] == qc
    plain = json.loads((twins["bf16"] / "pinsidecar_demo.json").read_text())
    assert "quant" not in plain and info["designed_hot"] == plain["designed_hot"]


def test_gptq_twin_stores_autogptq_tensors_close_to_the_bf16_experts(twins: dict[str, Path]) -> None:
    bf16, gq = _tensors(twins["bf16"]), _tensors(twins["gptq-int4"])
    name = "model.layers.1.mlp.experts.5.down_proj"
    w = bf16[name + ".weight"]  # [hidden, intermediate]
    t = {k: gq[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
    assert name + ".weight" not in gq
    assert tuple(t["qweight"].shape) == (GEO["expert_intermediate"] // 8, GEO["hidden"])
    deq = _dequant_gptq_like_vllm(t).t()
    step = float(t["scales"].float().max())
    assert float((deq - w.float()).abs().max()) <= step
    assert float(deq[dm.DOMAIN_DIM].abs().max()) == 0.0  # experts still never write the domain coordinate
    assert gq["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(gq["model.layers.1.mlp.gate.weight"], bf16["model.layers.1.mlp.gate.weight"])
    qc = json.loads((twins["gptq-int4"] / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    # vLLM: Linear layers by substring of modules_in_block_to_quantize; MoE and Linear by `dynamic` negatives.
    import re

    rules = [r.removeprefix("-:") for r in qc["dynamic"]]
    for prefix, skipped in (("model.layers.0.self_attn.qkv_proj", True), ("model.layers.1.mlp.gate", True),
                            ("model.layers.0.mlp.experts", False)):
        assert any(re.match(r, prefix) for r in rules) is skipped, prefix
        assert any(m in prefix for m in qc["modules_in_block_to_quantize"]) is not skipped, prefix


def test_the_default_geometry_is_refused_with_the_flag_that_fixes_it(tmp_path: Path) -> None:
    with pytest.raises(dm.DemoModelError, match="--expert-intermediate 128"):
        dm.build_demo_model(tmp_path / "m", quant="fp8-block")
    with pytest.raises(dm.DemoModelError, match=r"multiples of 128.*hidden 224"):
        dm.build_demo_model(tmp_path / "m", geometry=dm.Geometry.scaled(**{**GEO, "hidden": 224}),
                            quant="gptq-int4")
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_cli_quant_option(tmp_path: Path, twins: dict[str, Path]) -> None:
    runner = CliRunner()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in GEO.items()]
    result = runner.invoke(main, ["demo-model", str(tmp_path / "m"), *args, "--quant", "fp8-block", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["quant"] == "fp8-block" and payload["digest"] == dm.weights_digest(twins["fp8-block"])
    refused = runner.invoke(main, ["demo-model", str(tmp_path / "d"), "--quant", "gptq-int4"])
    assert refused.exit_code == 2 and "error:" in refused.stderr and "--expert-intermediate 128" in refused.stderr
    assert not (tmp_path / "d").exists()
