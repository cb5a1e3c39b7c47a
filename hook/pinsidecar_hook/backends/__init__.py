"""Pin mode's split backends: the contract each one states, the registry of them, and the rule that picks one.

A *split backend* replaces one MoE layer's experts call (vLLM's ``FusedMoEExpertsModular.apply``) with a split
invoke: partition each token's top-k ids by residency (hot rows in HBM, cold rows in pinned host memory), count
them live, run the experts kernel over each tier, and reduce each token's k rows once, in a fixed order. vLLM
states its fused-MoE stage contracts as base classes; ours is the :class:`SplitBackend` protocol, which each
backend module satisfies with module-level names:

- ``NAME``: its canonical name (``PINSIDECAR_PIN_BACKEND`` accepts it, or a short alias;
  :data:`pinsidecar_hook.contract.env.PIN_BACKENDS` lists them, and this registry refuses to import when the two
  lists differ);
- ``SPLIT_TENSORS``: the per-expert tensors it knows how to split (a layer with any other is refused at boot:
  ignoring a tensor would silently compute something else);
- ``REQUIRED_TENSORS``: the per-expert tensors it cannot work without;
- ``make_split_apply(experts, layer)``: the replacement for ``experts.apply``, built once per layer from vLLM's
  experts object and the layer's pin state (:class:`SplitLayer`).

The registry (:data:`BACKEND_MODULES`) maps each name to its module, imported only when chosen, so a backend whose
library is absent (FlashInfer, Triton) costs nothing until asked for. :func:`select_backend` picks one when the
setting is ``auto``, by these rules, in order:

1. the layer's weights are on the CPU and its experts object is vLLM's ``CPUUnquantizedExperts`` -> ``cpu``;
2. the experts object is vLLM's ``TritonExperts`` -> ``triton_experts``;
3. the experts object is vLLM's ``TrtLlmMxfp4ExpertsModular`` -> ``flashinfer_trtllm``;
4. anything else is refused, naming the device and the experts class. ``torch_ref`` is never picked
   automatically: it is a reference (a Python loop over experts, with its own arithmetic), and an engine must
   not silently serve with another kernel than the one it was configured with. Set
   ``PINSIDECAR_PIN_BACKEND=torch_ref`` to ask for it.

The class checks are vLLM's own classes, through :mod:`pinsidecar_hook.vllm_seam`; there is no matching on class
names or probing of attributes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.contract.env import AUTO_BACKEND, PIN_BACKENDS

__all__ = ["BACKEND_MODULES", "BackendUnavailable", "SplitBackend", "SplitLayer", "load_backend", "select_backend"]

# name -> module; one file per backend. Import-time check below: exactly the contract's names, in its order.
BACKEND_MODULES = {
    "cpu": "pinsidecar_hook.backends.cpu",
    "triton_experts": "pinsidecar_hook.backends.triton_experts",
    "flashinfer_trtllm": "pinsidecar_hook.backends.flashinfer_trtllm",
    "torch_ref": "pinsidecar_hook.backends.torch_ref",
}
if tuple(BACKEND_MODULES) != PIN_BACKENDS:
    raise ImportError(f"backend registry {tuple(BACKEND_MODULES)} differs from contract.env.PIN_BACKENDS "
                      f"{PIN_BACKENDS}; keep the two lists the same")


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot be used here (its library is missing, or nothing fits the layer)."""


class SplitLayer(Protocol):
    """One layer's pin state, as a backend reads it (pin mode's ``LayerPin``)."""

    row_map: torch.Tensor  # int32 [global experts]: hot rows 0..H-1, cold rows H.., -1 not on this rank
    hot_rows: int
    cold_rows: int
    hot: dict[str, torch.Tensor]  # per-expert tensors of the hot rows, by parameter name
    cold: dict[str, torch.Tensor]  # the same for the cold rows (a device view of host memory on CUDA)
    expert_counts: torch.Tensor  # int64 [global experts]: live selections per expert
    cold_counts: torch.Tensor  # int64 [1]: live selections landing on a cold row
    token_counts: torch.Tensor  # int64 [1]: tokens through this layer


@runtime_checkable
class SplitBackend(Protocol):
    """The contract a backend module states (see the package docstring)."""

    NAME: str
    SPLIT_TENSORS: tuple[str, ...]
    REQUIRED_TENSORS: tuple[str, ...]

    def make_split_apply(self, experts: Any, layer: SplitLayer) -> Callable[..., Any]: ...


def load_backend(name: str) -> SplitBackend:
    """Import the backend registered as ``name`` and check that it states the contract."""
    if name not in BACKEND_MODULES:
        raise BackendUnavailable(f"unknown pin backend {name!r}; registered: {', '.join(BACKEND_MODULES)}")
    try:
        module: Any = importlib.import_module(BACKEND_MODULES[name])
    except ImportError as exc:
        raise BackendUnavailable(f"pin backend {name!r} cannot be imported here ({exc})") from exc
    if not isinstance(module, SplitBackend) or name != module.NAME:
        raise BackendUnavailable(f"module {BACKEND_MODULES[name]} does not state the SplitBackend contract "
                                 f"(NAME == {name!r}, SPLIT_TENSORS, REQUIRED_TENSORS, make_split_apply)")
    return module


def select_backend(requested: str, device: torch.device, experts: Any) -> str:
    """The backend to use: ``requested`` unless it is ``auto``, else by the rules of the package docstring."""
    if requested != AUTO_BACKEND:
        return requested
    if device.type == "cpu" and vllm_seam.is_cpu_unquantized_experts(experts):
        return "cpu"
    if vllm_seam.is_triton_experts(experts):
        return "triton_experts"
    if vllm_seam.is_trtllm_mxfp4_experts(experts):
        return "flashinfer_trtllm"
    raise BackendUnavailable(
        f"no split backend for experts {type(experts).__name__} on {device.type}: auto picks cpu "
        "(CPUUnquantizedExperts on the CPU), triton_experts (TritonExperts) or flashinfer_trtllm "
        "(TrtLlmMxfp4ExpertsModular). Run with one of those experts, or set PINSIDECAR_PIN_BACKEND (torch_ref is "
        "a slow reference that runs anywhere)")
