"""A CPU tier, weighed before it is built: compute a step's cold experts on the host (only activations cross the
link) against reading their weights over the link, at 1, 4 and 16 tokens per expert.

Today a cold expert's weights (9.4 MB for the bf16 lane's expert: gate, up and down of hidden 2048 x intermediate
768) are read from pinned host memory over the link by the GPU. The alternative (ktransformers, Fiddler): the host
computes the expert itself from its own memory, and only the token's activations go down and the result comes up.
It pays where the host's memory bandwidth, as a CPU GEMM uses it, beats the link. Measured here, one process:

- ``host_read_gbps``: the host's memory read rate (a float32 sum over 1 GiB, every core);
- ``cpu_expert_us[n]``: one expert's FFN for ``n`` tokens on the CPU in bf16 through torch (oneDNN; AMX tiles where
  the CPU has them), weights cycled through a pool larger than the caches, so they come from memory as a cold
  expert's would; and the share of ``host_read_gbps`` that achieves;
- with a GPU: ``link_uva_gbps``, the GPU reading a pinned expert in place (what pin mode's cold tier does);
  ``link_copy_gbps``, a copy of it to the device; ``activation_round_trip_us[n]``, ``n`` tokens' activations down to
  the host and the result back up (synchronised, as a layer would wait for them).

Derived per ``n``: the link's time for one expert against the CPU tier's (its compute plus the round trip: the
round trip is per layer, so the figure charges one per expert, the worst case), the speed-up, and the host read
rate at which the CPU tier would break even at the measured efficiency. Timings are medians of interleaved
repetitions with (min-max); the verdict is the closing note's, from these figures.

Usage: ``PYTHONPATH=hook:. python3 bench/cpu_tier.py --out cpu_tier.json`` (torch only; the path gives the link
figures the production UVA view and the benches' CUDA-event timing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, INTER = 2048, 768
TOKENS = (1, 4, 16)


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def _median_spread(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def host_read_gbps(gib: float, reps: int) -> dict[str, float]:
    t = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    t.sum()  # touch every page
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        t.sum()
        rates.append(t.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return _median_spread(rates)


def cpu_expert_us(pool: int, reps: int, hidden: int, inter: int) -> dict[str, Any]:
    """One expert's bf16 FFN per token count, the experts cycled so their weights stream from memory; the token
    counts interleaved round by round."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(pool, 2 * inter, hidden, generator=g) / 32).to(torch.bfloat16)
    w2 = (torch.randn(pool, hidden, inter, generator=g) / 32).to(torch.bfloat16)
    xs = {n: torch.randn(n, hidden, generator=g).to(torch.bfloat16) for n in TOKENS}

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ w13[e].T
        return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T

    for n in TOKENS:  # warm-up: oneDNN picks and caches its kernels per shape
        for e in range(min(pool, 4)):
            expert(e, xs[n])
    samples: dict[int, list[float]] = {n: [] for n in TOKENS}
    e = 0
    for _ in range(reps):
        for n in TOKENS:
            t0 = time.perf_counter()
            for _ in range(pool // 2):
                expert(e % pool, xs[n])
                e += 1
            samples[n].append((time.perf_counter() - t0) / (pool // 2) * 1e6)
    return {str(n): _median_spread(s) for n, s in samples.items()}


def link(expert_bytes: int, reps: int, hidden: int) -> dict[str, Any]:
    from pinsidecar_hook.rehome import device_view_of_pinned

    from bench.gpu_timing import eager_samples_us

    pool = 16  # distinct experts, so no read is served from the GPU's L2
    host = torch.ones(pool, expert_bytes // 4, dtype=torch.float32, pin_memory=True)
    view = device_view_of_pinned(host)
    dev = torch.empty(expert_bytes // 4, dtype=torch.float32, device="cuda")
    i = {"n": 0}

    def uva() -> None:
        view[i["n"] % pool].sum()
        i["n"] += 1

    def copy() -> None:
        dev.copy_(host[i["n"] % pool], non_blocking=True)
        i["n"] += 1

    for fn in (uva, copy):
        eager_samples_us(fn, 3)
    uva_us, copy_us = [], []
    for _ in range(reps):  # interleaved, one of each a round
        uva_us += eager_samples_us(uva, 1, warmup=False)
        copy_us += eager_samples_us(copy, 1, warmup=False)
    trips: dict[str, Any] = {}
    for n in TOKENS:
        x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
        back = torch.empty(n, hidden, dtype=torch.bfloat16, pin_memory=True)
        up = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")

        def trip(x: torch.Tensor = x, back: torch.Tensor = back, up: torch.Tensor = up) -> None:
            back.copy_(x, non_blocking=True)
            torch.cuda.synchronize()  # the host waits for the activations, computes, then sends the result up
            up.copy_(back, non_blocking=True)

        trips[str(n)] = _median_spread(eager_samples_us(trip, reps))
    gbps = [expert_bytes / u / 1e3 for u in uva_us]
    return {"link_uva_gbps": _median_spread(gbps), "link_uva_us": _median_spread(uva_us),
            "link_copy_gbps": _median_spread([expert_bytes / u / 1e3 for u in copy_us]),
            "activation_round_trip_us": trips, "device": torch.cuda.get_device_name()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool", type=int, default=48, help="experts cycled on the CPU (48 x 9.4 MB: past the caches)")
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--small", action="store_true", help="a tiny geometry, for the test suite")
    args = ap.parse_args(argv)
    hidden, inter = (256, 128) if args.small else (HIDDEN, INTER)
    expert_bytes = 3 * hidden * inter * 2
    t0 = time.time()
    out: dict[str, Any] = {
        "command": "python3 bench/cpu_tier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "geometry": {"hidden": hidden, "intermediate": inter, "expert_bytes": expert_bytes},
    }
    out["host_read_gbps"] = host_read_gbps(args.host_gib, args.reps)
    out["cpu_expert_us"] = cpu_expert_us(args.pool, args.reps, hidden, inter)
    if torch.cuda.is_available():
        out.update(link(expert_bytes, args.reps * 3, hidden))
        link_us = out["link_uva_us"]["median"]
        host = out["host_read_gbps"]["median"]
        derived = {}
        for n in map(str, TOKENS):
            cpu_us = out["cpu_expert_us"][n]["median"]
            tier_us = cpu_us + out["activation_round_trip_us"][n]["median"]
            efficiency = expert_bytes / cpu_us / 1e3 / host  # share of the host read rate the GEMM achieves
            derived[n] = {"link_us": link_us, "cpu_tier_us": tier_us, "speedup_over_link": link_us / tier_us,
                          "cpu_share_of_host_read": efficiency,
                          "break_even_host_gbps": out["link_uva_gbps"]["median"] / efficiency}
        out["per_expert"] = derived
    out["seconds"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("cpu", "host_read_gbps", "cpu_expert_us", "per_expert") if k in out}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
