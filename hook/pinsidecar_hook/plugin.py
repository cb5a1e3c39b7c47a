"""The vLLM entry point: ``register()`` runs in every vLLM process (front end, engine core, workers).

It must be cheap and idempotent, and it must never break an engine whose hook mode is ``off``. It reads the
hook configuration from the environment (:class:`~pinsidecar_hook.contract.env.HookConfig`), refuses to start on a
bad one (an engine that silently serves with another placement is worse than one that does not boot), and hands
the rest to :func:`pinsidecar_hook.modes.install`, which wires the chosen mode into vLLM's worker.
"""

from __future__ import annotations

import logging

from pinsidecar_hook.contract.env import HookConfig

__all__ = ["register"]

log = logging.getLogger("pinsidecar_hook")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    cfg = HookConfig.from_env()  # HookConfigError propagates: vLLM logs it; the engine must not start half-configured
    _registered = True
    if cfg.mode == "off":
        return
    from pinsidecar_hook import modes

    modes.install(cfg)
    log.info("pinsidecar hook installed: mode=%s", cfg.mode)
