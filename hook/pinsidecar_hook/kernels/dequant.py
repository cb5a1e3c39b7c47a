"""Dequantize MoE expert weights in plain torch: one expert's dense weight, computed from that expert's rows only.

Why it exists. The torch reference backend (:mod:`pinsidecar_hook.backends.torch_ref`) is the one backend whose
split is checked bit for bit against its own unsplit call. To do that for quantized layers it dequantizes each
expert's weights before that expert's GEMMs, here. It is a reference of the *arithmetic*, not of any engine
kernel: it reads the tensors in their plain (checkpoint) layouts and makes a dense weight in the activation dtype.

Why a split stays bit-identical. Every per-expert tensor is split along dim 0 in mirror (weights, scales, zero
points, ``g_idx``, biases), so expert ``e``'s row of each tensor holds the same bytes whichever tier it lives in.
The dense weight of ``e`` is a function of those rows only: elementwise operations, and gathers *within* the row
(a scale block, a group), with no reduction over experts. So it has the same bits in either tier, at any row of
the tier, and whether it is dequantized alone (:func:`dequant_expert`) or with its neighbours (:func:`dequant`).

Formats (:data:`KINDS`), with vLLM's post-load tensor names; per layer ``E`` local experts, ``H`` hidden, ``I``
expert intermediate, ``N = 2I`` for ``w13`` (gate rows then up rows) and ``N = H`` for ``w2``; ``K`` is the input
dimension (``H`` for ``w13``, ``I`` for ``w2``):

- ``none``: ``{w}_weight`` float ``[E, N, K]``, used as it is;
- ``fp8_block``: ``{w}_weight`` float8_e4m3fn ``[E, N, K]`` and ``{w}_weight_scale_inv`` float32
  ``[E, ceil(N/bn), ceil(K/bk)]`` (block ``(bn, bk)``, 128 x 128 by default): ``w = q * scale_inv`` of its block;
- ``fp8_tensor``: ``{w}_weight_scale`` float32 ``[E]``, one scale per expert (vLLM's online ``--quantization fp8``);
- ``fp8_channel``: ``{w}_weight_scale`` float32 ``[E, N, 1]``, one scale per output row;
- ``int4_group`` (GPTQ, the *checkpoint* layout, not Marlin's repacked one): ``{w}_qweight`` int32 ``[E, K/8, N]``
  (eight 4-bit values per int32 along the input dim, the low nibble first), ``{w}_scales`` fp16/bf16/fp32
  ``[E, K/g, N]``, optional ``{w}_qzeros`` int32 ``[E, K/g, N/8]`` (packed along the output dim, low nibble
  first) and optional ``{w}_g_idx`` int32 ``[E, K]`` (the group of each input row; permuted with act-order, else
  ``k // g``). ``w = (q - z) * s`` of the row's group.

  Zero-point convention (AutoGPTQ's v1 checkpoints): the stored nibble is the zero point *minus one*, so
  ``z = stored + 1`` (:data:`GPTQ_ZERO_OFFSET`); a symmetric layer stores 7 for ``z = 8``. Without ``qzeros`` the
  zero point is the symmetric 8 (:data:`GPTQ_SYMMETRIC_ZERO`, Marlin's ``uint4b8``);
- ``mxfp4`` (OCP MX FP4, gpt-oss): ``{w}_weight`` uint8 ``[E, N, K/2]``, two e2m1 values a byte, the low nibble
  first (the lower K index); ``{w}_weight_scale`` uint8 ``[E, N, K/32]``, one ue8m0 exponent per 32 input values:
  ``w = e2m1 * 2^(s - 127)`` (255 is NaN). gpt-oss layers have biases (bf16 at load). vLLM 0.34:
  ``quantization/mxfp4.py:201-292`` (``GptOssMxfp4MoEMethod.create_weights``: the shapes, uint8, ``mxfp4_block =
  32``, bf16 biases; ``Mxfp4MoEMethod.create_weights`` at ``:765-863`` is the same), the nibble order and the scale
  decode in ``fused_moe/flashinfer_moe_ep.py:184-204`` (``values[:, ::2] = lut[raw & 0x0F]``, ``scale.view(
  float8_e8m0fnu).float()``). *These are the pre-swizzle tensors*: ``process_weights_after_loading`` then converts
  them to a backend's layout (``fused_moe/oracle/mxfp4.py:917``), which the reference does not read.
  gpt-oss's ``w13`` rows are gate/up *interleaved* (gate = rows ``0::2``, up = rows ``1::2``: the loader slices
  ``2 * tp_rank_start : 2 * tp_rank_end`` at ``models/gpt_oss.py:602, 650``, and the CUTLASS conversion
  de-interleaves with ``w13_w[:, ::2, :], w13_w[:, 1::2, :]`` at ``fused_moe/oracle/mxfp4.py:1145``); the rows
  are dequantized as stored, and the activation (torch_ref's ``activation="swigluoai"``) reads them interleaved;
- ``nvfp4`` (ModelOpt NVFP4): ``{w}_weight`` uint8 ``[E, N, K/2]`` (e2m1, low nibble first), ``{w}_weight_scale``
  float8_e4m3fn ``[E, N, K/16]`` (one scale per 16 input values), ``{w}_weight_scale_2`` float32, the per-expert
  global dequant *multiplier*: ``w13`` ``[E, 2]`` (gate, up) as loaded, or ``[E]``; ``w2`` ``[E]``. ``w = e2m1 *
  (block_scale * scale_2)``, the gate rows with column 0 of a ``[E, 2]`` ``w13_weight_scale_2`` and the up rows
  with column 1. Optional per-expert ``w13_input_scale`` ``[E, 2]`` or ``[E]`` and ``w2_input_scale`` ``[E]``
  (activation global scales, not applied, but split with their rows like any per-expert tensor; both or neither).
  vLLM 0.34: ``quantization/modelopt.py:943-1069`` (``create_weights``: shapes, dtypes, ``group_size`` 16, the
  ``[E, 2]`` scale_2 and input scales), ``quantization/utils/nvfp4_emulation_utils.py:550-567`` (nibble order, the
  sign in bit 3) and ``:580-679`` (``sf.float() * global_scale``, then times the values; the ``[E, 2]`` scale_2
  per gate/up shard, ``invert_global_scales=False`` for ModelOpt at ``modelopt.py:928-941``). vLLM's own kernels
  keep only ``w13_weight_scale_2[:, 0]`` (``modelopt.py:1089-1098``, with a warning when the two differ); the
  reference dequantizes each shard with its own, which is the same whenever vLLM does not warn;
- ``int4_awq`` (AutoAWQ, the checkpoint layout ``AutoAWQMoEMethod`` loads, ``quantization/auto_awq.py:559-653``):
  ``{w}_qweight`` int32 ``[E, K, N/8]`` (eight 4-bit values per int32 along the *output* dim, in AWQ's order:
  output column ``8p + c`` is the nibble at bit ``4 * [0, 4, 1, 5, 2, 6, 3, 7][c]``, ``auto_awq.py:78`` and
  ``awq_triton.py:54-67``), ``{w}_scales`` fp16/bf16 ``[E, K/g, N]``, ``{w}_qzeros`` int32 ``[E, K/g, N/8]``
  (the same packing; the stored value *is* the zero point, no offset: ``awq_triton.py:86-101``). ``w = (q - z) *
  s`` of the row's group ``k // g``;
- any format may add ``w13_bias [E, 2I]`` and ``w2_bias [E, H]`` (both or neither).

Shared tensors. A scalar shared by all experts (a static activation scale, :data:`SHARED_TENSORS`, shape ``[]``
or ``[1]``) is not per-expert: it is passed unsplit to both tiers. The reference does not apply it. In an
``nvfp4`` layer the same names are per-expert (``[E, ...]``, split with their rows); only a 0-d one is shared.

Not modelled. Activation quantization: the a1/a2 scales of FP8 w8a8 (dynamic per token, or the static
``*_input_scale``) are not applied; the reference is weight-dequantization only, with activations in their own
dtype. Dequantized weights are rounded once to the activation dtype, so a bf16 run reads bf16 weights.

:func:`scheme_of` recognises the format from the tensors' names, dtypes and shapes and refuses, with a
``ValueError`` naming the tensor (its name, shape and dtype), anything it does not know: a tensor silently
ignored would make the reference compute something else than the layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "AWQ_PACK_ORDER",
    "DEFAULT_BLOCK_SHAPE",
    "E2M1_VALUES",
    "GPTQ_SYMMETRIC_ZERO",
    "GPTQ_ZERO_OFFSET",
    "KINDS",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "PER_EXPERT_TENSORS",
    "SHARED_TENSORS",
    "QuantScheme",
    "dequant",
    "dequant_expert",
    "expert_bias",
    "scheme_of",
]

KINDS = ("none", "fp8_block", "fp8_tensor", "fp8_channel", "int4_group", "mxfp4", "nvfp4", "int4_awq")
SIDES = ("w13", "w2")
DEFAULT_BLOCK_SHAPE = (128, 128)
GPTQ_ZERO_OFFSET = 1  # z = stored nibble + 1 (AutoGPTQ v1 checkpoints store the zero point minus one)
GPTQ_SYMMETRIC_ZERO = 8  # the zero point when no qzeros are given
FP8_DTYPES = (torch.float8_e4m3fn,)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NIBBLES = 8  # 4-bit values per int32
# e2m1 magnitudes by the nibble's low three bits; bit 3 is the sign (vLLM's kE2M1ToFloat,
# quantization/utils/nvfp4_emulation_utils.py:27-29, and its sign test at :560).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32  # input values per ue8m0 scale (OCP MX; vLLM's ``mxfp4_block = 32``, quantization/mxfp4.py:213)
NVFP4_BLOCK = 16  # input values per e4m3 block scale (ModelOpt NVFP4's group size)
MXFP4_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # vLLM stores uint8; the e8m0 view is the same bytes
# AWQ packs output column 8p + c into the nibble at bit 4 * AWQ_PACK_ORDER[c] of int32 p (vLLM's
# _REVERSE_AWQ_PACK_ORDER, quantization/auto_awq.py:78: AutoAWQ's pack order [0, 2, 4, 6, 1, 3, 5, 7] inverted).
AWQ_PACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# Per-expert tensor names by role, for each side ({w} = w13 or w2).
# Per-expert tensor names by role, for each side ({w} = w13 or w2). A family is told from the names; its kind then
# from dtypes ("fp8": fp8 per tensor / per channel, mxfp4 or nvfp4) or shapes ("int4_group": GPTQ or AWQ).
_FAMILY = {
    "fp8_block": ("weight_scale_inv",),
    "fp8": ("weight_scale", "weight_scale_2"),
    "int4_group": ("qweight", "scales", "qzeros", "g_idx"),
}
_BIAS = "bias"
_INPUT_SCALE = "input_scale"
# Scalars shared by all experts: static activation scales (not applied, see the module docstring). In an nvfp4
# layer the same names are per-expert, which is why they are in PER_EXPERT_TENSORS too.
SHARED_TENSORS = ("w13_input_scale", "w2_input_scale")
PER_EXPERT_TENSORS = tuple(
    f"{side}_{role}"
    for role in ("weight", *(r for roles in _FAMILY.values() for r in roles), _BIAS, _INPUT_SCALE)
    for side in SIDES
)


@dataclass(frozen=True)
class QuantScheme:
    """Which tensors one MoE layer (or one tier of it) has and what they mean.

    ``kind``: one of :data:`KINDS`; ``block_shape``: ``(rows, cols)`` of one fp8 scale block (``fp8_block``
    only); ``group_size``: input rows per int4 group (``int4_group`` and ``int4_awq``); ``zeros`` / ``g_idx``: the
    GPTQ layer has ``qzeros`` / ``g_idx`` (else the symmetric zero point / sequential groups; an AWQ layer always
    has zero points); ``bias``: the layer has ``w13_bias`` and ``w2_bias``; ``input_scales``: the nvfp4 layer has
    per-expert ``w13_input_scale`` and ``w2_input_scale`` (split with their rows, not applied); ``shared``: names
    of the tensors shared by all experts (passed unsplit to both tiers). Two tiers of one layer have equal schemes.
    """

    kind: str = "none"
    block_shape: tuple[int, int] | None = None
    group_size: int | None = None
    zeros: bool = False
    g_idx: bool = False
    bias: bool = False
    shared: tuple[str, ...] = ()
    input_scales: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QuantScheme.kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "fp8_block") != (self.block_shape is not None):
            raise ValueError("QuantScheme.block_shape is given for kind 'fp8_block' and only for it")
        if (self.kind in ("int4_group", "int4_awq")) != (self.group_size is not None):
            raise ValueError("QuantScheme.group_size is given for kinds 'int4_group' and 'int4_awq' and only for them")
        if self.kind != "int4_group" and (self.zeros or self.g_idx):
            raise ValueError("QuantScheme.zeros / g_idx are int4_group fields")
        if self.kind != "nvfp4" and self.input_scales:
            raise ValueError("QuantScheme.input_scales (per-expert activation scales) is an nvfp4 field")

    def names(self, side: str) -> tuple[str, ...]:
        """The per-expert tensors of one side (``"w13"`` or ``"w2"``) this scheme reads."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if self.kind == "none":
            roles: tuple[str, ...] = ("weight",)
        elif self.kind == "fp8_block":
            roles = ("weight", "weight_scale_inv")
        elif self.kind in ("fp8_tensor", "fp8_channel", "mxfp4"):
            roles = ("weight", "weight_scale")
        elif self.kind == "nvfp4":
            roles = ("weight", "weight_scale", "weight_scale_2", *((_INPUT_SCALE,) if self.input_scales else ()))
        elif self.kind == "int4_awq":
            roles = ("qweight", "scales", "qzeros")
        else:
            roles = ("qweight", "scales", *(("qzeros",) if self.zeros else ()), *(("g_idx",) if self.g_idx else ()))
        return tuple(f"{side}_{r}" for r in (*roles, *((_BIAS,) if self.bias else ())))

    @property
    def per_expert(self) -> tuple[str, ...]:
        """Every per-expert tensor this scheme reads (split in mirror along dim 0); the first is ``w13``'s
        weight (``w13_weight`` or ``w13_qweight``), whose dim 0 is the number of experts."""
        return (*self.names("w13"), *self.names("w2"))


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name} (shape {tuple(t.shape)}, dtype {t.dtype})"


