"""The hook↔daemon contract: the only code both sides import.

The hook (inside the vLLM worker) and the daemon (outside it) never import each other's code or talk over a
socket. They exchange three files and one kind of request, and the engine learns its hook settings from
environment variables:

- :mod:`~pinsidecar_hook.contract.counts` — count mode's output (per-layer × per-expert selection counts);
- :mod:`~pinsidecar_hook.contract.map` — pin mode's input (the row map and its fixed geometry);
- :mod:`~pinsidecar_hook.contract.stats` — pin mode's live counters, and the fallback path they go to;
- :mod:`~pinsidecar_hook.contract.requests` — ``flush`` / ``reset`` / ``apply`` requests dropped beside an
  artifact, and :func:`request_and_wait`, the one client-side wait for their answer;
- :mod:`~pinsidecar_hook.contract.swap` — the swap plan between two maps of one geometry (remap in place), and
  :class:`ApplyResult`, the hook's answer to ``apply``;
- :mod:`~pinsidecar_hook.contract.trace` — a routing trace (every token's selected experts, in order), what the
  cache-tier simulator replays;
- :mod:`~pinsidecar_hook.contract.env` — the ``PINSIDECAR_*`` variables and :class:`HookConfig`;
- :mod:`~pinsidecar_hook.contract.io` — the rules every file follows (versioned, validated on read, written
  atomically).

Everything here needs only the standard library and numpy: it must import inside a container that has nothing
of pinsidecar but the bind-mounted ``hook/`` folder.
"""

from pinsidecar_hook.contract.counts import CountsArtifact, ModelInfo, load_counts
from pinsidecar_hook.contract.env import ENV, MODES, PIN_BACKENDS, HookConfig, HookConfigError
from pinsidecar_hook.contract.io import (
    COUNTS_FORMAT,
    MAP_FORMAT,
    STATS_FORMAT,
    TRACE_FORMAT,
    VERSION,
    ArtifactError,
    atomic_write_bytes,
    atomic_write_json,
    utc_now,
)
from pinsidecar_hook.contract.map import (
    CACHE_POLICIES,
    ExpertMap,
    LayerPlacement,
    RowMap,
    cold_selection_ratio,
    load_map,
    placement_row_map,
)
from pinsidecar_hook.contract.requests import (
    APPLY_ORDERINGS,
    HOOK_OPS,
    REQUEST_POLL_S,
    HookRequest,
    HookRequestError,
    apply_args,
    apply_hold_budget_s,
    apply_ordering,
    parse_apply_args,
    read_hook_request,
    request_and_wait,
    request_path,
    write_hook_request,
)
from pinsidecar_hook.contract.stats import StatsSnapshot, fallback_stats_path, load_stats
from pinsidecar_hook.contract.swap import (
    APPLY_OUTCOMES,
    ApplyResult,
    LayerSwap,
    SwapPlan,
    SwapPlanError,
    plan_swap,
)
from pinsidecar_hook.contract.trace import RoutingTrace, load_trace, save_trace

__all__ = [
    "APPLY_ORDERINGS",
    "APPLY_OUTCOMES",
    "CACHE_POLICIES",
    "COUNTS_FORMAT",
    "ENV",
    "HOOK_OPS",
    "MAP_FORMAT",
    "MODES",
    "PIN_BACKENDS",
    "REQUEST_POLL_S",
    "STATS_FORMAT",
    "TRACE_FORMAT",
    "VERSION",
    "ApplyResult",
    "ArtifactError",
    "CountsArtifact",
    "ExpertMap",
    "HookConfig",
    "HookConfigError",
    "HookRequest",
    "HookRequestError",
    "LayerPlacement",
    "LayerSwap",
    "ModelInfo",
    "RoutingTrace",
    "RowMap",
    "StatsSnapshot",
    "SwapPlan",
    "SwapPlanError",
    "apply_args",
    "apply_hold_budget_s",
    "apply_ordering",
    "atomic_write_bytes",
    "atomic_write_json",
    "cold_selection_ratio",
    "fallback_stats_path",
    "load_counts",
    "load_map",
    "load_stats",
    "load_trace",
    "parse_apply_args",
    "placement_row_map",
    "plan_swap",
    "read_hook_request",
    "request_and_wait",
    "request_path",
    "save_trace",
    "utc_now",
    "write_hook_request",
]
