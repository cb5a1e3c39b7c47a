"""Every place where the hook reaches into vLLM, and nothing else.

The rest of the hook (the modes, re-homing, the backends) never imports vLLM; it calls the functions here, which
import vLLM lazily, so every module of the hook imports without vLLM (tests, the daemon's tooling). Keep the
surface small and named: when upstream grows a real seam (the ExpertWeightProvider RFC, a per-expert residency
option) only this package should change. It imports nothing of the hook but the contract; the mode modules import
it, never the reverse.

What is here, by room:

- the common seam (:mod:`~pinsidecar_hook.vllm_seam._common`, re-exported here): the **workers**
  (:func:`patch_workers` wraps them; :func:`worker_model`, :func:`worker_rank`, :func:`model_info`,
  :func:`tp_cpu_group`, :func:`max_batched_tokens`, the real-token scalar :func:`real_token_count`), the **MoE
  layers** (:func:`moe_layers`, :func:`moe_geometry`), **count mode**'s router capture
  (:func:`router_capture_supported`, :func:`bind_router_capture`), and what **pin mode** does to a layer whatever
  its kernel (:func:`install_split`, :func:`run_layer_experts` for the self-check, :func:`accelerator_view`,
  :func:`vllm_class`, :func:`vllm_version`). All monkeypatching of vLLM is there, in one module;
- one module per kernel family, for its backend: :mod:`~pinsidecar_hook.vllm_seam.triton` (``TritonExperts``),
  :mod:`~pinsidecar_hook.vllm_seam.marlin` (``MarlinExperts``), :mod:`~pinsidecar_hook.vllm_seam.flashinfer`
  (FlashInfer's TRT-LLM MXFP4 experts), :mod:`~pinsidecar_hook.vllm_seam.oai_triton` (gpt-oss's modular MXFP4
  Triton experts), :mod:`~pinsidecar_hook.vllm_seam.humming` (``HummingIndexedExperts``: int4 and NVFP4 on SM90),
  :mod:`~pinsidecar_hook.vllm_seam.cpu` (the CPU engine's
  ``cpu_fused_moe``), and :mod:`~pinsidecar_hook.vllm_seam.monolithic` (count mode's routing probes for kernels
  that route inside themselves, gpt-oss's MXFP4 Triton kernel). Each says which vLLM versions it was read against
  and tells them apart by vLLM's own code (a signature, a function that exists), not by the version string.
"""

from pinsidecar_hook.vllm_seam import cpu, flashinfer, humming, marlin, monolithic, oai_triton, triton
from pinsidecar_hook.vllm_seam._common import (
    PINSIDECAR_CLASS,
    MoEGeometry,
    MoELayerRef,
    accelerator_view,
    bind_router_capture,
    install_split,
    max_batched_tokens,
    model_info,
    moe_geometry,
    moe_layers,
    patch_workers,
    real_token_count,
    router_capture_supported,
    run_layer_experts,
    run_layer_monolithic,
    set_real_tokens,
    tp_cpu_group,
    vllm_class,
    vllm_version,
    worker_model,
    worker_rank,
)

__all__ = [
    "PINSIDECAR_CLASS",
    "MoEGeometry",
    "MoELayerRef",
    "accelerator_view",
    "bind_router_capture",
    "cpu",
    "flashinfer",
    "install_split",
    "marlin",
    "max_batched_tokens",
    "model_info",
    "moe_geometry",
    "moe_layers",
    "monolithic",
    "oai_triton",
    "patch_workers",
    "real_token_count",
    "router_capture_supported",
    "run_layer_experts",
    "run_layer_monolithic",
    "set_real_tokens",
    "tp_cpu_group",
    "triton",
    "vllm_class",
    "vllm_version",
    "worker_model",
    "worker_rank",
]
