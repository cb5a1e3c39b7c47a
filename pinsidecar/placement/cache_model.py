"""A map's predicted cold rate when it has cache slots, from counts alone (no routing trace).

Counts say how often each expert was selected, not in what order, so a cache can only be modelled from them under
the **independent reference model**: every selection of a layer is drawn independently from that layer's count
distribution, with no temporal reuse. Per layer, with the map's hot set, ``K`` cache slots and a policy:

- Only selections of cold experts reach the slots (hot ones are always hits and never touch them, as in the
  simulator, :mod:`~pinsidecar.placement.simulate`). So the slots see the layer's **cold reference stream**, in
  which cold expert ``i`` has probability ``r_i = c_i / sum_{j cold} c_j`` per cold selection (``c`` the counts).
  Time is counted in cold selections.
- ``lru``: Che's approximation. The characteristic time ``T`` (in cold selections) solves
  ``sum_{i cold} (1 - exp(-r_i T)) = K``, and cold expert ``i`` is in a slot when it is selected with probability
  ``h_i = 1 - exp(-r_i T)``. With at least as many slots as cold experts ever selected, every one of them stays in
  a slot (``h_i = 1``): the model counts no first-use misses, which is what a long run converges to.
- ``lfu``: under independent references an LFU cache ends up holding the ``K`` most frequently selected cold
  experts, a static set (equal counts: the lower expert id, the ranking rule of every placement).
- The layer's **miss rate** is ``sum_{i cold} q_i (1 - h_i)``, with ``q_i = c_i / sum_j c_j`` over all of the
  layer's selections (hot ones included, as the simulator's ``miss_rate``); over all layers it is the expected
  misses over all selections.

What it leaves out: temporal reuse. Real routing repeats the experts of recent tokens, which an LRU cache catches
and this model cannot see, so on such routing it **over-states the misses** of ``lru`` (and usually of ``lfu``).
A routing trace of the same workload gives the simulator's figure instead (``pinsidecar map build --trace``);
maps record which model gave their figure in ``meta["cache_model"]`` (``"trace"`` or ``"independent"``).

Without cache slots (``cache_slots == 0``) every function here is the plain cold-selection ratio of
:func:`~pinsidecar.placement._ranking.cold_rates`, bit for bit, so maps without a cache keep their figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pinsidecar_hook.contract import CACHE_POLICIES, ArtifactError

from pinsidecar.placement._ranking import cold_rates, usage_order

__all__: list[str] = []  # nothing here is another package's business

# What meta["cache_model"] says for figures from this module.
INDEPENDENT = "independent"
TRACE = "trace"
INDEPENDENT_CAVEAT = ("independent references: each selection drawn from the layer's counts, no temporal reuse; "
                      "over-states misses when routing reuses recent experts (build with --trace for the simulator)")


def check_cache(cache_slots: int, cache_policy: str, hot_rows: int, num_experts: int) -> None:
    """Refuse slots or a policy a map cannot have: ``cache_slots`` in 0..cold rows, a policy of ``CACHE_POLICIES``."""
    if cache_policy not in CACHE_POLICIES:
        hint = (" (static is the simulator's baseline: a static set of N rows is a map with --cache-slots 0)"
                if cache_policy == "static" else "")
        raise ArtifactError(None, f"cache policy {cache_policy!r} is not one of {', '.join(CACHE_POLICIES)}{hint}",
                            "pass --cache-policy lru or --cache-policy lfu")
    cold = num_experts - hot_rows
    if isinstance(cache_slots, bool) or not isinstance(cache_slots, int) or not 0 <= cache_slots <= cold:
        raise ArtifactError(None, f"cache slots must be in 0..{cold} (the cold rows: {num_experts} experts - "
                            f"{hot_rows} hot), got {cache_slots!r}", "pass a smaller --cache-slots")


def che_hit_probabilities(rates: np.ndarray, cache_slots: int) -> np.ndarray:
    """Per expert, the probability that an LRU cache of ``cache_slots`` holds it when it is referenced, by Che's
    approximation under independent references with per-reference probabilities ``rates`` (summing to 1, or all
    zero). Experts of rate 0 get 0; with at least as many slots as experts of positive rate, those all get 1."""
    r = np.asarray(rates, dtype=np.float64)
    hits = np.zeros_like(r)
    live = r > 0
    if cache_slots <= 0 or not live.any():
        return hits
    rl = r[live]
    if cache_slots >= rl.size:
        hits[live] = 1.0
        return hits

    def filled(t: float) -> float:  # expected slots holding an expert after time t, minus K
        return float(-np.expm1(-rl * t).sum()) - cache_slots

    lo, hi = 0.0, float(cache_slots)  # sum(1 - exp(-r T)) <= sum(r T) = T, so T >= K
    while filled(hi) < 0:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if filled(mid) < 0:
            lo = mid
        else:
            hi = mid
    hits[live] = -np.expm1(-rl * (0.5 * (lo + hi)))
    return hits


def layer_misses(counts: np.ndarray, hot: np.ndarray, cache_slots: int, policy: str) -> float:
    """Expected misses of one layer's ``counts`` (per expert) under the model, with ``hot`` (bool per expert)."""
    c = np.asarray(counts, dtype=np.float64)
    cold = np.where(hot, 0.0, c)
    cold_total = float(cold.sum())
    if cold_total == 0.0:
        return 0.0
    if policy == "lfu":
        # The K most selected cold experts, equal counts to the lower id (hot ones ranked last by -1).
        order = usage_order(np.where(hot, -1, np.asarray(counts))[None, :])[0]
        held = np.zeros(c.shape, dtype=bool)
        held[order[:cache_slots]] = True
        return float(np.where(held, 0.0, cold).sum())
    if policy == "lru":
        hits = che_hit_probabilities(cold / cold_total, cache_slots)
        return float((cold * (1.0 - hits)).sum())
    raise ArtifactError(None, f"cache policy {policy!r} is not one of {', '.join(CACHE_POLICIES)}",
                        "pass --cache-policy lru or --cache-policy lfu")


