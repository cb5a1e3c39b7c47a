"""Measure the demo model's routing skew per layer and domain, under transformers or real vLLM CPU; writes JSON.

Issue 2 asks, in every MoE layer: the hottest 25 % of experts take >= 60 % of a domain's selections, and the two
domains' hot sets overlap by <= 50 %. Run ``python bench/demo_skew.py [--model DIR] [--engine vllm] [--out FILE]``;
without ``--model`` it builds the demo model (seed 0) in a temporary directory. ``--engine transformers`` (default)
needs no vLLM; ``--engine vllm`` boots vLLM CPU in this process and counts the top-k of every router's logits with a
forward hook on each ``mlp.gate`` (greedy decoding, EOS ignored, prefix caching off), as a cross-check.
``--router calibrated`` builds the model with the router calibrated to the reference skew; for every model the
held-out figures add ``cold_rate``: per domain, the cold-selection rate of the map from its training prompts with
23 % of the experts cold (the figure that router is set by), and ``cross_cold_rate``, the same map on the other
domain's held-out prompts (what drift detection sees).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "vllm_routing_counts"]

SPLITS = {"train": "", "heldout": "_heldout"}


def vllm_routing_counts(model: Path, prompt_sets: dict[str, list[str]], gen_tokens: int) -> dict[str, np.ndarray]:
    """Per-layer x per-expert top-k counts from real vLLM CPU (in-process engine) for each named prompt set."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=256 * 2**20,
              enable_prefix_caching=False)
    config = json.loads((Path(model) / "config.json").read_text())
    num_experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    captured: dict[int, np.ndarray] = {}

    def install(vllm_model: Any) -> int:
        import torch

        for name, mod in vllm_model.named_modules():
            if name.endswith("mlp.gate"):
                layer = int(name.split(".layers.")[1].split(".")[0])
                captured[layer] = np.zeros(num_experts, dtype=np.int64)

                def hook(_m: Any, _inp: Any, out: Any, layer: int = layer) -> None:
                    logits = out[0] if isinstance(out, tuple) else out
                    top = torch.topk(logits.float(), top_k, dim=-1).indices.reshape(-1).cpu().numpy()
                    captured[layer] += np.bincount(top, minlength=num_experts)

                mod.register_forward_hook(hook)
        return len(captured)

    llm.apply_model(install)  # in-process engine: the hooks write into `captured` here
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    result = {}
    for key, prompts in prompt_sets.items():
        for row in captured.values():
            row[:] = 0
        llm.generate(prompts, params, use_tqdm=False)
        result[key] = np.stack([captured[k].copy() for k in sorted(captured)])
    return result


def main(argv: list[str] | None = None) -> int:
    from pinsidecar import log
    from pinsidecar.demo.model import (
        DOMAINS,
        ROUTERS,
        build_demo_model,
        cold_selection_rate,
        load_prompts,
        routing_counts,
        skew_figures,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an existing demo model directory (default: build one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router", choices=ROUTERS, default="zipf", help="router of the model built (not with --model)")
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens generated per prompt (max_tokens)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    log.configure("warning")  # logs to stderr; stdout carries only the JSON

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_demo_model(Path(tmp) / "demo", seed=args.seed, router=args.router)
        result: dict[str, Any] = {"model": str(args.model or f"demo seed {args.seed}, router {args.router}"),
                                  "engine": args.engine,
                                  "gen_tokens": args.gen_tokens, "hot_fraction": 0.25,
                                  "command": "python bench/demo_skew.py " + " ".join(argv or sys.argv[1:])}
        t0 = time.perf_counter()
        sets = {(split, d): [r["prompt"] for r in load_prompts(d + suffix)]
                for split, suffix in SPLITS.items() for d in DOMAINS}
        if args.engine == "vllm":
            flat = vllm_routing_counts(model, {f"{s}/{d}": p for (s, d), p in sets.items()}, args.gen_tokens)
            counts = {key: flat[f"{key[0]}/{key[1]}"] for key in sets}
        else:
            counts = {key: routing_counts(model, p, gen_tokens=args.gen_tokens) for key, p in sets.items()}
        for split in SPLITS:
            per_domain = {d: counts[(split, d)] for d in DOMAINS}
            figures = skew_figures(per_domain).as_dict()
            figures.pop("hot_sets")
            figures["selections"] = {d: int(c.sum()) for d, c in per_domain.items()}
            result[split] = figures
        other = dict(zip(DOMAINS, DOMAINS[::-1], strict=True))
        result["heldout"]["cold_rate"] = {
            d: float(cold_selection_rate(counts[("train", d)], counts[("heldout", d)]).mean()) for d in DOMAINS}
        result["heldout"]["cross_cold_rate"] = {
            d: float(cold_selection_rate(counts[("train", d)], counts[("heldout", other[d])]).mean()) for d in DOMAINS}
        result["seconds"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
