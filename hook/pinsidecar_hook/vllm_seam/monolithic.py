"""Count mode on a monolithic MoE kernel: the top-k ids the kernel routes, computed beside it the same way.

A monolithic experts class takes the router's *logits* and routes inside its own call (vLLM 0.34 on an H100 serves
gpt-oss MXFP4 with ``OAITritonMxfp4ExpertsMonolithic``). The router never selects experts in Python there, so the
capture callback count mode binds on modular layers (:func:`~pinsidecar_hook.vllm_seam.bind_router_capture`) is
never called: without this module gpt-oss could not even be counted.

The seam is the experts object's ``apply``, switched once at attach to a subclass (as pin mode switches a modular
one, :func:`~pinsidecar_hook.vllm_seam.install_split`) whose ``apply`` first hands the ids to the capture callback,
then runs vLLM's own ``apply`` unchanged. The ids come from a **routing probe**: per experts class, the routing
step of that class's own forward, called with the same functions on the same logits it is given. Routing is
deterministic, so the probe's ids are the kernel's ids, ties included (a re-implementation with ``torch.topk``
would not be: bf16 logits tie often enough at the k-th place, and two top-k kernels need not break ties alike).
The cost is one extra top-k launch per layer and step; the kernel's output does not change.

A class without a probe is refused at attach, naming the class and the flag that gives a modular one.

:func:`check_probe` proves a probe inside the engine: the layer's monolithic call on given logits, and again on
the same logits with every expert the probe did *not* pick masked to ``-inf``. With renormalizing routing (top-k,
then softmax over the k kept) the masked logits route to the same experts with the same weights *only if* the
probe's ids are the kernel's, so the two outputs are bitwise equal then and differ (for that token) otherwise.

Read against vLLM 0.34.0 (``fused_moe/experts/gpt_oss_triton_kernels_moe.py``: ``triton_kernel_moe_forward``,
``OAITritonMxfp4ExpertsMonolithic``; ``modular_kernel.py:1726``, the keyword call of ``apply``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pinsidecar_hook.vllm_seam._common import (
    PINSIDECAR_CLASS,
    MoEGeometry,
    forward_context,
    run_layer_monolithic,
    vllm_class,
)

__all__ = ["MODULAR_FLAG", "bind_monolithic_capture", "check_probe", "monolithic_capture_problem", "oai_triton_routing",
           "register_probe", "routing_probe"]

# What to pass vLLM for a modular (splittable, router-captured) class instead, per monolithic class.
MODULAR_FLAG = {
    "OAITritonMxfp4ExpertsMonolithic": "--moe-backend triton_unfused",
}
_DEFAULT_FLAG = "--moe-backend triton (or another backend vLLM offers for the format whose experts class is modular)"

Probe = Callable[[Any, Any], Any]  # (experts object, router logits) -> top-k ids [T, k]


def oai_triton_routing(experts: Any, router_logits: Any) -> tuple[Any, Any]:
    """``triton_kernel_moe_forward``'s routing (vLLM 0.34; triton_kernels 3.5.1, whose fused ``routing()`` makes
    the same call, 3.6 and 3.8): softmax first unless the routing renormalizes, then ``triton_kernels.topk.topk``.
    Returns ``(weights, ids)`` ``[T, k]``: its ``vals`` (the router weights the kernel multiplies in, in the logits'
    dtype) and its ``indx`` (the experts it routes to)."""
    import torch
    from triton_kernels.topk import topk as topk_fn

    sm_first = not experts.renormalize
    logits = torch.softmax(router_logits, dim=-1) if sm_first else router_logits
    result = topk_fn(logits, experts.topk, apply_softmax=not sm_first)
    return (result[0], result[1]) if isinstance(result, tuple) else (result.vals, result.indx)


def _oai_triton_probe(experts: Any, router_logits: Any) -> Any:
    """The ids of :func:`oai_triton_routing`: the experts the kernel routes to."""
    return oai_triton_routing(experts, router_logits)[1]


def _oai_triton_problem(experts: Any) -> str | None:
    try:
        from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai
    except ImportError as exc:  # pragma: no cover - only inside an engine that built this class
        return f"cannot import vLLM's gpt_oss_triton_kernels_moe ({exc})"
    # triton_kernels 3.5.1 (the API vLLM 0.34 vendors) routes with routing(), which makes the same topk() call on the
    # same (softmaxed if sm_first) logits (triton_kernels/routing.py:292-297); 3.6/3.8 call topk() directly.
    if getattr(oai, "triton_kernels_version", None) not in ("3.5.1", "3.6", "3.8"):
        return f"triton_kernels API {getattr(oai, 'triton_kernels_version', None)!r} was not read"
    if not hasattr(experts, "renormalize") or not hasattr(experts, "topk"):
        return "this OAITritonMxfp4ExpertsMonolithic has no renormalize/topk attributes (not vLLM 0.34's)"
    return None


# class name -> (probe, the reason it cannot probe this object or None)
_PROBES: dict[str, tuple[Probe, Callable[[Any], str | None]]] = {
    "OAITritonMxfp4ExpertsMonolithic": (_oai_triton_probe, _oai_triton_problem),
}


def register_probe(class_name: str, probe: Probe, problem: Callable[[Any], str | None] = lambda _e: None,
                   modular_flag: str | None = None) -> None:
    """Teach count mode another monolithic class: its routing step as a probe, and why an object of it cannot be
    probed (None: it can). The registry is keyed by vLLM's class name, as the backends' registry is."""
    _PROBES[class_name] = (probe, problem)
    if modular_flag is not None:
        MODULAR_FLAG[class_name] = modular_flag


def routing_probe(experts: Any) -> Probe | None:
    """The probe for this monolithic experts object's class, or None."""
    entry = _PROBES.get(vllm_class(experts).__name__)
    return entry[0] if entry is not None else None


