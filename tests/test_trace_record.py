"""Count mode's routing trace without an engine: the recorder's device buffer (what each layer's capture writes,
padding left out, the bound, sampled steps, a reset), the count state writing the trace beside the counts, and the
hook configuration that turns it on. The engine's own recording is checked in tests/test_count_mode.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pinsidecar_hook.contract import ModelInfo, load_counts
from pinsidecar_hook.contract.env import ENV, HookConfig, HookConfigError
from pinsidecar_hook.contract.trace import load_trace
from pinsidecar_hook.count import CountState
from pinsidecar_hook.flusher import WriteInfo
from pinsidecar_hook.trace_record import TraceRecorder

E, K, LAYERS = 16, 2, (3, 5, 9)


def _step(rng: np.random.Generator, rows: int) -> np.ndarray:
    """One step's top-k ids, [rows, layers, k]: distinct experts per token and layer, as a router picks."""
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in LAYERS]) for _ in range(rows)])


def _run(rec: TraceRecorder, steps: list[np.ndarray], pads: list[int] | None = None) -> None:
    """Feed the recorder as the engine does: per step, each layer's capture in layer order; ``pads`` extra
    garbage rows after the real ones (CUDA graph padding), with the real count in the scalar."""
    real = torch.zeros((1,), dtype=torch.int64) if pads is not None else None
    for n, ids in enumerate(steps):
        pad = pads[n] if pads is not None else 0
        if real is not None:
            real.fill_(ids.shape[0])
        for i in range(len(LAYERS)):
            rows = torch.as_tensor(ids[:, i, :], dtype=torch.int32)
            if pad:
                rows = torch.cat([rows, torch.full((pad, K), E - 1, dtype=torch.int32)])
            rec.capture(i, rows, real)


def test_the_trace_is_every_real_row_in_engine_order() -> None:
    rng = np.random.default_rng(0)
    steps = [_step(rng, n) for n in (5, 1, 1, 3, 1)]
    rec = TraceRecorder(list(LAYERS), E, K, torch.device("cpu"), capacity=100, meta={"workload": "w"})
    _run(rec, steps, pads=[3, 7, 0, 1, 15])
    trace = rec.snapshot()
    assert trace is not None and trace.layer_ids == LAYERS and trace.num_experts == E
    assert np.array_equal(trace.experts, np.concatenate(steps))  # padding left out, order kept
    assert trace.meta["steps_seen"] == 5 and trace.meta["full"] is False and trace.meta["workload"] == "w"
    assert rec.snapshot() is None  # not grown: nothing to write again


def test_the_bound_stops_the_trace_and_every_samples_whole_steps() -> None:
    rng = np.random.default_rng(1)
    steps = [_step(rng, 4) for _ in range(6)]
    full = TraceRecorder(list(LAYERS), E, K, torch.device("cpu"), capacity=10)
    _run(full, steps)
    trace = full.snapshot()
    assert trace is not None and trace.tokens == 10 and trace.meta["full"] is True
    assert np.array_equal(trace.experts, np.concatenate(steps)[:10])  # the first 10 tokens, then nothing
    sampled = TraceRecorder(list(LAYERS), E, K, torch.device("cpu"), capacity=100, every=3)
    _run(sampled, steps)
    trace = sampled.snapshot()
    assert trace is not None and np.array_equal(trace.experts, np.concatenate([steps[0], steps[3]]))
    assert trace.meta["every_steps"] == 3


def test_a_reset_starts_the_trace_over() -> None:
    rng = np.random.default_rng(2)
    rec = TraceRecorder(list(LAYERS), E, K, torch.device("cpu"), capacity=50)
    _run(rec, [_step(rng, 3)])
    assert rec.snapshot() is not None
    rec.reset()
    assert rec.snapshot() is None  # empty: no trace
    after = [_step(rng, 2)]
    _run(rec, after)
    trace = rec.snapshot()
    assert trace is not None and np.array_equal(trace.experts, after[0]) and trace.meta["steps_seen"] == 1


def _state(tmp_path: Path, **cfg: object) -> CountState:
    config = HookConfig(mode="count", counts_path=tmp_path / "counts.json", trace_path=tmp_path / "t.npz", **cfg)
    trace = TraceRecorder(list(LAYERS), E, K, torch.device("cpu"), capacity=config.trace_tokens)
    return CountState(list(LAYERS), config, E, K, torch.device("cpu"), writer=True, meta={},
                      model_info=ModelInfo(), trace=trace)


def test_the_count_state_writes_the_trace_before_the_counts_and_they_agree(tmp_path: Path) -> None:
    state = _state(tmp_path)
    captures = [state.capture_fn(i, None) for i in range(len(LAYERS))]
    rng = np.random.default_rng(3)
    for ids in [_step(rng, n) for n in (4, 1, 1, 2)]:
        for i, capture in enumerate(captures):
            capture(torch.as_tensor(ids[:, i, :]))
    state.snapshot(WriteInfo(seq=1, flush_token="flush-1")).save(tmp_path / "counts.json")
    counts, trace = load_counts(tmp_path / "counts.json"), load_trace(tmp_path / "t.npz")
    assert trace.tokens == counts.tokens == 8 and counts.meta["trace"]["tokens"] == 8
    assert np.array_equal(trace.counts(), counts.counts)  # every step recorded: the trace's counts are the counts
    state.reset()
    assert not (tmp_path / "t.npz").exists()  # a trace on disk is the recording under way, or nothing


def test_a_trace_that_cannot_be_written_is_counted_and_the_counts_still_are(tmp_path: Path) -> None:
    state = _state(tmp_path)
    (tmp_path / "t.npz").mkdir()  # the trace's path is a directory: every write fails
    for i in range(len(LAYERS)):
        state.capture_fn(i, None)(torch.as_tensor([[1, 2]]))
    state.snapshot(WriteInfo(seq=1, flush_token="f1")).save(tmp_path / "counts.json")
    state.snapshot(WriteInfo(seq=2, flush_token="f2")).save(tmp_path / "counts.json")
    counts = load_counts(tmp_path / "counts.json")
    # the second write carries the first failure (a write reports the failures before it) and tried again
    assert counts.tokens == 1 and counts.meta["trace"]["write_errors"] == 1 and state.trace_write_errors == 2


def test_hook_config_reads_the_trace_settings_and_refuses_bad_ones() -> None:
    env = {ENV["mode"]: "count", ENV["counts_path"]: "/c.json", ENV["trace_path"]: "/t.npz",
           ENV["trace_tokens"]: "4096", ENV["trace_every"]: "2"}
    cfg = HookConfig.from_env(env)
    assert (cfg.trace_path, cfg.trace_tokens, cfg.trace_every) == (Path("/t.npz"), 4096, 2)
    assert HookConfig.from_env(cfg.to_env()) == cfg
    assert HookConfig.from_env({ENV["mode"]: "count", ENV["counts_path"]: "/c.json"}).trace_path is None
    for key, raw, says in (("trace_tokens", "0", "between 1 and"), ("trace_tokens", "many", "not an integer"),
                           ("trace_every", "-1", "between 1 and")):
        with pytest.raises(HookConfigError, match=says):
            HookConfig.from_env({**env, ENV[key]: raw})
    with pytest.raises(HookConfigError, match="only count mode records"):
        HookConfig.from_env({ENV["mode"]: "pin", ENV["map_path"]: "/m.json", ENV["trace_path"]: "/t.npz"})
