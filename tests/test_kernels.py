"""Pin-mode kernels: the Triton partition and finalize agree with their torch versions bit for bit.

The Triton checks run under ``TRITON_INTERPRET=1`` in a fresh process (Triton fixes its interpreter mode when it is
first imported, and other tests may import it first); tests/test_gpu.py runs the same checks on CUDA tensors.
The torch versions are checked here against exact arithmetic (fractions) and hand-made cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from pinsidecar_hook.kernels import finalize_torch, fma_fp32_exact, partition_torch

HERE = Path(__file__).resolve()


def _row_map(num_experts: int, hot_rows: int, non_local: int, g: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(num_experts, generator=g)
    row_map = torch.full((num_experts,), -1, dtype=torch.int32)
    local = perm[non_local:]
    row_map[local] = torch.randperm(local.numel(), generator=g).to(torch.int32)
    return row_map


def check_partition(device: str) -> dict[str, bool]:
    """partition_triton == partition_torch (ids and counters) over sizes that cross program boundaries, with
    non-local experts (-1 rows) and out-of-range ids (-1) in the input."""
    from pinsidecar_hook.kernels import partition_triton

    g = torch.Generator().manual_seed(11)
    results: dict[str, bool] = {}
    for num_tokens, top_k, num_experts, cold, non_local in [
        (1, 1, 8, 0, 0), (1, 8, 64, 64, 0), (7, 6, 64, 10, 0), (300, 8, 384, 89, 0), (513, 4, 128, 40, 32),
        (4096, 8, 256, 128, 0), (64, 6, 32, 16, 16),
    ]:
        hot_rows = num_experts - non_local - cold
        row_map = _row_map(num_experts, hot_rows, non_local, g)
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
        ids[::5, 0] = -1  # padded slots
        for count in (True, False):
            ec = [torch.zeros(num_experts, dtype=torch.int64, device=device) + 3 for _ in range(2)]
            cc = [torch.zeros(1, dtype=torch.int64, device=device) + 5 for _ in range(2)]
            a = partition_torch(ids.to(device), row_map.to(device), hot_rows, *((ec[0], cc[0]) if count else ()))
            b = partition_triton(ids.to(device), row_map.to(device), hot_rows, *((ec[1], cc[1]) if count else ()))
            ok = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].dtype == b[0].dtype == torch.int32
            if count:
                ok = ok and torch.equal(ec[0], ec[1]) and torch.equal(cc[0], cc[1])
            results[f"partition T={num_tokens} k={top_k} E={num_experts} cold={cold} nl={non_local} c={count}"] = ok
    return results


def check_finalize(device: str) -> dict[str, bool]:
    """finalize_triton == finalize_torch, bitwise, for bf16/fp16/fp32 rows, both arithmetics, with and without
    tier ids, one or two row buffers; skipped slots hold NaN and must not leak."""
    from pinsidecar_hook.kernels import finalize_triton

    g = torch.Generator().manual_seed(12)
    results: dict[str, bool] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_tokens, top_k, hidden in [(1, 1, 7), (5, 8, 1500), (9, 6, 256)]:
            rows = (torch.randn(num_tokens, top_k, hidden, generator=g) * 4).to(dtype)
            rows_cold = (torch.randn(num_tokens, top_k, hidden, generator=g) * 4).to(dtype)
            weights = torch.rand(top_k + 1, num_tokens, generator=g).t()[:, :top_k]  # strided view
            tier = torch.randint(0, 3, (num_tokens, top_k), generator=g)  # 0 hot, 1 cold, 2 other rank
            hot_ids = torch.where(tier == 0, torch.randint(0, 9, tier.shape, generator=g), -1).to(torch.int32)
            cold_ids = torch.where(tier == 1, torch.randint(0, 9, tier.shape, generator=g), -1).to(torch.int32)
            skipped = (tier == 2).unsqueeze(-1)
            rows_nan = rows.masked_fill(skipped, float("nan"))
            cold_nan = rows_cold.masked_fill(skipped | (tier == 0).unsqueeze(-1), float("nan"))
            hot_nan = rows_nan.masked_fill((tier == 1).unsqueeze(-1), float("nan"))
            # permuted layouts (FlashInfer do_finalize=False): slot -> row index, padded with NaN rows
            slots = num_tokens * top_k
            perm = torch.randperm(slots + 3, generator=g)[:slots].reshape(num_tokens, top_k).to(torch.int32)
            permuted = torch.full((slots + 3, hidden), float("nan")).to(dtype)
            permuted_cold = torch.full((slots + 5, hidden), float("nan")).to(dtype)
            permuted[perm[tier == 0].long()] = rows[tier == 0]
            permuted_cold[perm[tier == 1].long()] = rows_cold[tier == 1]
            hot_perm = torch.where(tier == 0, perm, -1)
            cold_perm = torch.where(tier == 1, perm, -1)
            modes = {
                "all": (rows, {}),
                "ids": (rows_nan, {"hot_ids": hot_ids, "cold_ids": cold_ids}),
                "ids+cold": (hot_nan, {"hot_ids": hot_ids, "cold_ids": cold_ids, "rows_cold": cold_nan}),
                "gather": (permuted, {"hot_ids": hot_perm, "cold_ids": cold_perm, "rows_cold": permuted_cold,
                                      "gather": True}),
            }
            for weighted in (False, True):
                for name, (r, kw) in modes.items():
                    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
                    x = finalize_torch(r.to(device), weights.to(device), weighted_rows=weighted, **kw)
                    y = finalize_triton(r.to(device), weights.to(device), weighted_rows=weighted, **kw)
                    ok = x.dtype == y.dtype == dtype and torch.equal(x, y) and not bool(torch.isnan(y).any())
                    key = f"finalize {str(dtype)[6:]} T={num_tokens} k={top_k} H={hidden} w={weighted} {name}"
                    results[key] = ok
    return results


def fma_is_fused(device: str) -> bool:
    """Whether ``tl.fma`` rounds once where the kernels run. True on GPUs; under the interpreter only from
    Triton 3.7-ish on (Triton 3.6's interpreter multiplies and adds in fp32, rounding twice)."""
    from pinsidecar_hook.kernels import finalize_triton

    g = torch.Generator().manual_seed(13)
    rows = torch.randn(4096, 2, 1, generator=g).to(device)
    weights = torch.rand(4096, 2, generator=g).to(device)
    return torch.equal(finalize_triton(rows, weights), finalize_torch(rows, weights))


def run_checks(device: str) -> dict[str, bool]:
    return {**check_partition(device), **check_finalize(device), "fma_is_fused": fma_is_fused(device)}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, bool]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, f"interpreter checks failed to run:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_partition_matches_torch_under_interpreter(interpreter_results: dict[str, bool]) -> None:
    part = {k: v for k, v in interpreter_results.items() if k.startswith("partition")}
    assert len(part) == 14
    assert all(part.values()), [k for k, v in part.items() if not v]


