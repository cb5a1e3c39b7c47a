"""Throughput of pin mode on the vLLM CPU engine against count mode and the hook off, side by side.

What it answers: what does the split invoke (partition + live counts + two top-1 kernel calls + finalize, every
MoE layer, every step) cost on the engine CI runs? The target is pin (all-hot map) >= 0.9 x hook off.

How: one engine per mode (off, count, pin with the all-hot map; optionally pin with a skewed map), all booted
first and kept up, then ``--rounds`` rounds in which every engine in turn serves the same batch (``--concurrency``
streams of ``--max-tokens`` greedy tokens, ``ignore_eos``). Interleaving the rounds spreads the load of a shared
machine evenly over the modes instead of favouring whichever ran first; the median round is reported.

    .venv/bin/python bench/bench_pin_cpu.py --out bench/results/pin_cpu.json

Prints one JSON document (also written to ``--out``) with tok/s per mode per round, medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import ExpertMap, LayerPlacement, atomic_write_json

from pinsidecar.counts.workload import WorkloadRequest, load_workload, replay
from pinsidecar.testing.engine import free_port, start_engine

__all__ = ["main"]

DEFAULT_PORTS = (8240, 8249)


def _maps(model_dir: Path, tmp: Path) -> dict[str, Path]:
    cfg = json.loads((model_dir / "config.json").read_text())
    n, k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    out = {}
    for name, hot_rows, seed in (("all-hot", n, 0), ("skew", n * 5 // 8, 3)):
        rng = random.Random(seed)
        placements = []
        for lid in range(layers):
            order = list(range(n))
            if seed:
                rng.shuffle(order)
            placements.append(LayerPlacement(lid, tuple(order[:hot_rows]), tuple(order[hot_rows:])))
        path = tmp / f"{name}.json"
        ExpertMap(layer_ids=tuple(range(layers)), num_experts=n, top_k=k, hot_rows=hot_rows,
                  layers=tuple(placements), label=name).save(path)
        out[name] = path
    return out


def _batch(prompts: list[WorkloadRequest], concurrency: int, max_tokens: int) -> list[WorkloadRequest]:
    return [WorkloadRequest(kind="completion", source=r.source,
                            body={**r.body, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
            for r in (prompts * (concurrency // max(1, len(prompts)) + 1))[:concurrency]]


def _measure(order: list[str], model: Path, maps: dict[str, Path], tmp: Path, batch: list[WorkloadRequest],
             args: argparse.Namespace, rounds: dict[str, list[float]], boot_s: dict[str, list[float]]) -> None:
    engines: dict[str, Any] = {}
    try:
        for mode in order:
            hook_mode = "pin" if mode.startswith("pin") else mode
            map_path = maps[mode.split("-", 1)[1]] if hook_mode == "pin" else None
            eng = start_engine(model, hook_mode, tmp / f"{mode}-{len(boot_s[mode])}", port=free_port(*DEFAULT_PORTS),
                               map_path=map_path)
            engines[mode] = eng
            boot_s[mode].append(round(eng.boot_s, 1))
            replay(batch[:2], eng.base_url, eng.spec.model_name, concurrency=2, progress=False)  # warm-up
            print(f"# {mode} up on {eng.base_url} (boot {eng.boot_s:.1f} s)", file=sys.stderr)
        for r in range(args.rounds):
            for mode in order:
                eng = engines[mode]
                res = replay(batch, eng.base_url, eng.spec.model_name, concurrency=args.concurrency, progress=False)
                if res.errors:
                    raise RuntimeError(f"{mode}: {res.errors[0].source}: {res.errors[0].error}")
                rounds[mode].append(res.completion_tokens / res.wall_s)
                print(f"# round {r} {mode}: {rounds[mode][-1]:.1f} tok/s", file=sys.stderr)
    finally:
        for eng in engines.values():
            eng.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the demo model)")
    ap.add_argument("--prompts", type=Path, default=None, help="JSONL prompts (default: the code fixture)")
    ap.add_argument("--modes", default="off,count,pin-all-hot,pin-skew")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one-order", dest="both_orders", action="store_false",
                    help="measure in boot order only (default: both orders, pooled)")
    args = ap.parse_args(argv)
    from pinsidecar import log

    log.configure("warning")  # stdout carries only the JSON result

    from pinsidecar.demo.model import build_demo_model, fixture_path

    tmp = Path(tempfile.mkdtemp(prefix="bench-pin-cpu-"))
    model = args.model or Path(build_demo_model(tmp / "model"))
    prompts = load_workload(args.prompts or fixture_path("code"))
    batch = _batch(prompts, args.concurrency, args.max_tokens)
    maps = _maps(model, tmp)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rounds: dict[str, list[float]] = {m: [] for m in modes}
    boot_s: dict[str, list[float]] = {m: [] for m in modes}
    # Engines booted later measured faster on the shared 2-core box, whatever their mode (core placement), so the
    # whole measurement runs twice, in boot order and in reverse, and the rounds of both passes are pooled.
    for order in (modes, list(reversed(modes))) if args.both_orders else (modes,):
        _measure(order, model, maps, tmp, batch, args, rounds, boot_s)
    median = {m: statistics.median(v) for m, v in rounds.items()}
    ratios = {}
    for base in ("off", "count"):
        if base in median:
            for m in modes:
                if m.startswith("pin"):
                    ratios[f"{m}/{base}"] = round(median[m] / median[base], 4)
    result = {
        "bench": "pin_cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/bench_pin_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "model": str(model), "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "both_orders": args.both_orders,
        "tok_s": {m: [round(v, 2) for v in vs] for m, vs in rounds.items()},
        "median_tok_s": {m: round(v, 2) for m, v in median.items()}, "ratios": ratios, "boot_s": boot_s,
        "target": "pin-all-hot/off >= 0.9",
    }
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if args.out:
        atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
