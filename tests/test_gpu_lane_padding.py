"""Exact counts with CUDA graphs on: the rows vLLM pads a batch with are not counted, in either mode.

vLLM pads a batch up to a captured CUDA-graph size, and the router (count mode's capture callback) and the experts
call (pin mode's partition) see the padded rows. The hook masks them with a per-worker device scalar holding the
step's real token count (``vllm_seam.real_token_count``), refilled by the ``execute_model`` wrapper from the
scheduler output. Here on the CPU with a simulated padded batch (the torch paths and, in a fresh process, the
Triton partition kernel under the interpreter); tests/test_gpu.py replays a captured graph on the GPU, and the
GPU lane (bench/gpu_lane.py) checks the counts of a real engine with CUDA graphs on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pinsidecar_hook import vllm_seam
from pinsidecar_hook.count import CountState
from pinsidecar_hook.kernels.partition import partition_torch

E, K = 16, 4


def _ids(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows)]).to(torch.int32)


def _count_state(real: torch.Tensor | None) -> CountState:
    return CountState([0], SimpleNamespace(workload=""), E, K, torch.device("cpu"), writer=False, meta={},
                      model_info=None, real_tokens=real)


@pytest.mark.parametrize("real_rows", [0, 1, 3, 8, 20])
def test_count_capture_counts_only_real_rows(real_rows: int) -> None:
    ids = _ids(8)  # a batch of 8 rows, as a graph captured at size 8 sees it
    state = _count_state(torch.tensor([real_rows]))
    state.capture_fn(0, None)(ids)
    n = min(real_rows, 8)
    assert torch.equal(state.counts[0], torch.bincount(ids[:n].reshape(-1).long(), minlength=E))
    assert int(state.tokens[0]) == n
    assert int(state.counts[0].sum()) == n * K  # selections == tokens x top_k


def test_count_capture_without_scalar_counts_every_row() -> None:
    ids = _ids(5)
    state = _count_state(None)
    state.capture_fn(0, None)(ids)
    assert int(state.tokens[0]) == 5 and int(state.counts[0].sum()) == 5 * K


def test_count_capture_chains_the_previous_callback() -> None:
    seen = []
    state = _count_state(torch.tensor([2]))
    state.capture_fn(0, lambda ids: seen.append(ids.shape))(_ids(4))
    assert seen == [torch.Size([4, K])] and int(state.tokens[0]) == 2


@pytest.mark.parametrize("real_rows", [0, 2, 6, 9])
def test_partition_torch_masks_padding(real_rows: int) -> None:
    ids = _ids(6, seed=1)
    row_map = torch.randperm(E, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    counts, cold, tokens = torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    hot_ids, cold_ids = partition_torch(ids, row_map, 10, counts, cold, num_real=torch.tensor([real_rows]),
                                        token_counts=tokens)
    full_hot, full_cold = partition_torch(ids, row_map, 10)
    assert torch.equal(hot_ids, full_hot) and torch.equal(cold_ids, full_cold)  # padded rows still partitioned
    n = min(real_rows, 6)
    assert torch.equal(counts, torch.bincount(ids[:n].reshape(-1).long(), minlength=E))
    assert int(cold) == int((row_map.long()[ids[:n].long()] >= 10).sum())
    assert int(tokens) == n


def test_execute_model_wrapper_sets_the_real_token_scalar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker wrapper writes ``total_num_scheduled_tokens`` before the step runs (and inside the guard)."""
    monkeypatch.setattr(vllm_seam._common, "_real_tokens", {})
    real = vllm_seam.real_token_count(torch.device("cpu"))
    assert int(real) > 1 << 30  # nothing masked before the first step
    order: list[str] = []

    class Worker:
        def execute_model(self, scheduler_output: object) -> str:
            order.append(f"step real={int(real)}")
            return "out"

    class Guard:
        def __enter__(self) -> None:
            order.append("guard")

        def __exit__(self, *exc: object) -> None:
            order.append("unguard")

    vllm_seam._common._wrap_execute(Worker, Guard)
    vllm_seam._common._wrap_execute(Worker, Guard)  # idempotent
    assert Worker().execute_model(SimpleNamespace(total_num_scheduled_tokens=5)) == "out"
    assert order == ["guard", "step real=5", "unguard"]
    Worker().execute_model(SimpleNamespace())  # a scheduler output without the field leaves the scalar alone
    assert int(real) == 5


def test_triton_experts_split_counts_only_real_rows() -> None:
    """Pin mode's Triton split passes the scalar to the partition: counters, cold counter and tokens are masked."""
    from pinsidecar_hook.backends import triton_experts as te
    from test_backends_gpu_adapters import (
        HIDDEN,
        INTER,
        FakeDesc,
        FakeQuantConfig,
        FakeTritonExperts,
        _layer,
        _triton_setup,
    )


    g, w1, w2, s1, s2 = _triton_setup(7)
    row_map = torch.randperm(16, generator=g).to(torch.int32)
    ids = _ids(6, seed=3)
    weights = torch.full((6, K), 1.0 / K)
    x = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16)
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2}, row_map, 16)
    split = te.TritonExpertsSplit(experts, layer, num_real=torch.tensor([4]), fused_finalize=False, naive_rule=None,
                                  config_fn=lambda *a: {"BLOCK_SIZE_K": 16},
                                  override_fn=lambda c: contextlib.nullcontext())
    split.apply(torch.empty(6, HIDDEN, dtype=torch.bfloat16), x, None, None, weights, ids, "silu", 16, None, None,
                None, torch.empty(6, K, 2 * INTER, dtype=torch.bfloat16),
                torch.empty(6, K, 2 * INTER, dtype=torch.bfloat16), None, False)
    tokens, counts, cold = layer.token_counts, layer.expert_counts, layer.cold_counts
    assert int(tokens) == 4 and int(counts.sum()) == 4 * K and int(cold) == 0


_INTERPRETER_CHECK = textwrap.dedent("""
    import torch
    from pinsidecar_hook.kernels.partition import partition_torch, partition_triton
    g = torch.Generator().manual_seed(0)
    for rows, k in ((1, 8), (8, 4), (1500, 8)):
        ids = torch.stack([torch.randperm(64, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
        row_map = torch.randperm(64, generator=g).to(torch.int32)
        for real in (None, 0, 1, rows // 2, rows, rows + 3):
            outs = []
            for fn in (partition_torch, partition_triton):
                c = [torch.zeros(64, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                     torch.zeros(1, dtype=torch.int64)]
                nr = None if real is None else torch.tensor([real], dtype=torch.int64)
                h, cold = fn(ids, row_map, 40, c[0], c[1], num_real=nr, token_counts=c[2])
                outs.append([h, cold, *c])
            assert all(torch.equal(a, b) for a, b in zip(*outs)), (rows, k, real)
    print("ok")
""")


def test_triton_partition_masks_padding_under_the_interpreter() -> None:
    """The Triton kernel's mask and token counter match the torch version (fresh process: TRITON_INTERPRET must be
    set before Triton is imported)."""
    pytest.importorskip("triton")
    hook = Path(__file__).resolve().parent.parent / "hook"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
