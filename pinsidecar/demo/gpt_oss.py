"""The MXFP4 twin: the demo model's tensors as a gpt-oss (``GptOssForCausalLM``) checkpoint, experts in MXFP4.

MXFP4 MoE checkpoints in the wild are gpt-oss's, and vLLM reads ``quant_method: mxfp4`` only for
``model_type: gpt_oss`` (``GptOssMxfp4Config.override_quantization_method``,
``vllm/model_executor/layers/quantization/mxfp4.py:129-147``), so ``pinsidecar demo-model DIR --quant mxfp4``
writes a tiny gpt-oss model. Its tensors are the bf16 demo model's of the same seed, geometry and router, moved into
gpt-oss's names and shapes:

==============================================  =====================================  ============================
gpt-oss tensor (vLLM 0.34 ``models/gpt_oss.py``)  shape, dtype                           from the demo model
==============================================  =====================================  ============================
``model.embed_tokens.weight``                   ``[vocab, H]`` bf16                     the same
``model.layers.N.input_layernorm.weight``,      ``[H]`` bf16                            the same
``post_attention_layernorm.weight``
``model.layers.N.self_attn.{q,k,v,o}_proj``     weight + bias, bf16                     the same weights (q and k
                                                                                        times the demo's q/k norm
                                                                                        gain, gpt-oss has no q/k
                                                                                        norms), zero biases
``model.layers.N.self_attn.sinks``              ``[heads]`` bf16                        :data:`SINK_LOGIT`
``model.layers.N.mlp.router.weight`` / ``bias``  ``[E, H]`` / ``[E]`` bf16              ``mlp.gate.weight`` / zeros
``...mlp.experts.gate_up_proj_blocks``          ``[E, 2I, H/32, 16]`` uint8             gate and up rows
                                                                                        interleaved (g0, u0, g1, ...)
``...mlp.experts.gate_up_proj_scales``          ``[E, 2I, H/32]`` uint8 (ue8m0)         their MX block exponents
``...mlp.experts.gate_up_proj_bias``            ``[E, 2I]`` bf16                        zeros
``...mlp.experts.down_proj_blocks`` / scales    ``[E, H, I/32, 16]`` / ``[E, H, I/32]``  ``down_proj``
``...mlp.experts.down_proj_bias``               ``[E, H]`` bf16                         zeros
``model.norm.weight``, ``lm_head.weight``       bf16                                    the same
==============================================  =====================================  ============================

What vLLM 0.34 does with them: ``GptOssForCausalLM.hf_to_vllm_mapper`` (``models/gpt_oss.py:1373-1401``) renames
``.self_attn.`` to ``.attn.``, ``embed_tokens`` to ``embedding`` and the expert suffixes to ``w13_weight``,
``w13_weight_scale``, ``w13_bias``, ``w2_*``; ``load_weights`` (:1311-1368) maps ``mxfp4`` to ``gpt_oss_mxfp4`` and
``_load_weights_mxfp4`` (:554-739) views ``w13_weight`` as ``[E, 2I, H/2]`` and ``w2_weight`` as ``[E, H, I/2]``
(so the blocks must be ``[..., H/32, 16]`` with 16 bytes = 32 nibbles a block) and slices the scales along the
same rows; q/k/v fold into ``qkv_proj`` (:1312-1316). ``GptOssMxfp4MoEMethod.create_weights``
(``quantization/mxfp4.py:201-293``) allocates exactly these shapes (uint8 weights and scales, bf16 biases);
``modules_to_not_convert`` is gpt-oss's own list (vLLM's ``Mxfp4Config.from_config`` ignores it and never quantizes
a Linear; transformers reads it). The router's logits are the demo router's (zero bias), so the *first* layer
routes as the bf16 demo model does; later layers see gpt-oss's attention (YaRN RoPE, sinks, no q/k norms, a
sliding window on even layers) and swigluoai experts (``(up + 1) * gate * sigmoid(1.702 gate)``, clamped at
``swiglu_limit``), so their routing follows the same design but is not token for token the demo model's.

The geometry needs hidden and expert intermediate sizes that are multiples of 32 (MX blocks; checked by
:func:`pinsidecar.demo.quant.geometry_problems`). vLLM pads further per kernel (``oracle/mxfp4.py:822-902``: 32 for
the CPU AMX kernel, 64 to 256 for GPU ones) and loads the unpadded checkpoint into the padded parameters
(``GptOssRoutedExperts._copy_to_expert``, ``models/gpt_oss.py:214-222``), so that is not the checkpoint's concern.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinsidecar.demo import quant_fp4

__all__: list[str] = []  # used inside pinsidecar.demo and by the tests only

# openai/gpt-oss-20b's config.json, quantization_config.modules_to_not_convert: everything but the experts.
GPT_OSS_MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                  "lm_head"]
# Attention sink logit of every head. Learned in gpt-oss; here low enough (exp(-8) = 3e-4 of one token's weight)
# that the demo's near-uniform attention over the prefix is what the heads do.
SINK_LOGIT = -8.0
# gpt-oss's published values (openai/gpt-oss-20b config.json): sliding window, YaRN RoPE, SwiGLU clamp.
SLIDING_WINDOW = 128
ROPE_THETA = 150000.0
ROPE_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 4096, "truncate": False}
SWIGLU_LIMIT = 7.0
_BF16_TWIN = ".bf16-twin"  # where the bf16 demo model is built inside the output's temporary directory
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    return out


def gpt_oss_tensors(demo: dict[str, torch.Tensor], num_layers: int, qk_gain: float) -> dict[str, torch.Tensor]:
    """The bf16 demo model's tensors -> gpt-oss's, experts quantized to MXFP4 (table in the module docstring)."""
    dtype = demo["model.embed_tokens.weight"].dtype
    out = {k: demo[k] for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        for k in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight"):
            out[p + k] = demo[p + k]
        for k in ("q_proj", "k_proj"):
            out[f"{p}self_attn.{k}.weight"] = (demo[f"{p}self_attn.{k}.weight"].float() * qk_gain).to(dtype)
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = out[f"{p}self_attn.{k}.weight"]
            out[f"{p}self_attn.{k}.bias"] = torch.zeros(w.shape[0], dtype=dtype)
        heads = out[f"{p}self_attn.q_proj.weight"].shape[0] // demo[f"{p}self_attn.q_norm.weight"].shape[0]
        out[p + "self_attn.sinks"] = torch.full((heads,), SINK_LOGIT, dtype=dtype)
        router = demo[p + "mlp.gate.weight"]
        out[p + "mlp.router.weight"] = router
        out[p + "mlp.router.bias"] = torch.zeros(router.shape[0], dtype=dtype)
        experts = router.shape[0]
        gate = torch.stack([demo[f"{p}mlp.experts.{e}.gate_proj.weight"] for e in range(experts)])  # [E, I, H]
        up = torch.stack([demo[f"{p}mlp.experts.{e}.up_proj.weight"] for e in range(experts)])
        down = torch.stack([demo[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(experts)])  # [E, H, I]
        num_e, inter, hidden = gate.shape
        gate_up = torch.stack((gate, up), dim=2).reshape(num_e, 2 * inter, hidden)  # rows g0, u0, g1, u1, ...
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            blocks, scales = quant_fp4.quantize_mxfp4(w.reshape(-1, w.shape[-1]))
            out[f"{p}mlp.experts.{name}_blocks"] = blocks.reshape(*w.shape[:2], *blocks.shape[1:]).contiguous()
            out[f"{p}mlp.experts.{name}_scales"] = scales.reshape(*w.shape[:2], scales.shape[1]).contiguous()
            out[f"{p}mlp.experts.{name}_bias"] = torch.zeros(w.shape[:2], dtype=dtype)
    return {k: v.contiguous() for k, v in out.items()}


def gpt_oss_config(demo_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of the gpt-oss twin of a demo model with ``demo_config``: what transformers' ``GptOssConfig``
    and vLLM's ``gpt_oss.py`` read (both the current ``rope_parameters`` and the legacy ``rope_scaling`` /
    ``rope_theta`` keys, and both ``num_experts_per_tok`` and gpt-oss's ``experts_per_token``)."""
    layers, top_k = demo_config["num_hidden_layers"], demo_config["num_experts_per_tok"]
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": demo_config["vocab_size"],
        "hidden_size": demo_config["hidden_size"],
        "intermediate_size": demo_config["moe_intermediate_size"],  # gpt-oss: each expert's intermediate size
        "num_hidden_layers": layers,
        "num_attention_heads": demo_config["num_attention_heads"],
        "num_key_value_heads": demo_config["num_key_value_heads"],
        "head_dim": demo_config["head_dim"],
        "num_local_experts": demo_config["num_experts"],
        "num_experts_per_tok": top_k,
        "experts_per_token": top_k,
        "sliding_window": SLIDING_WINDOW,
        # vLLM slides on even layers (OAIAttention._build_attention); transformers reads layer_types.
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": demo_config["max_position_embeddings"],
        "initial_context_length": ROPE_YARN["original_max_position_embeddings"],
        "rope_theta": ROPE_THETA,
        "rope_scaling": dict(ROPE_YARN),
        "rope_parameters": {**ROPE_YARN, "rope_theta": ROPE_THETA},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "swiglu_limit": SWIGLU_LIMIT,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "initializer_range": 0.02,
        "bos_token_id": demo_config["bos_token_id"],
        "eos_token_id": demo_config["eos_token_id"],
        "pad_token_id": demo_config["eos_token_id"],
        "torch_dtype": demo_config["torch_dtype"],
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_MODULES_TO_NOT_CONVERT},
    }


