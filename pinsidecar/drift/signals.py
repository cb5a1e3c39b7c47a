"""The drift signals of one window: plain functions of (window, active map, reference counts, previous window).

Three signals, each exported as a metric beside its threshold (:meth:`Signals.series`):

a. **live cold rate vs predicted** — the share of the window's selections that fell on cold experts, against the
   rate the active map predicted when it was built. It is what the operator pays for, so it is the first thing to
   look at; but it cannot say whether another map would do better (a flat router has a high cold rate that no map
   fixes), so it explains and never decides.

b. **per-layer divergence from the map's source counts** — Jensen-Shannon divergence, in bits, between each
   layer's expert distribution in the window and in the counts the active map was built from; reported per layer
   with the max and mean. Why Jensen-Shannon: it is symmetric (neither side is "the truth"), bounded in [0, 1] bit
   (one threshold means the same thing in every layer and model), and finite when an expert has zero count on one
   side, which a window of a few thousand selections over hundreds of experts always has. KL divergence and PSI
   are infinite (or need an arbitrary epsilon) on those zeros; L-infinity (the largest single-expert difference)
   ignores the tail, which is exactly where a hot/cold boundary sits. Divergence also only explains: routing can
   move *inside* the hot set (large divergence) with no effect on the cold rate.

c. **projected gain** — how much lower the window's cold rate would be under a map rebuilt from recent traffic
   (same hot rows, same budget: :func:`~pinsidecar.placement.rebuild_map`, as a remap builds it), than under the
   active map.
   This is the signal that decides. It is computed **out of sample**: the candidate is built from the *previous*
   window and scored on *this* one. A map built from a window and scored on the same window flatters itself: its
   hot set is fitted to that sample's noise, so even a uniform router shows a "gain" (64 experts, 48 hot, 4096
   selections per layer: the in-sample oracle sees 21 % cold where any map really gets 25 %). Out of sample, a
   noisy candidate is penalised rather than rewarded, stationary traffic shows a gain near zero (often negative:
   a one-window map is noisier than the active one), and a real shift shows up one window after it starts at the
   latest. The price is that latency of one window; the decision before a deploy is out of sample too (see
   decision.py).

**Skew**: a near-uniform router leaves a usage map nothing to gain. The best cold rate a map of this geometry
reaches on the traffic is compared with the uniform cold fraction ``cold_rows / num_experts`` (what any map gets on
uniform routing); when the gap is under ``skew_margin`` the routing has **no exploitable skew** and the detector
never trips. The best reachable rate is the lowest of three out-of-sample estimates: the active map on the window,
the previous-window candidate on the window, and a split-half cross-fit inside the window (the window's
selections split at random into two halves, a map built on each half and scored on the other). The last one is
there for the window in which traffic shifts: the two others are then both fitted to the old traffic and would
call a skewed new domain flat. The in-sample oracle (the window's own top experts, scored on the window) is not
used: it finds a gap in pure sampling noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.windows import Window
from pinsidecar.placement import rebuild_map
from pinsidecar.placement.cache_model import expected_misses

__all__ = ["cold_rate_on"]

# Seed of the random split in split_half_cold_rate: fixed, so a window always gets the same figure (replays repeat).
SPLIT_SEED = 0x5B117

NO_SKEW = "no exploitable skew"


@dataclass(frozen=True)
class Signals:
    """The figures of one window. ``None`` means "cannot be computed for this window" (see ``notes``)."""

    tokens: int
    uniform_cold_rate: float  # cold_rows / num_experts: any map's cold rate on uniform routing
    # a. live cold rate against the prediction
    cold_rate: float | None
    cold_rate_source: str  # "live" (what the hook counted under the active map) or "histogram" (computed)
    predicted_cold_rate: float | None
    cold_rate_excess: float | None
    # b. divergence from the active map's source counts (Jensen-Shannon, bits)
    divergence_per_layer: list[float] | None
    divergence_max: float | None
    divergence_mean: float | None
    divergence_reference: str  # "source counts", "first window", or "" (none)
    # c. projected gain, out of sample
    active_cold_rate: float | None  # the active map on this window's histogram
    candidate_cold_rate: float | None  # a map built from the previous window, on this window
    projected_gain: float | None  # active_cold_rate - candidate_cold_rate
    candidate_from: int | None  # index of the window the candidate was built from
    # skew
    split_cold_rate: float | None  # split-half cross-fit inside the window
    best_cold_rate: float | None
    skew_gap: float | None  # uniform_cold_rate - best_cold_rate
    exploitable_skew: bool | None
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """One line for a person: the skew verdict first, since it overrides the rest."""
        if self.exploitable_skew is False:
            return f"{NO_SKEW}: best reachable cold rate {_pct(self.best_cold_rate)}, uniform " \
                   f"{_pct(self.uniform_cold_rate)}"
        if self.projected_gain is None:
            return "; ".join(self.notes) or "no projected gain"
        return f"projected gain {_pts(self.projected_gain)} (active {_pct(self.active_cold_rate)}, rebuilt " \
               f"{_pct(self.candidate_cold_rate)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "uniform_cold_rate": self.uniform_cold_rate, "cold_rate": self.cold_rate,
            "cold_rate_source": self.cold_rate_source, "predicted_cold_rate": self.predicted_cold_rate,
            "cold_rate_excess": self.cold_rate_excess, "divergence_per_layer": self.divergence_per_layer,
            "divergence_max": self.divergence_max, "divergence_mean": self.divergence_mean,
            "divergence_reference": self.divergence_reference, "active_cold_rate": self.active_cold_rate,
            "candidate_cold_rate": self.candidate_cold_rate, "projected_gain": self.projected_gain,
            "candidate_from": self.candidate_from, "split_cold_rate": self.split_cold_rate,
            "best_cold_rate": self.best_cold_rate,
            "skew_gap": self.skew_gap, "exploitable_skew": self.exploitable_skew, "status": self.status,
            "notes": list(self.notes),
        }

    def series(self, cfg: DriftConfig) -> dict[str, tuple[float | None, float | None]]:
        """Metric name suffix -> (value, threshold): what the exporter publishes as two series per signal."""
        return {
            "cold_rate_excess": (self.cold_rate_excess, cfg.cold_rate_alert),
            "divergence_max": (self.divergence_max, cfg.divergence_alert),
            "projected_gain": (self.projected_gain, cfg.trip_level),
            "skew_gap": (self.skew_gap, cfg.skew_margin),
        }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2%}"


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f} pts"


def _check_geometry(window: Window, emap: ExpertMap) -> None:
    if (tuple(window.layer_ids), window.num_experts) != (tuple(emap.layer_ids), emap.num_experts):
        raise ArtifactError(None, f"window {window.index} ({len(window.layer_ids)} layers, {window.num_experts} "
                            f"experts) and map {emap.label or emap.short_hash} ({emap.num_layers} layers, "
                            f"{emap.num_experts} experts) are for different models",
                            "watch an engine with a map of its own model")


def cold_rate_on(hot: np.ndarray, histogram: np.ndarray, cache_slots: int = 0,
                 cache_policy: str = "lru") -> float | None:
    """Share of ``histogram``'s selections on experts where ``hot`` is False (None for an empty histogram).

    With ``cache_slots`` (a map with a cache tier) it is the share that misses the hot rows and the slots, by the
    same cache model ``pinsidecar map build`` predicts with from counts (:mod:`~pinsidecar.placement.cache_model`,
    independent references); without, the plain cold ratio, as before the cache tier.
    """
    total = int(histogram.sum())
    if total == 0:
        return None
    if cache_slots:
        return float(expected_misses(hot, histogram, cache_slots, cache_policy).sum() / total)
    return float(np.where(hot, 0, histogram).sum() / total)


def map_cold_rate_on(emap: ExpertMap, histogram: np.ndarray) -> float | None:
    """:func:`cold_rate_on` of a map: its hot set, and its cache slots and policy when it has a cache."""
    return cold_rate_on(emap.hot_mask(), histogram, emap.cache_slots, emap.cache_policy)


def live_cold_rate(window: Window, active: ExpertMap) -> tuple[float | None, str]:
    """Signal a's rate: the hook's own cold count when it served ``active``, else computed from the histogram."""
    if window.cold_selections is not None and window.map_hash in ("", active.content_hash) \
            and window.total_selections > 0:
        return float(window.cold_selections.sum() / window.total_selections), "live"
    if window.histogram is not None:
        return map_cold_rate_on(active, window.histogram), "histogram"
    return None, ""


def js_divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> np.ndarray:
    """Per row (layer), the Jensen-Shannon divergence in bits between two count tables of the same shape.

    Rows are normalised to distributions; an all-zero row on either side gives NaN (nothing to compare).
    ``0 * log 0`` is 0, so zero counts need no smoothing.
    """
    p = np.asarray(p_counts, dtype=np.float64)
    q = np.asarray(q_counts, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"count tables of different shapes {p.shape} and {q.shape}")
    ps, qs = p.sum(axis=1, keepdims=True), q.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = p / ps
        q = q / qs
        m = 0.5 * (p + q)

        def kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return np.where(a > 0, a * np.log2(np.where(a > 0, a, 1.0) / np.where(b > 0, b, 1.0)), 0.0).sum(axis=1)

        js = 0.5 * kl(p, m) + 0.5 * kl(q, m)
    empty = (ps[:, 0] == 0) | (qs[:, 0] == 0)
    return np.where(empty, np.nan, np.clip(js, 0.0, 1.0))


def top_mask(counts: np.ndarray, hot_rows: int) -> np.ndarray:
    """bool [layers, experts]: per layer the ``hot_rows`` most-selected experts, ties to the lower expert id (the
    order :func:`~pinsidecar.placement.build_usage_map` uses)."""
    order = np.argsort(-np.asarray(counts), axis=1, kind="stable")
    hot = np.zeros(np.shape(counts), dtype=bool)
    np.put_along_axis(hot, order[:, :hot_rows], True, axis=1)
    return hot


def split_half_cold_rate(histogram: np.ndarray, hot_rows: int, seed: int = SPLIT_SEED, cache_slots: int = 0,
                         cache_policy: str = "lru") -> float | None:
    """Cold rate of a map built on one random half of the window's selections and scored on the other, both ways.

    Each selection goes to either half with probability 1/2 (binomial thinning), so under independent selections
    the halves are independent samples of the same routing, and the figure is out of sample. Selections of one
    request are correlated, which makes it somewhat optimistic; it is only used to say whether skew exists.
    With ``cache_slots``, each half is scored by the cache model (:func:`cold_rate_on`).
    """
    hist = np.asarray(histogram, dtype=np.int64)
    total = int(hist.sum())
    if total == 0:
        return None
    a = np.random.default_rng(seed).binomial(hist, 0.5)
    b = hist - a
    if cache_slots:
        cold = (expected_misses(top_mask(a, hot_rows), b, cache_slots, cache_policy).sum()
                + expected_misses(top_mask(b, hot_rows), a, cache_slots, cache_policy).sum())
        return float(cold / total)
    cold = np.where(top_mask(a, hot_rows), 0, b).sum() + np.where(top_mask(b, hot_rows), 0, a).sum()
    return float(cold / total)


def candidate_hot_mask(previous: Window, active: ExpertMap) -> tuple[ExpertMap, np.ndarray]:
    """The map the pipeline would build from ``previous`` (same hot rows, cache slots and bytes as ``active``),
    and its mask."""
    name = f"window{previous.index}"
    cand = rebuild_map([previous.to_counts()], active, label=name, names=[name])
    return cand, cand.hot_mask()


def compute_signals(window: Window, active: ExpertMap, cfg: DriftConfig, *,
                    reference: CountsArtifact | Window | None = None, reference_kind: str = "source counts",
                    previous: Window | None = None) -> Signals:
    """All signals of ``window`` under ``active``.

    ``reference`` is what the divergence compares with: the counts the active map was built from when the caller
    has them, else an early window under this map (say which in ``reference_kind``). ``previous`` is the most
    recent judged window before this one, of the same model: the candidate for the projected gain is built from it
    (its map does not matter: the router picks the same experts whatever the placement).
    """
    _check_geometry(window, active)
    notes: list[str] = []
    # any map's cold rate on uniform routing; with slots, (cold rows - slots) / experts (the cache model's figure)
    uniform = active.cold_rows / active.num_experts if not active.cache_slots else \
        (active.num_experts - active.hbm_rows) / active.num_experts
    cold_rate, cold_source = live_cold_rate(window, active)
    predicted = active.predicted_cold_rate
    if predicted is None and isinstance(reference, CountsArtifact):
        predicted = map_cold_rate_on(active, reference.counts)
    excess = None if cold_rate is None or predicted is None else cold_rate - predicted

    div_layers = div_max = div_mean = None
    ref_kind = ""
    hist = window.histogram
    if hist is None:
        notes.append("no histogram in the live stats (the hook runs with PINSIDECAR_STATS_HISTOGRAM=0): only the "
                     "cold rate is known")
    elif window.total_selections == 0:
        notes.append("no selections in the window")
        hist = None
    if hist is not None and reference is not None:
        ref_hist = reference.counts if isinstance(reference, CountsArtifact) else reference.histogram
        if ref_hist is not None and ref_hist.shape == hist.shape:
            js = js_divergence(hist, ref_hist)
            if not np.isnan(js).all():
                div_layers = [None if np.isnan(x) else round(float(x), 6) for x in js]  # type: ignore[misc]
                div_max, div_mean = float(np.nanmax(js)), float(np.nanmean(js))
                ref_kind = reference_kind

    active_rate = cand_rate = gain = None
    cand_from = None
    if hist is not None:
        active_rate = map_cold_rate_on(active, hist)
        if previous is None or previous.histogram is None or previous.total_selections == 0:
            notes.append("no earlier window to build a candidate from (the projected gain is measured out of "
                         "sample: built on the previous window, scored on this one)")
        elif (previous.layer_ids, previous.num_experts) != (window.layer_ids, window.num_experts):
            notes.append("the previous window is of another model: no candidate")
        else:
            cand, _ = candidate_hot_mask(previous, active)
            cand_rate = map_cold_rate_on(cand, hist)
            cand_from = previous.index
            if active_rate is not None and cand_rate is not None:
                gain = active_rate - cand_rate

    split_rate = split_half_cold_rate(hist, active.hot_rows, cache_slots=active.cache_slots,
                                      cache_policy=active.cache_policy) if hist is not None else None
    estimates = [r for r in (active_rate, cand_rate, split_rate) if r is not None]
    best = min(estimates) if estimates else None
    skew_gap = None if best is None else uniform - best
    exploitable = None if skew_gap is None else skew_gap >= cfg.skew_margin
    return Signals(
        tokens=window.tokens, uniform_cold_rate=uniform, cold_rate=cold_rate, cold_rate_source=cold_source,
        predicted_cold_rate=predicted, cold_rate_excess=excess, divergence_per_layer=div_layers,
        divergence_max=div_max, divergence_mean=div_mean, divergence_reference=ref_kind,
        active_cold_rate=active_rate, candidate_cold_rate=cand_rate, projected_gain=gain, candidate_from=cand_from,
        split_cold_rate=split_rate, best_cold_rate=best, skew_gap=skew_gap, exploitable_skew=exploitable, notes=notes,
    )
