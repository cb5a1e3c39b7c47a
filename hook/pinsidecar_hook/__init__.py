"""pinsidecar's engine-side hook: a vLLM general plugin that counts router selections (``count`` mode) or
re-homes each MoE layer by a row map and splits every experts call by residency (``pin`` mode).

It is loaded by vLLM through the ``vllm.general_plugins`` entry point in every engine process, or from a
bind-mounted ``hook/`` folder on ``PYTHONPATH`` (the ``pinsidecar_hook-*.dist-info`` folder beside this package
makes the entry point visible without installing anything). It talks to the daemon only through the files
defined in :mod:`pinsidecar_hook.contract`.

The rooms, with imports pointing one way (``plugin -> modes -> count | pin -> flusher, rehome, backends ->
vllm_seam -> contract``):

- :mod:`~pinsidecar_hook.plugin`: vLLM's entry point; reads the configuration, hands over to ``modes``;
- :mod:`~pinsidecar_hook.modes`: wires the configured mode into vLLM's worker;
- :mod:`~pinsidecar_hook.vllm_seam`: every touch of vLLM internals, and nothing else (a common module and one per
  kernel family);
- :mod:`~pinsidecar_hook.contract`: the files, requests and environment shared with the daemon;
- :mod:`~pinsidecar_hook.flusher`: the one side thread that writes counters out, periodically and on request;
- :mod:`~pinsidecar_hook.count`: count mode (router selection counters);
- :mod:`~pinsidecar_hook.pin`: pin mode (map validation, re-homing, split invokes, live stats);
- :mod:`~pinsidecar_hook.rehome`: splitting a layer's per-expert tensors into hot and cold, and the device view
  of pinned host memory;
- :mod:`~pinsidecar_hook.backends`: the split backends as stages (a shared partition, a kernel family's tier
  calls, a reducer chosen at attach), their contract and registry;
- :mod:`~pinsidecar_hook.swap`: the in-place apply of a new map between two steps;
- :mod:`~pinsidecar_hook.kernels`: the partition and finalize kernels the backends share.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