def write_gpt_oss_twin(out: Path, write_bf16: Callable[[Path], None]) -> None:
    """Write the gpt-oss MXFP4 twin into ``out``: ``write_bf16(dir)`` writes the bf16 demo model it is built from
    (inside ``out``, removed afterwards); tokenizer and generation config are that model's."""
    from safetensors.torch import save_file

    from pinsidecar.demo.model import ATTN_QK_NORM

    bf16 = out / _BF16_TWIN
    bf16.mkdir()
    write_bf16(bf16)
    demo_config = json.loads((bf16 / "config.json").read_text())
    tensors = gpt_oss_tensors(_read_tensors(bf16), demo_config["num_hidden_layers"], ATTN_QK_NORM)
    name = "model.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _dump(out / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                 "weight_map": dict.fromkeys(sorted(tensors), name)})
    config = gpt_oss_config(demo_config)
    _dump(out / "config.json", config)
    for f in _COPIED:
        shutil.copyfile(bf16 / f, out / f)
    info = json.loads((bf16 / "pinsidecar_demo.json").read_text())
    info["architecture"] = "gpt_oss"
    info["quant"] = {"method": "mxfp4", "quantization_config": config["quantization_config"]}
    _dump(out / "pinsidecar_demo.json", info)
    shutil.rmtree(bf16)


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
