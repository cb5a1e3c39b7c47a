"""Builders of quantized MoE layers for tests of the torch reference split: random weights, quantized properly.

A layer here is what pin mode re-homes: a mapping of vLLM's post-load parameter names to per-expert tensors
(dim 0 = the layer's experts), in one of the formats of :mod:`pinsidecar_hook.kernels.dequant`. The weights are
drawn from a seed (:func:`float_layer`), then quantized the way the checkpoints are (:func:`quantized_layer`):
fp8 e4m3 with ``amax / 448`` scales per 128 x 128 block, per expert or per output channel; int4 GPTQ with groups of
128 input rows (symmetric, or asymmetric with zero points), optionally in act-order (permuted ``g_idx``).
:func:`rehome_tensors` splits such a layer into its two tiers, every per-expert tensor in mirror, with
:func:`pinsidecar.testing.moe.rehome_weights`. Imports torch and the hook only (no pytest, no vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pinsidecar_hook.kernels.dequant import (
    DEFAULT_BLOCK_SHAPE,
    GPTQ_SYMMETRIC_ZERO,
    GPTQ_ZERO_OFFSET,
    KINDS,
    scheme_of,
)

from pinsidecar.demo.quant import pack_int4
from pinsidecar.testing import moe

__all__: list[str] = []  # nothing here is another package's business

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_INT4_MAX = 15


def float_layer(num_experts: int, hidden: int, inter: int, seed: int, dtype: torch.dtype = torch.bfloat16, *,
                bias: bool = False) -> dict[str, torch.Tensor]:
    """A random unquantized layer in ``dtype``: ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]`` (entries of
    standard deviation ``fan_in ** -0.5``, so activations keep their scale), and with ``bias`` ``w13_bias [E, 2I]``,
    ``w2_bias [E, H]``. The same seed gives the same weights, which :func:`quantized_layer` then quantizes."""
    g = torch.Generator().manual_seed(seed)
    layer = {
        "w13_weight": (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype),
        "w2_weight": (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype),
    }
    if bias:
        layer["w13_bias"] = (torch.randn(num_experts, 2 * inter, generator=g) / 10).to(dtype)
        layer["w2_bias"] = (torch.randn(num_experts, hidden, generator=g) / 10).to(dtype)
    return layer


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block keeps scale 1


def quantize_fp8_block(w: torch.Tensor, block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> ``(q float8_e4m3fn [E, N, K], scale_inv float32 [E, ceil(N/bn), ceil(K/bk)])``: one
    ``amax / 448`` scale per block (edge blocks partial), ``w ~= q * scale_inv``."""
    e, n, k = w.shape
    bn, bk = block_shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(e, nb * bn, kb * bk, dtype=torch.float32)
    padded[:, :n, :k] = w.to(torch.float32)
    blocks = padded.view(e, nb, bn, kb, bk)
    scale = _nonzero(blocks.abs().amax(dim=(2, 4)) / FP8_MAX)  # [E, nb, kb]
    q = _fp8(blocks, scale[:, :, None, :, None]).view(e, nb * bn, kb * bk)[:, :n, :k].contiguous()
    return q, scale


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> ``(q float8_e4m3fn, scale float32 [E])``: one ``amax / 448`` scale per expert."""
    scale = _nonzero(w.to(torch.float32).abs().amax(dim=(1, 2)) / FP8_MAX)
    return _fp8(w.to(torch.float32), scale.view(-1, 1, 1)), scale


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> ``(q float8_e4m3fn, scale float32 [E, N, 1])``: one ``amax / 448`` scale per output row."""
    scale = _nonzero(w.to(torch.float32).abs().amax(dim=2, keepdim=True) / FP8_MAX)
    return _fp8(w.to(torch.float32), scale), scale


