"""How well does the last step's choice predict a step's cold experts? Recall, precision and link traffic of the
``last-step`` predictor (:mod:`pinsidecar.placement.prefetch`) on the seeded routing profiles of
``bench/routing_sequences.py``, at the GPU lane's geometry, for 1, 4 and 16 decode streams.

The prefetch the engine would run (issue 40): ahead of a layer's router, fill cache slots with the cold experts the
layer is predicted to pick, so their reads overlap the step instead of adding to it. A trace-level what-if, no
engine and no timing: every figure is a count, exact for the seeds. What it cannot say: the profiles are synthetic
(``short_reuse`` and ``mixed`` are calibrated to reuse statistics quoted for Qwen3-30B-A3B; ``stationary`` has no
temporal structure), and the random-weight lane model's routing may be less predictable than a trained model's;
the predictor from the next layer's router on the residual stream needs hidden states and is for the engine.

The model: 16 layers, 128 experts, top-8; the hot set is each layer's most selected experts on a training trace of
the same profile (another seed), ``--hot-rows`` of them (99 of 128 is the lane's 23 % host bytes); S streams decode
together, one token each per step, each stream its own sequence (S traces of one model, interleaved token by token).

Usage: ``python bench/prefetch_predictor.py --out bench/results/prefetch_predictor_<date>.json`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import routing_sequences as rs
from pinsidecar.placement import HotRanking, evaluate_prefetch

LAYERS, EXPERTS, TOP_K = 16, 128, 8
EXPERT_BYTES = 3 * 2048 * 768 * 2  # the bf16 lane's expert: gate, up and down of hidden 2048 x intermediate 768


def interleaved(profile: str, streams: int, tokens_per_stream: int, seed: int) -> Any:
    """``streams`` sequences of one model, interleaved token by token (one step = one token of each)."""
    runs = [rs.generate(profile, tokens_per_stream, LAYERS, EXPERTS, TOP_K, seed=seed * 1000 + s) for s in
            range(streams)]
    ids = np.stack(runs, axis=1).reshape(tokens_per_stream * streams, LAYERS, TOP_K)
    return rs.to_trace(ids, EXPERTS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hot-rows", type=int, default=99)
    ap.add_argument("--steps", type=int, default=1000, help="decode steps per configuration")
    ap.add_argument("--profiles", default="stationary,short_reuse,mixed")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = []
    for profile in args.profiles.split(","):
        train = rs.generate(profile, 20000, LAYERS, EXPERTS, TOP_K, seed=1)
        counts = np.stack([np.bincount(train[:, layer].ravel(), minlength=EXPERTS) for layer in range(LAYERS)])
        ranking = HotRanking.from_counts(counts, "train")
        for streams in (1, 4, 16):
            trace = interleaved(profile, streams, args.steps, seed=2)
            for window in (1, 2, 4):
                r = evaluate_prefetch(trace, ranking, args.hot_rows, "last-step", window, streams).as_dict()
                r.update(profile=profile, streams=streams,
                         moved_mb_per_step=round(r["moved_per_step"] * LAYERS * EXPERT_BYTES / 1e6, 1),
                         cold_mb_per_step=round(r["cold_per_step"] * LAYERS * EXPERT_BYTES / 1e6, 1),
                         missed_mb_per_step=round(r["missed_per_step"] * LAYERS * EXPERT_BYTES / 1e6, 1))
                rows.append(r)
                print(f"{profile:12s} {streams:2d} streams, window {window}: recall {r['recall']:.1%} precision "
                      f"{r['precision']:.1%}; cold {r['cold_per_step']:.2f}/layer/step, still missed "
                      f"{r['missed_per_step']:.2f}, moved {r['moved_per_step']:.2f}", flush=True)
    out = {"command": "python bench/prefetch_predictor.py " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "geometry": {"layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
                                                           "hot_rows": args.hot_rows, "expert_bytes": EXPERT_BYTES},
           "steps": args.steps, "seconds": round(time.time() - t0, 1), "results": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
