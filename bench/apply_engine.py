"""In-place applies inside a serving engine: the longest gap between two tokens while the hook swaps rows, against
the longest gap in windows of the same length with no apply, host-ordered and stream-ordered batches interleaved.

Why this and not the heal scenario's figure: at 4 and 16 streams the longest gap inside one stream is 60-100 ms on
the H200 lane model whether an apply runs or not (``bench/results/heal_h200_c4_2026-12-04.json``: 65 ms while the
apply request was out, 68 ms in the verify after it, which moves nothing). With ``max_tokens`` 32 a new request
joins the batch every few steps and its prefill lengthens that step, so the longest gap of a window is set by the
traffic as much as by the apply. What the apply costs a stream is the difference: the gap during the apply minus
the gap of an equal window without one. Equal length matters, because the longest of more gaps is longer.

One engine per map pair, started in pin mode on map A by the project's own engine builder
(:func:`pinsidecar.testing.engine.start_engine`; ``--engine-toml`` gives its ``[engine]`` keys), and the project's
own streaming clients (:mod:`pinsidecar.testing.streaming`). For each ``--clients`` level, while the clients stream:

1. warm-up: one apply per ordering, not counted (the first apply of an ordering may compile kernels, and it tells
   how long the ordering's applies take at this load);
2. ``--reps`` rounds; before each apply, a quiet time of ``--quiet-s`` or three times the ordering's previous
   apply, whichever is longer (the baseline); then it applies the other map of the pair, once per ordering, the
   order of the orderings reversed every other round (A-B-B-A), so the map flips every apply and
   each ordering moves both directions;
3. per apply, over the apply request (sent to answered, so the hook's batches lie inside): the longest gap between
   two tokens of a stream (``gap_ms``), and the same over each window of that length in the quiet time before it
   (``baseline``: their median and max). ``excess_ms`` is ``gap_ms`` minus the baseline median; the hook's own
   answer (rows, bytes, batches, longest hold, drain, device time, link bandwidth) beside it.

Each level ends on map A (an even number of applies). Before the first level and after the last, the engine's
greedy tokens and logprobs on fixed prompts, with nothing else running: they must be identical to the bit.

``--orderings`` lists the variants to interleave: an ordering (``host``, ``stream``), optionally with the batch
budget the request asks for after ``@`` in ms (``stream@8``: stream order, at most 8 ms of copies per batch on the
device; none: the hook's 20 ms), what ``[remap.advanced] apply_hold_ms`` sets on a lane. A stream waits for about
one step plus one batch, so the budget is the knob on the gap.

A pair is ``NAME=A.json,B.json`` or ``NAME=A.json`` (B: A's complement, :func:`complement_map`, so that every cold
row of every layer changes: the most rows one apply can move at that geometry). Optional ``:C1,C2`` after it
overrides ``--clients`` for that pair.

    python3 bench/apply_engine.py --model /tmp/gl/model --engine-toml /tmp/gl/heal-engine.toml \\
        --pair usage99=maps/code.json,maps/prose.json:1,4,16 --pair complement64=maps/code-64.json:16 \\
        --reps 3 --out $OUT/apply_engine_h200.json          # the H200 lane model, about 8 minutes

On vLLM CPU (tests/test_swap_engine.py) the stream order falls back to host syncs and the times mean nothing; the
test checks that every part runs and that the identities hold.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root, so that siblings import as bench.<name>
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinsidecar_hook.contract import ExpertMap, LayerPlacement, load_map
from pinsidecar_hook.contract.io import atomic_write_json
from pinsidecar_hook.contract.requests import APPLY_ORDERINGS

from bench.gpu_lane import spread
from bench.scenario.remap_lane import domain_prompts
from pinsidecar.remap.apply import request_apply
from pinsidecar.testing.streaming import ClientStats, LoadResult, load_during

__all__ = ["complement_map", "gap_figures", "main", "run_pair"]

TARGET_GAP_MS = 50.0  # the bound on the longest gap between tokens during an apply
SETTLE_S = 1.0  # the quiet time's first second is left out of the baseline: the previous apply's tail
BASELINE_WINDOWS = 3  # the quiet time before an apply fits at least this many windows of its ordering's last one
APPLY_TIMEOUT_S = 300.0


def complement_map(emap: ExpertMap, label: str = "") -> ExpertMap:
    """A map of ``emap``'s geometry in which every cold expert of every layer is hot, and the cold set is taken from
    the lowest ids of ``emap``'s hot set: an apply between the two swaps ``min(hot_rows, cold_rows)`` pairs per
    layer, the most one apply can move at this geometry."""
    layers = []
    for lp in emap.layers:
        cold_n = len(lp.cold)
        new_cold = sorted(lp.hot)[:cold_n]
        new_hot = sorted(set(range(emap.num_experts)) - set(new_cold))
        if len(new_cold) != cold_n:
            raise ValueError(f"layer {lp.layer_id}: {len(lp.hot)} hot rows cannot take the place of {cold_n} cold "
                             "ones; a complement needs hot_rows >= cold_rows")
        layers.append(LayerPlacement(lp.layer_id, tuple(new_hot), tuple(new_cold)))
    return dataclasses.replace(emap, layers=tuple(layers), policy="manual",
                               label=label or f"complement of {emap.label or 'map'}",
                               predicted_cold_rate=None, meta={"complement_of": emap.content_hash})


def gap_figures(load: LoadResult, sent: float, answered: float, quiet_from: float) -> dict[str, Any]:
    """``gap_ms`` over the apply request and ``baseline`` over equal windows of the quiet time before it
    (:meth:`~pinsidecar.testing.streaming.LoadResult.window_baseline`)."""
    gap = load.longest_gap(sent, answered, "token") * 1e3
    base = load.window_baseline(quiet_from, sent, answered - sent)
    return {"window_s": round(answered - sent, 3), "gap_ms": round(gap, 2), "baseline": base,
            "excess_ms": None if base["median_ms"] is None else round(gap - base["median_ms"], 2)}


def _maps(spec: str) -> tuple[str, Path, Path | None, list[int] | None]:
    name, _, rest = spec.partition("=")
    rest, _, clients = rest.partition(":")
    paths = [Path(p) for p in rest.split(",") if p]
    if not name or not 1 <= len(paths) <= 2:
        raise SystemExit(f"--pair {spec!r}: expected NAME=A.json[,B.json][:C1,C2]")
    levels = [int(c) for c in clients.split(",")] if clients else None
    return name, paths[0], paths[1] if len(paths) == 2 else None, levels


def variant(spec: str) -> tuple[str, float | None]:
    """``(ordering, hold_ms)`` of an ``--orderings`` entry ``ORDERING[@MS]`` (None: the hook's budget)."""
    ordering, _, ms = spec.partition("@")
    if ordering not in APPLY_ORDERINGS:
        raise SystemExit(f"--orderings {spec!r}: the ordering must be one of {', '.join(APPLY_ORDERINGS)}")
    try:
        hold_ms = float(ms) if ms else None
    except ValueError:
        hold_ms = -1.0
    if hold_ms is not None and not hold_ms >= 0:
        raise SystemExit(f"--orderings {spec!r}: after '@' the batch budget in ms, a number >= 0 (e.g. stream@8)")
    return ordering, hold_ms


def _hook(result: Any) -> dict[str, Any]:
    return {"outcome": result.outcome, "reason": result.reason, "rows": result.rows,
            "bytes_moved": result.bytes_moved, "batches": result.batches, "stream_batches": result.stream_batches,
            "budget_ms": round(result.hold_budget_s * 1e3, 2), "held_ms": round(result.seconds * 1e3, 2),
            "hold_max_ms": round(result.hold_max_s * 1e3, 2),
            "drain_max_ms": round(result.drain_max_s * 1e3, 2), "device_max_ms": round(result.device_max_s * 1e3, 2),
            "wall_s": round(result.wall_s, 3), "link_GBps": round(result.link_GBps, 2)}


def _spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """:func:`~bench.gpu_lane.spread` of the values there are (an apply too short for a baseline window has none)."""
    known = [v for v in values if v is not None]
    return spread(known) if known else None


async def _level(engine: Any, maps: dict[str, tuple[Path, ExpertMap]], clients: int, orderings: Sequence[str],
                 reps: int, quiet_s: float, warmup: bool, max_tokens: int, prompts: Sequence[str]) -> dict[str, Any]:
    stats_path = Path(engine.hook.stats_path)
    on = ["a"]  # which map serves
    applies: list[dict[str, Any]] = []

    last_window: dict[str, float] = {}  # per ordering, its previous apply's window

    async def apply(ordering: str, measured: bool) -> None:
        target = "b" if on[0] == "a" else "a"
        path, emap = maps[target]
        # Quiet long enough for BASELINE_WINDOWS windows as long as this ordering's last apply took.
        wait_s = max(quiet_s, SETTLE_S + BASELINE_WINDOWS * last_window.get(ordering, 0.0))
        quiet_from = time.time() + SETTLE_S
        await asyncio.sleep(wait_s)
        sent = time.time()
        how, hold_ms = variant(ordering)
        result, snap = await asyncio.to_thread(request_apply, stats_path, str(path.resolve()), emap.content_hash,
                                               timeout_s=APPLY_TIMEOUT_S, alive=engine.alive, ordering=how,
                                               hold_ms=hold_ms)
        answered = time.time()
        if result.outcome != "applied" or snap.map_hash != emap.content_hash:
            raise RuntimeError(f"apply to {target} ({ordering}) came to {result.outcome}: {result.reason} "
                             f"(serving {snap.map_hash})")
        on[0] = target
        last_window[ordering] = answered - sent
        applies.append({"ordering": ordering, "to": target, "measured": measured, "sent": sent,
                        "answered": answered, "quiet_from": quiet_from, "hook": _hook(result)})

    async def action() -> None:
        if warmup:
            for o in orderings:
                await apply(o, False)
            if on[0] != "a":
                await apply(orderings[0], False)
        for r in range(reps):
            for o in (orderings if r % 2 == 0 else orderings[::-1]):
                await apply(o, True)
        if on[0] != "a":
            await apply(orderings[0], False)

    stats = [ClientStats() for _ in range(clients)]
    t0 = time.monotonic()
    load = await load_during(engine.base_url, engine.spec.model_name, action, clients=clients,
                             max_tokens=max_tokens, prompts=prompts, stats=stats, limit_s=900.0)
    t_start = applies[0]["quiet_from"] - SETTLE_S
    for a in applies:
        a.update(gap_figures(load, a["sent"], a["answered"], a["quiet_from"]))
        a["t"] = round(a.pop("sent") - t_start, 2)  # seconds since the first apply's quiet time began
        del a["answered"], a["quiet_from"]
    summary = {}
    for o in orderings:
        mine = [a for a in applies if a["measured"] and a["ordering"] == o]
        if not mine:
            continue
        summary[o] = {
            "applies": len(mine),
            "gap_ms": spread([a["gap_ms"] for a in mine]),
            "baseline_median_ms": _spread([a["baseline"]["median_ms"] for a in mine]),
            "excess_ms": _spread([a["excess_ms"] for a in mine]),
            "over_target": sum(a["gap_ms"] > TARGET_GAP_MS for a in mine),
            **{k: spread([a["hook"][k] for a in mine])
               for k in ("hold_max_ms", "drain_max_ms", "device_max_ms", "wall_s", "link_GBps", "rows")},
        }
    fig = load.figure()
    return {"clients": clients, "seconds": round(time.monotonic() - t0, 1), "max_tokens": max_tokens,
            "requests": {k: fig[k] for k in ("sent", "completed", "failed", "lost")}, "errors": fig["errors"],
            "tokens": sum(s.tokens for s in stats), "summary": summary, "applies": applies}


def _pair_maps(a: Path, b: Path) -> dict[str, tuple[Path, ExpertMap]]:
    maps = {"a": (a, load_map(a)), "b": (b, load_map(b))}
    if not maps["a"][1].same_geometry(maps["b"][1]):
        raise ValueError(f"{a} and {b} have different geometries ({maps['a'][1].geometry} vs "
                         f"{maps['b'][1].geometry}); an apply needs the same one")
    return maps


def run_pair(engine: Any, a: Path, b: Path, clients: Sequence[int], *, reps: int = 3,
             orderings: Sequence[str] = APPLY_ORDERINGS, quiet_s: float = 6.0, warmup: bool = True,
             max_tokens: int = 32, prompts: Sequence[str] | None = None) -> dict[str, Any]:
    """The figures of one map pair on ``engine`` (a :class:`~pinsidecar.testing.engine.HookedEngine` in pin mode
    serving ``a``), one level per entry of ``clients``; the engine serves ``a`` again afterwards."""
    maps = _pair_maps(a, b)
    prompts = list(prompts) if prompts else [p for pair in zip(domain_prompts("code"), domain_prompts("prose"),
                                                                 strict=False) for p in pair]
    before = engine.greedy_outputs()
    levels = [asyncio.run(_level(engine, maps, n, orderings, reps, quiet_s, warmup, max_tokens, prompts))
              for n in clients]
    after = engine.greedy_outputs()
    return {"maps": {k: {"path": str(p), "label": m.label, "hash": m.content_hash, "hot_rows": m.hot_rows,
                         "cold_rows": m.cold_rows} for k, (p, m) in maps.items()},
            "identity": {"greedy_prompts": len(before), "identical_after_applies": after == before},
            "levels": levels}


def _engine_keys(toml: Path | None) -> dict[str, Any]:
    if toml is None:
        return {}
    from pinsidecar.engine.spec import load_engine_config

    cfg = load_engine_config(toml, defaults={"model": "."}, check_paths=False, unused=("map",))
    return {k: getattr(cfg, k) for k in ("enforce_eager", "dtype", "kv_cache_bytes", "max_model_len",
                                         "extra_args", "env")}


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    except Exception:  # no torch here: the engine's host is described by the rest of the document
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--pair", action="append", required=True, help="NAME=A.json[,B.json][:C1,C2] (repeatable)")
    ap.add_argument("--clients", default="16", help="streaming clients per level, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="measured applies per ordering and level")
    ap.add_argument("--orderings", default=",".join(APPLY_ORDERINGS))
    ap.add_argument("--quiet-s", type=float, default=6.0, help="seconds without an apply before each one")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engine-toml", type=Path, default=None, help="its [engine] keys start the engines")
    ap.add_argument("--work", type=Path, default=Path("/tmp/apply-engine"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "apply_engine.json")
    args = ap.parse_args(argv)
    from pinsidecar.testing.engine import start_engine

    orderings = [o for o in args.orderings.split(",") if o]
    for o in orderings:
        variant(o)  # a bad entry fails here, before any engine boots
    doc: dict[str, Any] = {
        "figure": "apply_gap_in_engine", "command": "python3 bench/apply_engine.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": _device(),
        "host": {"cpus": os.cpu_count()}, "model": str(args.model), "target_gap_ms": TARGET_GAP_MS,
        "reps": args.reps, "orderings": orderings, "quiet_s": args.quiet_s,
        "note": "gap_ms: the longest gap between two tokens of one stream while the apply request was out; "
                "baseline: the same over each window of that length in the quiet time before it (median, max); "
                "excess_ms = gap_ms - baseline median",
        "pairs": {}}
    started = time.monotonic()
    keys = _engine_keys(args.engine_toml)
    doc["engine"] = {k: (v if not isinstance(v, Path) else str(v)) for k, v in keys.items()}
    for spec in args.pair:
        name, a, b, levels = _maps(spec)
        work = args.work / name
        work.mkdir(parents=True, exist_ok=True)
        if b is None:
            b = work / "complement.json"
            complement_map(load_map(a)).save(b)
        clients = levels or [int(c) for c in args.clients.split(",")]
        t0 = time.monotonic()
        try:
            _pair_maps(a, b)  # before a boot: a pair that cannot apply costs no engine
            engine = start_engine(args.model, "pin", work, map_path=a.resolve(), **keys)
            try:
                pair = {"boot_s": round(time.monotonic() - t0, 1),
                        **run_pair(engine, a, b, clients, reps=args.reps, orderings=orderings, quiet_s=args.quiet_s,
                                   max_tokens=args.max_tokens)}
            finally:
                engine.stop()
        except Exception as exc:  # one pair's failure (a boot, an apply refused) is its result; the next pair runs
            pair = {"error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - t0, 1)}
        doc["pairs"][name] = pair
        atomic_write_json(args.out, doc)  # a pair at a time: what ran survives a cut-off call
        print(json.dumps({name: pair.get("error") or {lv["clients"]: lv["summary"] for lv in pair["levels"]}},
                         indent=1), flush=True)
    doc["seconds"] = round(time.monotonic() - started, 1)
    atomic_write_json(args.out, doc)
    if any("error" in p for p in doc["pairs"].values()):
        raise SystemExit(f"apply_engine: a pair failed; its error is in {args.out}")
    return doc


if __name__ == "__main__":
    main()
