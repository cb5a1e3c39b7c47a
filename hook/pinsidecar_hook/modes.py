"""Wires the hook's modes into vLLM's worker: which mode function runs at which worker seam.

This is the only module that knows both the modes and the seam. :func:`install` reads the mode from the hook's
configuration and hands :func:`pinsidecar_hook.vllm_seam.patch_workers` three callables:

- ``count``: :func:`pinsidecar_hook.count.attach` after ``load_model``, :func:`~pinsidecar_hook.count.on_engine_ready`
  after warm-up, and :func:`~pinsidecar_hook.count.step_guard` around each ``execute_model``;
- ``pin``: :func:`pinsidecar_hook.pin.attach` after ``load_model``, :func:`~pinsidecar_hook.pin.on_engine_ready`
  after warm-up, and :func:`~pinsidecar_hook.pin.step_guard` around each ``execute_model`` (an in-place apply
  runs between two steps, :mod:`pinsidecar_hook.swap`);
- ``off``: nothing is patched (:mod:`pinsidecar_hook.plugin` does not even import this module).

The imports point one way: ``plugin -> modes -> count | pin -> vllm_seam -> contract``. The mode modules receive
the loaded model and the worker from here and never import this module.
"""

from __future__ import annotations

import sys
from typing import Any

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.contract.env import PIN_REFUSED_MARKER, HookConfig

__all__ = ["install"]


def install(cfg: HookConfig) -> None:
    """Patch the worker classes for ``cfg.mode``. Safe to call in processes that never build a worker, and more
    than once (the seam patches once per process)."""
    if cfg.mode == "count":
        from pinsidecar_hook import count

        def on_loaded(worker: Any) -> None:
            count.attach(vllm_seam.worker_model(worker), cfg, worker)

        def on_ready(worker: Any) -> None:
            count.on_engine_ready()

        # Counter snapshots and resets fall between steps: count mode holds its step lock around each step.
        vllm_seam.patch_workers(on_loaded, on_ready, step_guard=count.step_guard)
    elif cfg.mode == "pin":
        from pinsidecar_hook import pin

        def on_loaded(worker: Any) -> None:
            try:
                pin.attach(vllm_seam.worker_model(worker), cfg, worker)
            except pin.PinMapMismatch as exc:  # one line the daemon can find in the engine log, then refuse
                print(PIN_REFUSED_MARKER + " ".join(str(exc).split()), file=sys.stderr, flush=True)
                raise

        def on_ready(worker: Any) -> None:
            pin.on_engine_ready()

        # An in-place apply swaps rows between steps: pin mode holds its step lock around each step.
        vllm_seam.patch_workers(on_loaded, on_ready, step_guard=pin.step_guard)
