"""Predicting a layer's cold experts from the residual stream, against the last step's choice, on a real model.

The prefetch needs a layer's cold experts named before its router runs. The last step's choice can be judged on a
routing trace (``pinsidecar placement prefetch``); a prediction from the residual stream cannot (a trace has no
hidden states). This runs a model in transformers on the CPU (the demo model: the GPU lane model's router design,
small), greedily continues each prompt, then replays every token through the model with hooks and scores, per
token, layer and predictor, the cold experts predicted against those the router picked:

- ``same-layer``: layer L's router applied to the residual *entering* layer L (its input, normalised with L's
  post-attention norm): known when layer L's attention starts, one attention ahead of the router;
- ``next-layer``: layer L+1's router on the residual entering layer L (one whole layer ahead; layer 0 not
  predicted); Pre-gated MoE and ProMoE predict this way;
- ``last-step``: the cold experts layer L picked for the previous token (W = 1), for comparison on the same tokens;
- ``same-layer+last-step``: the union.

A predictor names the top-k of its logits (k = the model's), of which only the cold ones would be prefetched; the
hot set is the first ``--hot-rows`` experts of each layer ranked on a counts file (the training workload's). One
stream: a step is a token. What it cannot say: a trained model's residual stream predicts its router far better
than a random-weight one's may; the demo model is what is here.

Usage: ``python bench/prefetch_residual.py --model DIR --counts COUNTS --workload W.jsonl [--workload ...]
--hot-rows 49 --out OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pinsidecar_hook.contract import load_counts

from pinsidecar.placement import HotRanking

PREDICTORS = ("same-layer", "next-layer", "last-step", "same-layer+last-step")


def routed(model: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward over ``ids`` [1, T]: per layer, the residual entering the layer [T, H] and the router's top-k
    [T, k] (hooks on each decoder layer's input and each router's output)."""
    layers = model.model.layers
    inputs: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    picked: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0][0].detach().clone())))
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda _m, _a, out, i=i: picked.__setitem__(i, out[2].detach().clone())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs, picked


def predicted_topk(model: Any, layer: int, residual: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s router on ``residual`` normalised as its MoE input is: its top-k ids [T, k]."""
    target = model.model.layers[layer]
    with torch.no_grad():
        logits = torch.nn.functional.linear(target.post_attention_layernorm(residual), target.mlp.gate.weight)
    return torch.topk(logits, target.mlp.gate.top_k, dim=-1).indices


def cold_sets(hot: np.ndarray, ids: torch.Tensor) -> np.ndarray:
    """bool ``[T, E]``: the cold experts among each token's ``ids`` [T, k]."""
    out = np.zeros((ids.shape[0], hot.shape[0]), dtype=bool)
    np.put_along_axis(out, ids.numpy().astype(np.int64), True, axis=1)
    return out & ~hot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--counts", type=Path, required=True)
    ap.add_argument("--workload", type=Path, action="append", required=True)
    ap.add_argument("--hot-rows", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import transformers

    t0 = time.time()
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    counts = load_counts(args.counts)
    hot = HotRanking.from_counts(counts.counts, "counts", counts.layer_ids).hot_mask(args.hot_rows)
    acc = {name: {"cold": 0, "prefetched": 0, "hits": 0} for name in PREDICTORS}
    tokens = 0
    prompts = [json.loads(line)["prompt"] for path in args.workload for line in path.read_text().splitlines()
               if line.strip()]
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ids = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        inputs, picked = routed(model, ids)
        tokens += int(ids.shape[1])
        for layer, actual in enumerate(picked):
            a = cold_sets(hot[layer], actual)
            same = cold_sets(hot[layer], predicted_topk(model, layer, inputs[layer]))
            # the next-layer predictor for this layer ran on the previous layer's input (none for layer 0)
            nxt = (cold_sets(hot[layer], predicted_topk(model, layer, inputs[layer - 1])) if layer
                   else np.zeros_like(a))
            last = np.zeros_like(a)
            last[1:] = a[:-1]  # the previous token's cold picks; the first token has none
            for name, p in (("same-layer", same), ("next-layer", nxt), ("last-step", last),
                            ("same-layer+last-step", same | last)):
                acc[name]["cold"] += int(a.sum())
                acc[name]["prefetched"] += int(p.sum())
                acc[name]["hits"] += int((a & p).sum())
    rows = []
    for name, a in acc.items():
        rows.append({"predictor": name, "recall": a["hits"] / a["cold"] if a["cold"] else 0.0,
                     "precision": a["hits"] / a["prefetched"] if a["prefetched"] else 0.0, **a})
        print(f"{name:22s} recall {rows[-1]['recall']:.1%}  precision {rows[-1]['precision']:.1%}  "
              f"(cold {a['cold']}, prefetched {a['prefetched']}, hits {a['hits']})", flush=True)
    out = {"command": "python bench/prefetch_residual.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "model": str(args.model), "prompts": len(prompts), "tokens": tokens,
           "hot_rows": args.hot_rows, "max_new_tokens": args.max_new_tokens, "seconds": round(time.time() - t0, 1),
           "results": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
