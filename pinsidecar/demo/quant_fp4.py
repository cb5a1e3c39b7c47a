"""FP4 (e2m1) quantizers for the demo twins: MXFP4 as gpt-oss stores it, NVFP4 as NVIDIA ModelOpt stores it.

Both formats hold each weight as a 4-bit e2m1 code (1 sign bit, 2 exponent bits, 1 mantissa bit: the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes a byte, the *first* element of a pair in the *low* nibble: vLLM 0.34 decodes
``low = a & 0x0F`` then ``high = a >> 4`` and interleaves them low first
(``model_executor/layers/quantization/utils/nvfp4_emulation_utils.py:550-569``, ``break_fp4_bytes``; its e2m1 table
is at :27-29), and gpt-oss's reference and transformers' MXFP4 dequantizer do the same (``lut[blk & 0x0F]`` to the
even positions, ``lut[blk >> 4]`` to the odd ones). They differ in the scales:

- **MXFP4** (OCP MX): a block of 32 consecutive values along the input dimension shares a power-of-two scale,
  stored as a biased exponent in one byte (ue8m0, ``2 ** (byte - 127)``). The scale exponent is OCP MX's
  ``floor(log2(amax)) - 2`` (2 is e2m1's largest exponent), so the block's largest value lands in ``[4, 8)`` and
  anything above 6 saturates to 6. (vLLM's own Triton quantizer, ``utils/mxfp4_utils.py:269-281``, first rounds
  ``amax`` to a power of two, which saturates less; gpt-oss checkpoints were written by NVIDIA/OpenAI tooling and
  are *read* the same either way: the scale byte is all a loader sees.)
- **NVFP4** (ModelOpt): a block of 16 values shares a float8_e4m3fn scale, and the whole tensor one float32
  ``weight_scale_2``. Both are *decode multipliers* (``w ~= e2m1 * weight_scale * weight_scale_2``; vLLM's
  ``dequantize_nvfp4_moe_weights`` says so at ``nvfp4_emulation_utils.py:697-699``, ``invert_global_scales=False``
  for ModelOpt). ModelOpt's recipe: ``weight_scale_2 = amax(tensor) / (6 * 448)`` and
  ``weight_scale = (amax(block) / 6) / weight_scale_2`` cast to e4m3, so a block scale uses e4m3's full range.

Every quantizer rounds to nearest (ties to the even code, as hardware converts) against the scale that is
*stored*, so dequantizing the file reproduces exactly the grid the values were rounded on.
"""

from __future__ import annotations

import torch

__all__: list[str] = []  # used inside pinsidecar.demo and by the tests only

# The 8 non-negative e2m1 magnitudes, by code 0..7; code | 8 is the negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # largest e2m1 exponent: 6 = 1.5 * 2**2
MXFP4_BLOCK = 32  # OCP MX block along the input dimension
UE8M0_BIAS = 127
NVFP4_GROUP = 16  # ModelOpt NVFP4 block along the input dimension (config: group_size 16)
FP8_E4M3_MAX = 448.0

