"""The attach-time self-check: every layer's split against vLLM's own unsplit call, bit for bit, inside the engine.

Why inside the engine: a kernel-level check (``scripts/gpu_lane/split_check.py``) builds vLLM's experts objects by
hand, for the formats someone thought to build. Here the layer is the one the engine loaded, with whatever
quantization the checkpoint or ``--quantization`` gave it and the experts class vLLM's oracle picked, and the call
is the one the engine makes (:func:`pinsidecar_hook.vllm_seam.run_layer_experts`: prepare, experts, finalize).
So a new checkpoint format is checked the first time it is booted with ``PINSIDECAR_PIN_SELFCHECK=1``.

For each layer, before its tensors are re-homed, the unsplit call runs twice on generated routing (:func:`cases`;
the second run says whether the unsplit kernel is deterministic there, ``unsplit_unstable``: where it is not, bit
identity with it is undefined): uniform, skewed (Zipf over the experts) and straddling (each token's slots
alternate between hot and cold experts), at decode sizes (1, 7, 64 tokens) and prefill sizes (512, 2048, 4096
tokens: where vLLM's kernels switch paths, the per-pair assignment, tuned tile configs per batch size, 0.34's
sorted-A down projection). Sizes above the engine's ``max_num_batched_tokens`` are left out (:func:`token_sizes`):
the engine never makes such a call. After re-homing and installing the split, the same cases run again and the
outputs are compared with ``torch.equal``. A layer whose kernel routes inside itself (monolithic: gpt-oss's default
MXFP4 kernel) is called on router logits built to route to each case's experts (:func:`routing_logits`), so its own
routing, and the split's copy of it, are checked too. The counters the split bumps meanwhile are zeroed at
engine-ready with the warm-up's. A backend that is not bit-identical by design (the CPU kernel reduces inside;
``SplitBackend.GUARANTEE`` other than "bitwise") is still run and reported, with ``expected_equal: false``: a
difference there is not an error.

Cost, at boot only. Per layer 18 cases, each run three times (two unsplit, one split). The prefill cases dominate:
at 4096 tokens nearly every expert of a layer is read, the unsplit call from HBM and the split's cold tier from host
memory over the link, so a layer takes about 9 x (its cold bytes / the host link's read rate) for them: 1.6 GB cold a
layer read at ~50 GB/s (the lent H200's zero-copy rate) is ~0.3 s a layer, ~12 s for a 40-layer model, plus well
under a second a layer from HBM. Memory is bounded by one case: inputs are generated in host memory and moved to
the device one case at a time, and every output is moved back to host memory at once, so the device holds one
case's input, its output and vLLM's own workspaces for that batch (which serving a batch of that size needs too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pinsidecar_hook import vllm_seam

__all__ = ["DECODE_TOKENS", "KINDS", "PREFILL_TOKENS", "TOKENS", "Case", "LayerCheck", "SelfCheck", "cases",
           "routing_logits", "token_sizes"]

DECODE_TOKENS = (1, 7, 64)
PREFILL_TOKENS = (512, 2048, 4096)
TOKENS = DECODE_TOKENS + PREFILL_TOKENS
KINDS = ("uniform", "skewed", "straddle")


def token_sizes(max_batched_tokens: int | None, sizes: tuple[int, ...] = TOKENS) -> tuple[int, ...]:
    """The check's batch sizes an engine can run: those up to its ``max_num_batched_tokens`` (all when unknown)."""
    if not max_batched_tokens:
        return sizes
    return tuple(t for t in sizes if t <= max_batched_tokens)


@dataclass(frozen=True)
class Case:
    """One routing case, in host memory; :meth:`inputs` puts it on the layer's device for one call."""

    kind: str
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    device: torch.device
    router_logits: torch.Tensor | None = None  # logits that route to ``topk_ids`` (:func:`routing_logits`)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x.to(self.device), self.topk_weights.to(self.device), self.topk_ids.to(self.device)

    def run(self, geometry: Any, vllm_config: Any) -> torch.Tensor:
        """The layer's experts call on this case, in host memory: on the routing for a modular layer, on the logits
        for a monolithic one (it routes inside itself)."""
        if getattr(geometry, "monolithic", False):
            assert self.router_logits is not None, "a monolithic layer's case needs router logits"
            return vllm_seam.run_layer_monolithic(geometry, self.x.to(self.device), self.router_logits.to(self.device),
                                                  vllm_config).to("cpu")
        return vllm_seam.run_layer_experts(geometry, *self.inputs(), vllm_config).to("cpu")


