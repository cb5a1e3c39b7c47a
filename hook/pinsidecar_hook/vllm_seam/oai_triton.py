"""The seam of vLLM's OAI Triton MoE experts (gpt-oss MXFP4 through triton_kernels' ``matmul_ogs``), for the
``oai_triton`` backend.

Read in vLLM 0.34.0 (``fused_moe/experts/gpt_oss_triton_kernels_moe.py``, its vendored triton_kernels 3.5.1, and
the 3.6 branches of the same file). Two modular classes take per-token ids, so a split can drive them:

- ``UnfusedOAITritonExperts`` (``--moe-backend triton_unfused``; ``apply`` at ``:1266``): GEMM1 with the expert
  weights gathered by the routing, the activation as its own op (``self.activation``: ``swigluoai_and_mul``), then
  GEMM2 with ``routing_data.n_expts_act = 1``, so ``matmul_ogs`` *scatters each slot's router-weighted row* into
  ``[T * k, K]`` instead of summing them, and ``masked_moe_sum`` (``:1005``) sums each token's k rows in fp32, in
  slot order, skipping ``-1`` slots, with one cast;
- ``OAITritonExperts`` (the modular form of the default ``triton`` backend; what 0.34 picks under expert
  parallel): GEMM1 with the swiglu fused into it, GEMM2 with ``n_expts_act = k``, whose rows ``matmul_ogs`` sums in
  its ``reduce_grouped`` (fp32 from 0, slot order, ``-1`` skipped, one cast: the same arithmetic).

The default class on SM90, ``OAITritonMxfp4ExpertsMonolithic`` (``:1506``), takes the router's logits and runs
``triton_kernel_moe_forward`` (``:602``): its routing (``triton_kernels``' ``topk``, inside ``routing()`` on 3.5.1)
and then the same ``triton_kernel_fused_experts`` as ``OAITritonExperts``. So the split stands in for it by running
that routing itself (:func:`pinsidecar_hook.vllm_seam.monolithic.oai_triton_routing`, count mode's probe), then the
fused form: the same ids, the same router weights (its ``vals``, in the logits' dtype), the same rows and sum.

A row depends on its token, its expert's weights, block scales and bias, its router weight and on the **kernel's
tiling**: ``make_opt_flags`` picks ``block_m`` (hence the warp count and the MMA shape) from the tokens per expert,
``m // routing_data.n_expts_tot``, and a tier's routing data counts only its own experts. So each tier call is made
with the flags the *unsplit* call would get (:func:`unsplit_flags`: the flag function is called with the routing
data's expert count set to the layer's). vLLM pins ``split_k = 1`` on SM90 (``_swizzle_mxfp4``), so rows are
written in the activation dtype, never as fp32 partials.

Weights: vLLM swizzles the MXFP4 values and ue8m0 scales for Hopper (``HopperMXValueLayout``, ``HopperMXScaleLayout``)
and keeps the swizzled bytes in the layer's parameters (``store_params_in_triton``): the expert dimension stays
first, the swizzle is inside each expert. A tier's weights are triton_kernels tensors over that tier's rows
(:func:`tier_tensor`), with the layer's layout objects; biases are fp32 ``[E, N]``.

triton_kernels 3.8 (no in-kernel scatter; rows combined with ``index_add_``) is refused: :func:`api_problem`.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["api_problem", "kind", "module", "precision_with_scale", "release_views", "tier_rows", "tier_tensor",
           "unsplit_flags"]

_MODULE = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"


def module() -> Any:
    """vLLM's OAI Triton experts module (its ``matmul_ogs``, ``make_routing_data``, ``masked_moe_sum``)."""
    import importlib

    return importlib.import_module(_MODULE)


# vLLM's class name -> what the split calls its form: "unfused" (activation as an op of its own), "fused" (swiglu
# inside GEMM1), "monolithic" (the fused arithmetic, and the routing inside the kernel).
_FORMS = {"UnfusedOAITritonExperts": "unfused", "OAITritonExperts": "fused",
          "OAITritonMxfp4ExpertsMonolithic": "monolithic"}


