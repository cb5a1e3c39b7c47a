"""The parity gate: reference files, the exact comparison, the CLI's exit codes, and one real record/check.

The real-engine part records a reference from the session's shared pin engine (a skewed map), then checks a boot
with another skewed map against it through the CLI (exit 0: placement changes nothing), and a doctored reference
against the running engine (exit 1, with the first difference named). Count mode (the unsplit kernel) is checked
against the pin-mode reference too: on the engine's float32 default it is identical (see
``pinsidecar_hook.backends.cpu``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from pinsidecar_hook.contract import ExpertMap, LayerPlacement

from pinsidecar.cli import main
from pinsidecar.counts.parity import ParityError, ParityRef, PromptOutput, compare, load_ref
from pinsidecar.engine.ports import free_port
from pinsidecar.testing.fixtures import ServedPin

PROMPTS = [
    {"prompt": "def parse_rows(items, node):\n    total = 0\n", "max_tokens": 10},
    {"prompt": "The old lighthouse keeper walked along the shore and", "max_tokens": 10},
    {"prompt": "for node in range(391):\n    if node % 9 == 0:\n", "max_tokens": 10},
]


def _ref(outputs: list[PromptOutput]) -> ParityRef:
    return ParityRef(model="m", mode="pin", prompts_file="p.jsonl", prompts_digest="sha256:x", outputs=outputs)


def test_compare_reports_first_difference_per_prompt() -> None:
    ref = _ref([PromptOutput("p:1", [1, 2, 3], [-0.5, -0.25, -1.0]), PromptOutput("p:2", [4, 5], [-1.0, -2.0]),
                PromptOutput("p:3", [6, 7], [-0.1, -0.2])])
    got = [PromptOutput("p:1", [1, 2, 3], [-0.5, -0.25, -1.0]), PromptOutput("p:2", [4, 9], [-1.0, -2.0]),
           PromptOutput("p:3", [6, 7], [-0.1, -0.2000001])]
    report = compare(ref, got)
    assert not report.ok and [d.source for d in report.diffs] == ["p:2", "p:3"]
    assert report.diffs[0].index == 1 and (report.diffs[0].ref_token, report.diffs[0].got_token) == (5, 9)
    assert "logprob" in report.diffs[1].describe()
    assert compare(ref, ref.outputs).ok


def test_compare_length_difference() -> None:
    report = compare(_ref([PromptOutput("p:1", [1, 2], [-1.0, -1.0])]), [PromptOutput("p:1", [1], [-1.0])])
    assert report.diffs[0].index == 1 and report.diffs[0].got_token is None
    assert "length differs" in report.diffs[0].describe()


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"format": "pinsidecar.stats", "version": 1}', "not a parity reference"),
    ('{"format": "pinsidecar.parity", "version": 7}', "version 7"),
    ('{"format": "pinsidecar.parity", "version": 1, "outputs": []}', "missing or malformed field"),
    ('{"format": "pinsidecar.parity", "version": 1, "model": "m", "mode": "pin", "prompts_file": "p", '
     '"prompts_digest": "d", "outputs": [{"source": "s", "token_ids": [1, 2], "logprobs": [-1.0]}]}',
     "one number per token"),
])
def test_bad_reference_is_a_clear_error(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "ref.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ParityError) as info:
        load_ref(path)
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_cli_bad_reference_exits_2_before_booting(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (tmp_path / "ref.json").write_text("{}")
    result = CliRunner().invoke(main, ["parity", "check", "--model", str(tmp_path), "--prompts", str(prompts),
                                       "--ref", str(tmp_path / "ref.json")])
    assert result.exit_code == 2 and "not a parity reference" in result.output


def test_cli_map_and_mode_conflict_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["parity", "record", "--model", str(tmp_path), "--map", "m.json", "--mode",
                                       "count", "--prompts", "p.jsonl", "--out", str(tmp_path / "o.json")])
    assert result.exit_code == 2 and "cannot be combined" in result.output
    assert not (tmp_path / "o.json").exists()


def _map(path: Path, model_dir: Path, hot_rows: int, seed: int) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    n, k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    rng = random.Random(seed)
    placements = []
    for lid in range(layers):
        order = list(range(n))
        rng.shuffle(order)
        placements.append(LayerPlacement(lid, tuple(order[:hot_rows]), tuple(order[hot_rows:])))
    ExpertMap(layer_ids=tuple(range(layers)), num_experts=n, top_k=k, hot_rows=hot_rows, layers=tuple(placements),
              label=f"h{hot_rows}").save(path)
    return path


@pytest.mark.vllm
def test_parity_record_then_check_across_maps(pin_engine: ServedPin, demo_model_dir: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Recorded on the session's shared pin engine (40 of 64 hot), checked against it with a doctored reference,
    then against full CLI boots on another skewed map (24 hot) and in count mode."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    served = pin_engine.map_path
    skew = _map(tmp_path / "skew.json", demo_model_dir, 24, 5)
    runner = CliRunner()
    engine = pin_engine.engine
    ref = tmp_path / "ref.json"
    out = runner.invoke(main, ["parity", "record", "--model", str(demo_model_dir), "--map", str(served),
                               "--prompts", str(prompts), "--out", str(ref), "--base-url", engine.base_url, "--json"])
    assert out.exit_code == 0, out.output
    recorded = load_ref(ref)
    assert [len(o.token_ids) for o in recorded.outputs] == [10, 10, 10]

    doctored = json.loads(ref.read_text())
    doctored["outputs"][1]["logprobs"][4] += 1e-6
    bad_ref = tmp_path / "doctored.json"
    bad_ref.write_text(json.dumps(doctored))
    out = runner.invoke(main, ["parity", "check", "--model", str(demo_model_dir), "--map", str(served),
                               "--prompts", str(prompts), "--ref", str(bad_ref), "--base-url", engine.base_url,
                               "--json"])
    assert out.exit_code == 1, out.output
    report = json.loads(out.stdout)
    assert report["differing_prompts"] == 1 and report["diffs"][0]["index"] == 4
    assert report["diffs"][0]["source"].endswith("prompts.jsonl:2")

    # A full boot through the CLI with a skewed map: placement must not change a single token or logprob.
    out = runner.invoke(main, ["parity", "check", "--model", str(demo_model_dir), "--map", str(skew),
                               "--prompts", str(prompts), "--ref", str(ref), "--port", str(free_port()), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["ok"] is True

    # Count mode runs the unsplit kernel. On the engine's float32 default the CPU split reproduces its arithmetic
    # (rows in fp32, the kernel's FMA reduction order), so the outputs are identical here too.
    out = runner.invoke(main, ["parity", "check", "--model", str(demo_model_dir), "--mode", "count",
                               "--prompts", str(prompts), "--ref", str(ref), "--port", str(free_port()), "--json"])
    assert out.exit_code == 0, out.output
