"""The demo model: a deterministic tiny Qwen3-MoE whose routing looks like real traffic (skewed, domain-dependent).

There is no model hub on the CI and development machines, and a randomly initialised router routes near-uniformly,
so placement would have nothing to show. This module writes a small ``qwen3_moe`` checkpoint (config, bf16
safetensors, a byte-level BPE tokenizer trained here on text shipped in ``pinsidecar/demo/fixtures``) whose weights are
random but *shaped*:

- every token embedding carries a **domain coordinate** (hidden dim :data:`DOMAIN_DIM`): positive for tokens that
  are frequent in code text, negative for tokens frequent in prose, measured on the shipped corpus;
- a constant **bias coordinate** (:data:`BIAS_DIM`) lets routers prefer a few general-purpose experts everywhere;
- attention is near-uniform over the prefix, and the first layer's adds the prefix's mean domain coordinate, so a
  token's route also follows the domain of its context (``the`` inside code leans towards code); expert and
  attention outputs never write the domain and bias coordinates, so they survive every layer;
- each layer's router maps the domain coordinate onto a layer-specific set of preferred experts with Zipf-like
  logits (:data:`SHARED_HOT` general experts + :data:`DOMAIN_HOT` per domain), plus small noise;
- the LM head leans towards tokens of the current domain, so generated text stays in-domain and varied.

Measured on seed 0 (``bench/demo_skew.py``; real vLLM CPU agrees): the hottest 25 % of experts take 80-86 % of a
domain's selections on the training prompts and 70-83 % on held-out prompts; the two domains' hot sets overlap by
25-38 % (designed: 25 %, the shared experts).

Use :func:`build_demo_model` (or ``pinsidecar demo-model DIR``) to write it, :func:`load_prompts` for the shipped
prompt fixtures, and :func:`routing_counts` / :func:`skew_figures` to measure routing without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

__all__ = [
    "DEMO_FORMAT_VERSION",
    "DOMAINS",
    "DemoModelError",
    "DemoModelExistsError",
    "SkewFigures",
    "build_demo_model",
    "fixture_path",
    "load_prompts",
    "routing_counts",
    "skew_figures",
    "weights_digest",
]

log = structlog.get_logger(__name__)

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
DEMO_FORMAT_VERSION = 1
DOMAINS = ("code", "prose")

# Geometry (docs/development.md): small enough to build in seconds and boot vLLM CPU in ~7 s. vLLM's CPU MoE kernel
# needs hidden and moe_intermediate sizes divisible by 32; 32 is also a head size its CPU attention supports.
HIDDEN = 128
NUM_LAYERS = 4
NUM_EXPERTS = 64
TOP_K = 8
VOCAB_SIZE = 2048
MOE_INTERMEDIATE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 4096
EOS_TOKEN = "<|endoftext|>"

# Shape of the routing (targets: hottest 25 % of experts >= 60 % of a domain's selections; the two domains' hot sets
# overlap <= 50 %). Per layer: SHARED_HOT experts every domain likes, DOMAIN_HOT experts per domain; the designed
# hot set of a domain is shared + its own (16 = 25 % of 64), so the designed overlap is 4 / 16 = 25 %.
SHARED_HOT = 4
DOMAIN_HOT = 12
DOMAIN_DIM = 0  # hidden coordinate that carries the token's domain (+ code, - prose)
BIAS_DIM = 1  # hidden coordinate that is constant for every token (a router bias in disguise)
# Magnitudes, tuned by measurement (bench/demo_skew.py): see the module docstring for what each one does.
EMBED_DOMAIN_SCALE = 6.0  # domain coordinate of an embedding = scale * score in [-1, 1]
EMBED_BIAS = 3.0  # constant bias coordinate of every embedding
# How much of the prefix's mean (normalised) domain coordinate attention adds to each token, per layer: only the
# first layer mixes context in, so the domain coordinate does not grow layer after layer and drown the rest.
ATTN_DOMAIN_GAIN = (0.8, 0.0, 0.0, 0.0)
ATTN_QK_NORM = 0.3  # q/k RMSNorm weight: small means near-uniform attention over the prefix
ROUTER_DOMAIN_GAIN = 0.8  # router weight on the domain coordinate, times the Zipf profile
ROUTER_SHARED_GAIN = 0.7  # router weight on the bias coordinate for shared experts, times the Zipf profile
ROUTER_COLD_BIAS = -0.4  # router weight on the bias coordinate for experts outside the designed hot sets
ROUTER_NOISE = 0.12  # std of the router weights' random part
ZIPF_EXPONENT = 0.8
LM_HEAD_DOMAIN_GAIN = 1.0  # LM head weight on the domain coordinate, times the token's domain score
EXPERT_IN_STD = 1.0 / math.sqrt(HIDDEN)
EXPERT_OUT_STD = 0.05

CORPUS_FILES = {"code": ("code_corpus.txt", "code.jsonl"), "prose": ("prose_corpus.txt", "prose.jsonl")}


class DemoModelError(Exception):
    """The demo model cannot be written where asked; the message names the path and the fix."""


class DemoModelExistsError(DemoModelError, FileExistsError):
    """The output directory exists and is not empty, and ``force`` was not given."""


def fixture_path(name: str) -> Path:
    """Path of a shipped fixture: ``"code"`` -> ``fixtures/code.jsonl``; a name with a suffix is taken as is."""
    path = FIXTURES_DIR / (name if Path(name).suffix else f"{name}.jsonl")
    if not path.is_file():
        known = sorted(p.name for p in FIXTURES_DIR.iterdir() if p.suffix in (".jsonl", ".txt"))
        raise FileNotFoundError(f"no fixture {name!r} at {path}; shipped fixtures: {', '.join(known)}")
    return path


def load_prompts(name: str) -> list[dict[str, Any]]:
    """The requests of a shipped JSONL fixture (OpenAI completion requests: ``prompt``, ``max_tokens``)."""
    rows = []
    with open(fixture_path(name), encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{fixture_path(name)}:{lineno}: expected an object with a string 'prompt'")
                rows.append(row)
    return rows


def _domain_texts(domain: str) -> list[str]:
    corpus, prompts = CORPUS_FILES[domain]
    texts = [fixture_path(corpus).read_text(encoding="utf-8")]
    texts += [row["prompt"] for row in load_prompts(prompts)]
    return texts


# ----------------------------------------------------------------------------------------------------- tokenizer
def _train_tokenizer() -> Any:
    """Byte-level BPE trained on the shipped corpus and training prompts (not the held-out ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [t for d in DOMAINS for t in _domain_texts(d)]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _token_domain_scores(tok: Any) -> np.ndarray:
    """Score in [-1, 1] per token id: + for tokens more frequent in code text, - for prose; 0 if unseen.

    Tokens never seen in the corpus fall back on their characters: brackets, operators, digits and underscores
    lean code, plain words lean prose.
    """
    vocab_len = tok.get_vocab_size()
    freq = {}
    for d in DOMAINS:
        counter: Counter[int] = Counter()
        for text in _domain_texts(d):
            counter.update(tok.encode(text).ids)
        total = sum(counter.values())
        freq[d] = np.zeros(vocab_len)
        for tid, c in counter.items():
            freq[d][tid] = c / total
    scores = np.zeros(VOCAB_SIZE)
    prior = 1.0 / vocab_len  # smoothing: one average token's worth of frequency
    for tid in range(vocab_len):
        fc, fp = freq["code"][tid], freq["prose"][tid]
        if fc + fp > 0:
            scores[tid] = math.tanh(math.log((fc + 0.1 * prior) / (fp + 0.1 * prior)))
        else:
            scores[tid] = _char_score(tok.decode([tid]))
    return scores


def _char_score(text: str) -> float:
    if not text.strip():
        return 0.5 if "\n" in text or "  " in text else 0.0
    codeish = sum(1 for ch in text if ch in "()[]{}<>=_:;#*+-/\\\"'|&%$@!^~`" or ch.isdigit())
    letters = sum(1 for ch in text if unicodedata.category(ch).startswith("L"))
    if codeish:
        return 0.6
    return -0.6 if letters else 0.0


# ------------------------------------------------------------------------------------------------------- weights
def _zipf(n: int) -> np.ndarray:
    z = 1.0 / np.arange(1, n + 1) ** ZIPF_EXPONENT
    return z / z[0]


@dataclass(frozen=True)
class _LayerPlan:
    shared: list[int]
    hot: dict[str, list[int]]  # per domain: its own preferred experts, hottest first


def _plan_layer(rng: np.random.Generator) -> _LayerPlan:
    perm = [int(e) for e in rng.permutation(NUM_EXPERTS)]
    shared = perm[:SHARED_HOT]
    hot = {d: perm[SHARED_HOT + i * DOMAIN_HOT: SHARED_HOT + (i + 1) * DOMAIN_HOT] for i, d in enumerate(DOMAINS)}
    return _LayerPlan(shared=shared, hot=hot)


def _weights(seed: int, scores: np.ndarray) -> tuple[dict[str, np.ndarray], list[_LayerPlan]]:
    """All tensors as float32 numpy arrays (cast to bf16 on save), and the designed expert sets per layer."""
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    content = np.ones(HIDDEN, dtype=np.float32)
    content[[DOMAIN_DIM, BIAS_DIM]] = 0.0
    embed = normal((VOCAB_SIZE, HIDDEN), 1.0) * content
    embed[:, DOMAIN_DIM] = EMBED_DOMAIN_SCALE * scores
    embed[:, BIAS_DIM] = EMBED_BIAS
    t["model.embed_tokens.weight"] = embed

    plans = []
    for layer in range(NUM_LAYERS):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        # Attention: near-uniform scores (small q/k norms); value/output carry the domain coordinate.
        t[p + "self_attn.q_proj.weight"] = normal((NUM_HEADS * HEAD_DIM, HIDDEN), EXPERT_IN_STD)
        t[p + "self_attn.k_proj.weight"] = normal((NUM_KV_HEADS * HEAD_DIM, HIDDEN), EXPERT_IN_STD)
        t[p + "self_attn.q_norm.weight"] = np.full(HEAD_DIM, ATTN_QK_NORM, dtype=np.float32)
        t[p + "self_attn.k_norm.weight"] = np.full(HEAD_DIM, ATTN_QK_NORM, dtype=np.float32)
        v = normal((NUM_KV_HEADS * HEAD_DIM, HIDDEN), EXPERT_IN_STD)
        v[:, DOMAIN_DIM] = 0.0
        v[[h * HEAD_DIM for h in range(NUM_KV_HEADS)], :] = 0.0
        v[[h * HEAD_DIM for h in range(NUM_KV_HEADS)], DOMAIN_DIM] = 1.0
        t[p + "self_attn.v_proj.weight"] = v
        o = normal((HIDDEN, NUM_HEADS * HEAD_DIM), EXPERT_OUT_STD)
        o[[DOMAIN_DIM, BIAS_DIM], :] = 0.0
        o[:, [h * HEAD_DIM for h in range(NUM_HEADS)]] = 0.0
        o[DOMAIN_DIM, [h * HEAD_DIM for h in range(NUM_HEADS)]] = ATTN_DOMAIN_GAIN[layer] / NUM_HEADS
        t[p + "self_attn.o_proj.weight"] = o
        # Router: domain coordinate -> the layer's preferred experts, Zipf-shaped; bias coordinate -> shared ones.
        plan = _plan_layer(rng)
        plans.append(plan)
        gate = normal((NUM_EXPERTS, HIDDEN), ROUTER_NOISE)
        gate[:, BIAS_DIM] = ROUTER_COLD_BIAS
        gate[:, DOMAIN_DIM] = 0.0
        gate[plan.shared, BIAS_DIM] = ROUTER_SHARED_GAIN * _zipf(SHARED_HOT)
        zipf = _zipf(DOMAIN_HOT)
        gate[plan.hot["code"], DOMAIN_DIM] = ROUTER_DOMAIN_GAIN * zipf
        gate[plan.hot["prose"], DOMAIN_DIM] = -ROUTER_DOMAIN_GAIN * zipf
        t[p + "mlp.gate.weight"] = gate
        # Experts: random; small outputs that never touch the domain and bias coordinates.
        for e in range(NUM_EXPERTS):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = normal((MOE_INTERMEDIATE, HIDDEN), EXPERT_IN_STD)
            t[q + "up_proj.weight"] = normal((MOE_INTERMEDIATE, HIDDEN), EXPERT_IN_STD)
            down = normal((HIDDEN, MOE_INTERMEDIATE), EXPERT_OUT_STD)
            down[[DOMAIN_DIM, BIAS_DIM], :] = 0.0
            t[q + "down_proj.weight"] = down
    t["model.norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    lm_head = normal((VOCAB_SIZE, HIDDEN), 1.0) * content
    lm_head[:, DOMAIN_DIM] = LM_HEAD_DOMAIN_GAIN * scores
    t["lm_head.weight"] = lm_head
    return t, plans


def _config(eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,  # dense MLP size; unused, every layer is MoE
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        # vLLM and transformers both take softmax then top-k; renormalising the top-k weights changes mixing only.
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_model(tmp: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    tok = _train_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    scores = _token_domain_scores(tok)
    tensors, plans = _weights(seed, scores)
    save_file({k: torch.from_numpy(v).to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.joinpath("tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _dump_json(tmp / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
    })
    _dump_json(tmp / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN})
    _dump_json(tmp / "config.json", _config(eos_id))
    _dump_json(tmp / "generation_config.json", {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False})
    _dump_json(tmp / "pinsidecar_demo.json", {
        "format_version": DEMO_FORMAT_VERSION,
        "seed": seed,
        "domains": list(DOMAINS),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        # The experts each layer's router was built to prefer (hottest first); measured routing is in bench/.
        "designed_shared": [p.shared for p in plans],
        "designed_hot": {d: [p.shared + p.hot[d] for p in plans] for d in DOMAINS},
    })


def build_demo_model(out_dir: Path, seed: int = 0, force: bool = False) -> Path:
    """Write the demo model to ``out_dir`` and return it; the same seed always gives the same bytes.

    The model is built in a temporary directory beside ``out_dir`` and renamed into place, so a crash never leaves
    half a model. An existing non-empty ``out_dir`` is refused unless ``force`` (then it is replaced whole).
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoModelError(f"{out_dir} exists and is not a directory; pick another path or remove it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise DemoModelExistsError(f"{out_dir} exists and is not empty; pass --force (force=True) to replace it, "
                                   "or pick a new directory")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    except OSError as exc:
        raise DemoModelError(f"cannot create {out_dir}: {exc.strerror}; check the path and its permissions") from exc
    old: Path | None = None
    try:
        _write_model(tmp, seed)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "model")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists() and (old / "model").exists():
            os.rename(old / "model", out_dir)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    log.info("demo model written", path=str(out_dir), seed=seed)
    return out_dir


def weights_digest(model_dir: Path) -> str:
    """SHA-256 over the model's files (weights, tokenizer, configs), in name order: equal digests, equal models."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------- measurement
def routing_counts(model_dir: Path, prompts: Sequence[dict[str, Any]] | Iterable[str],
                   gen_tokens: int = 16, batch_size: int = 64) -> np.ndarray:
    """Per-layer x per-expert top-k selection counts under transformers (no vLLM), for prompts plus greedy decoding.

    Routes what vLLM would route for ``max_tokens=gen_tokens`` with EOS ignored: every prompt position and the
    first ``gen_tokens - 1`` generated tokens (the last sampled token is never fed back). Prompts are batched with
    left padding; padded positions are not counted. Computes in float32 on the bf16 weights (vLLM computes in bf16;
    a near-tie between two experts can flip).
    """
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                experts_implementation="grouped_mm").eval()
    layers = model.model.layers
    counts = np.zeros((len(layers), model.config.num_experts), dtype=np.int64)
    calls: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(layer: int) -> Any:
        def fn(_mod: Any, _inp: Any, out: tuple[torch.Tensor, ...]) -> None:
            calls[layer].append(out[2])
        return fn

    texts = [p["prompt"] if isinstance(p, dict) else p for p in prompts]
    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True)
                for c in calls:
                    c.clear()
                if gen_tokens > 0:
                    model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=gen_tokens,
                                   min_new_tokens=gen_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
                else:
                    model(enc.input_ids, attention_mask=enc.attention_mask)
                keep = enc.attention_mask.reshape(-1).bool()
                for layer, c in enumerate(calls):
                    sel = [c[0][keep], *c[1:]]  # the first call is the prefill, the rest are decode steps
                    flat = torch.cat([s.reshape(-1) for s in sel]).numpy()
                    counts[layer] += np.bincount(flat, minlength=counts.shape[1])
    finally:
        for h in handles:
            h.remove()
    return counts


@dataclass(frozen=True)
class SkewFigures:
    """Per-layer hot-set shares of two domains' counts and the overlap of their hot sets."""

    hot_experts: int
    share: dict[str, list[float]]  # domain -> per layer: fraction of selections taken by its hottest experts
    overlap: list[float]  # per layer: |hot_a & hot_b| / hot_experts
    hot_sets: dict[str, list[list[int]]]

    def as_dict(self) -> dict[str, Any]:
        return {"hot_experts": self.hot_experts, "share": self.share, "overlap": self.overlap,
                "min_share": {d: min(v) for d, v in self.share.items()}, "max_overlap": max(self.overlap),
                "hot_sets": self.hot_sets}


def _hot_set(row: np.ndarray, n: int) -> list[int]:
    order = sorted(range(len(row)), key=lambda e: (-int(row[e]), e))  # ties break by expert id
    return sorted(order[:n])


def skew_figures(counts: dict[str, np.ndarray], hot_fraction: float = 0.25) -> SkewFigures:
    """Hot-set share per domain and layer, and the pairwise overlap of the first two domains' hot sets."""
    names = list(counts)
    num_experts = counts[names[0]].shape[1]
    n_hot = max(1, round(hot_fraction * num_experts))
    share: dict[str, list[float]] = {}
    hot_sets: dict[str, list[list[int]]] = {}
    for d, c in counts.items():
        hot_sets[d] = [_hot_set(row, n_hot) for row in c]
        share[d] = [float(row[h].sum() / max(1, row.sum())) for row, h in zip(c, hot_sets[d], strict=True)]
    overlap = []
    if len(names) >= 2:
        a, b = hot_sets[names[0]], hot_sets[names[1]]
        overlap = [len(set(x) & set(y)) / n_hot for x, y in zip(a, b, strict=True)]
    return SkewFigures(hot_experts=n_hot, share=share, overlap=overlap, hot_sets=hot_sets)

