"""Pin mode's split backends: load one by name, or let ``auto`` ask each in turn whether it fits the layer.

A *split backend* replaces one MoE layer's experts call (vLLM's ``FusedMoEExpertsModular.apply``) with a split
invoke: partition each token's top-k ids by residency (hot rows in HBM, cold rows in pinned host memory), count
them live, run the experts kernel over each tier, and reduce each token's k rows once, in a fixed order. Each
backend is a :class:`~pinsidecar_hook.backends.base.SplitBackend` subclass in a module of its own; the one
registry of names is :data:`pinsidecar_hook.contract.backends.BACKENDS`.

:func:`select_backend` with ``auto`` walks the registry in order and takes the first backend whose class may be
picked automatically (``AUTO``) and whose :meth:`~SplitBackend.supports` accepts the layer's experts object (its
class and its quant config): ``cpu`` (vLLM's ``CPUUnquantizedExperts``), ``triton_experts`` (``TritonExperts``:
bf16, FP8 block, per-channel and per-tensor), ``marlin_experts`` (``MarlinExperts``: weight-only int4/int8/FP8).
``flashinfer_trtllm`` has never run on hardware and ``torch_ref`` is a slow reference: ``auto`` never picks them;
name them in ``PINSIDECAR_PIN_BACKEND`` to use them. When nothing fits, the error names the experts class, the
quant method and every backend's reason, and for a class vLLM is known to pick (:mod:`.refused`) the vLLM flag that
gives a class pinsidecar splits, or that none does yet.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from pinsidecar_hook.backends.base import BackendUnavailable, SplitBackend, SplitLayer, UnsupportedSplit
from pinsidecar_hook.backends.refused import advice
from pinsidecar_hook.contract.backends import AUTO_BACKEND, BACKENDS
from pinsidecar_hook.vllm_seam import vllm_class

__all__ = ["BackendUnavailable", "SplitBackend", "SplitLayer", "UnsupportedSplit", "describe_experts",
           "load_backend", "select_backend"]

_ENTRIES = {entry.name: entry for entry in BACKENDS}


def load_backend(name: str) -> type[SplitBackend]:
    """The backend class registered as ``name`` (its module is imported now)."""
    entry = _ENTRIES.get(name)
    if entry is None:
        raise BackendUnavailable(f"unknown pin backend {name!r}; registered: {', '.join(_ENTRIES)}")
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        raise BackendUnavailable(f"pin backend {name!r} cannot be imported here ({exc})") from exc
    cls = getattr(module, entry.cls, None)
    if not (isinstance(cls, type) and issubclass(cls, SplitBackend)) or name != cls.NAME:
        raise BackendUnavailable(f"{entry.module}.{entry.cls} is not the SplitBackend named {name!r}")
    return cls


def describe_experts(experts: Any) -> str:
    """``TritonExperts (quant: fp8_w8a8, block [128, 128])``: what an operator needs to read in a refusal."""
    qc = getattr(experts, "quant_config", None)
    quant = "none"
    if qc is not None:
        dtype = getattr(qc, "quant_dtype", None)
        weight = getattr(getattr(qc, "_w1", None), "dtype", None)
        parts = [f"activations {dtype}" if dtype is not None else "activations unquantized"]
        if weight is not None:
            parts.append(f"weights {weight}")
        block = getattr(qc, "block_shape", None)
        if block:
            parts.append(f"block {list(block)}")
        if getattr(qc, "per_act_token_quant", False):
            parts.append("per-token activation scales")
        if getattr(qc, "per_out_ch_quant", False):
            parts.append("per-channel weight scales")
        quant = ", ".join(parts)
    return f"{type(experts).__name__} (quant: {quant})"


def select_backend(requested: str, device: torch.device, experts: Any) -> type[SplitBackend]:
    """The backend class for this layer: ``requested`` unless it is ``auto`` (then by the rules of the package
    docstring). A requested backend must still accept the layer (:meth:`SplitBackend.supports`)."""
    if requested != AUTO_BACKEND:
        cls = load_backend(requested)
        reason = cls.supports(experts, device)
        if reason is not None:
            raise BackendUnavailable(f"pin backend {requested!r} cannot split {describe_experts(experts)} on "
                                     f"{device.type}: {reason}")
        return cls
    reasons: list[str] = []
    for entry in BACKENDS:
        try:
            cls = load_backend(entry.name)
        except BackendUnavailable as exc:
            reasons.append(f"{entry.name}: {exc}")
            continue
        if not cls.AUTO:
            reasons.append(f"{entry.name}: never picked by auto (set PINSIDECAR_PIN_BACKEND={entry.name})")
            continue
        reason = cls.supports(experts, device)
        if reason is None:
            return cls
        reasons.append(f"{entry.name}: {reason}")
    what_to_do = advice(vllm_class(experts).__name__) or (
        "Serve this model in count mode (counting needs no split), or run it with experts and a quantization one of "
        "these backends supports")
    raise BackendUnavailable(
        f"no split backend for experts {describe_experts(experts)} on {device.type}. Tried: " + "; ".join(reasons)
        + f". {what_to_do}")
