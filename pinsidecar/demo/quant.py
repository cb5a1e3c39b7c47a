"""Quantized twins of the demo model: the routed experts in the on-disk layouts vLLM loads for real checkpoints.

Pin mode must handle quantized MoE checkpoints, and there is no model hub here, so ``pinsidecar demo-model DIR
--quant ...`` writes the same shaped model with its routed experts quantized. Only the experts
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj``) are quantized: they are what pin mode places, and keeping the
router, attention, norms, embeddings and LM head in bf16 keeps the routing *identical* to the bf16 twin (the router
is unchanged; only the experts' outputs move a little), so counts and maps of the bf16 model apply to its twin.

Five formats, each exactly what vLLM reads for the real thing (the FP4 quantizers are in
:mod:`pinsidecar.demo.quant_fp4`; ``mxfp4`` is a gpt-oss model of its own, :mod:`pinsidecar.demo.gpt_oss`):

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

- ``nvfp4`` (NVIDIA ModelOpt, ``quant_algo: NVFP4``, W4A4): ``X.weight`` uint8 ``[out, in/2]`` (e2m1, two a
  byte, low nibble first), ``X.weight_scale`` float8_e4m3fn ``[out, in/16]``, ``X.weight_scale_2`` float32 ``[]``
  and ``X.input_scale`` float32 ``[]``, the shapes vLLM 0.34 allocates in ``ModelOptNvFp4FusedMoE.create_weights``
  (``quantization/modelopt.py:946-1060``; the per-tensor scales become ``w13_weight_scale_2 [E, 2]``,
  ``w2_weight_scale_2 [E]``, ``w13_input_scale [E, 2]``, ``w2_input_scale [E]``, one scalar per expert and shard).
  ``config.json`` carries ModelOpt's current ``quantization_config`` (``quant_method: modelopt``, ``quant_algo``,
  ``group_size``, ``config_groups`` with non-null ``input_activations``: all-null ones would make vLLM treat the
  checkpoint as W4A16, ``modelopt.py:820-834``) and its exclusions under ``ignore``; ``hf_quant_config.json``
  carries the legacy form, whose ``quantization`` must hold ``group_size``, ``kv_cache_quant_algo`` and
  ``exclude_modules`` (``modelopt.py:845-856``). vLLM matches the list exactly, then by substring, then as
  ``fnmatch`` wildcards (``is_layer_excluded``, ``modelopt.py:198-233``); experts are quantized unless excluded
  (``:263-266``). No activations were seen, so ``input_scale`` is a *bound*, not a calibration:
  ``bound / (6 * 448)`` with ModelOpt's convention, where an expert's input is RMS-normed with weight 1 (``|x_i|
  <= sqrt(hidden)``) and the down projection's input ``silu(g) * u`` is bounded by ``hidden`` times the product
  of the largest gate and up row norms.
- ``awq-int4`` (AutoAWQ ``GEMM``, 4 bit, asymmetric, group 128): ``X.qweight`` int32 ``[in, out/8]`` packed along
  *out* in AWQ's order (nibble slot ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``; vLLM undoes it with
  ``_REVERSE_AWQ_PACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``, ``quantization/auto_awq.py:70-75``), ``X.qzeros`` int32
  ``[in/128, out/8]`` packed the same way, ``X.scales`` float16 ``[in/128, out]``. vLLM's ``AutoAWQConfig`` reads
  ``bits``/``w_bit``, ``group_size``/``q_group_size``, ``zero_point`` and ``modules_to_not_convert``, and skips a
  module, Linear or MoE, whose prefix *contains* a listed string (``match_mode="substring"``,
  ``auto_awq.py:296-300`` and ``:338-342``): ``["self_attn", "mlp.gate"]`` keeps attention and the router bf16
  (the router is a ``GateLinear`` built with the quant config, ``models/qwen3_moe.py:170-175``) and no expert
  prefix (``model.layers.N.mlp.experts``) contains either.

The 128-grid formats need hidden and expert intermediate sizes that are multiples of 128 (:func:`geometry_problems`),
so the tiny default geometry (expert intermediate 64) has no fp8-block, gptq-int4 or awq-int4 twin: pass
``--expert-intermediate 128``. NVFP4 needs multiples of 16 (its blocks) and MXFP4 multiples of 32: the default
geometry has both. Smaller FP8
blocks are not offered: vLLM's FP8 MoE method keys every block-quantized checkpoint as 128x128
(``kFp8Static128BlockSym``), the CPU W8A16 kernel supports only that, and ``validate_fp8_block_shape_moe`` wants
the gate/up outputs divisible by the block. GPTQ groups of 128 span whole blocks of ``in`` for both matrices.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from pinsidecar.demo import quant_fp4

__all__ = ["pack_int4"]

QUANT_METHODS = ("fp8-block", "gptq-int4", "awq-int4", "nvfp4", "mxfp4")
BLOCK = 128  # FP8 weight block, both dimensions (vLLM's CPU FP8 MoE kernel and DeepSeek-V3 checkpoints: 128x128)
GPTQ_GROUP = 128  # GPTQ group size along the input dimension
GPTQ_BITS = 4
AWQ_GROUP = 128  # AutoAWQ's default q_group_size, along the input dimension
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble slot i of an int32 holds column AWQ_PACK_ORDER[i]
# Each format's unit along hidden and expert intermediate: 128x128 FP8 tiles and int4 groups, NVFP4's block of 16,
# MXFP4's block of 32 (vLLM pads further per kernel; the format itself needs this).
_UNIT = {"fp8-block": BLOCK, "gptq-int4": GPTQ_GROUP, "awq-int4": AWQ_GROUP, "nvfp4": quant_fp4.NVFP4_GROUP,
         "mxfp4": quant_fp4.MXFP4_BLOCK}
_UNIT_WHAT = {"fp8-block": "128x128 weight blocks", "gptq-int4": "groups of 128 input channels",
              "awq-int4": "groups of 128 input channels", "nvfp4": "e2m1 blocks of 16 input channels",
              "mxfp4": "MX blocks of 32 input channels"}
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
    unit, what = _UNIT[quant], _UNIT_WHAT[quant]
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


def _int4_groups(w: torch.Tensor, group_size: int, fmt: str) -> tuple[int, int, torch.Tensor]:
    """``w [out, in]`` as float32 ``[in/group, group, out]`` (the groups int4 quantizers scale), with its shape;
    refuses a weight whose ``in`` is not whole groups or whose ``out`` does not pack 8 to an int32."""
    if w.dim() != 2:
        raise ValueError(f"{fmt} int4 wants a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % group_size or out_f % 8:
        raise ValueError(f"{fmt} int4 needs in ({in_f}) a multiple of the group size {group_size} and out "
                         f"({out_f}) a multiple of 8")
    return out_f, in_f, w.float().t().reshape(in_f // group_size, group_size, out_f)


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
    out_f, in_f, wt = _int4_groups(w, group_size, "GPTQ")
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


def pack_awq_int4(values: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` ints 0..15 -> int32 ``[rows, out/8]``, AutoAWQ's packing along ``out``: for columns
    ``8c .. 8c+7``, nibble slot ``i`` (bits ``4i .. 4i+3``) holds column ``8c + AWQ_PACK_ORDER[i]``."""
    rows, out_f = values.shape
    if out_f % 8:
        raise ValueError(f"AWQ packs 8 output channels per int32; out ({out_f}) is not a multiple of 8")
    grouped = values.reshape(rows, out_f // 8, 8)[..., list(AWQ_PACK_ORDER)]  # slot order
    return pack_int4(grouped.reshape(rows, out_f), dim=1)


def quantize_awq_int4(w: torch.Tensor, group_size: int = AWQ_GROUP) -> dict[str, torch.Tensor]:
    """``w [out, in]`` -> AutoAWQ GEMM tensors ``qweight``, ``qzeros``, ``scales`` (4 bit, zero point).

    AutoAWQ's asymmetric quantizer (``pseudo_quantize_tensor``), with no activation-aware search (no calibration
    data; the layout and rounding are AWQ's): per group of ``group_size`` input channels and per output channel,
    ``scale = max(max - min, 1e-5) / 15`` (stored fp16, and quantized against the stored value),
    ``zero = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w / scale) + zero, 0, 15)``; dequantized
    ``(q - zero) * scale``. ``qweight`` int32 ``[in, out/8]`` and ``qzeros`` int32 ``[in/group, out/8]`` are packed
    along ``out`` by :func:`pack_awq_int4`; ``scales`` float16 ``[in/group, out]``.
    """
    out_f, in_f, wt = _int4_groups(w, group_size, "AWQ")
    maxq = 2**GPTQ_BITS - 1
    hi, lo = wt.amax(dim=1, keepdim=True), wt.amin(dim=1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-5) / maxq).to(torch.float16).float()
    zero = torch.clamp(torch.round(-lo / scale), 0, maxq)
    q = torch.clamp(torch.round(wt / scale) + zero, 0, maxq).to(torch.int32).reshape(in_f, out_f)
    return {
        "qweight": pack_awq_int4(q),
        "qzeros": pack_awq_int4(zero.reshape(in_f // group_size, out_f).to(torch.int32)),
        "scales": scale.reshape(in_f // group_size, out_f).to(torch.float16).contiguous(),
    }


def _nvfp4_experts(experts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's ``{gate,up,down}_proj`` weights (keys ``P.weight``) -> ModelOpt NVFP4 tensors.

    Gate and up share one ``weight_scale_2`` and one ``input_scale`` (vLLM fuses them into ``w13``); the input
    scales are bounds (module docstring), in ModelOpt's convention ``amax / (6 * 448)``.
    """
    fp4_max = quant_fp4.E2M1_MAX * quant_fp4.FP8_E4M3_MAX
    by_proj = {name.rsplit(".", 2)[-2]: (name.removesuffix(".weight"), w) for name, w in experts.items()}
    gate, up = (by_proj[p][1].float() for p in ("gate_proj", "up_proj"))
    hidden = gate.shape[1]
    w13_amax = float(max(gate.abs().max(), up.abs().max()))
    w13_input = math.sqrt(hidden)  # RMS-normed, norm weight 1: |x_i| <= sqrt(hidden)
    w2_input = hidden * float(gate.norm(dim=1).max()) * float(up.norm(dim=1).max())  # |silu(g) u| <= |g| |u|
    out: dict[str, torch.Tensor] = {}
    for proj, amax, bound in (("gate_proj", w13_amax, w13_input), ("up_proj", w13_amax, w13_input),
                              ("down_proj", None, w2_input)):
        prefix, w = by_proj[proj]
        out.update({f"{prefix}.{k}": v.cpu() for k, v in quant_fp4.quantize_nvfp4(w, global_amax=amax).items()})
        out[f"{prefix}.input_scale"] = torch.tensor(max(bound, 1e-6) / fp4_max, dtype=torch.float32)
    return out


def quantize_expert_tensors(tensors: Mapping[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors with every routed expert's ``X.weight`` replaced by ``quant``'s tensors for ``X``.

    Everything else passes through untouched (same objects, same dtype). Computed on CUDA when there is one (a
    20 GB model's experts quantize in seconds there); the results come back to the CPU for safetensors.
    """
    if quant not in QUANT_METHODS:
        raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANT_METHODS)}")
    if quant == "mxfp4":
        raise ValueError("mxfp4 is a gpt-oss model of its own (pinsidecar.demo.gpt_oss), not an expert format of "
                         "the Qwen3-MoE demo model")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, torch.Tensor] = {}
    nvfp4: dict[str, dict[str, torch.Tensor]] = {}  # expert prefix -> its weights
    for name, t in tensors.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, w = m["prefix"], t.to(device)
        if quant == "nvfp4":  # needs the expert's three weights together: below
            nvfp4.setdefault(prefix.rsplit(".", 1)[0], {})[name] = w
            continue
        if quant == "fp8-block":
            q, scale_inv = quantize_fp8_block(w)
            out[f"{prefix}.weight"] = q.cpu()
            out[f"{prefix}.weight_scale_inv"] = scale_inv.cpu()
        else:
            quantize = quantize_gptq_int4 if quant == "gptq-int4" else quantize_awq_int4
            out.update({f"{prefix}.{k}": v.cpu() for k, v in quantize(w).items()})
    for experts in nvfp4.values():
        out.update(_nvfp4_experts(experts))
    return out


def hf_quant_config(quant: str, num_layers: int) -> dict[str, Any] | None:
    """``hf_quant_config.json`` for ``quant`` (ModelOpt's legacy file, which ModelOpt exports still write beside
    ``config.json``), or None where the format has none."""
    if quant != "nvfp4":
        return None
    qc = quantization_config(quant, num_layers)
    return {"producer": qc["producer"],
            "quantization": {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": None,
                             "group_size": qc["group_size"], "exclude_modules": qc["ignore"]}}


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
    if quant == "awq-int4":
        return {
            "quant_method": "awq",
            "bits": GPTQ_BITS,
            "group_size": AWQ_GROUP,
            "zero_point": True,
            "version": "gemm",
            # Substring match on the module prefix, for Linear and MoE layers alike (auto_awq.py:296-300, 338-342).
            "modules_to_not_convert": ["self_attn", "mlp.gate"],
        }
    if quant == "nvfp4":
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": quant_fp4.NVFP4_GROUP}
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": quant_fp4.NVFP4_GROUP,
            "producer": {"name": "modelopt", "version": "0.37.0"},
            "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
            "ignore": [*dense, "lm_head"],
        }
    raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANT_METHODS)}")