def test_triton_finalize_matches_torch_under_interpreter(interpreter_results: dict[str, bool]) -> None:
    fin = {k: v for k, v in interpreter_results.items() if k.startswith("finalize")}
    assert len(fin) == 72
    summing = {k: v for k, v in fin.items() if "w=True" in k}  # moe_sum arithmetic: no multiply
    assert all(summing.values()), [k for k, v in summing.items() if not v]


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version("triton").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


# Before 3.9, Triton's interpreter multiplies and adds tl.fma in fp32, rounding twice, so the weighted finalize
# cases (an FMA each) cannot match there; the compiled kernel on the GPU rounds once (tests/test_gpu.py). Seen in
# 3.6 (the device's own) and 3.8 (vLLM 0.34's carried Triton on the H100, 2026-12-07: fma_is_fused false); 3.9 (the
# CPU lane's) fuses. Strict: an interpreter below 3.9 that fuses makes this XPASS and fail, so the bound is moved.
@pytest.mark.xfail(_triton_version() < (3, 9), strict=True,
                   reason="Triton < 3.9's interpreter rounds tl.fma twice (3.6 and 3.8 seen); the GPU's compiled "
                          "kernel is checked")
def test_triton_finalize_fma_cases_match_torch_under_interpreter(interpreter_results: dict[str, bool]) -> None:
    fin = {k: v for k, v in interpreter_results.items() if k.startswith("finalize")}
    assert interpreter_results["fma_is_fused"]
    assert all(fin.values()), [k for k, v in fin.items() if not v]


