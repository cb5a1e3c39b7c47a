"""Bytes per expert per checkpoint format, read from a checkpoint, and ``map build --model / --expert-bytes``.

The two anchors were measured by the hook on an H200 under vLLM 0.26 (H=2048, I=768): 9437184 bytes per expert in
bf16 and 4718600 with online FP8. The FP8-block and GPTQ figures are derived from vLLM's code (see the module
docstring of ``pinsidecar.placement.expert_bytes``); here they are pinned by hand-computed shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pinsidecar_hook.contract import load_map

from pinsidecar.placement import ExpertBytesError, checkpoint_experts
from pinsidecar.placement.expert_bytes import (
    fp8_block_expert_bytes,
    fp8_per_tensor_expert_bytes,
    gptq_expert_bytes,
    unquantized_expert_bytes,
)
from pinsidecar.testing.artifacts import make_counts, write_counts
from pinsidecar.testing.cli import assert_user_error, run

H, INTER = 2048, 768  # the GPU lane's geometry, where the anchors were measured
GEO = dict(hidden=256, layers=2, experts=16, top_k=4, expert_intermediate=128)
BF16_SMALL = 3 * 128 * 256 * 2


def write_config(path: Path, **overrides: Any) -> Path:
    """A checkpoint directory with only config.json (what the reader reads), Qwen3-MoE keys."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": INTER, "num_experts": 128,
              "num_experts_per_tok": 8, "num_hidden_layers": 4, "torch_dtype": "bfloat16", **overrides}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


# ------------------------------------------------------------------------------------------------- formulas


def test_the_two_measured_anchors() -> None:
    assert unquantized_expert_bytes(H, INTER, "bfloat16") == 9437184
    assert fp8_per_tensor_expert_bytes(H, INTER) == 4718600
    assert unquantized_expert_bytes(H, INTER, "float32") == 2 * 9437184


def test_fp8_block_is_fp8_weights_plus_float32_block_scales() -> None:
    # w13 scales [2 * 768/128, 2048/128] = [12, 16], w2 scales [16, 6]: (192 + 96) float32
    assert fp8_block_expert_bytes(H, INTER) == 3 * INTER * H + (12 * 16 + 16 * 6) * 4 == 4719744
    assert fp8_block_expert_bytes(256, 128) == 3 * 128 * 256 + (2 * 2 + 2 * 1) * 4