# Midpoints between consecutive magnitudes: |x| above midpoint j rounds up past it. At an exact midpoint the even
# code wins: below for midpoints 0, 2, 4, 6 (0.25, 1.25, 2.5, 5.0), above for 1, 3, 5 (0.75, 1.75, 3.5).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (1, 3, 5)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float values (already divided by their scale) -> e2m1 codes 0..15 (uint8), round to nearest, ties to even,
    magnitudes above 6 saturated to 6. Zero (of either sign) is code 0."""
    x = x.float()
    mag = x.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, mids, right=False)  # midpoints strictly below |x|: a tie rounds down...
    for j in _TIES_UP:  # ...unless the code above the midpoint is the even one
        code = code + (mag == _MIDPOINTS[j]).to(code.dtype)
    sign = ((x < 0) & (code > 0)).to(code.dtype) * 8
    return (code + sign).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.long)
    return table[c & 7] * torch.where((c & 8) > 0, -1.0, 1.0)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` codes -> ``[..., n]`` uint8, element ``2i`` in the low nibble, ``2i + 1`` in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., n]`` uint8 -> ``[..., 2n]`` codes (uint8)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blocks(w: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{what} wants a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % block:
        raise ValueError(f"{what} needs the input dimension ({in_f}) to be a multiple of its block of {block}")
    return w.float().reshape(out_f, in_f // block, block)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> gpt-oss's ``(blocks uint8 [out, in/32, 16], scales uint8 [out, in/32])``.

    Per block of 32 along ``in``: exponent ``e = floor(log2(amax)) - 2`` (an all-zero block gets the smallest
    exponent, -127, and codes 0), stored as ``e + 127``; codes ``e2m1(w / 2**e)``, packed low nibble first.
    """
    b = _blocks(w, MXFP4_BLOCK, "quantize_mxfp4")
    amax = b.abs().amax(dim=-1, keepdim=True)
    # frexp: amax = m * 2**k with m in [0.5, 1), so floor(log2(amax)) = k - 1, exactly (no log2 rounding).
    _, k = torch.frexp(amax)
    exp = torch.where(amax > 0, k - 1 - E2M1_EMAX, torch.full_like(k, -UE8M0_BIAS))
    exp = exp.clamp(-UE8M0_BIAS, UE8M0_BIAS)
    codes = e2m1_codes(b * torch.exp2(-exp.float()))
    blocks = pack_fp4(codes)  # [out, in/32, 16]
    scales = (exp.squeeze(-1) + UE8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., nb, 16]`` uint8 and ``scales [..., nb]`` ue8m0 -> float32 ``[..., nb * 32]``."""
    vals = e2m1_values(unpack_fp4(blocks))  # [..., nb, 32]
    vals = vals * torch.exp2(scales.float() - UE8M0_BIAS).unsqueeze(-1)
    return vals.reshape(*vals.shape[:-2], vals.shape[-2] * vals.shape[-1])


def quantize_nvfp4(w: torch.Tensor, global_amax: float | None = None) -> dict[str, torch.Tensor]:
    """``w [out, in]`` -> ModelOpt's ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn
    ``[out, in/16]``, ``weight_scale_2`` float32 ``[]``.

    ``global_amax`` (default: ``w``'s own) sets ``weight_scale_2 = global_amax / (6 * 448)``: pass the larger amax
    of ``gate_proj`` and ``up_proj`` to give the two the one global scale vLLM fuses them under (it keeps
    ``w13_weight_scale_2[:, 0]`` and warns when the two differ, ``modelopt.py:1091-1098``).
    """
    b = _blocks(w, NVFP4_GROUP, "quantize_nvfp4")
    amax = float(w.float().abs().max()) if global_amax is None else float(global_amax)
    scale_2 = torch.tensor(amax / (E2M1_MAX * FP8_E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32)
    block_amax = b.abs().amax(dim=-1, keepdim=True)
    block_scale = (block_amax / E2M1_MAX / scale_2).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    stored = block_scale.float() * scale_2  # the decode multiplier the file holds
    safe = torch.where(stored > 0, stored, torch.ones_like(stored))
    codes = torch.where(stored > 0, e2m1_codes(b / safe).to(torch.int16), torch.zeros_like(b, dtype=torch.int16))
    return {
        "weight": pack_fp4(codes.reshape(w.shape)),
        "weight_scale": block_scale.squeeze(-1).contiguous(),
        "weight_scale_2": scale_2,
    }


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float32 ``e2m1 * weight_scale * weight_scale_2`` per block of 16: what a W4A16 kernel multiplies with."""
    vals = e2m1_values(unpack_fp4(weight))  # [out, in]
    in_f = vals.shape[1]
    scale = weight_scale.float().repeat_interleave(NVFP4_GROUP, dim=1)[:, :in_f]
    return vals * scale * weight_scale_2.float()
