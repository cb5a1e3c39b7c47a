"""Quantized twins of the demo model: the routed experts in the on-disk layouts vLLM loads for real checkpoints.

Pin mode must handle quantized MoE checkpoints, and there is no model hub here, so ``pinsidecar demo-model DIR
--quant ...`` writes the same shaped model with its routed experts quantized. Only the experts
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj``) are quantized: they are what pin mode places, and keeping the
router, attention, norms, embeddings and LM head in bf16 keeps the routing *identical* to the bf16 twin (the router
is unchanged; only the experts' outputs move a little), so counts and maps of the bf16 model apply to its twin.

Two formats, each exactly what vLLM reads for the real thing:

- ``fp8-block`` (DeepSeek-V3 / Qwen3-FP8): ``X.weight`` in float8_e4m3fn plus ``X.weight_scale_inv`` (float32,
  ``[ceil(out/128), ceil(in/128)]``, the *dequant multiplier*: ``w ~= w_fp8 * scale_inv`` per block). The config
  lists every other Linear under ``modules_to_not_convert``: vLLM's ``Fp8Config.from_config`` reads
  ``ignored_layers`` first and falls back on ``modules_to_not_convert`` (the key transformers' FP8 configs use, so
  both read the same list), and ``is_layer_skipped`` matches the vLLM module prefix *exactly* (a fused
  ``qkv_proj`` is skipped when all of its ``q/k/v_proj`` shards are listed). The router must be listed too: it
  is a Linear (``mlp.gate``) that would otherwise be quantized, and its ``num_experts`` outputs need not fill a
  128 block.
- ``gptq-int4`` (AutoGPTQ, 4 bit, symmetric, group 128, ``desc_act`` false): ``X.qweight`` int32 ``[in/8, out]``,
  ``X.qzeros`` int32 ``[in/128, out/8]``, ``X.scales`` fp16 ``[in/128, out]``, ``X.g_idx`` int32 ``[in]``. vLLM's
  ``AutoGPTQConfig`` decides per Linear from ``modules_in_block_to_quantize`` (substring match on the module
  prefix; inferred from the safetensors dtypes when absent) and per layer, MoE included, from ``dynamic`` (a
  ``"-:REGEX"`` key skips every module whose prefix ``re.match``-es it). The MoE path reads only ``dynamic``, so the
  config carries both: ``modules_in_block_to_quantize: ["mlp.experts"]`` and negative ``dynamic`` rules for
  attention and the router.

Both need hidden and expert intermediate sizes that are multiples of 128 (:func:`geometry_problems`), so the tiny
default geometry (expert intermediate 64) has no quantized twin: pass ``--expert-intermediate 128``. Smaller FP8
blocks are not offered: vLLM's FP8 MoE method keys every block-quantized checkpoint as 128x128
(``kFp8Static128BlockSym``), the CPU W8A16 kernel supports only that, and ``validate_fp8_block_shape_moe`` wants
the gate/up outputs divisible by the block. GPTQ groups of 128 span whole blocks of ``in`` for both matrices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["pack_int4"]

QUANT_METHODS = ("fp8-block", "gptq-int4")
BLOCK = 128  # FP8 weight block, both dimensions (vLLM's CPU FP8 MoE kernel and DeepSeek-V3 checkpoints: 128x128)
GPTQ_GROUP = 128  # GPTQ group size along the input dimension
GPTQ_BITS = 4
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
# vLLM's per_block_cast_to_fp8 (vllm/utils/deep_gemm.py) floors a block's amax here, so an all-zero block gets a
# finite scale and quantizes to zeros.
_FP8_AMAX_FLOOR = 1e-4

_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj)\.weight$")
# Per decoder layer, the Linear modules that stay bf16 (names as vLLM prefixes them; the same as the checkpoint's).
_DENSE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate")


def geometry_problems(quant: str, hidden: int, expert_intermediate: int) -> list[str]:
    """What stops ``quant`` at this geometry (empty: it can be written). Messages say which flag fixes it."""
    if quant not in QUANT_METHODS:
        return [f"unknown quant {quant!r}; use one of {', '.join(QUANT_METHODS)}"]
    unit = BLOCK if quant == "fp8-block" else GPTQ_GROUP
    what = "128x128 weight blocks" if quant == "fp8-block" else "groups of 128 input channels"
    bad = [f"{name} {size}" for name, size in (("hidden", hidden), ("expert intermediate", expert_intermediate))
           if size % unit]
    if not bad:
        return []
    fix_i = max(unit, -(-expert_intermediate // unit) * unit)
    fix_h = max(unit, -(-hidden // unit) * unit)
    return [f"--quant {quant} stores {what}, so hidden and expert intermediate sizes must be multiples of {unit} "
            f"({', '.join(bad)} is not); pass e.g. --hidden {fix_h} --expert-intermediate {fix_i}"]


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/block), ceil(in/block)])``.

    The standard recipe, as vLLM's ``per_block_cast_to_fp8`` does it: per ``block x block`` tile (the edges padded
    with zeros), ``scale = max(amax, 1e-4) / 448``, ``q = (w * (1 / scale)).to(float8_e4m3fn)`` (round to nearest
    even; ``|w| / scale <= 448`` so nothing saturates). ``scale_inv`` is named after the checkpoints that store it
    (``weight_scale_inv``), but it is the multiplier that dequantizes: ``w ~= q * scale_inv`` tile by tile. Zeros
    stay exact zeros (the demo model's expert outputs never write the domain and bias coordinates; that survives).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block wants a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    nb_o, nb_i = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros((nb_o * block, nb_i * block), dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(nb_o, block, nb_i, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=_FP8_AMAX_FLOOR)
    scale = amax / FP8_E4M3_MAX
    q = (tiles * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q.view(nb_o * block, nb_i * block)[:out_f, :in_f].contiguous(), scale.view(nb_o, nb_i).contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 ``q * scale_inv`` tile by tile: what a W8A16 kernel multiplies with (for checks and tests)."""
    out_f, in_f = q.shape
    full = scale_inv.repeat_interleave(block, dim=0)[:out_f].repeat_interleave(block, dim=1)[:, :in_f]
    return q.float() * full


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack int 0..15 along ``dim`` (8 per int32, the first in the lowest nibble), as AutoGPTQ and vLLM do.

    Computed in int64 and wrapped into int32 explicitly (the top nibble lands on the sign bit), so the result does
    not depend on how a narrowing cast treats values above 2**31.
    """
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64, device=v.device) * GPTQ_BITS
    packed = (v << shifts).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def quantize_gptq_int4(w: torch.Tensor, group_size: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """``w [out, in]`` -> AutoGPTQ tensors ``qweight``, ``qzeros``, ``scales``, ``g_idx`` (4 bit, symmetric).

    Round to nearest with AutoGPTQ's symmetric quantizer (no calibration data here, so no Hessian updates: the
    layout and convention are GPTQ's, the values are what GPTQ starts from): per group of ``group_size`` input
    channels and per output channel, ``scale = 2 * amax / 15`` and zero point 8, ``q = clamp(round(w / scale) + 8,
    0, 15)``; dequantized ``(q - 8) * scale``. vLLM reads it as ``uint4b8`` (bias 8; it ignores ``qzeros`` for a
    symmetric checkpoint); ``qzeros`` holds AutoGPTQ's stored value, the zero point minus one (7), for loaders
    that do read it (``(q - (qzeros + 1)) * scale``).

    Layout (vLLM's ``_unpack_and_dequant_int4_gptq`` unpacks exactly this): ``qweight`` int32 ``[in/8, out]``, 8
    nibbles along ``in`` per int32, the first in the lowest bits; ``qzeros`` int32 ``[in/group, out/8]``, packed
    the same way along ``out``; ``scales`` float16 ``[in/group, out]``; ``g_idx`` int32 ``[in]`` = channel // group
    (``desc_act`` false: channels in order).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_gptq_int4 wants a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % group_size or out_f % 8:
        raise ValueError(f"GPTQ int4 needs in ({in_f}) a multiple of the group size {group_size} and out ({out_f}) "
                         "a multiple of 8")
    wt = w.float().t().reshape(in_f // group_size, group_size, out_f)  # [groups, group, out]
    amax = wt.abs().amax(dim=1, keepdim=True)
    maxq = 2**GPTQ_BITS - 1
    scale = 2.0 * amax / maxq
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)  # AutoGPTQ: an all-zero group gets scale 1
    # Quantize against the fp16 scale that is stored, so dequantizing the file reproduces the same grid.
    scale = scale.to(torch.float16).float()
    zero = (maxq + 1) // 2
    q = torch.clamp(torch.round(wt / scale) + zero, 0, maxq).to(torch.int32).reshape(in_f, out_f)
    zeros = torch.full((in_f // group_size, out_f), zero - 1, dtype=torch.int32, device=w.device)
    return {
        "qweight": pack_int4(q, dim=0),
        "qzeros": pack_int4(zeros, dim=1),
        "scales": scale.reshape(in_f // group_size, out_f).to(torch.float16).contiguous(),
        "g_idx": (torch.arange(in_f, dtype=torch.int32, device=w.device) // group_size).contiguous(),
    }


def quantize_expert_tensors(tensors: Mapping[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors with every routed expert's ``X.weight`` replaced by ``quant``'s tensors for ``X``.

    Everything else passes through untouched (same objects, same dtype). Computed on CUDA when there is one (a
    20 GB model's experts quantize in seconds there); the results come back to the CPU for safetensors.
    """
    if quant not in QUANT_METHODS:
        raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANT_METHODS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, w = m["prefix"], t.to(device)
        if quant == "fp8-block":
            q, scale_inv = quantize_fp8_block(w)
            out[f"{prefix}.weight"] = q.cpu()
            out[f"{prefix}.weight_scale_inv"] = scale_inv.cpu()
        else:
            out.update({f"{prefix}.{k}": v.cpu() for k, v in quantize_gptq_int4(w).items()})
    return out


def quantization_config(quant: str, num_layers: int) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``quant``: the experts quantized, every other Linear bf16."""
    dense = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _DENSE_LINEARS]
    if quant == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            # vLLM: ignored_layers, else modules_to_not_convert; exact prefixes. lm_head is an embedding-like
            # ParallelLMHead that Fp8Config never quantizes; listed for loaders that would.
            "modules_to_not_convert": [*dense, "lm_head"],
        }
    if quant == "gptq-int4":
        return {
            "quant_method": "gptq",
            "bits": GPTQ_BITS,
            "group_size": GPTQ_GROUP,
            "desc_act": False,
            "sym": True,
            "lm_head": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "static_groups": False,
            "checkpoint_format": "gptq",
            # Linear layers: quantized iff a listed substring is in the prefix. MoE layers: only `dynamic` is read.
            "modules_in_block_to_quantize": ["mlp.experts"],
            "dynamic": {r"-:.*\.self_attn\..*": {}, r"-:.*\.mlp\.gate$": {}},
        }
    raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANT_METHODS)}")