def test_gptq_is_what_marlin_processing_leaves() -> None:
    qweight = 3 * INTER * H // 2  # int4, repacked for Marlin: same bits
    scales = (16 * 2 * INTER + 6 * H) * 2  # [H/128, 2I] + [I/128, H], 16-bit
    qzeros = (16 * 2 * INTER // 8 + 6 * H // 8) * 2  # as loaded, in params_dtype
    assert gptq_expert_bytes(H, INTER) == qweight + scales + qzeros == 2442240  # g_idx tensors are [E, 0]
    assert gptq_expert_bytes(H, INTER, desc_act=True) == 2442240 + 2 * (H + INTER) * 4  # g_idx + sort indices kept
    assert gptq_expert_bytes(H, INTER, bits=8) == 3 * INTER * H + scales + (16 * 2 * INTER // 4 + 6 * H // 4) * 2
    assert gptq_expert_bytes(H, INTER, group_size=-1) == qweight + (2 * INTER + H) * 2 + (2 * INTER // 8 + H // 8) * 2


@pytest.mark.parametrize(("call", "message"), [
    (lambda: fp8_block_expert_bytes(2048, 700), "intermediate 700 is not a multiple of 128"),
    (lambda: fp8_block_expert_bytes(2000, 768), "hidden 2000 is not a multiple of 128"),
    (lambda: gptq_expert_bytes(2048, 192), "lcm(64, group)"),  # Marlin would pad 192 to 256
    (lambda: gptq_expert_bytes(2048, 768, bits=3), "supports 4 and 8"),
    (lambda: gptq_expert_bytes(2048, 768, dtype="float32"), "16-bit activations"),
    (lambda: unquantized_expert_bytes(0, 768), "positive"),
    (lambda: unquantized_expert_bytes(2048, 768, "int8"), "unknown dtype"),
])
def test_bad_inputs_say_what_and_how(call: Any, message: str) -> None:
    with pytest.raises(ExpertBytesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


# ------------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_formats_from_config(tmp_path: Path) -> None:
    plain = checkpoint_experts(write_config(tmp_path / "bf16"))
    assert (plain.format, plain.expert_bytes, plain.measured_on_gpu) == ("unquantized", 9437184, True)
    assert plain.moe_layer_ids == (0, 1, 2, 3) and plain.num_experts == 128 and plain.top_k == 8
    online = checkpoint_experts(tmp_path / "bf16", quantization="fp8")
    assert (online.format, online.expert_bytes, online.measured_on_gpu) == ("fp8-online", 4718600, True)
    fp32 = write_config(tmp_path / "fp32", torch_dtype="float32")
    assert checkpoint_experts(fp32).expert_bytes == 9437184  # vLLM's auto runs a float32 checkpoint in bf16
    assert checkpoint_experts(fp32, dtype="float32").expert_bytes == 2 * 9437184  # the CPU engine's float32
    block = write_config(tmp_path / "fp8", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    info = checkpoint_experts(block)
    assert (info.format, info.expert_bytes, info.measured_on_gpu) == ("fp8-block", 4719744, False)
    tensor = write_config(tmp_path / "fp8t", quantization_config={"quant_method": "fp8",
                                                                  "activation_scheme": "dynamic"})
    assert checkpoint_experts(tensor).format == "fp8-per-tensor"
    gptq = write_config(tmp_path / "gptq", torch_dtype="float16", quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    assert (checkpoint_experts(gptq).format, checkpoint_experts(gptq).expert_bytes) == ("gptq-int4", 2442240)
    sparse = write_config(tmp_path / "sparse", decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    assert checkpoint_experts(sparse).moe_layer_ids == (1, 5)


@pytest.mark.parametrize(("overrides", "kwargs", "message"), [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, {}, "quant_method 'awq'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}, "moe_intermediate_size": 96},
     {}, "intermediate 96 is not a multiple of 128"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}}, {},
     "asymmetric"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "modules_to_not_convert": ["model.layers.2.mlp.experts.0.gate_proj"]}}, {},
     "model.layers.2.mlp.experts"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}},
     {"quantization": "fp8"}, "does not match"),
    ({}, {"quantization": "int8"}, "only online FP8"),
    ({"moe_intermediate_size": None}, {}, "moe_intermediate_size"),
])
def test_checkpoints_that_are_not_derived_are_refused(tmp_path: Path, overrides: dict, kwargs: dict,
                                                      message: str) -> None:
    with pytest.raises(ExpertBytesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoint_experts(write_config(tmp_path / "m", **overrides), **kwargs)


def test_a_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExpertBytesError, match="not a directory"):
        checkpoint_experts(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExpertBytesError, match=r"no config\.json"):
        checkpoint_experts(tmp_path / "empty")


# ------------------------------------------------------------------------------------------------- map build


@pytest.fixture(scope="module")
def fp8_twin(demo_model_factory: Callable[..., Path]) -> Path:
    """The FP8-block twin written by the demo-model generator: the reader must read what the writer wrote."""
    return demo_model_factory(geometry=GEO, quant="fp8-block")


@pytest.fixture()
def bf16_counts(tmp_path: Path) -> str:
    """Counts of the bf16 model (what a bf16 count boot records: its bytes, dtype and per-expert tensors)."""
    counts = make_counts(num_layers=GEO["layers"], num_experts=GEO["experts"], top_k=GEO["top_k"], tokens=300,
                         expert_bytes=BF16_SMALL)
    counts.meta.update(dtype="bfloat16", expert_tensors=["w13_weight", "w2_weight"])
    counts.save(tmp_path / "bf16.counts.json")
    return str(tmp_path / "bf16.counts.json")


