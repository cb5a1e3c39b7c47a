"""GPU benchmark of pin mode's split invoke: bit identity, launches per MoE layer, and what the split costs.

Run on the H200 through the device tool (see docs/backends.md for the exact command); writes one JSON file:

(a) ``bit_identity``: the torch reference backend's split (hot weights in HBM, cold weights read in place from
    pinned host memory over the bus) against its unsplit call, bitwise, over k = 1..8, tokens 1..4096, cold
    fractions 0..100 %, random and adversarial maps;
(b) ``launches``: CUDA kernels per MoE layer counted with torch.profiler for the partition with live counting
    fused in (one kernel), without counting, with counting as separate torch ops, and for the finalize;
(c) ``timings``: partition and finalize (CUDA-graph replayed, so launch gaps are included as in serving) against
    the experts GEMMs of the same step at a realistic shape, with the HBM floor of those GEMMs for scale.

Numbers are medians; nothing here is a pass/fail test (tests/test_gpu.py is).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from pinsidecar_hook.backends import torch_ref
from pinsidecar_hook.kernels import finalize_triton, partition_torch, partition_triton
from pinsidecar_hook.rehome import device_view_of_pinned

from pinsidecar.testing import moe

if __name__ == "__main__" and not __package__:  # run as a file: the repo root on the path, so that the
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # siblings import as the `bench` package
from bench.gpu_timing import eager_time_us, graph_time_us, kernels_launched, pinned_view

__all__ = ["main"]

# The HBM read rate the experts floor is computed with. 3.89 TB/s came from an earlier probe whose run was never
# committed; the placement bench measured 4.40 TB/s on the same kind of H200 (bench/results/placement_h200.json), so
# floors computed with this constant (bench/results/bench_split_gpu_h200.json) are about 13 % high. Kept so that
# new runs compare with the committed one.
HBM_READ_BYTES_PER_S = 3.89e12


def bit_identity(num_experts: int, hidden: int, intermediate: int, use_uva: bool) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2026)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / 16).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) / 16).to(torch.bfloat16).to(dev)
    cases, mismatches = 0, []
    t0 = time.perf_counter()
    for num_tokens, top_k, frac, adversarial in itertools.product(
        (1, 2, 7, 64, 513, 4096), range(1, 9), (0.0, 0.1, 0.5, 0.9, 1.0), (False, True)
    ):
        x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
        ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, num_experts, frac, adversarial, g)
        ids, weights, row_map = ids.to(dev), weights.to(dev), row_map.to(dev)
        ref = torch_ref.unsplit(x, w13, w2, weights, ids)
        w13_hot, w13_cold = moe.rehome_weights(w13, row_map, hot_rows)
        w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
        if use_uva and w13_cold.shape[0]:
            w13_cold, w2_cold = pinned_view(w13_cold), pinned_view(w2_cold)
        out = torch_ref.split(x, w13_hot, w2_hot, w13_cold, w2_cold, weights, ids, row_map, hot_rows)
        cases += 1
        if not torch.equal(out, ref):
            mismatches.append({"tokens": num_tokens, "top_k": top_k, "cold_fraction": frac, "adversarial": adversarial})
    return {
        "backend": "torch_ref (grouped GEMM in torch) + Triton partition/finalize",
        "dtype": "bfloat16",
        "num_experts": num_experts,
        "hidden": hidden,
        "intermediate": intermediate,
        "cold_tier": "pinned host memory, UVA device view" if use_uva else "device copy",
        "grid": "tokens {1,2,7,64,513,4096} x k 1..8 x cold {0,10,50,90,100}% x {random, adversarial}",
        "cases": cases,
        "bitwise_equal": cases - len(mismatches),
        "mismatches": mismatches,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def launches(num_experts: int, num_tokens: int, top_k: int, hidden: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g).to(dev)
    row_map = torch.randperm(num_experts, generator=g).to(torch.int32).to(dev)
    hot_rows = num_experts * 3 // 4
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    cold = torch.zeros(1, dtype=torch.int64, device=dev)
    ones = torch.ones(num_tokens * top_k, dtype=torch.int64, device=dev)
    weights = torch.rand(num_tokens, top_k, generator=g).to(dev)
    rows = torch.randn(num_tokens, top_k, hidden, generator=g).to(torch.bfloat16).to(dev)
    hot_ids, cold_ids = partition_triton(ids, row_map, hot_rows)

    def separate_count():
        h, c = partition_triton(ids, row_map, hot_rows)
        counts.index_add_(0, ids.reshape(-1), ones)
        cold.add_((c >= 0).sum())
        return h, c

    variants = {
        "partition_triton_with_live_counts_fused": lambda: partition_triton(ids, row_map, hot_rows, counts, cold),
        "partition_triton_without_counts": lambda: partition_triton(ids, row_map, hot_rows),
        "partition_triton_then_separate_count_ops": separate_count,
        "partition_torch_with_counts": lambda: partition_torch(ids, row_map, hot_rows, counts, cold),
        "finalize_triton": lambda: finalize_triton(rows, weights, hot_ids=hot_ids, cold_ids=cold_ids),
    }
    result = {"num_experts": num_experts, "tokens": num_tokens, "top_k": top_k, "hidden": hidden, "kernels": {}}
    for name, fn in variants.items():
        ks = kernels_launched(fn)
        result["kernels"][name] = {"count": len(ks), "names": sorted({n[:100] for n in ks})}
    k = result["kernels"]
    fused = k["partition_triton_with_live_counts_fused"]["count"] + k["finalize_triton"]["count"]
    result["per_moe_layer_added_by_split"] = {
        "with_live_counts_fused": fused,
        "without_live_counts": k["partition_triton_without_counts"]["count"] + k["finalize_triton"]["count"],
        "with_live_counts_as_separate_ops": k["partition_triton_then_separate_count_ops"]["count"]
        + k["finalize_triton"]["count"],
        "note": "plus the experts kernels of the hot call and of the cold call (backend-specific)",
    }
    return result


def _experts_gemm_fn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> Callable[[], None]:
    """The experts GEMMs of one step with the token grouping done up front (on the host, untimed), so the
    returned function has no host sync and can be captured in a CUDA graph: per touched expert, gather its
    tokens, GEMM1, SiLU-and-mul, GEMM2, scatter into the per-(token, slot) rows."""
    num_tokens, top_k = ids.shape
    rows = x.new_empty((num_tokens * top_k, x.shape[1]))
    flat = ids.reshape(-1).cpu()
    groups = []
    for e in torch.unique(flat).tolist():
        sel = torch.nonzero(flat == e).squeeze(1)
        groups.append((e, (sel // top_k).to(x.device), sel.to(x.device)))

    def run() -> None:
        for e, tok, sel in groups:
            h = x.index_select(0, tok) @ w13[e].t()
            n = h.shape[1] // 2
            act = (torch.nn.functional.silu(h[:, :n].float()) * h[:, n:].float()).to(x.dtype)
            rows[sel] = act @ w2[e].t()

    return run


def timings(num_experts: int, top_k: int, hidden: int, intermediate: int, cold_fraction: float) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    gd = torch.Generator(device=dev).manual_seed(3)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gd, device=dev, dtype=torch.bfloat16) / 16
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gd, device=dev, dtype=torch.bfloat16) / 16
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    hot_rows = num_experts - round(num_experts * cold_fraction)
    row_map = torch.randperm(num_experts, generator=g).to(torch.int32).to(dev)
    w13_hot, _ = moe.rehome_weights(w13, row_map, num_experts)  # experts timed all-hot (HBM)
    w2_hot, _ = moe.rehome_weights(w2, row_map, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    cold = torch.zeros(1, dtype=torch.int64, device=dev)
    out = []
    for num_tokens in (1, 16, 128, 1024, 4096):
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).to(dev)
        weights = torch.rand(num_tokens, top_k, generator=g).to(dev)
        x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
        hot_ids, cold_ids = partition_triton(ids, row_map, hot_rows)
        rows = torch.randn(num_tokens, top_k, hidden, generator=g).to(torch.bfloat16).to(dev)
        t_part = graph_time_us(partial(partition_triton, ids, row_map, hot_rows, counts, cold))
        t_fin = graph_time_us(partial(finalize_triton, rows, weights, hot_ids=hot_ids, cold_ids=cold_ids))
        all_hot_ids, _ = partition_triton(ids, row_map, num_experts)
        t_experts = eager_time_us(partial(torch_ref.expert_rows, x, w13_hot, w2_hot, all_hot_ids))
        t_gemms = graph_time_us(_experts_gemm_fn(x, w13_hot, w2_hot, all_hot_ids.long()), inner=1)
        unique = int(torch.unique(ids).numel())
        floor_us = unique * expert_bytes / HBM_READ_BYTES_PER_S * 1e6
        out.append({
            "tokens": num_tokens,
            "unique_experts": unique,
            "partition_with_counts_us": round(t_part, 2),
            "finalize_us": round(t_fin, 2),
            "experts_torch_ref_eager_us": round(t_experts, 1),
            "experts_gemms_cuda_graph_us": round(t_gemms, 1),
            "experts_hbm_floor_us": round(floor_us, 1),
            "split_overhead_vs_experts_gemms": round((t_part + t_fin) / t_gemms, 4),
            "split_overhead_vs_experts_floor": round((t_part + t_fin) / floor_us, 4),
            "split_overhead_vs_experts_torch_ref": round((t_part + t_fin) / t_experts, 4),
        })
    return {
        "num_experts": num_experts, "top_k": top_k, "hidden": hidden, "intermediate": intermediate,
        "dtype": "bfloat16", "expert_bytes": expert_bytes, "cold_fraction_in_partition": cold_fraction,
        "partition_and_finalize": "CUDA graph of 100 calls, median of 7 replays, per call",
        "experts": "experts_gemms_cuda_graph_us: the step's per-expert GEMMs (gather, GEMM1, SiLU-and-mul, GEMM2, "
        "scatter) captured in one CUDA graph, median of 7 replays; experts_torch_ref_eager_us: torch_ref.expert_rows "
        "as written (Python loop with host syncs), median of 5; experts_hbm_floor_us: unique experts x bytes per "
        "expert / 3.89 TB/s",
        "rows": out,
    }


def uva_tier_gap(hidden: int, intermediate: int) -> dict:
    """One expert's GEMMs with its weights in HBM versus read in place from pinned host memory (UVA), timed as
    CUDA-graph replays, for 1 and 16 tokens; and whether the two give the same bits."""
    dev = torch.device("cuda")
    gd = torch.Generator(device=dev).manual_seed(4)
    w13 = torch.randn(1, 2 * intermediate, hidden, generator=gd, device=dev, dtype=torch.bfloat16) / 16
    w2 = torch.randn(1, hidden, intermediate, generator=gd, device=dev, dtype=torch.bfloat16) / 16
    w13_c, w2_c = pinned_view(w13), pinned_view(w2)
    nbytes = (w13.numel() + w2.numel()) * 2
    rows = []
    for num_tokens in (1, 16):
        x = torch.randn(num_tokens, hidden, generator=gd, device=dev).to(torch.bfloat16)
        ids = torch.zeros(num_tokens, 1, dtype=torch.int64, device=dev)
        hbm = graph_time_us(_experts_gemm_fn(x, w13, w2, ids), inner=20)
        host = graph_time_us(_experts_gemm_fn(x, w13_c, w2_c, ids), inner=20)
        same = torch.equal(torch_ref.expert_rows(x, w13, w2, ids), torch_ref.expert_rows(x, w13_c, w2_c, ids))
        rows.append({
            "tokens": num_tokens, "hbm_us": round(hbm, 1), "pinned_host_uva_us": round(host, 1),
            "ratio": round(host / hbm, 1), "hbm_GB_per_s": round(nbytes / hbm / 1e3, 1),
            "host_GB_per_s": round(nbytes / host / 1e3, 1), "bitwise_equal": same,
        })
    return {"expert_bytes": nbytes, "timing": "CUDA graph of 20 calls, median of 7 replays, per call", "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_split_gpu.json"))
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_split_gpu needs a CUDA GPU; run it through the device tool", file=sys.stderr)
        return 2
    import triton

    started = dt.datetime.now(dt.UTC)
    result: dict = {
        "benchmark": "bench/bench_split_gpu.py",
        "command": os.environ.get("PINSIDECAR_BENCH_COMMAND", " ".join([sys.executable, *sys.argv])),
        "date": started.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        uva = True
        device_view_of_pinned(torch.zeros(4, pin_memory=True))
    except Exception as exc:  # no device view: the cold tier falls back to a device copy, and the JSON says so
        uva = False
        result["uva_unavailable"] = repr(exc)
    sections: dict[str, Callable[[], dict]] = {
        "bit_identity": lambda: bit_identity(64, 512 if not args.quick else 128, 256 if not args.quick else 64, uva),
        "launches": lambda: {
            "decode": launches(384, 16, 6, 4096),
            "prefill": launches(384, 4096, 6, 4096),
        },
        "timings": lambda: timings(384, 6, 4096, 1024, 0.23),
    }
    if uva:
        sections["uva_tier_gap"] = lambda: uva_tier_gap(4096, 1024)
    for name, fn in sections.items():
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # keep the other sections
            result[name] = {"error": repr(exc)}
        print(f"[{name}] {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        "bit_identity": {k: result["bit_identity"].get(k) for k in ("cases", "bitwise_equal")},
        "launches_per_layer": {k: v.get("per_moe_layer_added_by_split") for k, v in result["launches"].items()}
        if "error" not in result["launches"] else result["launches"],
        "timings": [
            {k: r[k] for k in ("tokens", "partition_with_counts_us", "finalize_us", "experts_gemms_cuda_graph_us",
                               "experts_hbm_floor_us")}
            for r in result["timings"].get("rows", [])
        ],
        "uva_tier_gap": result.get("uva_tier_gap"),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
