"""The ``oai_triton`` split against vLLM's own MXFP4 Triton kernels, on the GPU, kernel by kernel (no engine).

Runs on the device after the 0.34 install; writes one JSON. Random MXFP4 experts at the lane's geometry (128 experts,
top-8, hidden 2048, expert intermediate 768, fp32 biases) are swizzled by vLLM's own ``_swizzle_mxfp4`` and re-homed
by the production path (:func:`pinsidecar_hook.rehome.rehome_layer`: hot rows in HBM, cold rows in pinned host
memory read through the UVA view, the swizzled memory order kept). Then, per batch size (decode to prefill) and
cold fraction, with the routing of the monolithic kernel (``triton_kernels.topk`` on random bf16 logits):

1. ``unfused``: vLLM's ``UnfusedOAITritonExperts.apply`` (what ``--moe-backend triton_unfused`` serves) against
   :class:`pinsidecar_hook.backends.oai_triton.OAITritonSplit` driven as pin mode drives it;
2. ``fused``: ``triton_kernel_fused_experts`` (what ``OAITritonExperts`` runs) against the split's fused form;
3. ``monolithic``: ``OAITritonMxfp4ExpertsMonolithic``'s forward (``triton_kernel_moe_forward``: routing inside)
   against the split standing in for it (``apply_routed``: the kernel's own ``topk`` on the logits, then the fused
   form), and against (2)'s unsplit call: whether the default kernel can be split bit for bit.

Usage: ``python3 scripts/gpu_lane/oai_split_check.py --out $OUT/oai_split_check.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = (1, 7, 64, 512, 2048, 4096)
COLD = (0.0, 0.23, 0.6, 1.0)


def mxfp4_layer(seed: int) -> dict[str, torch.Tensor]:
    """A gpt-oss layer in the checkpoint's layout: e2m1 pairs, ue8m0 block scales (one per 32 inputs), fp32 biases."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

    return {"w13_weight": u8(EXPERTS, 2 * INTER, HIDDEN // 2), "w2_weight": u8(EXPERTS, HIDDEN, INTER // 2),
            "w13_weight_scale": u8(EXPERTS, 2 * INTER, HIDDEN // 32, lo=118, hi=124),
            "w2_weight_scale": u8(EXPERTS, HIDDEN, INTER // 32, lo=118, hi=124),
            "w13_bias": torch.randn(EXPERTS, 2 * INTER, generator=g) / 4,
            "w2_bias": torch.randn(EXPERTS, HIDDEN, generator=g) / 4}


def build(seed: int) -> tuple[Any, Any, torch.nn.Module]:
    """vLLM's kernel inputs for one layer: (its module, a quant config the kernels read, the layer's tensors as
    parameters in the swizzled storage, the way ``store_params_in_triton`` leaves them)."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4

    raw = mxfp4_layer(seed)
    owner = torch.nn.Module()
    qc = SimpleNamespace(gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gemm1_beta=None)
    for name, w in (("w13", "w1"), ("w2", "w2")):
        value, flex, scale = _swizzle_mxfp4(raw[f"{name}_weight"].cuda(), raw[f"{name}_weight_scale"].cuda())
        setattr(owner, f"{name}_weight", torch.nn.Parameter(value.storage.data, requires_grad=False))
        setattr(owner, f"{name}_weight_scale", torch.nn.Parameter(scale.storage.data, requires_grad=False))
        setattr(owner, f"{name}_bias", torch.nn.Parameter(raw[f"{name}_bias"].cuda(), requires_grad=False))
        setattr(owner, f"{name}_weight_triton", value)
        setattr(qc, f"{w}_precision", PrecisionConfig(weight_scale=scale, flex_ctx=FlexCtx(rhs_data=flex)))
        setattr(qc, f"{w}_bias", getattr(owner, f"{name}_bias"))
    return qc, owner, raw


def routing(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The monolithic kernel's routing (renormalize: top-k, then softmax over the kept): ids and bf16 weights."""
    from triton_kernels.topk import topk

    result = topk(logits, TOP_K, apply_softmax=True)
    vals, ids = (result[0], result[1]) if isinstance(result, tuple) else (result.vals, result.indx)
    return ids.to(torch.int64), vals


def unfused_self(m: Any, qc: Any) -> Any:
    """``UnfusedOAITritonExperts``'s state as its ``apply`` reads it."""
    ns = SimpleNamespace(quant_config=qc, _lora_context=None)
    ns.activation = functools.partial(m.UnfusedOAITritonExperts.activation, ns)
    ns._make_routing_data = functools.partial(m.BaseOAITritonExperts._make_routing_data, ns)
    ns.adjust_N_for_activation = lambda n, _a: n // 2
    return ns


def check(quick: bool) -> dict[str, Any]:
    import vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe as m
    from pinsidecar_hook.backends.oai_triton import OAITritonSplit
    from pinsidecar_hook.rehome import MemoryLedger, rehome_layer
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    act = MoEActivation.SWIGLUOAI
    out: dict[str, Any] = {"triton_kernels": m.triton_kernels_version, "cases": [], "errors": []}
    tokens = TOKENS[:4] if quick else TOKENS
    for seed, cold in enumerate(COLD[:2] if quick else COLD):
        qc, owner, _raw = build(seed)
        g = torch.Generator(device="cpu").manual_seed(100 + seed)
        cases = []
        logits_of: dict[int, torch.Tensor] = {}
        for t in tokens:
            x = (torch.randn(t, HIDDEN, generator=g) / 2).to(torch.bfloat16).cuda()
            logits = torch.randn(t, EXPERTS, generator=g).to(torch.bfloat16).cuda()
            ids, weights = routing(logits)
            ref: dict[str, torch.Tensor] = {}
            ref["monolithic"] = m.triton_kernel_moe_forward(x, owner.w13_weight_triton, owner.w2_weight_triton,
                                                            logits, TOP_K, renormalize=True, quant_config=qc)
            fused = torch.empty_like(x)
            rd, gi, si = m.make_routing_data(ids, weights, EXPERTS)
            m.triton_kernel_fused_experts(fused, x, owner.w13_weight_triton, owner.w2_weight_triton, rd, gi, si,
                                          topk=TOP_K, activation=act, quant_config=qc)
            ref["fused"] = fused
            unfused = torch.empty_like(x)
            ws = torch.empty(t * TOP_K * 2 * INTER * 2, dtype=torch.bfloat16, device="cuda")
            m.UnfusedOAITritonExperts.apply(unfused_self(m, qc), unfused, x, owner.w13_weight_triton,
                                            owner.w2_weight_triton, weights, ids, act, -1, None, None, None,
                                            torch.empty_like(ws), ws, None, False)
            ref["unfused"] = unfused
            cases.append((t, x, ids, weights, {k: v.cpu() for k, v in ref.items()}))
            logits_of[t] = logits
        # re-home as pin mode does (after vLLM's second references are dropped), then split
        perm = torch.randperm(EXPERTS, generator=g).tolist()
        n_cold = round(cold * EXPERTS)
        hot_local, cold_local = perm[: EXPERTS - n_cold], perm[EXPERTS - n_cold:]
        experts = SimpleNamespace(quant_config=qc, _lora_context=None)
        OAITritonSplit.before_rehome(experts, owner)
        names = ["w13_bias", "w13_weight", "w13_weight_scale", "w2_bias", "w2_weight", "w2_weight_scale"]
        re = rehome_layer(owner, names, hot_local, cold_local, MemoryLedger())
        row_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
        for r, e in enumerate(hot_local + cold_local):
            row_map[e] = r
        layer = SimpleNamespace(row_map=row_map.cuda(), hot_rows=len(hot_local), cold_rows=len(cold_local),
                                hot=re.hot, cold=re.cold, cache=None, cache_slots=0,
                                expert_counts=torch.zeros(EXPERTS, dtype=torch.int64, device="cuda"),
                                cold_counts=torch.zeros(1, dtype=torch.int64, device="cuda"),
                                token_counts=torch.zeros(1, dtype=torch.int64, device="cuda"))
        unfused_experts = unfused_self(m, qc)
        unfused_experts._pinsidecar_oai_templates = experts._pinsidecar_oai_templates
        mono_experts = SimpleNamespace(quant_config=qc, _lora_context=None, renormalize=True, topk=TOP_K,
                                       _pinsidecar_oai_templates=experts._pinsidecar_oai_templates)
        splits = {"unfused": OAITritonSplit(unfused_experts, layer, form="unfused", num_real=None),
                  "fused": OAITritonSplit(experts, layer, form="fused", num_real=None),
                  "monolithic": OAITritonSplit(mono_experts, layer, form="monolithic", num_real=None)}
        for t, x, ids, weights, ref in cases:
            row: dict[str, Any] = {"tokens": t, "cold_fraction": cold, "seed": seed}
            for form, split in splits.items():
                got = torch.empty_like(x)
                try:
                    if form == "monolithic":  # routed by the split itself, as pin mode runs the default class
                        got = split.apply_routed(x, logits_of[t], act, EXPERTS, None, False)
                    else:
                        split.apply(got, x, None, None, weights, ids, act, EXPERTS, None, None, None, None, None,
                                    None, False)
                    got = got.cpu()
                    row[f"{form}_split_equal"] = bool(torch.equal(got, ref[form]))
                    row[f"{form}_split_max_abs"] = float((got.float() - ref[form].float()).abs().max())
                    if form == "fused":
                        row["fused_split_equal_monolithic"] = bool(torch.equal(got, ref["monolithic"]))
                except Exception as exc:
                    out["errors"].append({"tokens": t, "form": form, "error": f"{type(exc).__name__}: {exc}",
                                          "trace": traceback.format_exc()[-2000:]})
            row["fused_unsplit_equal_monolithic"] = bool(torch.equal(ref["fused"], ref["monolithic"]))
            row["unfused_unsplit_equal_monolithic"] = bool(torch.equal(ref["unfused"], ref["monolithic"]))
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
        del splits, layer, re, owner
        torch.cuda.empty_cache()
    rows = out["cases"]
    for key in ("unfused_split_equal", "fused_split_equal", "monolithic_split_equal", "fused_split_equal_monolithic",
                "fused_unsplit_equal_monolithic", "unfused_unsplit_equal_monolithic"):
        out[key] = f"{sum(bool(r.get(key)) for r in rows)}/{len(rows)}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    try:
        result = check(args.quick)
    except Exception as exc:
        result = {"fatal": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.time() - t0, 1)
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("cases", "errors")}), flush=True)
    return 0 if "fatal" not in result and not result.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
