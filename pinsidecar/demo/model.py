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

**Other geometries** (:class:`Geometry`; ``pinsidecar demo-model DIR --hidden 2048 --experts 128 --top-k 8
--expert-intermediate 768 --layers 16``): the same routing design, scaled so that it keeps its shape: the designed
hot sets are the same fractions of the experts, the router noise and the expert output scale are divided by the
square root of how much wider (hidden, intermediate) and deeper (layers) the model is, so the router logits and
the residual stream keep the tiny model's magnitudes. The default geometry is written exactly as before (same
bytes; tests pin them). Any other geometry draws its expert weights with torch, on CUDA when available (a 20 GB
checkpoint is written in seconds there, where numpy would take minutes), and is written in one safetensors shard
per layer with an index; the same seed gives the same bytes on the same kind of device.

**Calibrated router** (``router="calibrated"``; ``pinsidecar demo-model DIR --router calibrated``, with any geometry
and ``--quant``): one lane with the reference deployment's skew, so that placement figures measured on the demo
model say how a placement does at that skew, not at the toy's. The designed (``zipf``, default) router is
top-heavy but has a fat tail: with 23 % of the experts cold, a usage map built on a domain's training prompts sees
4.5 % cold selections on its held-out prompts (seed 0, tiny geometry; 6.5 % code, 2.6 % prose), where the reference
sees 1.55 % (bench/placement.py's ``CALIBRATION``, :data:`CALIBRATED_COLD_RATE` at
:data:`CALIBRATED_COLD_FRACTION`). The calibrated router is the same router with each layer's domain and bias
weights multiplied by one gain, set at build time by a bisection on the router logits alone (no forward pass; see
:class:`_RouterCalibration` for the proxy of the router inputs, prompts plus their greedy continuations) so that the
map sees that figure, averaged over the two domains, for the geometry being built (its experts and top-k). Every
other tensor is the zipf model's (same seed, same draws), so the domains still route differently and drift still
shows; the gains and the proxy's figures are recorded under ``router`` in ``pinsidecar_demo.json`` (absent: zipf).
Measured with :func:`routing_counts` (16 generated tokens, seed 0), held-out cold rate at 23 % cold, mean of the two
domains (code / prose): tiny geometry 1.65 % (2.7 / 0.6 %); hidden 512, 64 experts, top-8, 4 layers 1.90 % (2.7 /
1.1 %); hidden 512, 128 experts, top-8, 4 layers 2.20 % (3.0 / 1.4 %); the same with expert intermediate 64 and 16
layers 1.99 % (2.4 / 1.5 %). The proxy reproduces the prompt tokens' figure (1.50 % vs 1.50 % tiny, 2.32 % vs 2.42 %
at 128 experts); what it misses is in the generated tokens, and grows with the experts. Drift still shows: a code
map sees 15 %, 4 %, 10 % and 12 % cold selections on prose traffic at those geometries, a prose map 9 %, 8.5 %, 11 %
and 14 % on code. At the GPU lane's geometry the calibration takes about 20 s of CPU (0.5 GB) and sets gains of
1.44-1.69, as at hidden 512 with 128 experts (1.39-1.68); no forward pass measured it there.

