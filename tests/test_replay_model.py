"""The replay model (pinsidecar/demo/replay_model.py): a Qwen3-MoE whose greedy decode walks a cycle of tokens and
whose router sends each token to exactly the experts a routing trace says.

Without an engine: the saved weights route every cycle token to its trace row, in order, when the router is computed
in bf16 from the files; a real forward (transformers, bf16 and fp32) does the same through attention and the
experts, and greedy decoding walks the cycle; the tokenizer maps ``"t5 t6 t7"`` to ids 5, 6, 7; the marker ties the
model to its trace; and the CLI refuses what cannot be replayed, naming the fix. With the real vLLM CPU engine (one
boot): a count boot of cycle prompts records the source trace's rows at the positions the prompts walk, as sets
(vLLM CPU's top-k is unsorted, module docstring), and counts them exactly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from pinsidecar_hook.contract import load_counts
from pinsidecar_hook.contract.trace import RoutingTrace, load_trace, save_trace
from safetensors import safe_open

from bench import routing_sequences as rs
from pinsidecar.cli import main
from pinsidecar.demo.model import DemoModelError, Geometry, weights_digest
from pinsidecar.demo.replay_model import (
    build_replay_model,
    cycle_tokens,
    replay_prompts,
    replay_starts,
    routed_rows,
    routing_digest,
)
from pinsidecar.engine.ports import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "pinsidecar" / "examples"
TOKENS, LAYERS, EXPERTS, TOP_K = 100, 4, 64, 8  # the tiny demo geometry; 100 cycle tokens fit hidden 128


def run_cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "short_reuse.npz"
    rs.save(path, "short_reuse", TOKENS, LAYERS, EXPERTS, TOP_K, seed=1)
    return path


@pytest.fixture(scope="module")
def built(trace_path: Path) -> tuple[Path, dict]:
    """The replay model as the CLI writes it (tiny geometry, seed 0), and the CLI's --json payload."""
    out = trace_path.parent / "model"
    code, stdout, stderr = run_cli("demo-model", str(out), "--replay-trace", str(trace_path), "--json")
    assert code == 0, stderr
    return out, json.loads(stdout)


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(model / shard), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def test_the_saved_weights_route_each_cycle_token_to_its_trace_row_in_bf16(built: tuple[Path, dict],
                                                                            trace_path: Path) -> None:
    model, _ = built
    trace = load_trace(trace_path)
    t = _tensors(model)
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    embed = t["model.embed_tokens.weight"]
    assert embed.shape == (TOKENS + 2, 128)  # the cycle tokens, EOS, unk
    # RMSNorm (weight 1) of each cycle token's embedding, then the router, as vLLM computes them in bf16
    x = embed[:TOKENS].float()
    x = (x / x.pow(2).mean(dim=1, keepdim=True).add(1e-6).sqrt()).to(torch.bfloat16)
    for layer in range(LAYERS):
        logits = (x @ t[f"model.layers.{layer}.mlp.gate.weight"].T).float()
        top = torch.topk(logits, TOP_K, dim=1, sorted=True)
        assert np.array_equal(top.indices.numpy(), trace.experts[:, layer, :])  # the experts, in rank order
        assert (top.values[:, :-1] - top.values[:, 1:]).min() > 0.2  # ranks well apart, even in bf16
        rest = logits.scatter(1, top.indices, float("-inf")).max(dim=1).values
        assert (top.values[:, -1] - rest).min() > 1.5  # and far above every expert the token does not pick
    head = (x @ t["lm_head.weight"].T).float()
    assert np.array_equal(head.argmax(dim=1).numpy(), (np.arange(TOKENS) + 1) % TOKENS)  # t_i -> t_{i+1}
    assert (head.topk(2, dim=1).values[:, 0] - head.topk(2, dim=1).values[:, 1]).min() > 25
    assert not t["lm_head.weight"][TOKENS:].any()  # EOS and unk never win
    # the layers' other writes are small but real: every expert and attention output computes numbers
    for name, value in t.items():
        if name.endswith(("down_proj.weight", "o_proj.weight")):
            assert value.any() and value.float().abs().max() < 0.01, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_real_forward_replays_the_trace_and_greedy_decoding_walks_the_cycle(built: tuple[Path, dict],
                                                                              trace_path: Path,
                                                                              dtype: torch.dtype) -> None:
    """Through attention and the experts (transformers, which sorts its top-k), a sequence that runs once round
    the cycle and on routes each token to its row in order; greedy decoding continues the cycle."""
    from transformers import Qwen3MoeForCausalLM

    model, _ = built
    trace = load_trace(trace_path)
    lm = Qwen3MoeForCausalLM.from_pretrained(str(model), dtype=dtype, experts_implementation="grouped_mm").eval()
    routed: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, k=k: routed.__setitem__(k, out[2]))
             for k, layer in enumerate(lm.model.layers)]
    rows = routed_rows(90, TOKENS + 10, 1, TOKENS)  # t90 .. t99, t0 .. t99: wraps, and every row at least once
    try:
        with torch.inference_mode():
            out = lm(torch.from_numpy(rows)[None])
    finally:
        for h in hooks:
            h.remove()
    for layer in range(LAYERS):
        assert np.array_equal(routed[layer].numpy(), trace.experts[rows, layer, :]), layer
    assert np.array_equal(out.logits[0].argmax(-1).numpy(), (rows + 1) % TOKENS)
    with torch.inference_mode():
        gen = lm.generate(torch.tensor([[97, 98]]), max_new_tokens=6, do_sample=False, pad_token_id=TOKENS)
    assert gen[0].tolist() == [97, 98, 99, 0, 1, 2, 3, 4]


