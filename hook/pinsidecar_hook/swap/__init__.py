"""Remap in place: swap expert rows between the hot and cold tier of the running engine, between two steps.

The in-place apply in four modules, one idea each:

- :mod:`~pinsidecar_hook.swap.apply` serves an ``apply`` request: every check that can refuse, the swap, the answer
  and its one log line (:func:`apply_map`), and the place fault injection wraps (``swap_layers``, ``_prepare``);
- :mod:`~pinsidecar_hook.swap.batches` carries a plan out on the live tensors in bounded batches between steps
  (:func:`swap_layers`, :class:`StepClock`);
- :mod:`~pinsidecar_hook.swap.rows` holds what one pair swap is made of (the plan resolved to rows, the copies,
  the swap-back) and the layer protocol it works on (:class:`SwapLayer`);
- :mod:`~pinsidecar_hook.swap.tp` runs the apply on every tensor-parallel rank at one step boundary
  (:class:`TPApply`).

This facade names what pin mode and the tools use; the modules say how it works.
"""

from pinsidecar_hook.swap.apply import ApplyTarget, apply_map
from pinsidecar_hook.swap.batches import (
    HOLD_BUDGET_S,
    IDLE_S,
    ORDERING,
    ORDERINGS,
    STAGING_BYTES,
    SWITCH_INTERVAL_S,
    StepClock,
    SwapFailed,
    SwapStats,
    swap_layers,
)
from pinsidecar_hook.swap.batches import _Apply as _Apply  # re-exported: tests and bench/ drive the internals
from pinsidecar_hook.swap.rows import ApplyRefused, SwapLayer
from pinsidecar_hook.swap.rows import _resolve as _resolve  # re-exported, the same
from pinsidecar_hook.swap.rows import _swap_row as _swap_row  # re-exported, the same
from pinsidecar_hook.swap.tp import CHECK_EVERY, IDLE_TIMEOUT_S, RankGroup, TorchRankGroup, TPApply

__all__ = ["CHECK_EVERY", "HOLD_BUDGET_S", "IDLE_S", "IDLE_TIMEOUT_S", "ORDERING", "ORDERINGS", "STAGING_BYTES",
           "SWITCH_INTERVAL_S", "ApplyRefused", "ApplyTarget", "RankGroup", "StepClock", "SwapFailed", "SwapLayer",
           "SwapStats", "TPApply", "TorchRankGroup", "apply_map", "swap_layers"]