def expected_misses(hot: np.ndarray, counts: np.ndarray, cache_slots: int = 0, policy: str = "lru") -> np.ndarray:
    """float ``[layers]``: expected misses per layer of ``counts`` under a hot mask plus ``cache_slots`` slots.
    Without slots, the selections of cold experts (exact)."""
    counts = np.asarray(counts)
    hot = np.asarray(hot, dtype=bool)
    if not cache_slots:
        return np.where(hot, 0, counts).sum(axis=1).astype(np.float64)
    return np.asarray([layer_misses(c, h, cache_slots, policy) for c, h in zip(counts, hot, strict=True)],
                      dtype=np.float64)


def miss_rates(hot: np.ndarray, counts: np.ndarray, cache_slots: int = 0,
               policy: str = "lru") -> tuple[float, np.ndarray]:
    """Share of ``counts``' selections that miss HBM (the hot rows and the slots): (all layers, per layer).

    ``cache_slots == 0`` is :func:`~pinsidecar.placement._ranking.cold_rates` itself. A layer with no selections
    costs 0.
    """
    if not cache_slots:
        return cold_rates(hot, counts)
    counts = np.asarray(counts)
    total = counts.sum(axis=1)
    misses = expected_misses(hot, counts, cache_slots, policy)
    per_layer = np.where(total > 0, misses / np.maximum(total, 1), 0.0)
    all_sel = int(total.sum())
    return (float(misses.sum() / all_sel) if all_sel else 0.0), per_layer


def map_miss_rates(emap: Any, counts: np.ndarray) -> tuple[float, np.ndarray]:
    """:func:`miss_rates` of a map (anything with ``hot_mask()``, and ``cache_slots`` / ``cache_policy`` when it
    has a cache) on ``counts`` ``[layers, experts]``."""
    return miss_rates(emap.hot_mask(), counts, int(getattr(emap, "cache_slots", 0) or 0),
                      str(getattr(emap, "cache_policy", "lru")))
