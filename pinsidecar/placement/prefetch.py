"""Would prefetching the cold experts ahead of the router pay? A routing trace replayed against a hot set and a
predictor of each step's cold experts: its recall, its precision, and the experts it moves over the link.

The prefetch the engine needs to come close to all-HBM at one stream: while a layer's attention runs, a copy stream
fills cache slots with the cold experts that layer is predicted to pick; an expert predicted wrongly costs link
bandwidth, and one not predicted is read in place as today. It hides link time only for the experts it names right.
Before it is built into the engine, this measures the predictors a routing trace can judge by itself:

- ``last-step``, window W: layer L at step s predicts the cold experts layer L selected in the last W steps
  (W = 1: the last step's choice). The other predictor worth measuring, the next layer's router applied to the
  current residual stream, needs the hidden states, which a routing trace does not carry.

The model, per MoE layer, over steps of ``batch`` consecutive tokens (as :mod:`~pinsidecar.placement.simulate`):
A(s) is the set of distinct cold experts step s selects (not in the hot set), P(s) the distinct cold experts the
predictor names. Summed over steps and layers:

- **recall** = Σ|P ∩ A| / Σ|A|: the share of today's cold-expert reads the prefetch would have on their way;
- **precision** = Σ|P ∩ A| / Σ|P|: the share of prefetched experts the step then uses;
- per layer and step: ``cold`` |A| (experts read over the link today), ``prefetched`` |P|, ``missed`` |A \\ P|
  (still read in place, on the critical path), and ``moved`` |P| + |A \\ P| against today's |A|: the link traffic
  with the prefetch.

A step with no history (the first of each layer) predicts nothing. The trace's own order is the engine's: a trace of
one stream is one sequence's decode steps; a batched trace interleaves its sequences as the engine did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from pinsidecar_hook.contract import ArtifactError, RoutingTrace

from pinsidecar.placement.simulate import HotRanking

__all__: list[str] = []  # nothing here is another package's business

PREDICTORS = ("last-step",)


@dataclass(frozen=True)
class PrefetchResult:
    """One predictor's figures on one trace (sums over layers and steps)."""

    predictor: str
    window: int
    steps: int  # steps per layer
    layers: int
    cold: int  # Σ|A|
    prefetched: int  # Σ|P|
    hits: int  # Σ|P ∩ A|

    @property
    def recall(self) -> float:
        return self.hits / self.cold if self.cold else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.prefetched if self.prefetched else 0.0

    def per_step(self, n: int) -> float:
        """``n`` (a sum over layers and steps) per layer per step."""
        return n / (self.steps * self.layers) if self.steps and self.layers else 0.0

    def as_dict(self) -> dict[str, Any]:
        missed = self.cold - self.hits
        return {"predictor": self.predictor, "window": self.window, "recall": self.recall,
                "precision": self.precision, "cold_per_step": self.per_step(self.cold),
                "prefetched_per_step": self.per_step(self.prefetched), "missed_per_step": self.per_step(missed),
                "moved_per_step": self.per_step(self.prefetched + missed), "cold": self.cold,
                "prefetched": self.prefetched, "hits": self.hits}


def step_cold_sets(trace: RoutingTrace, hot: np.ndarray, layer: int, batch: int) -> np.ndarray:
    """bool ``[steps, num_experts]``: the cold experts each step of ``batch`` tokens selects in ``layer``."""
    steps = -(-trace.tokens // batch)
    out = np.zeros((steps, trace.num_experts), dtype=bool)
    ids = trace.experts[:, layer, :]
    tok, slot = np.nonzero(~hot[layer][ids])
    out[tok // batch, ids[tok, slot]] = True
    return out


def last_step_prediction(cold: np.ndarray, window: int) -> np.ndarray:
    """bool like ``cold``: at step s, the experts cold at any of the ``window`` steps before s."""
    seen = np.cumsum(cold, axis=0, dtype=np.int32)
    before = np.zeros_like(seen)
    before[1:] = seen[:-1]  # selections up to step s - 1
    start = np.zeros_like(seen)
    if window + 1 < len(seen):
        start[window + 1:] = seen[: -(window + 1)]  # selections up to step s - 1 - window
    return (before - start) > 0


def evaluate_prefetch(trace: RoutingTrace, ranking: HotRanking, hot_rows: int, predictor: str = "last-step",
                      window: int = 1, batch: int = 1) -> PrefetchResult:
    """Recall, precision and link traffic of ``predictor`` over ``trace`` with the first ``hot_rows`` experts of
    each layer's ``ranking`` in HBM (module docstring)."""
    if predictor not in PREDICTORS:
        raise ArtifactError(None, f"predictor {predictor!r} is not one of {', '.join(PREDICTORS)}",
                            "pass --predictor last-step")
    if window < 1:
        raise ArtifactError(None, f"the window must be at least 1 step, got {window}", "pass --window 1 or more")
    if batch < 1:
        raise ArtifactError(None, f"batch must be at least 1 token per step, got {batch}", "pass --batch 1 or more")
    if not 0 <= hot_rows < trace.num_experts:
        raise ArtifactError(None, f"--hot-rows must be in 0..{trace.num_experts - 1}, got {hot_rows}",
                            "with every expert hot there is nothing to prefetch")
    fixed = ranking.fixed_hot_rows
    if fixed is not None and hot_rows != fixed:
        raise ArtifactError(None, f"the map keeps {fixed} hot rows per layer, not {hot_rows}",
                            f"pass --hot-rows {fixed}, or --counts to rank experts for any split")
    hot = ranking.hot_mask(hot_rows)
    cold_n = prefetched = hits = 0
    steps = -(-trace.tokens // batch)
    for layer in range(trace.num_layers):
        actual = step_cold_sets(trace, hot, layer, batch)
        predicted = last_step_prediction(actual, window)
        cold_n += int(actual.sum())
        prefetched += int(predicted.sum())
        hits += int((actual & predicted).sum())
    return PrefetchResult(predictor, window, steps, trace.num_layers, cold_n, prefetched, hits)
