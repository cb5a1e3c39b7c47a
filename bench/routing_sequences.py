"""Routing sequences with temporal structure: seeded synthetic traces ``experts[tokens, layers, top_k]`` for the
cache-tier benches, and the reuse statistics they are calibrated by.

Counts say how often each expert is picked; a cache tier lives on *when*: an expert one token picks is likely
picked again a few tokens later. The kernel-level bench's routing profiles (``bench/placement.py``) draw every token
independently, which is right for a static placement and says nothing about a cache. These generators add the
order. Four profiles, each a function of ``(tokens, layers, experts, top_k, seed, model_seed)``:

- ``stationary``: each token draws its top-k without replacement from one fixed skewed popularity per layer (a
  Zipf law over ranks, p(rank r) ~ r^-1, each layer its own random order of experts). No temporal structure:
  keeping the most selected experts is as good as any placement gets;
- ``flat``: uniform popularity, no structure: nothing to learn, for a static set or a cache;
- ``short_reuse``: a drifting working set per layer. Every expert is in or out of the layer's working set, a
  two-state Markov chain per expert and layer (leaves with probability 1/dwell per token; enters with probability
  proportional to a mild Zipf base popularity, so the set holds ``working_set`` experts on average). Each token
  draws its top-k without replacement from the base popularity with the working set's members weighted ``boost``
  times. The parameters are calibrated (:data:`CALIBRATION`) so that the measured reuse statistics match the figures
  quoted for Qwen3-30B-A3B: median reuse distance 2 tokens, 80 % of selections repeat within 8 tokens. The set
  drifts through every expert, so which experts are busy in one stretch of tokens says little about the next: a
  static set ranked on one trace sees only the base popularity of another;
- ``mixed``: domains alternate in segments (geometric lengths, mean ``segment`` tokens); each domain has its own
  Zipf popularity per layer (its own order of experts), and within a domain the same working-set mechanism adds
  reuse. Its parameters are fitted to the miss rates the issue quotes for "mixed domains" traffic
  (:data:`MIXED_CALIBRATION`): 32 domains of 24 tokens on average, so a static set cannot hold every domain's head
  and a cache has the current one's to catch.

``seed`` draws the tokens; ``model_seed`` fixes what belongs to the "model" (popularities, expert orders), so a
training trace and a held-out trace of one profile are two samples of one model: pass the same ``model_seed`` and
different ``seed``.

**Reuse distance** (:func:`reuse_distances`): for a selection of expert e at token t in layer l, the distance is
t - t' where t' < t is the most recent earlier token that selected e in layer l (1 = the previous token). A
selection whose expert was never selected before in that layer (a first selection) has no distance; it is counted
as infinite: it is in the denominator of every share and sorts last for the median, i.e. it never "repeats within
8". Over a trace of thousands of tokens first selections are a fraction of a percent (``first_selection_share``).

Write a trace for ``pinsidecar placement simulate`` with :func:`save` (the project's format,
``pinsidecar_hook.contract.save_trace``), or from the shell::

    python bench/routing_sequences.py short_reuse --tokens 20000 --seed 1 --out train.npz
    python bench/routing_sequences.py short_reuse --tokens 20000 --seed 2 --out test.npz
    pinsidecar placement simulate test.npz --train train.npz --hbm-rows 123 --cache-slots auto --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CALIBRATION", "MIXED_CALIBRATION", "PROFILES", "generate", "main", "reuse_distances", "reuse_stats", "save",
           "to_trace"]

# The figures the short-reuse profile is calibrated to (Qwen3-30B-A3B, as quoted in the cache-tier issue).
CALIBRATION = {"median_reuse_distance": 2.0, "share_within_8": 0.80, "within": 8}
CHUNK = 512  # tokens per block of random numbers (bounds memory at [chunk, layers, experts] floats)


@dataclass(frozen=True)
class WorkingSet:
    """A per-layer working set: each expert is in or out, a two-state Markov chain per token; members' weights are
    multiplied by ``boost`` when the token draws its top-k."""

    size: float  # mean members per layer
    dwell: float  # mean tokens an expert stays in
    boost: float  # weight multiplier of a member


@dataclass(frozen=True)
class Params:
    """What a profile is made of (recorded in each trace's ``meta``)."""

    zipf: float  # base popularity p(rank r) ~ r^-zipf (0: uniform)
    domains: int = 1
    segment: float = 0.0  # mean tokens per domain segment (mixed)
    working_set: WorkingSet | None = None


# short_reuse: ``working_set`` calibrated (see tests/test_routing_sequences.py and docs/placement-bench.md) to the
# median reuse distance of 2 tokens and 80 % within 8 at top-6 of 160; zipf is a choice (a mild skew), not fitted.
# mixed: every parameter fitted (a grid search, least squares on the log miss rates) to the "mixed domains"
# row, MIXED_CALIBRATION, at its geometry; the fit's domains are many and short (topics more than languages): with
# two domains of 512 tokens (this profile before 2026-12-06) a static set held both domains' heads and missed 2.9 %,
# not the 8.4 % the traffic shows.
PROFILES: dict[str, Params] = {
    "stationary": Params(zipf=1.0),
    "flat": Params(zipf=0.0),
    "short_reuse": Params(zipf=0.3, working_set=WorkingSet(size=12.0, dwell=32.0, boost=100.0)),
    "mixed": Params(zipf=0.91, domains=32, segment=24.0, working_set=WorkingSet(size=16.0, dwell=8.0, boost=100.0)),
}
# The simulation (quoted, not measured here) that ``mixed`` is fitted to: miss rates of a static set, LRU
# slots only and a hot set + LRU slots, at 24 layers x 160 experts, top-6, 123 HBM rows a layer, batch 1.
MIXED_CALIBRATION = {"static": 0.084, "lru_only": 0.046, "hybrid": 0.032}


def _zipf_logp(rng: np.random.Generator, layers: int, experts: int, exponent: float) -> np.ndarray:
    """``[layers, experts]`` log-probabilities: a Zipf law over ranks, each layer its own random order."""
    ranks = np.arange(1, experts + 1, dtype=np.float64) ** -exponent
    ranks /= ranks.sum()
    out = np.empty((layers, experts))
    for layer in range(layers):
        out[layer, rng.permutation(experts)] = ranks
    return np.log(out)


def _topk(scores: np.ndarray, top_k: int) -> np.ndarray:
    """The ``top_k`` highest scores' indices along the last axis, highest first (a router's order)."""
    top = np.argpartition(-scores, top_k - 1, axis=-1)[..., :top_k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=-1), axis=-1)
    return np.take_along_axis(top, order, axis=-1)


