"""Record the demo model's real routing, one histogram per request, for the drift-watch tests.

The drift tests (``tests/test_drift_*.py``) need windows of live traffic that look like what the daemon will see
on the demo: a few hundred to a few thousand tokens of code or prose requests. Booting vLLM for each test is too
slow, so this script records, once, the per-layer x per-expert top-k selections of every shipped demo prompt
(``code``, ``code_heldout``, ``prose``, ``prose_heldout``) under transformers, exactly as
:func:`pinsidecar.demo.model.routing_counts` measures them (prompt positions plus the first ``max_tokens - 1``
greedy tokens, the tokens vLLM routes for a completion of ``max_tokens``), but keeps one histogram per request. A
test window is then a sum of whole recorded requests, so it keeps the correlation between the tokens of one request
that per-selection sampling would lose.

Re-record (about a minute on two cores) after changing the demo model or its prompts::

    .venv/bin/python tests/data/drift/record_demo_routing.py            # writes demo_routing.json beside itself
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pinsidecar.demo import model as dm

OUT = Path(__file__).resolve().parent / "demo_routing.json"
SPLITS = ("code", "code_heldout", "prose", "prose_heldout")
SEED = 0


def record_requests(model_dir: Path, prompts: list[dict[str, Any]], batch_size: int = 16) -> list[dict[str, Any]]:
    """One ``{"tokens", "counts"}`` per prompt: its routed tokens and its int [layers][experts] selections."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                experts_implementation="grouped_mm").eval()
    layers = model.model.layers
    num_experts = model.config.num_experts
    calls: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(layer: int) -> Any:
        def fn(_mod: Any, _inp: Any, out: tuple[torch.Tensor, ...]) -> None:
            calls[layer].append(out[2])
        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    out: list[dict[str, Any]] = []
    try:
        with torch.inference_mode():
            # Batch prompts of equal max_tokens together, so every row of a batch generates the same count.
            order = sorted(range(len(prompts)), key=lambda i: int(prompts[i].get("max_tokens", 16)))
            results: dict[int, dict[str, Any]] = {}
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                gen = {int(prompts[i].get("max_tokens", 16)) for i in idx}
                if len(gen) > 1:  # split the batch at a change of max_tokens
                    first = int(prompts[idx[0]].get("max_tokens", 16))
                    idx = [i for i in idx if int(prompts[i].get("max_tokens", 16)) == first]
                gen_tokens = int(prompts[idx[0]].get("max_tokens", 16))
                enc = tok([prompts[i]["prompt"] for i in idx], return_tensors="pt", padding=True)
                for c in calls:
                    c.clear()
                model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=gen_tokens,
                               min_new_tokens=gen_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
                bsz, seq = enc.input_ids.shape
                mask = enc.attention_mask.bool()
                per_row = np.zeros((bsz, len(layers), num_experts), dtype=np.int64)
                for layer, c in enumerate(calls):
                    prefill = c[0].reshape(bsz, seq, -1)
                    for b in range(bsz):
                        sel = [prefill[b][mask[b]].reshape(-1)] + [d.reshape(bsz, -1)[b] for d in c[1:]]
                        flat = torch.cat(sel).numpy()
                        per_row[b, layer] = np.bincount(flat, minlength=num_experts)
                for b, i in enumerate(idx):
                    tokens = int(mask[b].sum()) + gen_tokens - 1
                    results[i] = {"tokens": tokens, "counts": per_row[b].tolist()}
            # Any prompt skipped by a max_tokens split is picked up here, one by one.
            missing = [i for i in range(len(prompts)) if i not in results]
            if missing:
                rest = record_requests(model_dir, [prompts[i] for i in missing], batch_size)
                results.update(dict(zip(missing, rest, strict=True)))
            out = [results[i] for i in range(len(prompts))]
    finally:
        for h in handles:
            h.remove()
    return out


def dump(doc: dict[str, Any]) -> str:
    """Compact JSON with one request per line, so a re-recording diffs request by request."""
    return json.dumps(doc, separators=(",", ":")).replace('{"tokens"', '\n{"tokens"') + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an existing demo model folder (default: build seed 0 in a tmpdir)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or dm.build_demo_model(Path(tmp) / "model", seed=SEED)
        doc: dict[str, Any] = {
            "format": "pinsidecar.test.demo-routing", "version": 1, "model_seed": SEED,
            "weights_digest": dm.weights_digest(model_dir), "recorded_with": "transformers (float32 on bf16 weights)",
            "layer_ids": list(range(dm.NUM_LAYERS)), "num_experts": dm.NUM_EXPERTS, "top_k": dm.TOP_K,
            "requests": {},
        }
        for split in SPLITS:
            doc["requests"][split] = record_requests(model_dir, dm.load_prompts(split))
    text = dump(doc)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