def _expect(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
            dtypes: tuple[torch.dtype, ...]) -> None:
    t = tensors[name]
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{_describe(name, t)}: expected shape {shape}, dtype {want}")


def _refuse_unknown(tensors: Mapping[str, torch.Tensor]) -> None:
    unknown = [n for n in tensors if n not in PER_EXPERT_TENSORS and n not in SHARED_TENSORS]
    if unknown:
        listed = "; ".join(_describe(n, tensors[n]) for n in sorted(unknown))
        raise ValueError(f"unknown MoE expert tensor(s): {listed}. The torch reference knows the per-expert tensors "
                         f"{list(PER_EXPERT_TENSORS)} and the shared scalars {list(SHARED_TENSORS)}; it refuses any "
                         "other rather than compute without it")


def _shared_scalars(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> None:
    for n in names:
        if tensors[n].numel() != 1 or tensors[n].dim() > 1:
            raise ValueError(f"{_describe(n, tensors[n])}: a tensor shared by all experts must be a scalar (shape "
                             "[] or [1]); a per-expert activation scale is not supported")


def _kind_family(present: set[str]) -> str:
    families = {fam for fam, roles in _FAMILY.items() for side in SIDES for r in roles if f"{side}_{r}" in present}
    if len(families) > 1:
        raise ValueError(f"MoE tensors of more than one quantization format: {sorted(present)}")
    return families.pop() if families else "none"


def _kind_of(tensors: Mapping[str, torch.Tensor], family: str, present: set[str]) -> str:
    """Refine a family told by the names into a kind told by dtypes and shapes: packed uint8 weights make the
    ``weight_scale`` family FP4 (nvfp4 with its ``weight_scale_2`` or e4m3 block scales, else mxfp4); an int32
    ``qweight`` packed along the output dim (``[E, K, N/8]`` against ``scales [E, K/g, N]``) is AWQ, else GPTQ.
    ``"fp8"`` (per tensor or per channel) is resolved by :func:`_weight_scheme`."""
    if family == "fp8":
        w13 = tensors.get("w13_weight")
        if w13 is None or w13.dtype != torch.uint8:
            return "fp8"
        scale = tensors.get("w13_weight_scale")
        fp8_scale = scale is not None and scale.dtype in FP8_DTYPES
        return "nvfp4" if fp8_scale or any(n.endswith("_weight_scale_2") for n in present) else "mxfp4"
    if family == "int4_group":
        qweight, scales = tensors.get("w13_qweight"), tensors.get("w13_scales")
        if (qweight is not None and scales is not None and qweight.dim() == 3 and scales.dim() == 3
                and qweight.shape[2] != scales.shape[2] and qweight.shape[2] * _NIBBLES == scales.shape[2]):
            return "int4_awq"
    return family


_REQUIRED_ROLES = {
    "none": ("weight",),
    "fp8_block": ("weight", "weight_scale_inv"),
    "fp8": ("weight", "weight_scale"),
    "mxfp4": ("weight", "weight_scale"),
    "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "int4_group": ("qweight", "scales"),
    "int4_awq": ("qweight", "scales", "qzeros"),
}


def scheme_of(tensors: Mapping[str, torch.Tensor],
              block_shape: tuple[int, int] | None = DEFAULT_BLOCK_SHAPE) -> QuantScheme:
    """Recognise a layer's (or one tier's) quantization format from its tensors' names, dtypes and shapes.

    ``tensors`` maps vLLM's parameter names to tensors: the per-expert ones (dim 0 = the tier's experts, possibly
    0) and any shared scalars. ``block_shape`` is the fp8 scale block (``(bn, bk)``). Raises ``ValueError`` naming
    the tensor (name, shape, dtype) for an unknown tensor, a missing or surplus one, or a shape or dtype that does
    not fit the format: nothing is silently ignored. Shape and dtype checks only (no value is read, no host sync).
    """
    _refuse_unknown(tensors)
    shared = tuple(n for n in SHARED_TENSORS if n in tensors)
    present = {n for n in tensors if n in PER_EXPERT_TENSORS and n not in SHARED_TENSORS}
    kind = _kind_of(tensors, _kind_family(present), present)
    bias = any(f"{side}_{_BIAS}" in present for side in SIDES)
    required = [f"{side}_{r}" for side in SIDES for r in _REQUIRED_ROLES[kind]]
    if bias:
        required += [f"{side}_{_BIAS}" for side in SIDES]
    missing = [n for n in required if n not in tensors]
    if missing:
        have = "; ".join(_describe(n, tensors[n]) for n in sorted(present)) or "nothing"
        raise ValueError(f"MoE layer of format {kind!r} lacks {missing} (has {have})")

    if kind in ("mxfp4", "nvfp4"):
        scheme = _fp4_scheme(tensors, kind, bias, shared)
    else:
        _shared_scalars(tensors, shared)
        if kind == "int4_group":
            scheme = _int4_scheme(tensors, present, bias, shared)
        elif kind == "int4_awq":
            scheme = _awq_scheme(tensors, bias, shared)
        else:
            scheme = _weight_scheme(tensors, kind, block_shape, bias, shared)
    surplus = sorted(present - set(scheme.per_expert))
    if surplus:
        listed = "; ".join(_describe(n, tensors[n]) for n in surplus)
        raise ValueError(f"MoE tensor(s) {listed} do not belong to a {scheme.kind!r} layer "
                         f"(which has {list(scheme.per_expert)})")
    if bias:
        e, n13, h = _dims(tensors, scheme)
        _expect(tensors, "w13_bias", (e, n13), FLOAT_DTYPES)
        _expect(tensors, "w2_bias", (e, h), FLOAT_DTYPES)
    return scheme


def _dims(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int, int]:
    """``(E, N13, H)`` of a layer whose weights ``scheme_of`` has checked."""
    if scheme.kind == "int4_group":
        e, k8, n13 = tensors["w13_qweight"].shape
        return e, n13, k8 * _NIBBLES
    if scheme.kind == "int4_awq":
        e, h, n8 = tensors["w13_qweight"].shape
        return e, n8 * _NIBBLES, h
    e, n13, h = tensors["w13_weight"].shape
    return (e, n13, 2 * h) if scheme.kind in ("mxfp4", "nvfp4") else (e, n13, h)


def _weight_shapes(tensors: Mapping[str, torch.Tensor], w13: str, w2: str,
                   dtypes: tuple[torch.dtype, ...]) -> tuple[int, int, int, int]:
    """Check ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (dtype in ``dtypes``) agree; return ``(E, 2I, H, I)``."""
    for name in (w13, w2):
        t = tensors[name]
        if t.dim() != 3 or t.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{_describe(name, t)}: expected a 3-d per-expert weight of dtype {want}")
    e, n13, h = tensors[w13].shape
    if n13 % 2:
        raise ValueError(f"{_describe(w13, tensors[w13])}: gate and up rows stacked, so dim 1 must be even")
    _expect(tensors, w2, (e, h, n13 // 2), (tensors[w2].dtype,))
    return e, n13, h, n13 // 2


def _weight_scheme(tensors: Mapping[str, torch.Tensor], family: str, block_shape: tuple[int, int] | None,
                   bias: bool, shared: tuple[str, ...]) -> QuantScheme:
    if family == "none":
        _weight_shapes(tensors, "w13_weight", "w2_weight", FLOAT_DTYPES)
        return QuantScheme("none", bias=bias, shared=shared)
    e, n13, h, i = _weight_shapes(tensors, "w13_weight", "w2_weight", FP8_DTYPES)
    nk = {"w13": (n13, h), "w2": (h, i)}
    if family == "fp8_block":
        if block_shape is None or len(block_shape) != 2 or min(block_shape) <= 0:
            raise ValueError(f"fp8 block scales need a block shape (rows, cols), got {block_shape!r}")
        bn, bk = (int(b) for b in block_shape)
        for side, (n, k) in nk.items():
            _expect(tensors, f"{side}_weight_scale_inv", (e, math.ceil(n / bn), math.ceil(k / bk)), (torch.float32,))
        return QuantScheme("fp8_block", block_shape=(bn, bk), bias=bias, shared=shared)
    s13 = tensors["w13_weight_scale"]
    kind = "fp8_tensor" if s13.dim() == 1 else "fp8_channel"
    for side, (n, _k) in nk.items():
        _expect(tensors, f"{side}_weight_scale", (e,) if kind == "fp8_tensor" else (e, n, 1), (torch.float32,))
    return QuantScheme(kind, bias=bias, shared=shared)


def _expect_qweights(tensors: Mapping[str, torch.Tensor], layout: str, fmt: str) -> None:
    """Both sides' packed int4 ``{side}_qweight`` are 3-d int32 in ``fmt``'s checkpoint ``layout``."""
    for name in ("w13_qweight", "w2_qweight"):
        t = tensors[name]
        if t.dim() != 3 or t.dtype != torch.int32:
            raise ValueError(f"{_describe(name, t)}: expected int32 {layout} ({fmt} checkpoint layout, not "
                             "Marlin's repacked one)")


def _int4_scheme(tensors: Mapping[str, torch.Tensor], present: set[str], bias: bool,
                 shared: tuple[str, ...]) -> QuantScheme:
    _expect_qweights(tensors, "[E, K/8, N]", "GPTQ")
    e, k8, n13 = tensors["w13_qweight"].shape
    h = k8 * _NIBBLES
    if n13 % 2:
        raise ValueError(f"{_describe('w13_qweight', tensors['w13_qweight'])}: dim 2 (gate and up) must be even")
    i = n13 // 2
    if i % _NIBBLES:
        raise ValueError(f"{_describe('w13_qweight', tensors['w13_qweight'])}: the intermediate size {i} must be a "
                         f"multiple of {_NIBBLES} to pack w2's input dim")
    _expect(tensors, "w2_qweight", (e, i // _NIBBLES, h), (torch.int32,))
    zeros = {side: f"{side}_qzeros" in present for side in SIDES}
    g_idx = {side: f"{side}_g_idx" in present for side in SIDES}
    for what, flags in (("qzeros", zeros), ("g_idx", g_idx)):
        if flags["w13"] != flags["w2"]:
            raise ValueError(f"int4 layer has {what} for one side only ({flags}); give both or neither")
    nk = {"w13": (n13, h), "w2": (h, i)}
    group = _scale_groups(tensors, e, nk, "int4")
    for side, (n, k) in nk.items():
        if zeros[side]:
            if n % _NIBBLES:
                raise ValueError(f"{_describe(f'{side}_qzeros', tensors[f'{side}_qzeros'])}: N = {n} is not a "
                                 f"multiple of {_NIBBLES}")
            _expect(tensors, f"{side}_qzeros", (e, k // group, n // _NIBBLES), (torch.int32,))
        if g_idx[side]:
            _expect(tensors, f"{side}_g_idx", (e, k), (torch.int32,))
    return QuantScheme("int4_group", group_size=group, zeros=zeros["w13"], g_idx=g_idx["w13"], bias=bias,
                       shared=shared)


def _scale_groups(tensors: Mapping[str, torch.Tensor], e: int, nk: Mapping[str, tuple[int, int]], fmt: str) -> int:
    """The group size of an int4 layer (GPTQ or AWQ): each side's ``{side}_scales`` is ``[E, K/group, N]`` with the
    group dividing K (``nk``: side -> (N, K)), and both sides share one group size."""
    groups: dict[str, int] = {}
    for side, (n, k) in nk.items():
        s = tensors[f"{side}_scales"]
        if s.dim() != 3 or s.shape[0] != e or s.shape[2] != n or s.shape[1] == 0 or k % s.shape[1]:
            raise ValueError(f"{_describe(f'{side}_scales', s)}: expected [E, K/group, N] = [{e}, {k}/group, {n}] "
                             "with the group size dividing K")
        _expect(tensors, f"{side}_scales", tuple(s.shape), FLOAT_DTYPES)
        groups[side] = k // s.shape[1]
    if groups["w13"] != groups["w2"]:
        raise ValueError(f"{fmt} group sizes differ between w13 ({groups['w13']}) and w2 ({groups['w2']})")
    return groups["w13"]


def _fp4_scheme(tensors: Mapping[str, torch.Tensor], kind: str, bias: bool,
                shared: tuple[str, ...]) -> QuantScheme:
    """mxfp4 / nvfp4: packed e2m1 weights ``[E, N, K/2]``, one block scale per ``block`` input values, and for
    nvfp4 the per-expert global scales (and input scales, per-expert or a shared 0-d scalar)."""
    block = MXFP4_BLOCK if kind == "mxfp4" else NVFP4_BLOCK
    for name in ("w13_weight", "w2_weight"):
        t = tensors[name]
        if t.dim() != 3 or t.dtype != torch.uint8:
            raise ValueError(f"{_describe(name, t)}: expected a 3-d uint8 {kind} weight [E, N, K/2] (two e2m1 values "
                             "a byte, vLLM's pre-swizzle layout)")
    e, n13, h2 = tensors["w13_weight"].shape
    h = 2 * h2
    if n13 % 2:
        raise ValueError(f"{_describe('w13_weight', tensors['w13_weight'])}: gate and up rows stacked, so dim 1 must "
                         "be even")
    i = n13 // 2
    scale_what = "ue8m0 exponent" if kind == "mxfp4" else "e4m3 block scale"
    for name, k, what in (("w13_weight", h, "H"), ("w2_weight", i, "I")):
        if k % block:
            raise ValueError(f"{_describe(name, tensors[name])}: {kind} needs its input dim K = {what} = {k} to be a "
                             f"multiple of {block} (one {scale_what} per {block} input values along K)")
    _expect(tensors, "w2_weight", (e, h, i // 2), (torch.uint8,))
    scale_dtypes = MXFP4_SCALE_DTYPES if kind == "mxfp4" else FP8_DTYPES
    for side, (n, k) in {"w13": (n13, h), "w2": (h, i)}.items():
        _expect(tensors, f"{side}_weight_scale", (e, n, k // block), scale_dtypes)
    if kind == "mxfp4":
        _shared_scalars(tensors, shared)
        return QuantScheme("mxfp4", bias=bias, shared=shared)
    s13 = tensors["w13_weight_scale_2"]
    _expect(tensors, "w13_weight_scale_2", (e, 2) if s13.dim() == 2 else (e,), (torch.float32,))
    _expect(tensors, "w2_weight_scale_2", (e,), (torch.float32,))
    per_expert = tuple(n for n in shared if tensors[n].dim() > 0)
    if per_expert and len(per_expert) != len(SHARED_TENSORS):
        have = "; ".join(_describe(n, tensors[n]) for n in shared)
        raise ValueError(f"nvfp4 layer has per-expert input scales for one side only ({have}); give both "
                         "w13_input_scale [E, 2] or [E] and w2_input_scale [E], or neither")
    if per_expert:
        a13 = tensors["w13_input_scale"]
        _expect(tensors, "w13_input_scale", (e, 2) if a13.dim() == 2 else (e,), (torch.float32,))
        _expect(tensors, "w2_input_scale", (e,), (torch.float32,))
    return QuantScheme("nvfp4", bias=bias, input_scales=bool(per_expert),
                       shared=tuple(n for n in shared if n not in per_expert))


def _awq_scheme(tensors: Mapping[str, torch.Tensor], bias: bool, shared: tuple[str, ...]) -> QuantScheme:
    """AWQ: ``qweight [E, K, N/8]`` and ``qzeros [E, K/g, N/8]`` packed along the output dim, ``scales [E, K/g,
    N]``, ``w13`` with ``K = H, N = 2I`` and ``w2`` with ``K = I, N = H``."""
    _expect_qweights(tensors, "[E, K, N/8]", "AWQ")
    e, h, n8 = tensors["w13_qweight"].shape
    n13 = n8 * _NIBBLES
    i = n13 // 2
    if h % _NIBBLES:
        raise ValueError(f"{_describe('w13_qweight', tensors['w13_qweight'])}: the hidden size {h} must be a "
                         f"multiple of {_NIBBLES} to pack w2's output dim")
    _expect(tensors, "w2_qweight", (e, i, h // _NIBBLES), (torch.int32,))
    nk = {"w13": (n13, h), "w2": (h, i)}
    group = _scale_groups(tensors, e, nk, "AWQ")
    for side, (n, k) in nk.items():
        _expect(tensors, f"{side}_qzeros", (e, k // group, n // _NIBBLES), (torch.int32,))
    return QuantScheme("int4_awq", group_size=group, bias=bias, shared=shared)


def _unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along ``dim``, the low nibble first: ``[.., P, ..] -> [.., 8P, ..]`` (int32)."""
    shifts = torch.arange(0, 4 * _NIBBLES, 4, dtype=torch.int32, device=packed.device)
    dim = dim % packed.dim()
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = _NIBBLES
    q = (packed.unsqueeze(dim + 1) >> shifts.view(view)) & 0xF  # arithmetic shift; the mask keeps the nibble
    shape = list(packed.shape)
    shape[dim] *= _NIBBLES
    return q.reshape(shape)


def dequant(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, which: str, dtype: torch.dtype,
            rows: slice = slice(None)) -> torch.Tensor:
    """Dense weights ``[R, N, K]`` in ``dtype`` of the experts ``rows`` (a slice of dim 0, all by default) of one
    side (``which``: ``"w13"`` or ``"w2"``), in vLLM's layout (``w13 [R, 2I, H]``, ``w2 [R, H, I]``).

    Each expert's weight is computed from its own rows only (module docstring), so the result for an expert does
    not depend on which other experts are dequantized with it. Unquantized weights are returned as they are
    (a view, no copy) when already in ``dtype``."""
    if which not in SIDES:
        raise ValueError(f"which must be one of {SIDES}, got {which!r}")
    if scheme.kind == "none":
        return tensors[f"{which}_weight"][rows].to(dtype)
    if scheme.kind == "int4_group":
        return _dequant_int4(tensors, scheme, which, dtype, rows)
    if scheme.kind == "int4_awq":
        return _dequant_awq(tensors, which, dtype, rows)
    if scheme.kind in ("mxfp4", "nvfp4"):
        return _dequant_fp4(tensors, scheme, which, dtype, rows)
    w = tensors[f"{which}_weight"][rows].to(torch.float32)
    if scheme.kind == "fp8_block":
        assert scheme.block_shape is not None
        bn, bk = scheme.block_shape
        n, k = w.shape[1:]
        s = tensors[f"{which}_weight_scale_inv"][rows].to(torch.float32)
        s = s.repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
    elif scheme.kind == "fp8_tensor":
        s = tensors[f"{which}_weight_scale"][rows].to(torch.float32).view(-1, 1, 1)
    else:  # fp8_channel
        s = tensors[f"{which}_weight_scale"][rows].to(torch.float32)
    return (w * s).to(dtype)


def _dequant_int4(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, which: str, dtype: torch.dtype,
                  rows: slice) -> torch.Tensor:
    q = _unpack_nibbles(tensors[f"{which}_qweight"][rows], dim=1)  # [R, K, N]
    r, k, n = q.shape
    if scheme.g_idx:
        group = tensors[f"{which}_g_idx"][rows].to(torch.int64)  # [R, K]
    else:
        assert scheme.group_size is not None
        group = (torch.arange(k, device=q.device) // scheme.group_size).expand(r, k)
    index = group.unsqueeze(-1).expand(r, k, n)
    s = torch.gather(tensors[f"{which}_scales"][rows].to(torch.float32), 1, index)  # [R, K, N]
    if scheme.zeros:
        z = _unpack_nibbles(tensors[f"{which}_qzeros"][rows], dim=2) + GPTQ_ZERO_OFFSET  # [R, G, N]
        z = torch.gather(z, 1, index)
    else:
        z = torch.full((), GPTQ_SYMMETRIC_ZERO, dtype=torch.int32, device=q.device)
    w = (q - z).to(torch.float32) * s  # (q - z) is a small integer: the product is the scale's value, exactly
    return w.transpose(1, 2).contiguous().to(dtype)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 ``[.., P]`` -> ``[.., 8P]`` (int32): output column ``8p + c`` from the nibble at bit
    ``4 * AWQ_PACK_ORDER[c]`` of ``packed[.., p]``."""
    shifts = 4 * torch.tensor(AWQ_PACK_ORDER, dtype=torch.int32, device=packed.device)
    q = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask keeps the nibble
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * _NIBBLES)


def _dequant_awq(tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype, rows: slice) -> torch.Tensor:
    q = _unpack_awq(tensors[f"{which}_qweight"][rows])  # [R, K, N]
    k = q.shape[1]
    z = _unpack_awq(tensors[f"{which}_qzeros"][rows])  # [R, G, N], the zero point as stored
    s = tensors[f"{which}_scales"][rows].to(torch.float32)  # [R, G, N]
    group = torch.arange(k, device=q.device) // (k // s.shape[1])  # sequential groups: AWQ has no act-order
    w = (q - z.index_select(1, group)).to(torch.float32) * s.index_select(1, group)  # a small integer times s: exact
    return w.transpose(1, 2).contiguous().to(dtype)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[.., P]`` of two e2m1 values each, the low nibble first -> their float32 values ``[.., 2P]``."""
    lut = torch.tensor((*E2M1_VALUES, *(-v for v in E2M1_VALUES)), dtype=torch.float32, device=packed.device)
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(-1).to(torch.int64)
    # index_select rather than lut[nibbles]: the same values, and the CPU's advanced indexing is ~50x slower here
    return lut.index_select(0, nibbles).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _dequant_fp4(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, which: str, dtype: torch.dtype,
                 rows: slice) -> torch.Tensor:
    """``w = e2m1 * block scale`` (mxfp4: ``2^(s - 127)``; nvfp4: ``e4m3 * scale_2``, the product taken first, as
    vLLM's ``dequantize_to_dtype`` does), every factor read from the expert's own rows."""
    values = _e2m1(tensors[f"{which}_weight"][rows])  # [R, N, K]
    raw = tensors[f"{which}_weight_scale"][rows]
    if scheme.kind == "mxfp4":
        block = MXFP4_BLOCK
        scale = raw.view(torch.float8_e8m0fnu).to(torch.float32)  # 2^(s - 127) exactly, 255 -> NaN
    else:
        block = NVFP4_BLOCK
        scale_2 = tensors[f"{which}_weight_scale_2"][rows].to(torch.float32)  # [R] or w13's [R, 2] (gate, up)
        # w13's [R, 2]: row n is a gate row for n < I (column 0), an up row after (column 1) -> [R, N]; else [R, 1]
        scale_2 = scale_2.repeat_interleave(raw.shape[1] // 2, dim=1) if scale_2.dim() == 2 else scale_2.unsqueeze(1)
        scale = raw.to(torch.float32) * scale_2.unsqueeze(2)
    return (values * scale.repeat_interleave(block, dim=2)).to(dtype)


def dequant_expert(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, e: int, which: str = "w13",
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Expert (row) ``e``'s dense weight ``[N, K]`` of one side, in ``dtype``: the same bits as row ``e`` of
    :func:`dequant` over all rows, and the same in whichever tier (and row of it) the expert lives."""
    return dequant(tensors, scheme, which, dtype, slice(e, e + 1))[0]


def expert_bias(tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, e: int, which: str) -> torch.Tensor | None:
    """Expert ``e``'s bias of one side (``[2I]`` for ``w13``, ``[H]`` for ``w2``), or ``None`` without biases."""
    return tensors[f"{which}_{_BIAS}"][e] if scheme.bias else None