def domain_schedule(rng: np.random.Generator, tokens: int, domains: int, segment: float) -> np.ndarray:
    """int ``[tokens]``: the domain of each token; segments of geometric length (mean ``segment``), each segment
    a different domain from the one before (uniformly among the others)."""
    out = np.zeros(tokens, dtype=np.int64)
    if domains < 2:
        return out
    t, d = 0, int(rng.integers(domains))
    while t < tokens:
        n = int(rng.geometric(1.0 / segment))
        out[t: t + n] = d
        t += n
        d = (d + 1 + int(rng.integers(domains - 1))) % domains
    return out


def generate(profile: str, tokens: int, layers: int, experts: int, top_k: int, seed: int,
             model_seed: int = 0) -> np.ndarray:
    """uint16 ``[tokens, layers, top_k]``: ``profile``'s routing, distinct ids per row, deterministic per
    ``(seed, model_seed)``. ``model_seed`` fixes the popularities (the model), ``seed`` the tokens."""
    return generate_with(PROFILES[profile], tokens, layers, experts, top_k, seed, model_seed)


def generate_with(params: Params, tokens: int, layers: int, experts: int, top_k: int, seed: int,
                  model_seed: int = 0) -> np.ndarray:
    """:func:`generate` for explicit :class:`Params` (what calibration searches over)."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    if not 1 <= experts <= 65535:
        raise ValueError(f"experts must be in 1..65535, got {experts}")
    mrng = np.random.default_rng([model_seed, 7919])
    logp = np.stack([_zipf_logp(mrng, layers, experts, params.zipf) for _ in range(params.domains)])  # [D, L, E]
    rng = np.random.default_rng([seed, 104729])
    dom = domain_schedule(rng, tokens, params.domains, params.segment)
    out = np.empty((tokens, layers, top_k), dtype=np.uint16)
    ws = params.working_set
    if ws is None:  # no temporal structure: every token independent, given its domain
        for start in range(0, tokens, CHUNK):
            n = min(CHUNK, tokens - start)
            scores = logp[dom[start: start + n]] + rng.gumbel(size=(n, layers, experts))
            out[start: start + n] = _topk(scores, top_k)
        return out
    leave = 1.0 / ws.dwell
    # enter with probability ~ popularity, so that the mean size is about ws.size: size ~ sum enter / (enter+leave)
    p = np.exp(logp)
    enter = np.minimum(1.0, leave * ws.size * p / np.maximum(1e-12, 1.0 - np.minimum(ws.size * p, 0.999)))
    log_boost = float(np.log(ws.boost))
    member = rng.random((layers, experts)) < enter[dom[0]] / (enter[dom[0]] + leave)  # the chain's stationary law
    for start in range(0, tokens, CHUNK):
        n = min(CHUNK, tokens - start)
        u = rng.random((n, layers, experts))
        g = rng.gumbel(size=(n, layers, experts))
        for i in range(n):
            d = dom[start + i]
            member = np.where(member, u[i] >= leave, u[i] < enter[d])
            out[start + i] = _topk(logp[d] + log_boost * member + g[i], top_k)
    return out


# ----------------------------------------------------------------------------------------------- reuse statistics


def reuse_distances(experts: np.ndarray) -> np.ndarray:
    """float ``[tokens, layers, top_k]``: each selection's reuse distance (see the module docstring): tokens since
    the same layer last selected the same expert, ``inf`` for a first selection."""
    ids = np.asarray(experts)
    tokens, layers, top_k = ids.shape
    out = np.full(ids.shape, np.inf)
    tok = np.repeat(np.arange(tokens), top_k)
    for layer in range(layers):
        flat = ids[:, layer, :].reshape(-1).astype(np.int64)
        order = np.lexsort((tok, flat))  # by expert, then token
        e_sorted, t_sorted = flat[order], tok[order]
        d = np.full(flat.size, np.inf)
        same = e_sorted[1:] == e_sorted[:-1]
        d[1:][same] = (t_sorted[1:] - t_sorted[:-1])[same]
        col = np.empty(flat.size)
        col[order] = d
        out[:, layer, :] = col.reshape(tokens, top_k)
    return out


def reuse_stats(experts: np.ndarray, within: int = 8) -> dict[str, float]:
    """The reuse figures of a trace: the median reuse distance over all selections (first selections counted as
    infinite), the share of selections whose distance is at most ``within`` (and at most 1, 2), the share of first
    selections, and the median and mean distance over repeats only."""
    d = reuse_distances(experts).reshape(-1)
    finite = d[np.isfinite(d)]
    return {
        "median_reuse_distance": float(np.median(d)) if d.size else float("nan"),
        f"share_within_{within}": float((d <= within).mean()) if d.size else float("nan"),
        "share_within_1": float((d <= 1).mean()) if d.size else float("nan"),
        "share_within_2": float((d <= 2).mean()) if d.size else float("nan"),
        "first_selection_share": float(np.isinf(d).mean()) if d.size else float("nan"),
        "median_reuse_distance_repeats_only": float(np.median(finite)) if finite.size else float("nan"),
        "mean_reuse_distance_repeats_only": float(finite.mean()) if finite.size else float("nan"),
        "selections": int(d.size),
    }


def popularity_shift(train: np.ndarray, test: np.ndarray, num_experts: int, cold: int) -> dict[str, float]:
    """How much a static set learns across two traces: the share of ``test``'s selections that fall on each
    layer's ``cold`` least-selected experts of ``train`` (ranked as the simulator ranks), and the same with the
    ranking taken from ``test`` itself (the best any static set of that size could do)."""
    def cold_share(rank_from: np.ndarray) -> float:
        missed = 0
        for layer in range(test.shape[1]):
            counts = np.bincount(rank_from[:, layer].reshape(-1), minlength=num_experts)
            coldest = np.lexsort((-np.arange(num_experts), counts))[:cold]  # fewest first; ties: higher id colder
            missed += int(np.isin(test[:, layer], coldest).sum())
        return missed / test.size

    return {"static_cold_share_trained_on_train": cold_share(train), "static_cold_share_oracle": cold_share(test)}


# ----------------------------------------------------------------------------------------------- trace files


def to_trace(experts: np.ndarray, num_experts: int, meta: dict[str, Any] | None = None) -> Any:
    """A :class:`pinsidecar_hook.contract.RoutingTrace` of ``experts`` (checked: ids in range, distinct per row)."""
    from pinsidecar_hook.contract import RoutingTrace

    return RoutingTrace(experts, num_experts, tuple(range(experts.shape[1])), dict(meta or {}))


def save(path: str | Path, profile: str, tokens: int, layers: int, experts: int, top_k: int, seed: int,
         model_seed: int = 0) -> dict[str, Any]:
    """Generate ``profile`` and write it with ``pinsidecar_hook.contract.save_trace`` (what ``pinsidecar
    placement simulate`` reads); returns the trace's ``meta`` (the profile, its parameters, seeds, reuse stats)."""
    from pinsidecar_hook.contract import save_trace

    ids = generate(profile, tokens, layers, experts, top_k, seed, model_seed)
    meta = {"generator": "bench/routing_sequences.py", "profile": profile, "seed": seed, "model_seed": model_seed,
            "params": asdict(PROFILES[profile]), "reuse": reuse_stats(ids)}
    save_trace(path, to_trace(ids, experts, meta))
    return meta


def calibrate(generate_fn: Callable[[float], np.ndarray], lo: float, hi: float, target: float,
              stat: str = "share_within_8", steps: int = 12) -> float:
    """Bisect one parameter (``generate_fn(x)`` -> trace, ``stat`` increasing in x) to ``target``: how the
    short-reuse working set was tuned; kept for re-tuning at another geometry."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reuse_stats(generate_fn(mid))[stat] < target else (lo, mid)
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a synthetic routing trace (pinsidecar trace format).")
    ap.add_argument("profile", choices=sorted(PROFILES))
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1, help="the tokens")
    ap.add_argument("--model-seed", type=int, default=0, help="the popularities (same for train and held-out)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    meta = save(args.out, args.profile, args.tokens, args.layers, args.experts, args.top_k, args.seed,
                args.model_seed)
    print(json.dumps(meta["reuse"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