def test_map_build_takes_the_twins_bytes_from_its_checkpoint(tmp_path: Path, fp8_twin: Path,
                                                             bf16_counts: str) -> None:
    out = tmp_path / "fp8.map.json"
    result = run("map", "build", bf16_counts, "--hot-rows", "8", "--model", str(fp8_twin), "--out", str(out),
                 "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    fp8_bytes = fp8_block_expert_bytes(GEO["hidden"], GEO["expert_intermediate"])
    assert (r["expert_bytes"], r["expert_bytes_from"], r["counts_expert_bytes"]) == (fp8_bytes, "model", BF16_SMALL)
    assert r["model"]["format"] == "fp8-block" and r["model"]["measured_on_gpu"] is False
    emap = load_map(out)
    assert emap.expert_bytes == fp8_bytes
    # The counted engine's format facts would make pin mode refuse the twin: they are left out of the map.
    assert "expert_tensors" not in emap.meta and "dtype" not in emap.meta
    assert emap.meta["expert_bytes_from"]["format"] == "fp8-block"
    # Same counts, same placement as the bf16 map: only the bytes differ.
    plain = tmp_path / "bf16.map.json"
    assert run("map", "build", bf16_counts, "--hot-rows", "8", "--out", str(plain)).exit_code == 0
    bf16_map = load_map(plain)
    assert bf16_map.expert_bytes == BF16_SMALL and bf16_map.meta["expert_tensors"] == ["w13_weight", "w2_weight"]
    assert [lay.hot for lay in bf16_map.layers] == [lay.hot for lay in emap.layers]
    human = run("map", "build", bf16_counts, "--hot-rows", "8", "--model", str(fp8_twin), "--out", str(out))
    assert "derived from vLLM's code, not yet measured" in human.stdout
    assert f"the counted engine had {BF16_SMALL}" in human.stdout


def test_an_hbm_budget_buys_more_rows_of_the_smaller_twin(tmp_path: Path, fp8_twin: Path, bf16_counts: str) -> None:
    fp8_bytes = fp8_block_expert_bytes(GEO["hidden"], GEO["expert_intermediate"])
    budget = str(GEO["layers"] * 8 * fp8_bytes)  # 8 fp8 rows per layer = 4 bf16 rows
    twin = run("map", "build", bf16_counts, "--hbm-bytes", budget, "--model", str(fp8_twin), "--positional",
               "--json")
    plain = run("map", "build", bf16_counts, "--hbm-bytes", budget, "--positional", "--json")
    assert json.loads(twin.stdout)["hot_rows"] == 8 and json.loads(plain.stdout)["hot_rows"] == 4


def test_explicit_expert_bytes_override_the_counts(tmp_path: Path, bf16_counts: str) -> None:
    out = tmp_path / "m.map.json"
    r = run("map", "build", bf16_counts, "--hot-rows", "8", "--expert-bytes", "4718600", "--out", str(out), "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["expert_bytes_from"] == "expert-bytes"
    assert load_map(out).expert_bytes == 4718600 and "expert_tensors" not in load_map(out).meta


def test_a_model_that_is_not_the_counted_ones_twin_is_refused(tmp_path: Path, fp8_twin: Path) -> None:
    other = str(write_counts(tmp_path / "c.json", num_layers=2, num_experts=32, top_k=4, tokens=100))
    out = tmp_path / "m.map.json"
    result = run("map", "build", other, "--hot-rows", "8", "--model", str(fp8_twin), "--out", str(out))
    assert_user_error(result, "not a twin", "16 experts per layer in --model, 32 in the counts")
    deeper = str(write_counts(tmp_path / "d.json", num_layers=3, num_experts=16, top_k=4, tokens=100))
    assert_user_error(run("map", "build", deeper, "--hot-rows", "8", "--model", str(fp8_twin), "--out", str(out)),
                      "MoE layers 0..1 (2) in --model, 0..2 (3) in the counts")
    assert not out.exists()


def test_bad_map_build_byte_options(tmp_path: Path, fp8_twin: Path, bf16_counts: str) -> None:
    out = str(tmp_path / "m.map.json")
    base = ("map", "build", bf16_counts, "--hot-rows", "8", "--out", out)
    assert_user_error(run(*base, "--model", str(fp8_twin), "--expert-bytes", "10"), "pass one of them")
    assert_user_error(run(*base, "--dtype", "float16"), "add --model DIR")
    assert_user_error(run(*base, "--quantization", "fp8"), "add --model DIR")
    assert_user_error(run(*base, "--model", str(tmp_path)), "no config.json")
    awq = write_config(tmp_path / "awq", hidden_size=256, moe_intermediate_size=128, num_experts=16,
                       num_experts_per_tok=4, num_hidden_layers=2,
                       quantization_config={"quant_method": "awq", "bits": 4})
    assert_user_error(run(*base, "--model", str(awq)), "quant_method 'awq'", "--expert-bytes N")
    odd = write_config(tmp_path / "odd", hidden_size=256, moe_intermediate_size=96, num_experts=16,
                       num_experts_per_tok=4, num_hidden_layers=2,
                       quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert_user_error(run(*base, "--model", str(odd)), "intermediate 96 is not a multiple of 128")
    assert_user_error(run(*base, "--expert-bytes", "0"), "must be positive")
    assert not Path(out).exists()
