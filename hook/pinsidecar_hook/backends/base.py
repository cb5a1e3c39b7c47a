"""What a split backend is: a class, built once per layer at attach, whose :meth:`SplitBackend.apply` replaces
vLLM's experts call for that layer.

vLLM states its fused-MoE stages as classes (``FusedMoEExpertsModular``, picked by a factory per quantization);
ours follow that shape. A backend class says what it can split (:meth:`SplitBackend.supports`, asked once per
layer before anything is moved), which per-expert tensors it knows (:attr:`SplitBackend.SPLIT_TENSORS`: a layer
with any other is refused, since ignoring a tensor would silently compute something else), and whether it has
run on the hardware it targets (:attr:`SplitBackend.VERIFIED`). Its constructor builds everything a call needs
(the tier experts objects with their tier's quant config, the tier maps, the finalize choice); :meth:`apply`
then only partitions, runs the tiers and finalizes. Nothing of vLLM's is patched per call: the layer's experts
object is switched once, at attach, to a subclass of its own class whose ``apply`` calls the split
(:func:`pinsidecar_hook.vllm_seam.install_split`).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol

import torch

__all__ = ["BackendUnavailable", "SplitBackend", "SplitLayer", "UnsupportedSplit"]


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot be used here (its library is missing, or nothing fits the layer)."""


class UnsupportedSplit(RuntimeError):
    """The experts object is configured in a way this backend's split cannot reproduce bit for bit."""


class SplitLayer(Protocol):
    """One layer's pin state, as a backend reads it (pin mode's ``LayerPin``)."""

    row_map: torch.Tensor  # int32 [global experts]: hot rows 0..H-1, cold rows H.., -1 not on this rank
    hot_rows: int
    cold_rows: int
    hot: dict[str, torch.Tensor]  # per-expert tensors of the hot rows, by parameter name
    cold: dict[str, torch.Tensor]  # the same for the cold rows (a device view of host memory on CUDA)
    expert_counts: torch.Tensor  # int64 [global experts]: live selections per expert
    cold_counts: torch.Tensor  # int64 [1]: live selections landing on a cold row (with a cache: the misses)
    token_counts: torch.Tensor  # int64 [1]: tokens through this layer
    cache: Any  # pinsidecar_hook.cache.ExpertCache or None; its slots are the last cache_slots of the HBM rows
    cache_slots: int
    cache_key: int


class SplitBackend(abc.ABC):
    """One layer's split invoke. Subclasses set the class attributes and implement :meth:`supports` and
    :meth:`apply`; the registry (:mod:`pinsidecar_hook.contract.backends`) says where each class lives."""

    NAME: ClassVar[str]
    # Per-expert tensors (dim 0 = local experts) this backend splits and reads, by layer parameter name.
    SPLIT_TENSORS: ClassVar[tuple[str, ...]]
    REQUIRED_TENSORS: ClassVar[tuple[str, ...]] = ("w13_weight", "w2_weight")
    # Tensors of the layer that are not per expert and that the backend leaves shared by both tiers (a per-tensor
    # input scale, say). Anything else on the layer that is not per expert is listed as "shared" by the re-homing
    # plan too, but only after a check that it cannot be per-expert data in another layout.
    SHARED_TENSORS: ClassVar[tuple[str, ...]] = ()
    # Has run on the hardware it targets, bit-identical to vLLM's unsplit kernel. An unverified backend still runs
    # when asked for by name, with a warning at boot, and `pinsidecar status` says so.
    VERIFIED: ClassVar[bool] = True
    # May ``auto`` pick it? A reference (torch_ref) or an adapter that never ran (FlashInfer) may not.
    AUTO: ClassVar[bool] = True
    # Equal to the unsplit kernel bit for bit (what the self-check compares). The CPU kernel reduces inside, so
    # its split guarantees placement invariance instead (backends/cpu.py).
    BIT_IDENTICAL: ClassVar[bool] = True
    # Runs the cache tier (pinsidecar_hook.cache): calls ``layer.cache.step`` before its tiers, treats the slots as
    # HBM rows, and lets the cache count the misses. A map with cache slots is refused on a backend without it.
    CACHE: ClassVar[bool] = False

    def __init__(self, experts: Any, layer: SplitLayer) -> None:
        self.experts = experts
        self.layer = layer

    @classmethod
    @abc.abstractmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        """``None`` when this backend can split ``experts`` (its class and its quant config) on ``device``, else
        the reason it cannot, in words an operator can act on. Asked at attach, before anything is moved."""

    @abc.abstractmethod
    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        """vLLM's ``FusedMoEExpertsModular.apply``: write the layer's experts output into ``output``. The weights
        vLLM passes (the layer's parameters, which now hold only the hot rows) are not used; the layer state holds
        both tiers."""

    def refresh(self) -> None:
        """The layer's row map was flipped in place (an in-place apply): recompute, in place, whatever this split
        derived from it. Called on the same stream, right after the flip. Most backends derive nothing."""
        return
