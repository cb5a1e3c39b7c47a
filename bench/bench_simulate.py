"""How long does `pinsidecar placement simulate` take on a trace of realistic length? The issue asks for seconds.

Draws a synthetic trace (skewed per-layer popularities, each token's top-k without repeats; 100k tokens x 24
layers x top-6 of 128 experts by default) and a training trace from the same popularities, ranks the hot set on the
training trace, and times :func:`pinsidecar.placement.simulate` for each policy at a few cache-slot counts of 64 HBM
rows, side by side in one run, median of ``--repeats``. The time grows with the selections outside the static set
(the only ones the per-step loop sees), so the miss rate is printed beside each time.

Run: ``python bench/bench_simulate.py [--tokens 100000] [--repeats 3] [--out FILE]``. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _draw(rng: np.random.Generator, popularity: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """``[tokens, layers, top_k]`` ids, each token's k drawn without replacement by the layer's popularity."""
    layers, experts = popularity.shape
    out = np.empty((tokens, layers, top_k), np.uint16)
    for layer in range(layers):  # Gumbel-top-k: k distinct experts, weighted by popularity
        keys = np.log(popularity[layer]) - np.log(-np.log(rng.random((tokens, experts))))
        out[:, layer] = np.argpartition(-keys, top_k, axis=1)[:, :top_k]
    return out


def main(argv: list[str] | None = None) -> int:
    from pinsidecar_hook.contract import RoutingTrace

    from pinsidecar.placement import HotRanking, simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hbm-rows", type=int, default=64)
    ap.add_argument("--slots", type=int, nargs="+", default=[0, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    popularity = rng.dirichlet(np.full(args.experts, 0.3), size=args.layers)
    trace = RoutingTrace(_draw(rng, popularity, args.tokens, args.top_k), args.experts)
    train = RoutingTrace(_draw(rng, popularity, max(1, args.tokens // 5), args.top_k), args.experts)
    ranking = HotRanking.from_counts(train.counts(), "train")
    runs = []
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for policy in ("static", "lru", "lfu"):
            for k in args.slots:
                t0 = time.perf_counter()
                r = simulate(trace, ranking, args.hbm_rows, k, policy)
                runs.append({"policy": policy, "cache_slots": k, "s": time.perf_counter() - t0,
                             "miss_rate": r.miss_rate})
    results = []
    for policy in ("static", "lru", "lfu"):
        for k in args.slots:
            mine = [x for x in runs if x["policy"] == policy and x["cache_slots"] == k]
            times = sorted(x["s"] for x in mine)
            results.append({"policy": policy, "cache_slots": k, "median_s": round(statistics.median(times), 3),
                            "min_s": round(times[0], 3), "max_s": round(times[-1], 3),
                            "miss_rate": round(mine[0]["miss_rate"], 5)})
    doc = {"bench": "simulate", "date": datetime.now(UTC).strftime("%Y-%m-%d"), "host": platform.node(),
           "command": " ".join(["python bench/bench_simulate.py", *(sys.argv[1:] if argv is None else argv)]),
           "trace": {"tokens": args.tokens, "layers": args.layers, "experts": args.experts, "top_k": args.top_k},
           "hbm_rows": args.hbm_rows, "repeats": args.repeats, "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
