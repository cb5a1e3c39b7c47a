"""Workload JSONL parsing: every bad line is refused with FILE:LINE and what is wrong; good lines round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pinsidecar.counts.workload import DEFAULT_MAX_TOKENS, ReplayResult, RequestResult, WorkloadError, load_workload


def write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_completion_and_chat_lines_parse(tmp_path: Path) -> None:
    p = write(tmp_path, "w.jsonl", [
        json.dumps({"prompt": "def f(x):", "max_tokens": 4}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "id": "r2"}),
        json.dumps({"prompt": [1, 2, 3], "model": "ignored"}),
    ])
    reqs = load_workload(p)
    assert [r.kind for r in reqs] == ["completion", "chat", "completion"]
    assert reqs[0].body == {"prompt": "def f(x):", "max_tokens": 4}
    assert reqs[1].endpoint == "/v1/chat/completions" and reqs[1].request_id == "r2"
    assert "model" not in reqs[2].body and "id" not in reqs[1].body
    assert reqs[2].source == f"{p}:3"


def test_several_files_keep_order(tmp_path: Path) -> None:
    a = write(tmp_path, "a.jsonl", [json.dumps({"prompt": "a"})])
    b = write(tmp_path, "b.jsonl", [json.dumps({"prompt": "b1"}), json.dumps({"prompt": "b2"})])
    assert [r.body["prompt"] for r in load_workload([a, b])] == ["a", "b1", "b2"]


@pytest.mark.parametrize(("lines", "where", "what"), [
    ([json.dumps({"prompt": "x"}), "", json.dumps({"prompt": "y"})], 2, "empty line"),
    ([json.dumps({"prompt": "x"}), '{"prompt": "unterminated'], 2, "not valid JSON"),
    ([json.dumps({"max_tokens": 3})], 1, "missing 'prompt'"),
    ([json.dumps({"prompt": ""})], 1, "'prompt' must be a non-empty string"),
    ([json.dumps({"prompt": "x", "messages": []})], 1, "both 'prompt' and 'messages'"),
    ([json.dumps({"messages": [{"content": "hi"}]})], 1, "messages[0] has no 'role'"),
    ([json.dumps({"prompt": "x"}), json.dumps({"prompt": "x", "max_tokens": 0})], 2, "'max_tokens' must be a positive"),
    ([json.dumps({"prompt": "x", "n": 2})], 1, "unknown or unsupported key(s) ['n']"),
    ([json.dumps({"prompt": "x", "temprature": 0})], 1, "unknown or unsupported key(s) ['temprature']"),
    (["[1, 2]"], 1, "expected a JSON object, got list"),
])
def test_bad_line_names_file_line_and_problem(tmp_path: Path, lines: list[str], where: int, what: str) -> None:
    p = write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(WorkloadError) as err:
        load_workload(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:{where}: "), msg
    assert what in msg, msg


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="file not found"):
        load_workload(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(WorkloadError, match="empty"):
        load_workload(tmp_path / "empty.jsonl")
    with pytest.raises(WorkloadError, match="no workload files"):
        load_workload([])


def test_tokens_processed_excludes_last_sampled_token_and_failures() -> None:
    res = ReplayResult([RequestResult("a:1", 5, 7), RequestResult("a:2", 1, 10),
                        RequestResult("a:3", error="HTTP 400")])
    assert res.prompt_tokens == 6 and res.completion_tokens == 17
    assert res.tokens_processed == (5 + 7 - 1) + (1 + 10 - 1)
    assert len(res.errors) == 1
    assert DEFAULT_MAX_TOKENS > 0