def kind(experts: Any) -> str | None:
    """The form of vLLM's OAI Triton experts object (``_FORMS``), each with vLLM's own ``apply``; None for anything
    else."""
    from pinsidecar_hook.vllm_seam._common import vllm_class

    try:
        m = module()
    except ImportError:
        return None
    cls = vllm_class(experts)
    for name, form in _FORMS.items():
        known = getattr(m, name, None)
        if known is not None and isinstance(experts, known) and cls.apply is known.apply:
            return form
    return None


def api_problem() -> str | None:
    """Why this vLLM's OAI Triton path cannot be split here, or None: the triton_kernels API must be 3.5.1 or 3.6
    (``matmul_ogs`` with in-kernel scatter and ``make_opt_flags``)."""
    try:
        m = module()
    except ImportError as exc:
        return f"vLLM's OAI Triton experts module does not import ({exc})"
    version = getattr(m, "triton_kernels_version", None)
    if version not in ("3.5.1", "3.6"):
        return (f"triton_kernels {version or 'unknown'}: the split is written against the 3.5.1 and 3.6 APIs "
                "(matmul_ogs with in-kernel scatter); 3.8 combines rows with index_add")
    if not hasattr(sys.modules.get(m.matmul_ogs.__module__), "make_opt_flags"):
        return "this triton_kernels' matmul_ogs has no make_opt_flags to pin the unsplit call's tiling to"
    return None


@contextlib.contextmanager
def unsplit_flags(num_experts: int) -> Iterator[None]:
    """Inside: ``matmul_ogs`` picks its tiling as if its routing data had ``num_experts`` experts (the unsplit
    layer's), whatever the tier's own count (module docstring). Patches the name ``matmul_ogs`` looks up and puts it
    back; vLLM's forward is single-threaded, and under CUDA graph capture the flags are fixed at capture."""
    owner = sys.modules[module().matmul_ogs.__module__]
    original = owner.make_opt_flags

    def pinned(out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any, precision_config: Any, m: Any, n: Any, k: Any,
               routing_data: Any, *rest: Any) -> Any:
        if routing_data is not None:
            if not hasattr(routing_data, "n_expts_tot"):  # loud at the first call (boot), never silently unpinned
                raise RuntimeError(f"pinsidecar oai_triton: this triton_kernels' routing data "
                                   f"({type(routing_data).__name__}) has no n_expts_tot; the split cannot pin the "
                                   "unsplit call's tiling. Serve this engine in count mode, or without pin mode")
            routing_data = copy.copy(routing_data)
            routing_data.n_expts_tot = num_experts
        return original(out_dtype, lhs_dtype, rhs_dtype, precision_config, m, n, k, routing_data, *rest)

    owner.make_opt_flags = pinned
    try:
        yield
    finally:
        owner.make_opt_flags = original


def tier_tensor(full: Any, data: Any) -> Any:
    """A triton_kernels tensor like ``full`` (its dtype, layout and logical shape) over ``data``, one tier's rows of
    ``full``'s storage (the expert dimension first)."""
    import dataclasses

    storage = copy.copy(full.storage)
    storage.data = data
    rows = int(data.shape[0])
    return dataclasses.replace(full, storage=storage, shape=[rows, *list(full.shape)[1:]],
                               shape_max=[rows, *list(full.shape_max)[1:]])


def precision_with_scale(precision: Any, scale: Any) -> Any:
    """A copy of a ``PrecisionConfig`` whose weight scale is ``scale`` (a tier's block scales)."""
    out = copy.copy(precision)
    out.weight_scale = scale
    return out


def release_views(owner: Any, experts: Any) -> dict[str, Any]:
    """Drop the second references vLLM keeps to the layer's swizzled weights and scales (the triton_kernels tensors
    ``w13_weight_triton``/``w2_weight_triton`` and the precision configs' scale tensors share the parameters'
    storage), so that re-homing frees the originals. Called just before re-homing; the unsplit call cannot run
    after it (the self-check's reference runs before). Returns the weight tensors, emptied, by parameter name: the
    templates (layout, dtype, logical shape) of the tier tensors (:func:`tier_tensor`)."""
    import torch

    empty = torch.empty(0, dtype=torch.uint8, device=owner.w13_weight.device)
    templates: dict[str, Any] = {}
    for name in ("w13_weight", "w2_weight"):
        t = getattr(owner, f"{name}_triton", None)
        if t is not None and hasattr(t, "storage"):
            t.storage.data = empty
            templates[name] = t
    qc = getattr(experts, "quant_config", None)
    for attr in ("w1_precision", "w2_precision"):
        scale = getattr(getattr(qc, attr, None), "weight_scale", None)
        if scale is not None and hasattr(scale, "storage"):
            scale.storage.data = empty
    return templates