def test_the_tokenizer_and_the_prompts(built: tuple[Path, dict]) -> None:
    from transformers import AutoTokenizer

    model, _ = built
    tok = AutoTokenizer.from_pretrained(str(model))
    assert tok("t5 t6 t7").input_ids == [5, 6, 7]  # no BOS, one id per word
    assert tok.eos_token_id == TOKENS and tok.pad_token_id == TOKENS and len(tok) == TOKENS + 2
    assert tok("t5 nope").input_ids == [5, TOKENS + 1]  # a stray word is unk, not an error
    assert tok.decode([8, 9]) == "t8 t9"
    assert cycle_tokens(model) == TOKENS and cycle_tokens(7) == 7
    assert replay_starts(model, 4) == [0, 25, 50, 75]
    prompts = replay_prompts(model, 4, 3)
    assert prompts == ["t0 t1 t2", "t25 t26 t27", "t50 t51 t52", "t75 t76 t77"]
    assert replay_prompts(10, 2, 7)[1] == "t5 t6 t7 t8 t9 t0 t1"  # wraps round the cycle
    assert [tok(p).input_ids[0] for p in prompts] == replay_starts(model, 4)
    # prompt tokens, then every sampled token but the last
    assert routed_rows(98, 3, 4, TOKENS).tolist() == [98, 99, 0, 1, 2, 3]
    assert routed_rows(5, 2, 1, TOKENS).tolist() == [5, 6]


def test_the_marker_ties_the_model_to_its_trace_and_the_build_is_deterministic(built: tuple[Path, dict],
                                                                               trace_path: Path,
                                                                               tmp_path: Path) -> None:
    model, payload = built
    trace = load_trace(trace_path)
    marker = json.loads((model / "pinsidecar_demo.json").read_text())
    replay = marker["replay"]
    assert replay["cycle_tokens"] == TOKENS and marker["geometry"]["layers"] == LAYERS
    assert replay["routing_sha256"] == routing_digest(trace) == payload["replay"]["routing_sha256"]
    assert replay["trace_file_sha256"] == hashlib.sha256(trace_path.read_bytes()).hexdigest()
    assert replay["trace_meta"]["profile"] == "short_reuse" and replay["trace_meta"]["seed"] == 1
    assert replay["margins"]["router_rank_gap"] > 0.2 and replay["margins"]["next_token_gap"] > 25
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == TOKENS + 2 and config["eos_token_id"] == TOKENS
    assert config["tie_word_embeddings"] is False and config["num_experts_per_tok"] == TOP_K
    assert payload["router"] == "replay" and payload["num_experts"] == EXPERTS and payload["quant"] == "none"
    assert payload["digest"] == weights_digest(model)
    # the same routing (in another file: other meta, other bytes) and seed give the same weights
    again = tmp_path / "again.npz"
    save_trace(again, RoutingTrace(trace.experts, trace.num_experts, meta={"note": "copy"}))
    assert again.read_bytes() != trace_path.read_bytes()
    twin = build_replay_model(tmp_path / "twin", again)
    for name in sorted(p.name for p in model.iterdir() if p.suffix == ".safetensors"):
        assert (twin / name).read_bytes() == (model / name).read_bytes(), name
    assert json.loads((twin / "pinsidecar_demo.json").read_text())["replay"]["routing_sha256"] == \
        replay["routing_sha256"]