def routing_logits(ids: torch.Tensor, num_experts: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Router logits ``[T, num_experts]`` whose top-k is ``ids`` in slot order, for a kernel that routes inside
    itself: each token's k experts get distinct values, falling by random gaps of 0.1-0.6 from 6 (kept distinct and
    in order by ``dtype``'s rounding), everything else -4 or below. The weights follow from the logits, not from
    the case's weights."""
    tokens, k = ids.shape
    logits = -4.0 - torch.rand(tokens, num_experts, generator=gen) * 4.0
    top = 6.0 - torch.cumsum(0.1 + 0.5 * torch.rand(tokens, k, generator=gen), dim=1)
    return logits.scatter_(1, ids.to(torch.int64), top).to(dtype)


def _distinct_ids(scores: torch.Tensor, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Per row, ``top_k`` distinct experts drawn with probabilities ``scores`` (a router never picks one twice)."""
    return torch.multinomial(scores, top_k, replacement=False, generator=gen)


def cases(num_experts: int, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device,
          row_map: torch.Tensor, hot_rows: int, seed: int = 0, tokens: tuple[int, ...] = TOKENS,
          monolithic: bool = False) -> list[Case]:
    """The routing cases of one layer (module docstring), one per kind and size in ``tokens``. Ids are in
    ``[0, num_experts)``; experts not on this rank (row map -1) are avoided, as vLLM's expert-parallel routing would
    never send them here unmapped. ``monolithic``: the layer routes inside its kernel, so each case also carries
    router logits that route to its ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = row_map.to("cpu", torch.int64)
    local = rows >= 0
    hot = (rows >= 0) & (rows < hot_rows)
    cold = rows >= hot_rows
    ranks = torch.randperm(num_experts, generator=gen).to(torch.float64)
    out: list[Case] = []
    for size in tokens:
        for kind in KINDS:
            if kind == "uniform":
                ids = _distinct_ids(local.double().expand(size, -1).contiguous(), top_k, gen)
            elif kind == "skewed":
                zipf = local.double() / (ranks + 1.0) ** 1.2
                ids = _distinct_ids(zipf.expand(size, -1).contiguous(), top_k, gen)
            else:
                if not bool(hot.any()) or not bool(cold.any()):
                    continue  # an all-hot or all-cold map has nothing to straddle
                n_hot, n_cold = (top_k + 1) // 2, top_k // 2
                if int(hot.sum()) < n_hot or int(cold.sum()) < n_cold:
                    continue
                h = _distinct_ids(hot.double().expand(size, -1).contiguous(), n_hot, gen)
                c = _distinct_ids(cold.double().expand(size, -1).contiguous(), n_cold, gen)
                ids = torch.empty(size, top_k, dtype=torch.int64)
                ids[:, 0::2], ids[:, 1::2] = h, c
            logits = torch.randn(size, top_k, generator=gen, dtype=torch.float32)
            weights = torch.softmax(logits, dim=-1)
            x = (torch.randn(size, hidden, generator=gen) * 0.5).to(dtype)
            out.append(Case(kind, x, weights, ids.to(torch.int32), torch.device(device),
                            routing_logits(ids, num_experts, dtype, gen) if monolithic else None))
    return out


@dataclass
class LayerCheck:
    layer_id: int
    cases: list[Case]
    reference: list[torch.Tensor | None] = field(default_factory=list)
    error: str = ""
    unstable: int = 0  # cases where two unsplit calls on the same input differed


@dataclass
class SelfCheck:
    """Collects the per-layer results; :meth:`summary` is what the log line and the stats meta carry."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    vllm_config: Any = None  # the worker's: the forward context both calls run in
    expected_equal: bool = True  # False for a backend that is placement-invariant, not bit-identical, by design

    @property
    def tokens(self) -> tuple[int, ...]:
        """The batch sizes this engine's layers are checked at (:func:`token_sizes`)."""
        return token_sizes(vllm_seam.max_batched_tokens(self.vllm_config))

    def before(self, geometry: Any, layer_id: int, layer_cases: list[Case]) -> LayerCheck:
        """Run the unsplit call on every case (the layer is not re-homed yet)."""
        check = LayerCheck(layer_id, layer_cases)
        try:
            for c in layer_cases:
                first = c.run(geometry, self.vllm_config)
                again = c.run(geometry, self.vllm_config)
                # The unsplit kernel against itself: where it is not deterministic, bit identity is undefined
                check.unstable += int(not torch.equal(first, again))
                check.reference.append(first)
        except Exception as exc:  # reported, never fatal: the check is a diagnosis, not a gate
            check.error = f"unsplit call failed: {type(exc).__name__}: {exc}"
        return check

    def after(self, geometry: Any, check: LayerCheck) -> None:
        """Run the split on the same cases and compare bit for bit."""
        result: dict[str, Any] = {"layer": check.layer_id, "cases": len(check.cases), "equal": 0, "mismatches": [],
                                  "unsplit_unstable": check.unstable}
        if check.error:
            result["error"] = check.error
            self.layers.append(result)
            return
        try:
            for case, want in zip(check.cases, check.reference, strict=True):
                got = case.run(geometry, self.vllm_config)
                if want is not None and got.shape == want.shape and torch.equal(got, want):
                    result["equal"] += 1
                else:
                    diff = (got.float() - want.float()).abs() if want is not None and got.shape == want.shape \
                        else None
                    result["mismatches"].append({
                        "kind": case.kind, "tokens": int(case.x.shape[0]),
                        "max_abs_diff": None if diff is None else float(diff.max()),
                        "elements_differing": None if diff is None else int((diff > 0).sum())})
        except Exception as exc:
            result["error"] = f"split call failed: {type(exc).__name__}: {exc}"
        self.layers.append(result)

    def summary(self) -> dict[str, Any]:
        mismatches = [dict(m, layer=r["layer"]) for r in self.layers for m in r["mismatches"]]
        errors = [{"layer": r["layer"], "error": r["error"]} for r in self.layers if r.get("error")]
        return {"layers": len(self.layers), "tokens": list(self.tokens), "cases": sum(r["cases"] for r in self.layers),
                "equal": sum(r["equal"] for r in self.layers), "mismatches": mismatches[:50],
                "mismatch_count": len(mismatches), "errors": errors[:20], "expected_equal": self.expected_equal,
                "unsplit_unstable": sum(r.get("unsplit_unstable", 0) for r in self.layers)}