def tier_rows(form: str, *, hidden_states: Any, w1: Any, w2: Any, w1_precision: Any, w2_precision: Any,
              w1_bias: Any, w2_bias: Any, topk_weights: Any, tier_ids: Any, num_experts: int, activation: Any,
              activation_fn: Any, apply_router_weight_on_input: bool) -> Any:
    """One tier's router-weighted rows ``[T, k, K]`` (slots of other tiers zero) through vLLM's own functions:
    ``make_routing_data`` on the tier's ids (other tiers' slots ``-1``), GEMM1 as the class does it (``form``
    "unfused": no fused activation, then ``activation_fn``; "fused": the swiglu inside GEMM1, vLLM's defaults),
    GEMM2 with one active expert per row so each slot's row is scattered, not summed; every ``matmul_ogs`` under
    the unsplit call's flags (``num_experts``: the layer's local expert count)."""
    import torch

    m = module()
    num_tokens, hidden = hidden_states.shape
    top_k = int(tier_ids.shape[1])
    routing_data, gather_indx, scatter_indx = m.make_routing_data(tier_ids, topk_weights, int(w1.shape[0]))
    gammas = routing_data.gate_scal if routing_data is not None else None
    n = int(w1.shape[-1])
    dtype, device = hidden_states.dtype, hidden_states.device
    rows = torch.empty((1, num_tokens * top_k, hidden), dtype=dtype, device=device)
    with unsplit_flags(num_experts):
        if hasattr(m, "_constrain_sm12x_block_m"):
            m._constrain_sm12x_block_m(num_tokens * top_k, num_experts)
        if form == "unfused":
            gemm1 = torch.empty((1, num_tokens * top_k, n), dtype=dtype, device=device)
            m.matmul_ogs(hidden_states, w1, w1_bias, routing_data, gather_indx=gather_indx,
                         precision_config=w1_precision, gammas=gammas if apply_router_weight_on_input else None,
                         fused_activation=None, y=gemm1)
            act_input = gemm1.view(-1, n)[gather_indx.dst_indx]
            act = torch.empty((num_tokens * top_k, n // 2), dtype=dtype, device=device)
            activation_fn(activation, act, act_input)
            down_input = act[gather_indx.src_indx]
        else:
            act = torch.empty((1, num_tokens * top_k, n // 2), dtype=dtype, device=device)
            m.matmul_ogs(hidden_states, w1, w1_bias, routing_data, gather_indx=gather_indx,
                         precision_config=w1_precision, gammas=gammas if apply_router_weight_on_input else None,
                         fused_activation=_fused_swiglu(m), y=act)
            down_input = act.view(num_tokens * top_k, n // 2)
        routing_data.n_expts_act = 1  # scatter each slot's row; the reduce stage sums them
        m.matmul_ogs(down_input, w2, w2_bias, routing_data, scatter_indx=scatter_indx, precision_config=w2_precision,
                     gammas=None if apply_router_weight_on_input else gammas, y=rows)
    return rows.view(num_tokens, top_k, hidden)


def _fused_swiglu(m: Any) -> Any:
    """The swiglu ``triton_kernel_fused_experts`` fuses into GEMM1 (its defaults: alpha 1.702, limit 7.0), in the
    installed triton_kernels' form."""
    specs_args = ("swiglu", m.triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"))
    if m.triton_kernels_version == "3.5.1":
        return m.FusedActivation(m.FnSpecs(*specs_args), (1.702, 7.0), 2)
    return m.FusedActivation(m.FnSpecs(*specs_args, reduction_n=2), (1.702, 7.0))