def monolithic_capture_problem(geometry: MoEGeometry) -> str | None:
    """Why count mode cannot count this monolithic layer (None: it can), in words an operator can act on."""
    experts = geometry.experts
    if experts is None:
        return "the layer's quant method has no experts object to follow"
    name = vllm_class(experts).__name__
    entry = _PROBES.get(name)
    flag = MODULAR_FLAG.get(name, _DEFAULT_FLAG)
    if entry is None:
        return (f"monolithic experts class {name} routes inside its kernel and pinsidecar has no routing probe for "
                f"it; boot the count engine with a modular class: {flag}")
    problem = entry[1](experts)
    return None if problem is None else f"{name}: {problem}; boot the count engine with {flag}"


@functools.cache
def _count_class(cls: type) -> type:
    """A subclass of vLLM's monolithic experts class ``cls`` whose ``apply`` captures the probe's ids first."""

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        # modular_kernel calls apply by keyword (0.34: hidden_states=, w1=, w2=, router_logits=, ...)
        logits = kwargs["router_logits"] if "router_logits" in kwargs else args[3]
        self._pinsidecar_capture(self._pinsidecar_probe(self, logits))
        return cls.apply(self, *args, **kwargs)

    return type(f"PinCount{cls.__name__}", (cls,), {
        "apply": apply, "__doc__": f"vLLM's {cls.__name__}, its routing counted beside it (pinsidecar)",
        PINSIDECAR_CLASS: True})


def bind_monolithic_capture(geometry: MoEGeometry,
                            make_capture: Callable[[Callable[[Any], None] | None], Callable[[Any], None]]) -> None:
    """Make this monolithic layer hand its top-k ids to ``make_capture(None)`` on every call (the counterpart of
    :func:`~pinsidecar_hook.vllm_seam.bind_router_capture`); :func:`monolithic_capture_problem` must be None."""
    problem = monolithic_capture_problem(geometry)
    if problem is not None:
        raise RuntimeError(problem)
    experts = geometry.experts
    experts.__class__ = _count_class(vllm_class(experts))
    experts._pinsidecar_probe = routing_probe(experts)
    experts._pinsidecar_capture = make_capture(None)


def check_probe(geometry: MoEGeometry, x: Any, router_logits: Any, vllm_config: Any = None) -> dict[str, Any]:
    """Prove the layer's probe on one batch: its monolithic call on ``router_logits`` against the same call with
    every expert the probe did not pick masked to ``-inf`` (see the module docstring). Returns ``{"tokens",
    "equal_rows", "bitwise"}``. Valid for renormalizing routing only (``experts.renormalize``)."""
    import torch

    experts = geometry.experts
    probe = routing_probe(experts)
    if probe is None:
        raise RuntimeError(monolithic_capture_problem(geometry) or "no routing probe")
    if not getattr(experts, "renormalize", False):
        raise ValueError(f"{vllm_class(experts).__name__} routes softmax-first: masking the other experts would "
                         "change the weights, so this check does not apply")
    with torch.inference_mode(), forward_context(vllm_config):
        ids = probe(experts, router_logits).long()
    keep = torch.zeros_like(router_logits, dtype=torch.bool).scatter_(1, ids, True)
    masked = router_logits.masked_fill(~keep, float("-inf"))
    calls = [run_layer_monolithic(geometry, x, logits, vllm_config).clone() for logits in (router_logits, masked)]
    same = (calls[0] == calls[1]).all(dim=-1)
    return {"tokens": int(x.shape[0]), "equal_rows": int(same.sum()), "bitwise": bool(same.all())}
