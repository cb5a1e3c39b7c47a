"""The one registry of pin mode's split backends: names, short names, and where each class lives.

Torch-free data, in the contract because both sides need the names: the hook to load a backend, the daemon to
validate ``PINSIDECAR_PIN_BACKEND`` in a config before it boots anything. Everything a backend *says about
itself* (what it supports, whether it has run on hardware, whether ``auto`` may pick it) lives on its class, in
its own module under :mod:`pinsidecar_hook.backends`; this table only says where to find it. Order matters: it is
the order in which ``auto`` asks each backend whether it fits a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO_BACKEND", "BACKENDS", "PIN_BACKENDS", "PIN_BACKEND_ALIASES", "BackendEntry"]

AUTO_BACKEND = "auto"


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend class lives: ``module`` (imported only when the backend is chosen, so a backend whose
    library is absent costs nothing until asked for) and ``cls``, its class there."""

    name: str
    module: str
    cls: str
    aliases: tuple[str, ...] = ()


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry("cpu", "pinsidecar_hook.backends.cpu", "CpuSplit"),
    BackendEntry("triton_experts", "pinsidecar_hook.backends.triton_experts", "TritonExpertsSplit", ("triton",)),
    BackendEntry("marlin_experts", "pinsidecar_hook.backends.marlin_experts", "MarlinExpertsSplit", ("marlin",)),
    BackendEntry("oai_triton", "pinsidecar_hook.backends.oai_triton", "OAITritonSplit", ("oai",)),
    BackendEntry("humming", "pinsidecar_hook.backends.humming", "HummingSplit"),
    BackendEntry("flashinfer_trtllm", "pinsidecar_hook.backends.flashinfer_trtllm", "FlashinferTrtllmSplit",
                 ("flashinfer",)),
    BackendEntry("torch_ref", "pinsidecar_hook.backends.torch_ref", "TorchRefSplit", ("torch",)),
)
PIN_BACKENDS = tuple(entry.name for entry in BACKENDS)
PIN_BACKEND_ALIASES = {alias: entry.name for entry in BACKENDS for alias in entry.aliases}
