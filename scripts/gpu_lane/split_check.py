"""Pin mode's Triton split against vLLM's own unsplit ``TritonExperts`` call, on the GPU, at the lane's geometry.

Runs on the device after the install (``scripts/gpu_lane/device_smoke.sh``); writes one JSON. What it checks:

1. ``ops.moe_sum``'s arithmetic for k = 1..8 (is it an fp32 in-order sum with one cast, a bf16 running sum, or
   something else?). The split does not depend on the answer (it reduces with the experts class's own
   ``moe_sum``), but the docs record it.
2. **Bit identity of the split**: a real ``TritonExperts`` (built the way vLLM builds it for unquantized bf16),
   its weights re-homed by the production path (:func:`pinsidecar_hook.rehome.rehome_layer`: hot rows in HBM,
   cold rows in pinned host memory read through vLLM's UVA view), driven through
   :class:`pinsidecar_hook.backends.triton_experts.TritonExpertsSplit` exactly as pin mode builds it (after
   ``configure_unsplit``, as pin mode runs it on the layer); output compared bitwise with the unsplit ``apply`` over
   the original weights, for decode sizes (1..64 tokens) and prefill sizes (256 to 4096 tokens, where vLLM's
   kernels switch paths), cold fractions 0..100 %, random and adversarial (every token straddles the tiers)
   routing. Also that the live counters are exact.
3. **The padding mask under CUDA graphs**: the partition kernel (pin mode) and count mode's capture callback,
   captured in a graph at a padded size and replayed with different real-token counts, count only the real rows.
4. **Live counting cost**: one decode step's worth of partition launches (one per layer), captured in a CUDA graph,
   with the counters and the padding mask against without; the difference is what live counting costs per step.
5. **What the seam read from the installed vLLM** (``seams``): its per-pair assignment rule, which
   ``TritonExperts.apply`` body the phased FP8 steps recognise, which ``_fused_marlin_moe`` signature, whether
   ``TritonExperts`` has the sorted-A switch: the lead compares these with ``docs/vllm-versions.md``.

Usage: ``python3 scripts/gpu_lane/split_check.py --out $OUT/split_check.json`` (needs vLLM and a GPU; ``--quick``
runs fewer cases).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 2048, 768, 128, 8, 16


def moe_sum_arithmetic() -> dict[str, Any]:
    from vllm import _custom_ops as ops

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    for k in range(1, 9):
        x = (torch.randn(257, k, 512, device="cuda", generator=g) * 3).to(torch.bfloat16)
        got = torch.empty(257, 512, device="cuda", dtype=torch.bfloat16)
        ops.moe_sum(x, got)
        acc = torch.zeros(257, 512, device="cuda")
        for j in range(k):
            acc = acc + x[:, j].float()
        running = x[:, 0].clone()
        for j in range(1, k):
            running = running + x[:, j]
        out[str(k)] = {"fp32_in_order_one_cast": bool(torch.equal(got, acc.bfloat16())),
                       "bf16_running_sum": bool(torch.equal(got, running)),
                       "torch_sum_dim1": bool(torch.equal(got, x.sum(dim=1)))}
    return out


def make_experts(num_experts: int, hidden: int, inter: int, top_k: int) -> Any:
    """A ``TritonExperts`` for unquantized bf16, built the way vLLM's unquantized method builds it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    def build() -> Any:
        cfg = FusedMoEConfig(
            num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=inter,
            num_local_experts=num_experts, num_logical_experts=num_experts, activation=MoEActivation.SILU,
            device="cuda", routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)
        return TritonExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG)

    try:
        return build(), MoEActivation.SILU
    except Exception:  # some versions read the current vLLM config while building
        with set_current_vllm_config(VllmConfig()):
            return build(), MoEActivation.SILU


