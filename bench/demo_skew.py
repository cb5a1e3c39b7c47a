"""Measure the demo model's routing skew without vLLM (transformers), per layer and domain; writes JSON.

Issue 2 asks, in every MoE layer: the hottest 25 % of experts take >= 60 % of a domain's selections, and the two
domains' hot sets overlap by <= 50 %. Run ``python bench/demo_skew.py [--model DIR] [--out FILE]``; without
``--model`` it builds the demo model (seed 0) in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from pinsidecar.demo_model import build_demo_model, load_prompts, routing_counts, skew_figures

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an existing demo model directory (default: build one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens routed after each prompt")
    ap.add_argument("--out", type=Path, help="write the JSON here (default: stdout only)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_demo_model(Path(tmp) / "demo", seed=args.seed)
        result: dict = {"model": str(args.model or f"demo seed {args.seed}"), "gen_tokens": args.gen_tokens}
        for split in ("", "_heldout"):
            t0 = time.perf_counter()
            counts = {d: routing_counts(model, load_prompts(d + split), gen_tokens=args.gen_tokens)
                      for d in ("code", "prose")}
            figures = skew_figures(counts).as_dict()
            figures.pop("hot_sets")
            figures["selections"] = {d: int(c.sum()) for d, c in counts.items()}
            figures["seconds"] = round(time.perf_counter() - t0, 2)
            result["train" if not split else "heldout"] = figures
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