def quantize_int4(w: torch.Tensor, g_idx: torch.Tensor, group_size: int = 128, *, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """GPTQ-style int4 of ``w [E, N, K]`` with input row ``k`` of expert ``e`` in group ``g_idx[e, k]``: returns
    ``qweight [E, K/8, N]``, ``scales [E, K/g, N]`` (``scale_dtype``), ``qzeros [E, K/g, N/8]`` (stored as the zero
    point minus one, AutoGPTQ's convention) and ``g_idx [E, K]`` (int32), so that ``w ~= (q - z) * s``.

    Symmetric: ``s = 2 amax / 15``, ``z = 8`` (every error at most ``s / 2``). Asymmetric: ``s = (max - min) / 15``
    over a range that includes 0, ``z = round(-min / s)`` kept in ``[1, 15]`` so that ``z - 1`` is a nibble."""
    e, n, k = w.shape
    groups = k // group_size
    w = w.to(torch.float32)
    idx = g_idx.to(torch.int64).unsqueeze(1).expand(e, n, k)
    if symmetric:
        amax = torch.zeros(e, n, groups).scatter_reduce(2, idx, w.abs(), "amax")
        scale = 2 * amax / _INT4_MAX
        zero = torch.full((e, n, groups), float(GPTQ_SYMMETRIC_ZERO))
    else:
        wmax = torch.zeros(e, n, groups).scatter_reduce(2, idx, w, "amax")  # include_self: the range covers 0
        wmin = torch.zeros(e, n, groups).scatter_reduce(2, idx, w, "amin")
        scale = (wmax - wmin) / _INT4_MAX
        zero = torch.round(-wmin / _nonzero(scale)).clamp(GPTQ_ZERO_OFFSET, _INT4_MAX)
    stored = _nonzero(scale).to(scale_dtype)
    s = stored.to(torch.float32)
    q = (torch.round(w / s.gather(2, idx)) + zero.gather(2, idx)).clamp(0, _INT4_MAX)
    return {
        "qweight": pack_int4(q.transpose(1, 2), dim=1),
        "scales": stored.transpose(1, 2).contiguous(),
        "qzeros": pack_int4((zero - GPTQ_ZERO_OFFSET).transpose(1, 2), dim=2),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def _g_idx(num_experts: int, k: int, group_size: int, act_order: bool, g: torch.Generator) -> torch.Tensor:
    """Each input row's group: sequential (``k // g``), or with act-order each expert's own permutation of rows
    into groups (so the row -> group map differs between experts)."""
    if not act_order:
        return (torch.arange(k) // group_size).expand(num_experts, k).clone()
    out = torch.empty(num_experts, k, dtype=torch.int64)
    for e in range(num_experts):
        out[e, torch.randperm(k, generator=g)] = torch.arange(k) // group_size
    return out


def quantized_layer(kind: str, num_experts: int, hidden: int, inter: int, seed: int,
                    dtype: torch.dtype = torch.bfloat16, *, bias: bool = False, act_order: bool = False,
                    symmetric: bool = True, group_size: int = 128,
                    block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE) -> dict[str, torch.Tensor]:
    """A random layer's per-expert tensors in format ``kind`` (:data:`pinsidecar_hook.kernels.dequant.KINDS`):
    :func:`float_layer` ``(num_experts, hidden, inter, seed, dtype)`` quantized. ``dtype`` is the original weights'
    dtype, and that of the int4 scales and the biases. ``kind="none"`` is the float layer itself. int4 options:
    ``act_order`` (permuted ``g_idx``), ``symmetric``, ``group_size``; fp8 block: ``block_shape``."""
    built = ("none", "int4_group", "fp8_block", "fp8_tensor", "fp8_channel")
    if kind not in built:
        # the 4-bit kinds (mxfp4, nvfp4, int4_awq) have builders of their own in tests/test_backends_4bit_ref.py
        raise ValueError(f"kind must be one of {built} (of the reference's {KINDS}), got {kind!r}")
    layer = float_layer(num_experts, hidden, inter, seed, dtype, bias=bias)
    if kind == "none":
        return layer
    out = {name: t for name, t in layer.items() if name.endswith("_bias")}
    g = torch.Generator().manual_seed(seed + 1)
    for side in ("w13", "w2"):
        w = layer[f"{side}_weight"]
        if kind == "int4_group":
            g_idx = _g_idx(num_experts, w.shape[2], group_size, act_order, g)
            for role, t in quantize_int4(w, g_idx, group_size, symmetric=symmetric, scale_dtype=dtype).items():
                out[f"{side}_{role}"] = t
        elif kind == "fp8_block":
            out[f"{side}_weight"], out[f"{side}_weight_scale_inv"] = quantize_fp8_block(w, block_shape)
        elif kind == "fp8_tensor":
            out[f"{side}_weight"], out[f"{side}_weight_scale"] = quantize_fp8_tensor(w)
        else:  # fp8_channel
            out[f"{side}_weight"], out[f"{side}_weight_scale"] = quantize_fp8_channel(w)
    return out


def rehome_tensors(tensors: Mapping[str, torch.Tensor], hot_ids: Sequence[int] | torch.Tensor,
                   cold_ids: Sequence[int] | torch.Tensor, *,
                   block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a layer into its tiers: ``(hot, cold)``, each per-expert tensor (dim 0 = experts) cut in mirror with
    ``hot_ids`` in hot rows ``0..H-1`` and ``cold_ids`` in cold rows, in the order given (byte copies, through
    :func:`pinsidecar.testing.moe.rehome_weights`); experts in neither list are left out (another rank's). Shared
    scalars go to both tiers unchanged. The tensors are told apart by :func:`scheme_of`, so an unknown tensor is
    refused here as the backend would refuse it."""
    scheme = scheme_of(tensors, block_shape)
    num_experts = tensors[scheme.per_expert[0]].shape[0]
    hot_list, cold_list = [int(e) for e in hot_ids], [int(e) for e in cold_ids]
    row_map = moe.row_map_tensor(num_experts, hot_list, cold_list)
    hot: dict[str, torch.Tensor] = {}
    cold: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in scheme.shared:
            hot[name] = cold[name] = t
        else:
            hot[name], cold[name] = moe.rehome_weights(t, row_map, len(hot_list))
    return hot, cold