def _routing(num_tokens: int, row_map: torch.Tensor, hot_rows: int, adversarial: bool,
             g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = row_map.shape[0]
    rows = row_map.tolist()
    hot = [e for e in range(num_experts) if 0 <= rows[e] < hot_rows]
    cold = [e for e in range(num_experts) if rows[e] >= hot_rows]
    ids = torch.empty((num_tokens, TOP_K), dtype=torch.int32)
    for t in range(num_tokens):
        if adversarial and hot and cold:
            h = [hot[i] for i in torch.randperm(len(hot), generator=g).tolist()]
            c = [cold[i] for i in torch.randperm(len(cold), generator=g).tolist()]
            picked = []
            for j in range(TOP_K):
                take_hot = (j % 2 == 0 and h) or not c
                picked.append(h.pop() if take_hot else c.pop())
            ids[t] = torch.tensor(picked, dtype=torch.int32)
        else:
            ids[t] = torch.randperm(num_experts, generator=g)[:TOP_K].to(torch.int32)
    weights = torch.rand((num_tokens, TOP_K), generator=g)
    return ids.cuda(), (weights / weights.sum(1, keepdim=True)).cuda()


def split_identity(quick: bool) -> dict[str, Any]:
    from pinsidecar_hook.backends import triton_experts as te
    from pinsidecar_hook.rehome import MemoryLedger, rehome_layer

    experts, act = make_experts(EXPERTS, HIDDEN, INTER, TOP_K)
    configured = te.TritonExpertsSplit.configure_unsplit(experts)  # what pin mode does before anything runs
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to(torch.bfloat16).cuda()
    tokens = (1, 3, 16, 512, 2048, 4096) if quick else (1, 2, 3, 4, 7, 16, 64, 256, 512, 2048, 4096)
    fractions = (0.0, 0.23, 1.0) if quick else (0.0, 0.1, 0.23, 0.4, 1.0)
    cases, equal, mismatches, count_errors = 0, 0, [], []

    def unsplit(x, ids, weights):
        m, n, k = x.shape[0], w13.shape[1], HIDDEN
        ws1, ws2, out_shape = experts.workspace_shapes(m, n, k, TOP_K, EXPERTS, EXPERTS, None, act)
        out = torch.full(out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        type(experts).apply(experts, output=out, hidden_states=x, w1=w13, w2=w2, topk_weights=weights,
                            topk_ids=ids, activation=act, global_num_experts=EXPERTS, expert_map=None,
                            a1q_scale=None, a2_scale=None,
                            workspace13=torch.empty(ws1, device="cuda", dtype=torch.bfloat16),
                            workspace2=torch.empty(ws2, device="cuda", dtype=torch.bfloat16),
                            expert_tokens_meta=None, apply_router_weight_on_input=False)
        return out

    for frac, adversarial in [(f, a) for f in fractions for a in (False, True)]:
        n_cold = round(EXPERTS * frac)
        perm = torch.randperm(EXPERTS, generator=g).tolist()
        hot_ids, cold_ids = sorted(perm[: EXPERTS - n_cold]), sorted(perm[EXPERTS - n_cold:])
        row_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
        for r, e in enumerate([*hot_ids, *cold_ids]):
            row_map[e] = r
        owner = torch.nn.Module()
        owner.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
        owner.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
        re = rehome_layer(owner, ["w13_weight", "w2_weight"], hot_ids, cold_ids, MemoryLedger())
        layer = SimpleNamespace(
            row_map=row_map.cuda(), hot_rows=len(hot_ids), cold_rows=len(cold_ids), hot=re.hot, cold=re.cold,
            expert_counts=torch.zeros(EXPERTS, dtype=torch.int64, device="cuda"),
            cold_counts=torch.zeros(1, dtype=torch.int64, device="cuda"),
            token_counts=torch.zeros(1, dtype=torch.int64, device="cuda"), cache=None, cache_slots=0)
        split = te.TritonExpertsSplit(experts, layer)
        split.overlap = os.environ.get("SPLIT_CHECK_OVERLAP") == "1"  # the cold tier on a side stream
        split_apply = split.apply
        for t in tokens:
            x = (torch.randn(t, HIDDEN, generator=g)).to(torch.bfloat16).cuda()
            ids, weights = _routing(t, row_map, len(hot_ids), adversarial, g)
            ref = unsplit(x, ids, weights)
            ws1, ws2, out_shape = experts.workspace_shapes(t, 2 * INTER, HIDDEN, TOP_K, EXPERTS, EXPERTS, None, act)
            out = torch.full(out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            before = (int(layer.expert_counts.sum()), int(layer.cold_counts), int(layer.token_counts))
            split_apply(out, x, layer.hot["w13_weight"], layer.hot["w2_weight"], weights, ids, act, EXPERTS, None,
                        None, None, torch.empty(ws1, device="cuda", dtype=torch.bfloat16),
                        torch.empty(ws2, device="cuda", dtype=torch.bfloat16), None, False)
            torch.cuda.synchronize()
            cases += 1
            if torch.equal(out, ref):
                equal += 1
            else:
                diff = (out.float() - ref.float()).abs()
                mismatches.append({"tokens": t, "cold_fraction": frac, "adversarial": adversarial,
                                   "elements_differing": int((diff > 0).sum()), "max_abs": float(diff.max()),
                                   "nan": bool(torch.isnan(out).any())})
            want_cold = int((row_map.cuda().long()[ids.long()] >= len(hot_ids)).sum())
            got = (int(layer.expert_counts.sum()) - before[0], int(layer.cold_counts) - before[1],
                   int(layer.token_counts) - before[2])
            if got != (t * TOP_K, want_cold, t):
                count_errors.append({"tokens": t, "cold_fraction": frac, "got": got,
                                     "want": (t * TOP_K, want_cold, t)})
        del owner, re, layer, split_apply
        torch.cuda.empty_cache()
    return {"geometry": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K,
                         "dtype": "bfloat16"},
            "experts_class": type(experts).__name__, "cold_tier": "pinned host memory, vLLM UVA view (rehome_layer)",
            "configure_unsplit": configured,
            "tokens": list(tokens), "cold_fractions": list(fractions), "cases": cases, "bitwise_equal": equal,
            "mismatches": mismatches[:20], "live_count_errors": count_errors[:20]}


def padding_mask() -> dict[str, Any]:
    """Capture at a padded size (8 rows), replay with 3, 8 and 5 real rows: only real rows count."""
    from pinsidecar_hook import vllm_seam
    from pinsidecar_hook.count import CountState
    from pinsidecar_hook.kernels.partition import partition

    real = vllm_seam.real_token_count(torch.device("cuda"))
    try:
        return _padding_mask(real, vllm_seam, CountState, partition)
    finally:
        real.fill_(vllm_seam._common._UNMASKED)


def _padding_mask(real: torch.Tensor, vllm_seam: Any, CountState: Any, partition: Any) -> dict[str, Any]:
    rows, k, e = 8, TOP_K, EXPERTS
    ids = torch.randint(0, e, (rows, k), dtype=torch.int32, device="cuda")
    row_map = torch.randperm(e, device="cuda").to(torch.int32)
    ec, cc, tc = (torch.zeros(e, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"),
                  torch.zeros(1, dtype=torch.int64, device="cuda"))
    state = CountState([0], SimpleNamespace(workload=""), e, k, torch.device("cuda"), writer=False, meta={},
                       model_info=None, real_tokens=real)
    capture = state.capture_fn(0, None)
    real.fill_(rows)
    partition(ids, row_map, 100, ec, cc, num_real=real, token_counts=tc)  # warm-up (Triton compile)
    capture(ids)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        partition(ids, row_map, 100, ec, cc, num_real=real, token_counts=tc)
        capture(ids)
    results = []
    for n in (3, 8, 5, 0):
        for t in (ec, cc, tc, *state.counts, *state.tokens):
            t.zero_()
        real.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want_hist = torch.bincount(ids[:n].reshape(-1).long(), minlength=e)
        want_cold = int((row_map.long()[ids[:n].long()] >= 100).sum())
        ok = (torch.equal(ec, want_hist) and int(cc) == want_cold and int(tc) == n
              and torch.equal(state.counts[0], want_hist) and int(state.tokens[0]) == n)
        results.append({"real_rows": n, "padded_rows": rows, "exact": bool(ok)})
    return {"replays": results, "all_exact": all(r["exact"] for r in results)}


def counting_cost(layers: int = LAYERS) -> dict[str, Any]:
    """One decode step's partition launches (one per layer, T=1, k=8), in a CUDA graph, with and without the
    live counters + padding mask + token counter."""
    from pinsidecar_hook import vllm_seam
    from pinsidecar_hook.kernels.partition import partition

    real = vllm_seam.real_token_count(torch.device("cuda"))
    try:
        return _counting_cost(real, partition, layers)
    finally:
        real.fill_(vllm_seam._common._UNMASKED)


def _counting_cost(real: torch.Tensor, partition: Any, layers: int) -> dict[str, Any]:
    real.fill_(1)
    ids = torch.randint(0, EXPERTS, (1, TOP_K), dtype=torch.int32, device="cuda")
    row_map = torch.randperm(EXPERTS, device="cuda").to(torch.int32)
    counters = [(torch.zeros(EXPERTS, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64,
                 device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")) for _ in range(layers)]

    def step(count: bool) -> None:
        for ec, cc, tc in counters:
            if count:
                partition(ids, row_map, 99, ec, cc, num_real=real, token_counts=tc)
            else:
                partition(ids, row_map, 99)

    out: dict[str, Any] = {}
    for count in (False, True):
        step(count)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(10):
                step(count)
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 10)  # us per step (10 steps per replay)
        times.sort()
        out["with_counters_us" if count else "without_counters_us"] = times[len(times) // 2]
    out["delta_us_per_step"] = out["with_counters_us"] - out["without_counters_us"]
    out["layers"] = layers
    out["what"] = ("partition launches of one decode step (T=1, k=8, one per layer), graph-replayed; with = live "
                   "expert/cold/token counters and the padding mask, without = no counters")
    return out


def seams() -> dict[str, Any]:
    """What the seam reads from the installed vLLM (module docstring, item 5)."""
    from pinsidecar_hook import vllm_seam

    rule = vllm_seam.triton.naive_rule()
    experts, _act = make_experts(EXPERTS, HIDDEN, INTER, TOP_K)
    return {"vllm": vllm_seam.vllm_version(),
            "triton_naive_rule": None if rule is None else {"counts_weight_rows": rule.counts_weight_rows,
                                                            "checks_host_residency": rule.checks_host_residency},
            "triton_apply_form": vllm_seam.triton.apply_form(),
            "marlin_call_form": vllm_seam.marlin.call_form(),
            "triton_has_sorted_a_switch": hasattr(experts, "_enable_sorted_a_tma")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import vllm

    report: dict[str, Any] = {"script": "scripts/gpu_lane/split_check.py", "date": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0)}
    for name, fn in (("seams", seams), ("moe_sum", moe_sum_arithmetic), ("padding_mask", padding_mask),
                     ("counting_cost", counting_cost), ("split_identity", lambda: split_identity(args.quick))):
        t0 = time.time()
        try:
            report[name] = fn()
        except Exception as exc:  # report and go on: one failed check must not hide the others
            report[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        report[name + "_seconds"] = round(time.time() - t0, 1)
        print(name, json.dumps(report[name])[:600], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = (report["split_identity"].get("cases") == report["split_identity"].get("bitwise_equal")
          and report["padding_mask"].get("all_exact"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