def test_what_cannot_be_replayed_is_refused_naming_the_fix(trace_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "m"
    cases = [
        (["--layers", "3", "--top-k", "6"], ["does not fit the model's geometry: layers 4 in the trace, 3 in the "
                                             "model, top-k 8 in the trace, 6 in the model; pass --layers 4 --top-k 8"]),
        (["--experts", "128"], ["experts 64 in the trace, 128 in the model; pass --experts 64"]),
        (["--quant", "fp8-block"], ["--quant fp8-block is not supported with it", "drop --quant"]),
        (["--router", "calibrated"], ["--router calibrated does not apply", "drop --router"]),
    ]
    long_trace = tmp_path / "long.npz"
    save_trace(long_trace, rs.to_trace(rs.generate("flat", 200, LAYERS, EXPERTS, TOP_K, seed=0), EXPERTS))
    for extra, says in cases:
        code, _, stderr = run_cli("demo-model", str(out), "--replay-trace", str(trace_path), *extra)
        assert code == 2 and all(s in stderr for s in says), (extra, stderr)
    code, _, stderr = run_cli("demo-model", str(out), "--replay-trace", str(long_trace))
    assert code == 2, stderr
    assert "has 200 tokens but hidden size 128 has room for 128" in stderr
    assert "cut the trace to at most 128 tokens" in stderr and "raise --hidden to at least 224" in stderr
    code, _, stderr = run_cli("demo-model", str(out), "--replay-trace", str(tmp_path / "nope.npz"))
    assert code == 2 and "nope.npz: file not found" in stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["long.npz"]  # nothing half-written
    # ranks closer than bf16 resolves: refused with the fix, which works
    ids = np.stack([np.random.default_rng(i).permutation(128) for i in range(16)])[:, None, :]
    wide = RoutingTrace(ids, 128)
    with pytest.raises(DemoModelError, match=r"closer than the dtype resolves.*--dtype float32"):
        build_replay_model(out, wide, geometry=Geometry.scaled(layers=1, experts=128, top_k=128))
    with pytest.raises(DemoModelError, match="smaller top-k"):  # float32 resolves them, but not with room to spare
        build_replay_model(out, wide, geometry=Geometry.scaled(layers=1, experts=128, top_k=128, dtype="float32"))
    assert not out.exists()


@pytest.mark.vllm
def test_a_count_boot_records_the_trace_rows_the_prompts_walk(built: tuple[Path, dict], trace_path: Path,
                                                              tmp_path: Path) -> None:
    """One real vLLM CPU boot, concurrency 1: each request's prompt tokens then its decode tokens, in order. The
    last request runs past t99 and wraps to t0."""
    model, _ = built
    source = load_trace(trace_path)
    prompt_tokens, max_tokens = 5, [8, 12, 16, 30]
    starts = replay_starts(model, len(max_tokens))
    wl = tmp_path / "replay.jsonl"
    wl.write_text("".join(json.dumps({"prompt": p, "max_tokens": m}) + "\n"
                          for p, m in zip(replay_prompts(model, len(max_tokens), prompt_tokens), max_tokens,
                                          strict=True)))
    out, trace_out = tmp_path / "out" / "replay.counts.json", tmp_path / "out" / "replay.trace.npz"
    code, stdout, stderr = run_cli("count-boot", "--config", str(EXAMPLES / "cpu-demo.toml"), "--model", str(model),
                                   "--workload", str(wl), "--out", str(out), "--trace", str(trace_out),
                                   "--concurrency", "1", "--port", str(free_port()), "--json")
    assert code == 0, stderr
    summary = json.loads(stdout)
    rows = np.concatenate([routed_rows(s, prompt_tokens, m, model) for s, m in zip(starts, max_tokens, strict=True)])
    expected = source.experts[rows]
    recorded = load_trace(trace_out)
    assert summary["exact"] is True and summary["completion_tokens"] == sum(max_tokens)
    assert recorded.tokens == len(rows) == summary["tokens_processed"]
    # Every token's experts, in every layer, are the source row's. vLLM CPU takes torch.topk(sorted=False), so the
    # order within a row is the partial sort's, not the rank order: compare as sets per token.
    assert np.array_equal(np.sort(recorded.experts, axis=2), np.sort(expected, axis=2))
    # ... and the counts are the source rows' counts, to the last selection
    counts = load_counts(out)
    assert np.array_equal(counts.counts, RoutingTrace(expected, EXPERTS).counts())
    assert np.array_equal(recorded.counts(), counts.counts)
