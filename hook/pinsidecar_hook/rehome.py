"""Re-home one MoE layer's per-expert tensors by a row map: hot rows into one tensor, cold rows into another.

After vLLM has loaded and processed (repacked) the weights, every per-expert tensor of a layer (weights, biases,
block scales: whatever has the local expert count as its first dimension) is split in mirror:

- the **hot** rows, in the map's hot order, into one tensor on the layer's device (HBM on a GPU);
- the **cold** rows, in the map's cold order, into a separate host tensor. On CUDA that tensor is pinned and the
  layer reads it in place through :func:`device_view_of_pinned`, marked ``_vllm_is_uva_offloaded`` so vLLM's
  kernels treat it as host-resident. On the CPU engine it is simply a second host tensor.

The layer's own ``Parameter`` objects are kept and re-pointed at the hot rows (``param.data = hot``), so anything
that holds a reference to them (vLLM's quant config holds the bias parameters) sees the hot tensor, and the
original storage is freed as soon as the last reference to it goes. Slicing one expert out of a repacked tensor
is valid: vLLM's CPU and GPU repacks are per expert (they never interleave experts).

Layers are re-homed one at a time, each finished (original freed) before the next starts, so the transient extra
memory is bounded by one layer, not by the model. A :class:`MemoryLedger` tracks every byte this module allocates
and frees per tier, which gives the peak without trusting allocator statistics that the CPU build lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pinsidecar_hook import vllm_seam

__all__ = ["TIERS", "MemoryLedger", "RehomedLayer", "TensorFate", "device_view_of_pinned", "expert_tensor_names",
           "memory_order", "plan_layer_tensors", "rehome_layer", "tensor_bytes"]

# The two residency tiers, by the names the stats file uses for their byte counts.
TIERS = ("hbm", "host")
# Module attributes that have the expert count as first dimension but are routing tables, not expert data.
_ROUTING_TABLE_HINTS = ("expert_map", "expert_mask", "routing", "global_to", "to_global", "_map",
                        "correction_bias")


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expert_tensor_names(owner: torch.nn.Module, local_num_experts: int) -> list[str]:
    """Names of ``owner``'s own parameters and buffers that hold one slice per local expert (dim 0 == count)."""
    names: list[str] = []
    for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
        if tensor is None or tensor.dim() == 0 or tensor.shape[0] != local_num_experts:
            continue
        if any(hint in name for hint in _ROUTING_TABLE_HINTS):
            continue
        names.append(name)
    return sorted(names)