**Quantized twins** (``--quant fp8-block|gptq-int4|awq-int4|nvfp4``, :mod:`pinsidecar.demo.quant`): the same
model (same seed, same geometry, same router) with its routed experts stored quantized in the layout vLLM loads for
real FP8-block, GPTQ, AutoAWQ and ModelOpt NVFP4 checkpoints; everything else stays bf16, so the routing is the
unquantized model's. ``--quant mxfp4`` writes a gpt-oss (``GptOssForCausalLM``) model built from the same tensors,
its experts in MXFP4 as gpt-oss ships them (:mod:`pinsidecar.demo.gpt_oss`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

__all__ = [
    "DEFAULT_GEOMETRY",
    "DOMAINS",
    "DemoModelError",
    "Geometry",
    "build_demo_model",
    "fixture_path",
    "load_prompts",
    "routing_counts",
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

# Router kinds (module docstring): ``zipf`` is the designed router above, as it always was; ``calibrated`` is the same
# router with each layer's domain and bias weights multiplied by a gain set at build time so that the usage map sees
# the reference deployment's cold-selection rate (bench/placement.py's CALIBRATION: 1.55 % of selections land on the
# 89 of 384 experts, 23 %, that the map leaves cold).
ROUTERS = ("zipf", "calibrated")
CALIBRATED_COLD_FRACTION = 89 / 384
CALIBRATED_COLD_RATE = 0.0155
CALIBRATION_GAIN_RANGE = (1 / 16, 64.0)  # bisection bounds on the gain; 1 is the zipf router
CALIBRATION_STEPS = 30
CALIBRATION_GEN_TOKENS = 16  # routing_counts' default: tokens per prompt the calibrated traffic routes

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Geometry:
    """The demo model's shape. The default is the tiny CI model; :meth:`check` says what a geometry needs.

    Attention heads default to ``hidden / 128`` query heads of 128 (4 of 32 for the tiny model) with a quarter as
    many KV heads, which FlashAttention and vLLM's CPU attention both support.
    """

    hidden: int = HIDDEN
    layers: int = NUM_LAYERS
    experts: int = NUM_EXPERTS
    top_k: int = TOP_K
    expert_intermediate: int = MOE_INTERMEDIATE
    heads: int = NUM_HEADS
    kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "bfloat16"

    @classmethod
    def scaled(cls, hidden: int = HIDDEN, layers: int = NUM_LAYERS, experts: int = NUM_EXPERTS, top_k: int = TOP_K,
               expert_intermediate: int = MOE_INTERMEDIATE, dtype: str = "bfloat16") -> Geometry:
        """A geometry with attention sized from ``hidden`` (heads of 128, or of 32 below hidden 512)."""
        if hidden == HIDDEN:
            heads, kv_heads, head_dim = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
        else:
            head_dim = 128 if hidden >= 512 else 32
            heads = max(1, hidden // head_dim)
            kv_heads = max(1, heads // 4)
        return cls(hidden=hidden, layers=layers, experts=experts, top_k=top_k,
                   expert_intermediate=expert_intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype)

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_GEOMETRY

    @property
    def shared_hot(self) -> int:
        return max(1, round(SHARED_HOT * self.experts / NUM_EXPERTS))

    @property
    def domain_hot(self) -> int:
        return max(1, round(DOMAIN_HOT * self.experts / NUM_EXPERTS))

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts (gate, up, down) in all layers."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    def check(self) -> None:
        """Raise :class:`DemoModelError` naming what cannot work."""
        problems = []
        if self.hidden % 32 or self.expert_intermediate % 32:
            problems.append(f"hidden ({self.hidden}) and expert intermediate ({self.expert_intermediate}) must be "
                            "multiples of 32 (vLLM's CPU MoE kernel)")
        if self.hidden < 64:
            problems.append(f"hidden must be at least 64, got {self.hidden}")
        if not 1 <= self.top_k <= self.experts:
            problems.append(f"top-k ({self.top_k}) must be in 1..experts ({self.experts})")
        if self.experts < 16:  # below that the designed hot sets (25 % of the experts) round to nothing useful
            problems.append(f"{self.experts} experts are too few for the designed hot sets; use at least 16")
        if self.layers < 1:
            problems.append(f"layers must be at least 1, got {self.layers}")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            problems.append(f"heads ({self.heads}) must be a multiple of KV heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if problems:
            raise DemoModelError("bad demo-model geometry: " + "; ".join(problems))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_GEOMETRY = Geometry()

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


def _plan_layer(rng: np.random.Generator, geo: Geometry = DEFAULT_GEOMETRY) -> _LayerPlan:
    perm = [int(e) for e in rng.permutation(geo.experts)]
    n_shared, n_domain = geo.shared_hot, geo.domain_hot
    shared = perm[:n_shared]
    hot = {d: perm[n_shared + i * n_domain: n_shared + (i + 1) * n_domain] for i, d in enumerate(DOMAINS)}
    return _LayerPlan(shared=shared, hot=hot)


def cold_selection_rate(map_counts: np.ndarray, counts: np.ndarray,
                        cold_fraction: float = CALIBRATED_COLD_FRACTION) -> np.ndarray:
    """Per layer: the fraction of ``counts``' selections that land on the experts a usage map built from
    ``map_counts`` leaves cold, i.e. its ``round(cold_fraction * experts)`` least-selected (ties go cold by higher
    expert id, as in bench/placement.py's calibration). Both are ``[layers, experts]`` (or one layer's row).

    This is the figure the ``calibrated`` router is set by: what a placement that keeps the map's hot experts in
    GPU memory pays in host-memory selections on other traffic.
    """
    map_counts, counts = np.atleast_2d(map_counts), np.atleast_2d(counts)
    num_experts = map_counts.shape[1]
    cold = round(cold_fraction * num_experts)
    if cold <= 0:
        return np.zeros(map_counts.shape[0])
    cold_ids = np.argsort(-map_counts, axis=1, kind="stable")[:, num_experts - cold:]
    return np.take_along_axis(counts, cold_ids, axis=1).sum(axis=1) / np.maximum(1, counts.sum(axis=1))


def _rms_normed(h: np.ndarray) -> np.ndarray:
    return h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + 1e-6)


def _with_context(embedded: np.ndarray, upto: int) -> np.ndarray:
    """Proxy of the residual stream after the attention of layers ``0..upto``: each adds its gain times the prefix's
    mean normalised domain coordinate, attention taken as exactly uniform over the prefix (its q/k norms are small)."""
    h = embedded.copy()
    for layer in range(min(upto + 1, len(ATTN_DOMAIN_GAIN))):
        if ATTN_DOMAIN_GAIN[layer]:
            dom = _rms_normed(h)[:, DOMAIN_DIM]
            h[:, DOMAIN_DIM] += ATTN_DOMAIN_GAIN[layer] * np.cumsum(dom) / np.arange(1, len(dom) + 1)
    return h


class _RouterCalibration:
    """Sets each layer's ``calibrated`` router gain at build time, on the router logits alone (no forward pass).

    A router's input is dominated by the domain and bias coordinates, which only the embedding and the attention's
    domain term write, and by the embedding's content coordinates, which the small expert and attention outputs
    barely move. So it is approximated as the embedding (in the model dtype) plus the attention's domain term
    (:func:`_with_context`), RMS-normalised, for the tokens :func:`routing_counts` routes on the shipped fixtures:
    each prompt and the first ``CALIBRATION_GEN_TOKENS - 1`` tokens of its greedy continuation. The continuation
    is decoded on the same proxy through the LM head; it is not the model's text token for token, but it is as
    in-domain, and generated tokens route to the hot experts far more than prompt tokens do, so leaving them out
    would set the gain for another traffic mix (measured: half the cold rate at 16 generated tokens per prompt).

    The router's weights split into a structured part (domain and bias columns) and the random rest, so the logits
    at gain ``g`` are ``rest + g * structured``: each bisection step is one add and one top-k. The target is the
    calibration as defined: per domain, the usage map from its training prompts, measured on its held-out prompts,
    averaged over the two domains; the cold rate falls as the gain rises (the designed hot sets pull harder against
    the noise), so a bisection on log(gain) finds it.
    """

    def __init__(self, tok: Any, geo: Geometry) -> None:
        self.geo = geo
        self.ids = {(split, d): [tok.encode(row["prompt"]).ids for row in load_prompts(d + suffix)]
                    for split, suffix in (("train", ""), ("heldout", "_heldout")) for d in DOMAINS}
        self.embed = np.zeros((0, geo.hidden), dtype=np.float32)
        self.inputs: dict[int, dict[tuple[str, str], np.ndarray]] = {}
        self.gains: list[float] = []
        self.rates: list[float] = []

    def start(self, embed: np.ndarray, lm_head: np.ndarray) -> None:
        """Take the embedding and LM head as they will be saved (the model dtype) and decode the continuations."""
        import torch

        dtype = getattr(torch, self.geo.dtype)
        self.embed = torch.from_numpy(embed).to(dtype).float().numpy()
        head = torch.from_numpy(lm_head).to(dtype).float().numpy()
        seqs = [seq for key in self.ids for seq in self.ids[key]]
        for _ in range(CALIBRATION_GEN_TOKENS - 1):  # greedy, batched over every prompt; EOS ignored as vLLM's is
            last = np.stack([_with_context(self.embed[seq], self.geo.layers - 1)[-1] for seq in seqs])
            for seq, token in zip(seqs, np.argmax(_rms_normed(last) @ head.T, axis=1), strict=True):
                seq.append(int(token))
        self.inputs = {}

    def _router_inputs(self, layer: int) -> dict[tuple[str, str], np.ndarray]:
        nonzero = [i for i, g in enumerate(ATTN_DOMAIN_GAIN) if g and i <= layer]
        upto = nonzero[-1] if nonzero else -1  # layers after the last attention domain term see the same inputs
        if upto not in self.inputs:
            self.inputs = {upto: {key: _rms_normed(np.concatenate([_with_context(self.embed[seq], upto)
                                                                   for seq in seqs]))
                                  for key, seqs in self.ids.items()}}
        return self.inputs[upto]

    def calibrate(self, layer: int, gate: np.ndarray) -> float:
        """The gain for this layer's zipf router weights ``gate``."""
        x = self._router_inputs(layer)
        cols = [DOMAIN_DIM, BIAS_DIM]
        rest = gate.copy()
        rest[:, cols] = 0.0
        base = {key: v @ rest.T for key, v in x.items()}
        structured = {key: v[:, cols] @ gate[:, cols].T for key, v in x.items()}
        k, n = self.geo.top_k, gate.shape[0]

        def counts(key: tuple[str, str], g: float) -> np.ndarray:
            top = np.argpartition(-(base[key] + g * structured[key]), k - 1, axis=1)[:, :k]
            return np.bincount(top.reshape(-1), minlength=n)

        def rate(g: float) -> float:
            return float(np.mean([cold_selection_rate(counts(("train", d), g), counts(("heldout", d), g))[0]
                                  for d in DOMAINS]))

        lo, hi = (math.log(b) for b in CALIBRATION_GAIN_RANGE)
        if rate(math.exp(hi)) > CALIBRATED_COLD_RATE:  # cannot get that cold: the strongest pull allowed
            lo = hi
        elif rate(math.exp(lo)) < CALIBRATED_COLD_RATE:
            hi = lo
        for _ in range(CALIBRATION_STEPS if lo < hi else 0):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(math.exp(mid)) > CALIBRATED_COLD_RATE else (lo, mid)
        gain = math.exp((lo + hi) / 2)
        self.gains.append(gain)
        self.rates.append(rate(gain))
        return gain

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "calibrated", "cold_fraction": CALIBRATED_COLD_FRACTION,
                "target_cold_rate": CALIBRATED_COLD_RATE, "gen_tokens": CALIBRATION_GEN_TOKENS,
                "gains": self.gains, "proxy_cold_rate": self.rates}


def _replayed_lm_head(seed: int, scores: np.ndarray, geo: Geometry) -> np.ndarray:
    """The LM head the build draws last, drawn ahead by replaying the build's numpy draws (the calibration decodes
    through it before the first router is written; the calibrated model keeps every zipf tensor but the routers)."""
    rng = np.random.default_rng(seed)
    experts = _ExpertSource(seed, geo, rng)
    _embedding(rng, geo, scores)
    for layer in range(geo.layers):
        if geo.is_default:  # _weights: numpy experts drawn after each layer's dense part
            _layer_dense(rng, geo, layer, "", None)
            experts.numpy_layer("")
        else:  # _write_sharded: experts come from torch
            _layer_dense(rng, geo, layer, "", experts)
    return _head(rng, geo, scores)["lm_head.weight"]


class _ExpertSource:
    """Where the routed experts' weights come from: numpy (the default geometry, byte for byte as always) or torch
    (any other geometry: fast, on CUDA when available). ``layer(i)`` yields ``(name, float32 array-like)``."""

    def __init__(self, seed: int, geo: Geometry, rng: np.random.Generator) -> None:
        self.seed, self.geo, self.rng = seed, geo, rng
        # Scaled so that expert outputs keep the tiny model's magnitude per layer and over the depth (module doc).
        self.out_std = EXPERT_OUT_STD * math.sqrt(MOE_INTERMEDIATE / geo.expert_intermediate) \
            * math.sqrt(NUM_LAYERS / max(geo.layers, NUM_LAYERS))
        self.in_std = 1.0 / math.sqrt(geo.hidden)

    def numpy_layer(self, prefix: str) -> dict[str, np.ndarray]:
        geo, out = self.geo, {}
        for e in range(geo.experts):
            q = f"{prefix}mlp.experts.{e}."
            out[q + "gate_proj.weight"] = (self.rng.standard_normal((geo.expert_intermediate, geo.hidden))
                                           * self.in_std).astype(np.float32)
            out[q + "up_proj.weight"] = (self.rng.standard_normal((geo.expert_intermediate, geo.hidden))
                                         * self.in_std).astype(np.float32)
            down = (self.rng.standard_normal((geo.hidden, geo.expert_intermediate)) * self.out_std).astype(np.float32)
            down[[DOMAIN_DIM, BIAS_DIM], :] = 0.0
            out[q + "down_proj.weight"] = down
        return out

    def torch_layer(self, layer: int, prefix: str) -> dict[str, Any]:
        """One layer's experts drawn with torch (cast to the model dtype, on the CPU, contiguous)."""
        import torch

        geo = self.geo
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + layer)
        dtype = getattr(torch, geo.dtype)
        shape_in, shape_out = (geo.experts, geo.expert_intermediate, geo.hidden), \
            (geo.experts, geo.hidden, geo.expert_intermediate)
        gate = (torch.randn(shape_in, generator=gen, device=device) * self.in_std).to(dtype)
        up = (torch.randn(shape_in, generator=gen, device=device) * self.in_std).to(dtype)
        down = torch.randn(shape_out, generator=gen, device=device) * self.out_std
        down[:, [DOMAIN_DIM, BIAS_DIM], :] = 0.0
        down = down.to(dtype)
        gate, up, down = gate.cpu(), up.cpu(), down.cpu()
        out = {}
        for e in range(geo.experts):  # separate storages: safetensors refuses tensors that share memory
            q = f"{prefix}mlp.experts.{e}."
            out[q + "gate_proj.weight"] = gate[e].clone()
            out[q + "up_proj.weight"] = up[e].clone()
            out[q + "down_proj.weight"] = down[e].clone()
        return out


def _layer_dense(rng: np.random.Generator, geo: Geometry, layer: int, prefix: str, experts: _ExpertSource | None,
                 calibration: _RouterCalibration | None = None) -> tuple[dict[str, np.ndarray], _LayerPlan]:
    """One layer's attention, norms and router (numpy). With ``calibration`` the router's domain and bias weights
    are scaled by the calibrated gain; the random draws are the same either way, so every other tensor is the
    zipf model's."""
    hidden, heads, kv_heads, head_dim = geo.hidden, geo.heads, geo.kv_heads, geo.head_dim
    in_std = 1.0 / math.sqrt(hidden)
    out_std = EXPERT_OUT_STD if experts is None else experts.out_std

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    p = prefix
    t[p + "input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    t[p + "post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    # Attention: near-uniform scores (small q/k norms); value/output carry the domain coordinate.
    t[p + "self_attn.q_proj.weight"] = normal((heads * head_dim, hidden), in_std)
    t[p + "self_attn.k_proj.weight"] = normal((kv_heads * head_dim, hidden), in_std)
    t[p + "self_attn.q_norm.weight"] = np.full(head_dim, ATTN_QK_NORM, dtype=np.float32)
    t[p + "self_attn.k_norm.weight"] = np.full(head_dim, ATTN_QK_NORM, dtype=np.float32)
    v = normal((kv_heads * head_dim, hidden), in_std)
    v[:, DOMAIN_DIM] = 0.0
    v[[h * head_dim for h in range(kv_heads)], :] = 0.0
    v[[h * head_dim for h in range(kv_heads)], DOMAIN_DIM] = 1.0
    t[p + "self_attn.v_proj.weight"] = v
    o = normal((hidden, heads * head_dim), out_std if geo.is_default else EXPERT_OUT_STD * math.sqrt(
        HIDDEN / hidden))
    o[[DOMAIN_DIM, BIAS_DIM], :] = 0.0
    o[:, [h * head_dim for h in range(heads)]] = 0.0
    gain = ATTN_DOMAIN_GAIN[layer] if layer < len(ATTN_DOMAIN_GAIN) else 0.0
    o[DOMAIN_DIM, [h * head_dim for h in range(heads)]] = gain / heads
    t[p + "self_attn.o_proj.weight"] = o
    # Router: domain coordinate -> the layer's preferred experts, Zipf-shaped; bias coordinate -> shared ones.
    plan = _plan_layer(rng, geo)
    noise = ROUTER_NOISE if geo.is_default else ROUTER_NOISE * math.sqrt(HIDDEN / hidden)
    gate = normal((geo.experts, hidden), noise)
    gate[:, BIAS_DIM] = ROUTER_COLD_BIAS
    gate[:, DOMAIN_DIM] = 0.0
    gate[plan.shared, BIAS_DIM] = ROUTER_SHARED_GAIN * _zipf(geo.shared_hot)
    zipf = _zipf(geo.domain_hot)
    gate[plan.hot["code"], DOMAIN_DIM] = ROUTER_DOMAIN_GAIN * zipf
    gate[plan.hot["prose"], DOMAIN_DIM] = -ROUTER_DOMAIN_GAIN * zipf
    if calibration is not None:
        gate[:, [DOMAIN_DIM, BIAS_DIM]] *= calibration.calibrate(layer, gate)
    t[p + "mlp.gate.weight"] = gate
    return t, plan


def _weights(seed: int, scores: np.ndarray, calibration: _RouterCalibration | None = None
             ) -> tuple[dict[str, np.ndarray], list[_LayerPlan]]:
    """All tensors of the default geometry as float32 numpy arrays (cast to bf16 on save), and the designed
    expert sets per layer. The numpy draws come in one fixed order: the default model's bytes depend on it."""
    rng = np.random.default_rng(seed)
    geo = DEFAULT_GEOMETRY
    experts = _ExpertSource(seed, geo, rng)
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": _embedding(rng, geo, scores)}
    if calibration is not None:
        calibration.start(t["model.embed_tokens.weight"], _replayed_lm_head(seed, scores, geo))
    plans = []
    for layer in range(geo.layers):
        p = f"model.layers.{layer}."
        dense, plan = _layer_dense(rng, geo, layer, p, None, calibration)
        t.update(dense)
        plans.append(plan)
        # Experts: random; small outputs that never touch the domain and bias coordinates.
        t.update(experts.numpy_layer(p))
    t.update(_head(rng, geo, scores))
    return t, plans


def _embedding(rng: np.random.Generator, geo: Geometry, scores: np.ndarray) -> np.ndarray:
    content = np.ones(geo.hidden, dtype=np.float32)
    content[[DOMAIN_DIM, BIAS_DIM]] = 0.0
    embed = (rng.standard_normal((VOCAB_SIZE, geo.hidden)) * 1.0).astype(np.float32) * content
    embed[:, DOMAIN_DIM] = EMBED_DOMAIN_SCALE * scores
    embed[:, BIAS_DIM] = EMBED_BIAS
    return embed


def _head(rng: np.random.Generator, geo: Geometry, scores: np.ndarray) -> dict[str, np.ndarray]:
    content = np.ones(geo.hidden, dtype=np.float32)
    content[[DOMAIN_DIM, BIAS_DIM]] = 0.0
    lm_head = (rng.standard_normal((VOCAB_SIZE, geo.hidden)) * 1.0).astype(np.float32) * content
    lm_head[:, DOMAIN_DIM] = LM_HEAD_DOMAIN_GAIN * scores
    return {"model.norm.weight": np.ones(geo.hidden, dtype=np.float32), "lm_head.weight": lm_head}


def _config(eos_id: int, geo: Geometry = DEFAULT_GEOMETRY) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": geo.hidden,
        "intermediate_size": 4 * geo.hidden,  # dense MLP size; unused, every layer is MoE
        "moe_intermediate_size": geo.expert_intermediate,
        "num_hidden_layers": geo.layers,
        "num_attention_heads": geo.heads,
        "num_key_value_heads": geo.kv_heads,
        "head_dim": geo.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": geo.experts,
        "num_experts_per_tok": geo.top_k,
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
        "torch_dtype": geo.dtype,
    }


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_sharded(tmp: Path, seed: int, scores: np.ndarray, geo: Geometry, quant: str | None = None,
                   calibration: _RouterCalibration | None = None) -> list[_LayerPlan]:
    """Any non-default geometry: one safetensors shard per layer (experts from torch) plus one for the embedding,
    norm and head, and the index that names each tensor's shard. With ``quant``, the routed experts are stored
    quantized from exactly the weights the unquantized model has (:mod:`pinsidecar.demo.quant`)."""
    import torch
    from safetensors.torch import save_file

    from pinsidecar.demo.quant import quantize_expert_tensors

    dtype = getattr(torch, geo.dtype)
    rng = np.random.default_rng(seed)
    experts = _ExpertSource(seed, geo, rng)
    n_files = geo.layers + 1
    weight_map: dict[str, str] = {}
    total = 0

    def write(index: int, tensors: dict[str, Any]) -> None:
        nonlocal total
        name = f"model-{index + 1:05d}-of-{n_files:05d}.safetensors"
        as_torch = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v).to(dtype).contiguous()
                    for k, v in tensors.items()}
        if quant:
            as_torch = quantize_expert_tensors(as_torch, quant)
        save_file(as_torch, str(tmp / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in as_torch.values())
        weight_map.update(dict.fromkeys(as_torch, name))

    embed = _embedding(rng, geo, scores)
    if calibration is not None:
        calibration.start(embed, _replayed_lm_head(seed, scores, geo))
    plans = []
    for layer in range(geo.layers):
        p = f"model.layers.{layer}."
        dense, plan = _layer_dense(rng, geo, layer, p, experts, calibration)
        plans.append(plan)
        write(layer, {**dense, **experts.torch_layer(layer, p)})
    write(geo.layers, {"model.embed_tokens.weight": embed, **_head(rng, geo, scores)})
    _dump_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return plans


def _write_model(tmp: Path, seed: int, geo: Geometry = DEFAULT_GEOMETRY, quant: str | None = None,
                 router: str = "zipf") -> None:
    import torch
    from safetensors.torch import save_file

    tok = _train_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    scores = _token_domain_scores(tok)
    calibration = _RouterCalibration(tok, geo) if router == "calibrated" else None
    if geo.is_default:
        tensors, plans = _weights(seed, scores, calibration)
        as_torch = {k: torch.from_numpy(v).to(torch.bfloat16).contiguous() for k, v in tensors.items()}
        if quant:  # a format whose blocks fit the tiny geometry (nvfp4): the default model's experts, quantized
            from pinsidecar.demo.quant import quantize_expert_tensors

            as_torch = quantize_expert_tensors(as_torch, quant)
        save_file(as_torch, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        plans = _write_sharded(tmp, seed, scores, geo, quant, calibration)
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
    config = _config(eos_id, geo)
    if quant:
        from pinsidecar.demo.quant import hf_quant_config, quantization_config

        config["quantization_config"] = quantization_config(quant, geo.layers)
        legacy = hf_quant_config(quant, geo.layers)
        if legacy is not None:
            _dump_json(tmp / "hf_quant_config.json", legacy)
    _dump_json(tmp / "config.json", config)
    _dump_json(tmp / "generation_config.json", {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False})
    info: dict[str, Any] = {
        "format_version": DEMO_FORMAT_VERSION,
        "seed": seed,
        "domains": list(DOMAINS),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        # The experts each layer's router was built to prefer (hottest first); measured routing is in bench/.
        "designed_shared": [p.shared for p in plans],
        "designed_hot": {d: [p.shared + p.hot[d] for p in plans] for d in DOMAINS},
    }
    if not geo.is_default:  # the default model's file stays byte for byte what it always was
        info["geometry"] = geo.as_dict()
    if calibration is not None:  # absent means the zipf router (the default model's file stays as it was)
        info["router"] = calibration.as_dict()
    if quant:  # the experts' format; the unquantized twin (same seed and geometry) routes identically
        info["quant"] = {"method": quant, "quantization_config": config["quantization_config"]}
    _dump_json(tmp / "pinsidecar_demo.json", info)


def _into_place(out_dir: Path, force: bool, write: Callable[[Path], None]) -> Path:
    """``write`` into a temporary directory beside ``out_dir``, then rename it into place (replacing ``out_dir``
    whole with ``force``): a crash never leaves half a model. What every model writer here uses."""
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
        write(tmp)
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
    return out_dir


def build_demo_model(out_dir: Path, seed: int = 0, force: bool = False,
                     geometry: Geometry = DEFAULT_GEOMETRY, quant: str | None = None, router: str = "zipf") -> Path:
    """Write the demo model to ``out_dir`` and return it; the same seed always gives the same bytes (for a
    non-default ``geometry``: on the same kind of device, see the module docstring).

    ``quant`` (``"fp8-block"``, ``"gptq-int4"``, ``"awq-int4"``, ``"nvfp4"``, :mod:`pinsidecar.demo.quant`)
    stores the routed experts quantized; the 128-grid formats need hidden and expert intermediate sizes that are
    multiples of 128, so never the default geometry. ``"mxfp4"`` writes a gpt-oss model instead
    (:mod:`pinsidecar.demo.gpt_oss`): this model's tensors in gpt-oss's layout, its experts in MXFP4.
    The model is built in a temporary directory beside ``out_dir`` and renamed into place, so a crash
    never leaves half a model. An existing non-empty ``out_dir`` is refused unless ``force`` (then it is replaced
    whole). ``router="calibrated"`` sets the routers' gains for the reference deployment's skew (module docstring);
    everything else is the ``zipf`` model's, and the kind and gains are recorded in ``pinsidecar_demo.json``.
    """
    if quant:  # first: its message names the flags that fix the geometry for this format
        from pinsidecar.demo.quant import geometry_problems

        problems = geometry_problems(quant, geometry.hidden, geometry.expert_intermediate)
        if problems:
            raise DemoModelError("bad demo-model quantization: " + "; ".join(problems))
    geometry.check()
    if router not in ROUTERS:
        raise DemoModelError(f"unknown demo-model router {router!r}; use one of {', '.join(ROUTERS)}")

    def write(tmp: Path) -> None:
        if quant == "mxfp4":  # another architecture: gpt-oss, built from this model's tensors
            from pinsidecar.demo.gpt_oss import write_gpt_oss_twin

            write_gpt_oss_twin(tmp, lambda bf16: _write_model(bf16, seed, geometry, None, router))
        elif geometry.is_default and router == "zipf" and not quant:
            _write_model(tmp, seed)
        else:
            _write_model(tmp, seed, geometry, quant, router)

    out_dir = _into_place(out_dir, force, write)
    log.info("demo model written", path=str(out_dir), seed=seed, router=router)
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

