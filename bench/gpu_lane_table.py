"""The engine tables of docs/results.md, rendered from one ``bench/gpu_lane.py`` report: the table is the run.

Each row is one engine of the report (the placements in the order the tables read them: the bound, the split
with nothing cold, then positional and usage map per host budget), each cell the decode tok/s per stream at 1, 4
and 16 streams: the median of the interleaved rounds with their min and max when the run had ``--reps`` (one
value otherwise), then the live cold-selection rate (pin engines) and the engine's GPU memory. Under the table, the
ratios the text quotes (usage over positional, usage and positional over the bound), each a median of per-round
ratios with its spread, and a flag on any row that beats its own bound at some stream count (which a table must
explain or re-measure, not publish as is).

    python bench/gpu_lane_table.py bench/results/gpu_lane_h200_bf16_reps.json > /tmp/table.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["ORDER", "beats_bound", "main", "render"]

ORDER = ("off", "u0", "p10", "u10", "p23", "u23", "p40", "u40")
STREAMS = ("1", "4", "16")
GIB = 1 << 30


def _cell(decode: dict[str, Any] | None, streams: str) -> str:
    d = (decode or {}).get(streams)
    if not d:
        return "-"
    spread = (d.get("reps") or {}).get("decode_tok_s_per_stream")
    if spread and spread.get("n", 1) > 1:
        return f"{spread['median']:.0f} ({spread['min']:.0f}-{spread['max']:.0f})"
    return f"{d['decode_tok_s_per_stream']:.0f}"


def _median(decode: dict[str, Any] | None, streams: str) -> float | None:
    d = (decode or {}).get(streams)
    if not d:
        return None
    spread = (d.get("reps") or {}).get("decode_tok_s_per_stream")
    return float(spread["median"]) if spread else float(d["decode_tok_s_per_stream"])


def _what(name: str, engine: dict[str, Any], total_expert_bytes: int | None) -> tuple[str, str]:
    place = engine.get("placement") or {}
    host = int(place.get("host_bytes") or place.get("bytes") or 0)
    if name == "off":
        return "0", "all in HBM (hook off): the bound"
    if name == "u0":
        return "0", "usage map, nothing cold (the split's own cost)"
    share = f"{host / total_expert_bytes:.0%} " if total_expert_bytes else ""
    where = f"{share}({host / GIB:.2f} GiB)"
    if name.startswith("p"):
        return where, "vLLM positional (`--cpu-offload-gb`)"
    return where, "**usage map (pin)**" if name == "u23" else "usage map (pin)"


def beats_bound(doc: dict[str, Any]) -> list[str]:
    """Engines whose median beats the hook-off bound of the same run at some stream count."""
    engines = doc.get("engines") or {}
    bound = engines.get("off", {}).get("decode")
    out = []
    for name, e in engines.items():
        if name in ("off", "count"):
            continue
        for s in STREAMS:
            b, v = _median(bound, s), _median(e.get("decode"), s)
            if b is not None and v is not None and v > b:
                out.append(f"{name} at {s} stream(s): {v:.0f} > bound {b:.0f}")
    return out


def _ratio_line(doc: dict[str, Any]) -> list[str]:
    reps = doc.get("figures_reps") or {}
    figs = doc.get("figures") or {}
    lines = []
    for key, what in (("usage_over_positional_23pct", "usage map over positional at 23 %"),
                      ("usage_23pct_over_all_hbm", "usage map at 23 % over the bound"),
                      ("positional_23pct_over_all_hbm", "positional at 23 % over the bound")):
        cells = []
        for s in STREAMS:
            k = f"{key}_{s}stream"
            r = reps.get(k)
            if r:
                cells.append(f"{r['median']:.2f}× ({r['min']:.2f}-{r['max']:.2f}) at {s}")
            elif figs.get(k) is not None:
                cells.append(f"{figs[k]:.2f}× at {s}")
        if cells:
            lines.append(f"- {what}: " + ", ".join(cells))
    return lines


def render(doc: dict[str, Any]) -> str:
    """The markdown table and its ratio lines for report ``doc``."""
    engines = doc.get("engines") or {}
    total = None
    u0 = (engines.get("u0") or {}).get("live") or {}
    if u0.get("tier_bytes"):
        total = int(sum(u0["tier_bytes"].values()))
    elif (engines.get("u23") or {}).get("live", {}).get("tier_bytes"):
        total = int(sum(engines["u23"]["live"]["tier_bytes"].values()))
    rounds = doc.get("reps") or 1
    head = "1 stream | 4 streams | 16 streams"
    rows = [f"| experts in host memory | placement | {head} | live cold selections | GPU memory |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in ORDER:
        e = engines.get(name)
        if not e:
            continue
        where, label = _what(name, e, total)
        live = e.get("live") or {}
        cold = f"{live['cold_rate']:.1%}" if live.get("cold_rate") is not None else "-"
        mem = f"{e['gpu_memory_mib'] / 1024:.1f} GiB" if e.get("gpu_memory_mib") else "-"
        cells = " | ".join(_cell(e.get("decode"), s) for s in STREAMS)
        rows.append(f"| {where} | {label} | {cells} | {cold} | {mem} |")
    out = [*rows, "", f"Decode tok/s per stream, median of {rounds} interleaved rounds (min-max) "
                      f"({doc.get('date', '?')}; `{doc.get('command', '?')}`)."]
    ratios = _ratio_line(doc)
    if ratios:
        out += ["", "Ratios, the median of the per-round ratios (min-max):", *ratios]
    beats = beats_bound(doc)
    if beats:
        out += ["", "Beats its own bound (explain or re-measure before publishing): " + "; ".join(beats)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    args = ap.parse_args(argv)
    sys.stdout.write(render(json.loads(args.report.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