def test_partition_torch_contract() -> None:
    row_map = torch.tensor([2, 0, -1, 3, 1], dtype=torch.int32)  # expert 2 lives on another rank
    ids = torch.tensor([[0, 1, 2], [3, 4, 0], [-1, 4, 9]])
    counts = torch.zeros(5, dtype=torch.int64)
    cold = torch.zeros(1, dtype=torch.int64)
    hot_ids, cold_ids = partition_torch(ids, row_map, 2, counts, cold)
    assert hot_ids.tolist() == [[-1, 0, -1], [-1, 1, -1], [-1, 1, -1]]
    assert cold_ids.tolist() == [[0, -1, -1], [1, -1, 0], [-1, -1, -1]]
    assert counts.tolist() == [2, 1, 1, 1, 2]  # -1 and 9 are out of range: not counted
    assert cold.tolist() == [3]
    partition_torch(ids, row_map, 2, counts, cold)  # counters accumulate
    assert counts.tolist() == [4, 2, 2, 2, 4] and cold.tolist() == [6]


def _round_fp32(value: Fraction) -> float:
    """Correct round-to-nearest-even of an exact rational to fp32."""
    import numpy as np

    guess = np.float32(float(value))
    cands = [np.nextafter(guess, np.float32("-inf")), guess, np.nextafter(guess, np.float32("inf"))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - value), int(np.float32(c).view(np.int32)) & 1)))


def test_fma_fp32_exact_rounds_once() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.rand(3000, generator=g)
    r = (torch.randn(3000, generator=g) * 10).to(torch.bfloat16).float()
    acc = torch.randn(3000, generator=g) * torch.logspace(-6, 6, 3000)
    # cancellation-heavy cases: acc close to -w*r
    acc[:500] = -(w[:500] * r[:500]) * (1 + torch.randn(500, generator=g) * 1e-6)
    got = fma_fp32_exact(w, r, acc)
    want = [
        _round_fp32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
        for a, b, c in zip(w, r, acc, strict=True)
    ]
    assert got.tolist() == want
    assert not torch.equal(got, w * r + acc)  # and it is not the unfused mul-then-add


def test_finalize_torch_order_and_cast() -> None:
    """Slot order is part of the result: 1 + 2^-24 - 1 in fp32 differs by order; the cast happens once."""
    rows = torch.tensor([[[1.0], [2.0**-24], [-1.0]]])
    ones = torch.ones(1, 3)
    assert finalize_torch(rows, ones).item() == 0.0  # (1 + 2^-24) rounds to 1, then - 1
    assert finalize_torch(rows[:, [1, 2, 0]], ones).item() == 2.0**-24
    bf = finalize_torch(torch.tensor([[[1.0], [2.0**-8], [2.0**-8]]]).to(torch.bfloat16), ones)
    assert bf.dtype == torch.bfloat16 and bf.item() == 1.0 + 2.0**-7  # bf16 per step would give 1.0


def test_finalize_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"rows must be \[T, k, H\]"):
        finalize_torch(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="hot_ids and cold_ids together"):
        finalize_torch(torch.zeros(2, 3, 4), torch.zeros(2, 3), hot_ids=torch.zeros(2, 3, dtype=torch.int32))


if __name__ == "__main__":  # the interpreter run: TRITON_INTERPRET=1 is set by the fixture before Triton loads
    print(json.dumps(run_checks("cpu")))