@dataclass(frozen=True)
class TensorFate:
    """One tensor of an MoE layer and what re-homing does with it: ``split`` (per expert, hot and cold rows in
    mirror), ``alias`` (another name of a split tensor: follows it), ``shared`` (not per expert: both tiers read
    the one tensor), ``routing`` (a per-expert routing table, not expert data), or ``unknown`` (refused)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fate: str
    detail: str = ""
    alias_of: str = ""  # for an alias: the name of the tensor it is another name of

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.name} [{shape}] {self.dtype}: {self.fate}{f' ({self.detail})' if self.detail else ''}"


def plan_layer_tensors(owner: torch.nn.Module, local_num_experts: int, split_known: Sequence[str],
                       shared_known: Sequence[str]) -> list[TensorFate]:
    """Every parameter and buffer of ``owner`` (the module holding the layer's expert tensors), each with its fate.

    A tensor whose first dimension is the local expert count is per-expert data and must be one the backend splits
    (``split_known``); a tensor of one element, or one the backend names as shared (``shared_known``), is shared by
    both tiers. Anything else is ``unknown``: a scale, zero point or index the backend does not know could be
    per-expert data in another layout, and serving with it unsplit would read the wrong experts' values, so the
    caller refuses the boot, naming it."""
    fates: list[TensorFate] = []
    seen: dict[int, str] = {}
    items = [*owner.named_parameters(recurse=False, remove_duplicate=False),
             *owner.named_buffers(recurse=False, remove_duplicate=False)]
    for name, tensor in sorted(items, key=lambda item: item[0]):
        if tensor is None:
            continue
        shape, dtype = tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch.")
        first = seen.get(id(tensor))
        if first is not None:
            fates.append(TensorFate(name, shape, dtype, "alias", f"another name of {first}", first))
            continue
        seen[id(tensor)] = name
        per_expert = tensor.dim() > 0 and tensor.shape[0] == local_num_experts
        if any(hint in name for hint in _ROUTING_TABLE_HINTS):  # expert maps and masks: the router's, not data
            fates.append(TensorFate(name, shape, dtype, "routing"))
        elif per_expert:
            fates.append(TensorFate(name, shape, dtype, "split" if name in split_known else "unknown",
                                    "" if name in split_known else "per-expert, not split by this backend"))
        elif name in shared_known or tensor.numel() <= 1:
            fates.append(TensorFate(name, shape, dtype, "shared"))
        else:
            fates.append(TensorFate(name, shape, dtype, "unknown", "not per-expert and not known to be shared"))
    return fates


@dataclass
class MemoryLedger:
    """Bytes allocated and freed while re-homing, per tier; ``peak`` is the largest net extra seen at any point."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    peak_total: int = 0

    def alloc(self, tier: str, nbytes: int) -> None:
        self.current[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.current[tier])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def free(self, tier: str, nbytes: int) -> None:
        self.current[tier] -= nbytes


@dataclass
class RehomedLayer:
    """One layer's tensors after re-homing: ``hot[name]`` (device), ``cold[name]`` (what kernels read: the host
    tensor on CPU, its device view on CUDA) and ``cold_host[name]`` (the host storage itself, kept alive here)."""

    hot: dict[str, torch.Tensor]
    cold: dict[str, torch.Tensor]
    cold_host: dict[str, torch.Tensor]
    hot_bytes: int
    cold_bytes: int


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of ``t``'s dimensions from outermost to innermost in memory, the expert dimension first: the
    permutation that makes it contiguous. The identity for a contiguous tensor, and for any tensor whose expert
    dimension is not outermost or that is not dense (such a tensor is copied contiguous, as before)."""
    identity = tuple(range(t.dim()))
    if t.dim() < 2 or t.is_contiguous():
        return identity
    inner = sorted(range(1, t.dim()), key=lambda d: (-t.stride(d), d))
    order = (0, *inner)
    return order if t.permute(order).is_contiguous() else identity


def device_view_of_pinned(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor that reads the pinned host tensor ``host`` in place, over the bus (zero-copy): the one device
    view of pinned memory, used by re-homing in production and by the GPU tests and benchmark.

    With vLLM importable it is vLLM's own view (``get_accelerator_view_from_cpu_tensor`` through
    :func:`pinsidecar_hook.vllm_seam.accelerator_view`, the path ``--cpu-offload-gb`` uses). Without it, torch's:
    pinned (``cudaHostAlloc``'ed) memory is mapped into the device address space under UVA, so its host pointer
    is a valid device pointer, wrapped through the CUDA array interface (as bytes, since bf16 has no typestr).
    The view does not own the memory: it holds a reference to ``host`` (``_pinsidecar_host``), and the caller
    should keep ``host`` alive too for as long as the view is used.
    """
    if host.numel() == 0:  # an empty tier (an all-hot map): nothing to map, and empty tensors report unpinned
        return torch.empty(host.shape, dtype=host.dtype, device="cuda")
    if not host.is_pinned():
        raise ValueError("device_view_of_pinned needs pinned host memory (torch.empty(..., pin_memory=True))")
    view = vllm_seam.accelerator_view(host)
    if view is None:
        view = _cuda_array_interface_view(host)
    view._pinsidecar_host = host  # type: ignore[attr-defined]
    return view


def _cuda_array_interface_view(host: torch.Tensor) -> torch.Tensor:
    flat = host.reshape(-1).view(torch.uint8)
    iface = type("_PinnedHostView", (), {"__cuda_array_interface__": {
        "shape": (flat.numel(),), "typestr": "|u1", "data": (flat.data_ptr(), False), "version": 3, "strides": None}})
    return torch.as_tensor(iface(), device="cuda").view(host.dtype).view(host.shape)


def rehome_layer(
    owner: torch.nn.Module,
    names: Sequence[str],
    hot_local: Sequence[int],
    cold_local: Sequence[int],
    ledger: MemoryLedger,
    aliases: dict[str, str] | None = None,
    slot_rows: int = 0,
) -> RehomedLayer:
    """Split each of ``owner``'s per-expert tensors ``names`` into hot rows ``hot_local`` and cold rows
    ``cold_local`` (local expert indices, in row order), re-point the parameters at the hot rows, free the rest.

    Order inside the layer, chosen for the smallest transient: cold copy first (host grows by the cold bytes, which
    stay), then the hot copy (device grows by the hot bytes), then the original goes (device shrinks by all).
    ``aliases`` maps another attribute name of a split parameter to that parameter's name (vLLM's Marlin layers
    keep ``w13_weight`` as a second name of ``w13_qweight``): the tiers carry both names for the same tensors.
    ``slot_rows`` (the cache tier, :mod:`pinsidecar_hook.cache`) adds that many rows after the hot ones, zero until
    a fill.
    """
    device = next(iter(getattr(owner, n) for n in names)).device
    on_cuda = device.type == "cuda"
    hot_tier = "hbm" if on_cuda else "host"
    hot_idx = torch.tensor(list(hot_local), dtype=torch.long, device=device)
    cold_idx = torch.tensor(list(cold_local), dtype=torch.long, device=device)
    hot: dict[str, torch.Tensor] = {}
    cold: dict[str, torch.Tensor] = {}
    cold_host: dict[str, torch.Tensor] = {}
    hot_bytes = cold_bytes = 0
    for name in names:
        original = getattr(owner, name)
        data = original.data if isinstance(original, torch.nn.Parameter) else original
        original_bytes = tensor_bytes(data)
        # Rows are copied in the tensor's own memory order (a kernel may read a transposed view by its strides:
        # triton_kernels' swizzled MXFP4 weights), then shown in its logical order again.
        order = memory_order(data)
        back = tuple(order.index(d) for d in range(len(order)))
        src = data.permute(order)
        # cold rows -> host (pinned on CUDA, so the device can read them in place)
        host = torch.empty((len(cold_local), *src.shape[1:]), dtype=data.dtype, device="cpu", pin_memory=on_cuda)
        host.copy_(src.index_select(0, cold_idx))
        if on_cuda:  # give the staging copy's segment back now, or the next allocation splits it and strands it
            torch.cuda.empty_cache()
        ledger.alloc("host", tensor_bytes(host))
        if on_cuda:
            view = device_view_of_pinned(host).permute(back)
            view._vllm_is_uva_offloaded = True  # type: ignore[attr-defined]
        else:
            view = host.permute(back)
        # hot rows -> a fresh tensor on the layer's device
        if slot_rows:  # one allocation: the hot rows, then the slots
            hot_t = src.new_zeros((len(hot_local) + slot_rows, *src.shape[1:]))
            torch.index_select(src, 0, hot_idx, out=hot_t[: len(hot_local)])
        else:
            hot_t = src.index_select(0, hot_idx).contiguous()
        hot_t = hot_t.permute(back)
        ledger.alloc(hot_tier, tensor_bytes(hot_t))
        # the original goes: re-point the parameter (same object, so outside references follow) and drop ours
        if isinstance(original, torch.nn.Parameter):
            original.data = hot_t
            hot[name] = original
        else:
            setattr(owner, name, hot_t)
            hot[name] = hot_t
        del data, original
        if on_cuda:  # likewise the original's segment (tests/test_placement_gpu.py checks mem_get_info gets it back)
            torch.cuda.empty_cache()
        ledger.free(hot_tier, original_bytes)
        cold[name] = view
        cold_host[name] = host.permute(back)
        hot_bytes += tensor_bytes(hot_t)
        cold_bytes += tensor_bytes(host)
    for alias, target in (aliases or {}).items():
        if target in hot:
            hot[alias], cold[alias], cold_host[alias] = hot[target], cold[target], cold_host[target]
    if on_cuda:
        torch.cuda.empty_cache()  # so vLLM's KV sizing, which measures free memory, sees the freed HBM
    return RehomedLayer(hot=hot, cold=cold, cold_host=cold_host, hot_bytes=hot_bytes, cold_bytes=cold_bytes)

