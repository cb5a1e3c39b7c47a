"""The daemon's apply client against the hook's real request server, without an engine.

:func:`pinsidecar.remap.apply.request_apply` talks to the hook's :class:`~pinsidecar_hook.flusher.Flusher` (the
side thread that serves ``flush``, ``reset`` and ``apply`` beside the stats file) the way the daemon talks to the
hook in a serving engine; only the source behind the flusher is small: it keeps one map and swaps it when asked,
as pin mode's ``PinState.apply`` does after the copies. Also: what the pipeline makes of answers
(:func:`~pinsidecar.remap.apply.classify_answer`), token parity, and withdrawing a request nobody answered.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from pinsidecar_hook.contract import ExpertMap, StatsSnapshot, load_map
from pinsidecar_hook.contract.requests import (
    HookRequestError,
    parse_apply_args,
    request_path,
    write_hook_request,
)
from pinsidecar_hook.contract.swap import ApplyResult, plan_swap
from pinsidecar_hook.flusher import Flusher, WriteInfo

from pinsidecar.counts.parity import ParityRef, PromptOutput, compare
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.apply import classify_answer, request_apply, withdraw_apply_request
from pinsidecar.remap.parity import compare_outputs
from pinsidecar.testing.artifacts import make_counts


class OneMapSource:
    """A pin-mode-like flush source: stats under one map; ``apply`` swaps it (refusing a hash that does not match
    the file, as the hook does)."""

    def __init__(self, emap: ExpertMap, *, refuse: str = "") -> None:
        self.emap = emap
        self.refuse = refuse
        self.boot_id = "boot-a"

    def snapshot(self, info: WriteInfo) -> StatsSnapshot:
        n = self.emap.num_layers
        return StatsSnapshot(boot_id=self.boot_id, seq=info.seq, layer_ids=list(self.emap.layer_ids),
                             num_experts=self.emap.num_experts, top_k=self.emap.top_k, selections=[0] * n,
                             cold_selections=[0] * n, tokens=0, map_hash=self.emap.content_hash,
                             flush_token=info.flush_token, meta={"apply": info.apply} if info.apply else {})

    def reset(self) -> None:
        pass

    def apply(self, args: Mapping[str, Any], token: str) -> ApplyResult:
        try:
            path, want = parse_apply_args(args)
        except ValueError as exc:
            return ApplyResult(token, "refused", reason=str(exc), map_hash=self.emap.content_hash)
        new = load_map(path)
        if self.refuse or new.content_hash != want:
            return ApplyResult(token, "refused", reason=self.refuse or "hash mismatch",
                               map_hash=self.emap.content_hash)
        plan = plan_swap(self.emap, new)
        self.emap = new
        return ApplyResult(token, "applied", map_hash=new.content_hash, from_hash=plan.from_hash,
                           to_hash=plan.to_hash, rows=plan.rows, bytes_moved=plan.bytes_moved, seconds=0.001,
                           layers=new.num_layers)


def _map(tmp: Path, domain: int, name: str) -> tuple[Path, ExpertMap]:
    emap = build_usage_map([make_counts(tokens=3000, domain=domain, seed=domain + 1)], 48, label=name)
    path = tmp / f"{name}.json"
    emap.save(path)
    return path, emap


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Flusher, OneMapSource, Path]]:
    _, code = _map(tmp_path, 0, "code")
    source = OneMapSource(code)
    stats = tmp_path / "stats.json"
    flusher = Flusher(source, stats, interval_s=5.0, name="pin", what="stats", write_error_key="stats_write")
    flusher.flush()
    flusher.start()
    yield flusher, source, stats
    flusher.stop()


def test_an_apply_request_is_answered_by_the_hooks_request_server(served: Any, tmp_path: Path) -> None:
    _, source, stats = served
    prose_path, prose = _map(tmp_path, 1, "prose")
    code_hash = source.emap.content_hash
    result, snap = request_apply(stats, str(prose_path.absolute()), prose.content_hash, timeout_s=10,
                                 alive=lambda: True)
    assert result.outcome == "applied" and snap.map_hash == prose.content_hash
    assert result.rows == plan_swap(load_map(tmp_path / "code.json"), prose).rows > 0
    answer = classify_answer(result, snap, map_hash=prose.content_hash, boot_before="boot-a", purpose="candidate",
                             wait_s=0.3)
    assert answer.applied and answer.rows == result.rows and answer.served_hash == prose.content_hash
    assert not request_path(stats).exists()  # served and removed
    # the answer stays in later writes until the next apply; a second apply (back) is answered with its own
    back, snap = request_apply(stats, str(tmp_path / "code.json"), code_hash, timeout_s=10, alive=lambda: True)
    assert back.outcome == "applied" and snap.map_hash == code_hash and back.token != result.token


def test_a_refusal_and_a_stale_hash_are_answers_not_timeouts(served: Any, tmp_path: Path) -> None:
    stats = served[2]
    prose_path, prose = _map(tmp_path, 1, "prose")
    result, snap = request_apply(stats, str(prose_path), "sha256:" + "0" * 64, timeout_s=10, alive=lambda: True)
    assert result.outcome == "refused" and result.reason == "hash mismatch"
    answer = classify_answer(result, snap, map_hash=prose.content_hash, boot_before="boot-a", purpose="candidate",
                             wait_s=0.1)
    assert answer.result == "refused" and not answer.applied
    result, _ = request_apply(stats, "relative/prose.json", prose.content_hash, timeout_s=10, alive=lambda: True)
    assert result.outcome == "refused" and "absolute path" in result.reason


def test_an_unanswered_request_times_out_or_notices_the_engine_gone_and_is_withdrawn(tmp_path: Path) -> None:
    prose_path, prose = _map(tmp_path, 1, "prose")
    stats = tmp_path / "stats.json"  # nobody serves it
    t0 = time.monotonic()
    with pytest.raises(HookRequestError, match="did not answer the apply request"):
        request_apply(stats, str(prose_path), prose.content_hash, timeout_s=0.3, alive=lambda: True)
    assert time.monotonic() - t0 < 5
    assert json.loads(request_path(stats).read_text())["op"] == "apply"
    assert withdraw_apply_request(stats) and not request_path(stats).exists()
    with pytest.raises(HookRequestError, match="the engine exited"):
        request_apply(stats, str(prose_path), prose.content_hash, timeout_s=30, alive=lambda: False)
    # a flush or reset request is not the daemon's to withdraw
    write_hook_request(stats, "flush")
    assert not withdraw_apply_request(stats) and request_path(stats).exists()
    assert not withdraw_apply_request(None)


def test_an_answer_from_another_engine_life_or_that_the_stats_contradict_is_not_applied(served: Any,
                                                                                       tmp_path: Path) -> None:
    stats = served[2]
    prose_path, prose = _map(tmp_path, 1, "prose")
    result, snap = request_apply(stats, str(prose_path), prose.content_hash, timeout_s=10, alive=lambda: True)
    died = classify_answer(result, snap, map_hash=prose.content_hash, boot_before="boot-0", purpose="candidate",
                           wait_s=1.0)
    assert died.result == "engine_died" and "boot-0 -> boot-a" in died.reason
    lying = dataclasses.replace(snap, map_hash="sha256:" + "1" * 64)
    failed = classify_answer(result, lying, map_hash=prose.content_hash, boot_before=None, purpose="candidate",
                             wait_s=1.0)
    assert failed.result == "failed" and "the stats report map" in failed.reason


def test_parity_across_an_apply_compares_tokens_and_reports_logprobs() -> None:
    want = [PromptOutput("p:1", [1, 2, 3], [-0.5, -0.25, -0.125]), PromptOutput("p:2", [4, 5], [-1.0, -2.0])]
    same_tokens = [PromptOutput("p:1", [1, 2, 3], [-0.5, -0.2500001, -0.125]), PromptOutput("p:2", [4, 5],
                                                                                         [-1.0, -2.0])]
    v = compare_outputs(want, same_tokens, logprobs=False)
    assert v.ok and v.figures["differing_prompts"] == 0 and 0 < v.figures["max_logprob_diff"] < 1e-6
    assert "5 tokens" in v.reason and v.figures["compared"] == "token ids"
    v = compare_outputs(want, [want[0], PromptOutput("p:2", [4, 6], [-1.0, -2.0])], logprobs=False)
    assert not v.ok and v.reason == "p:2: token 1 is 6, reference 5" and v.figures["differing_prompts"] == 1
    assert v.figures["first_diff"] == v.reason
    v = compare_outputs(want, [want[0], PromptOutput("p:2", [4], [-1.0])], logprobs=False)
    assert not v.ok and "length differs at token 1 (reference 5, this run ends)" in v.reason
    v = compare_outputs(want, want[:1], logprobs=False)
    assert not v.ok and "2 prompts recorded, 1 answered" in v.reason


def test_parity_across_a_reboot_is_bitwise_and_the_same_helper() -> None:
    """The reboot's check (the gate holds: nothing but placement can differ) compares logprobs bitwise too, with the
    same vocabulary as ``pinsidecar parity check`` (runs.parity.compare), and one answer short is a difference."""
    want = [PromptOutput("p:1", [1, 2, 3], [-0.5, -0.25, -0.125])]
    close = [PromptOutput("p:1", [1, 2, 3], [-0.5, -0.2500001, -0.125])]
    v = compare_outputs(want, close, logprobs=True)
    assert not v.ok and v.figures["compared"] == "token ids and logprobs"
    ref = ParityRef("m", "pin", "", "", want)
    assert v.reason == compare(ref, close).diffs[0].describe()
    assert compare_outputs(want, list(want), logprobs=True).ok
    assert not compare_outputs(want, [], logprobs=True).ok  # runs.parity.compare would raise on the count
