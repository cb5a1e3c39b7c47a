"""``pinsidecar map``: build a placement from counts, evaluate it, look at it, compare two.

Every figure a usage map is judged by is printed next to the positional baseline for the same budget (what vLLM's
``--cpu-offload-gb`` would do), because that is the only comparison that says whether deploying it is worth it.
The positional baseline is an evaluation object, not a map file: it has a different hot count in every layer,
which the map format refuses on purpose (see :class:`pinsidecar.placement.PlacementMask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from pinsidecar_hook.contract import load_counts, load_map

from pinsidecar import placement
from pinsidecar.cli._common import UserError, emit, handle_errors, json_option, parse_cache_slots

__all__: list[str] = []  # nothing here is another package's business


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (right-aligned numbers), readable in a terminal and in a log."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(row, widths,
                                                                                           strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "" if v is None else str(v)


def _numeric(s: str) -> bool:
    return s.replace(".", "", 1).replace("%", "").replace("-", "", 1).isdigit()


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2%}"


def _gib(n: int) -> str:
    """Bytes for a person: GiB for model-sized figures, smaller units for toy models."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def check_out_path(out: str, inputs: Sequence[str] = (), what: str = "output") -> Path:
    """Refuse an output path that is a directory or one of the inputs (before any work, so nothing is written)."""
    target = Path(out)
    if target.is_dir():
        raise UserError(f"--out {out} is a directory", f"pass a file name for the {what}, e.g. {out.rstrip('/')}/"
                        f"{what}.json")
    resolved = target.resolve()
    for src in inputs:
        if Path(src).resolve() == resolved:
            raise UserError(f"--out {out} is also an input file", "write the result to a new file")
    return target


def _write(fn: Any, path: Path) -> None:
    try:
        fn(path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}", "check the directory exists and is writable"
                        ) from None


def _positional_description(mask: placement.PlacementMask) -> str:
    full, part = mask.meta["full_cold_layers"], mask.meta["partial_layer_cold"]
    ordered = sorted(mask.layer_ids)
    text = f"{mask.cold_total} cold experts = {full} whole layer(s)"
    if full:
        text += f" ({ordered[0]}..{ordered[full - 1]})"
    if part:
        text += f" + {part} experts of layer {ordered[full]}"
    return text


# ---------------------------------------------------------------------------------------------------- build


def _build(counts_paths: tuple[str, ...], hot_rows: int | None, hbm_bytes: int | None, expert_bytes: int | None,
           positional: bool, label: str, out: str | None, model: str | None = None, dtype: str | None = None,
           quantization: str | None = None, cache_slots: str | None = None, cache_policy: str = "lru",
           trace_path: str | None = None) -> dict[str, Any]:
    slots_arg = 0 if cache_slots is None else parse_cache_slots(cache_slots)
    policy = placement.check_cache_policy(cache_policy)
    placement.check_auto_has_trace(slots_arg, trace_path is not None)
    if positional and out:
        raise UserError(
            "--positional cannot be written to --out: the positional placement has a different hot count in every "
            "layer (whole layers cold), which is not a deployable fixed-geometry map, and vLLM deploys it itself "
            "with --cpu-offload-gb",
            "drop --out; the baseline is printed here (--json to keep it), and `map eval MAP COUNTS` reports it "
            "for any map's budget",
        )
    if not positional and not out:
        raise UserError("missing --out MAP", "say where to write the map, e.g. --out maps/code.map.json")
    target = check_out_path(out, [*counts_paths, *([trace_path] if trace_path else [])], "map") if out else None
    names = list(counts_paths)
    counts = placement.load_counts_files(names)
    total = placement.sum_counts(counts, names)
    xbytes = placement.resolve_expert_bytes(counts, names, total, expert_bytes, model, dtype, quantization)
    hbm_rows = placement.resolve_hbm_rows(hot_rows, hbm_bytes, xbytes.value, total)  # hot rows + cache slots
    trace = placement.load_build_trace(trace_path, total) if trace_path else None
    built = placement.build_map(counts, hbm_rows, xbytes, names=names, label=label, cache_slots=slots_arg,
                                cache_policy=policy, trace=trace, trace_path=trace_path)
    emap = built.map
    rows, slots = emap.hot_rows, emap.cache_slots
    mask = placement.positional_for(emap)
    usage_eval = placement.evaluate(emap, total, "map", "counts")
    positional_eval = placement.evaluate(mask, total, "positional baseline", "counts")
    result: dict[str, Any] = {
        "hot_rows": rows,
        "cold_rows": emap.cold_rows,
        "hbm_rows": hbm_rows,
        "cache_slots": slots,
        "cache_policy": policy if slots else None,
        "cache_model": emap.meta.get("cache_model"),
        "cache": built.cache,
        "trace": trace_path,
        "budget_from": "hot-rows" if hot_rows is not None else "hbm-bytes",
        "hbm_bytes": hbm_bytes,
        "expert_bytes": xbytes.value,
        "expert_bytes_from": xbytes.source,
        "counts_expert_bytes": xbytes.counted,
        "model": xbytes.model,
        "counts": names,
        "tokens": total.tokens,
        "selections": total.selections,
        "predicted_cold_rate": emap.predicted_cold_rate,
        "positional_cold_rate": positional_eval["cold_rate"],
        "positional": {"description": _positional_description(mask), **mask.meta,
                       "per_layer": positional_eval["per_layer"]},
        "leave_one_out": placement.leave_one_out(counts, rows, names, cache_slots=slots, cache_policy=policy),
        # a periodic flush can land mid-forward; a few tokens off is harmless, a large gap means a broken count boot
        "inconsistent_counts": [n for n, c in zip(names, counts, strict=True) if not c.consistent],
    }
    if positional:
        result["mode"] = "positional"
        return result
    assert target is not None
    _write(lambda p: placement.save_map(emap, p), target)
    result.update(mode="usage", out=str(target), map=placement.summary(emap), per_layer=usage_eval["per_layer"])
    return result


def _build_human(r: dict[str, Any]) -> str:
    lines = []
    if r["mode"] == "usage":
        m = r["map"]
        lines.append(f"wrote {r['out']}  hash {m['short_hash']}  label {m['label'] or '-'}")
    lines.append(f"budget: {r['hot_rows']} hot / {r['cold_rows']} cold rows per layer"
                 + (f" + {r['cache_slots']} {r['cache_policy']} cache slots ({r['hbm_rows']} HBM rows)"
                    if r.get("cache_slots") else "")
                 + (f" (from --hbm-bytes {r['hbm_bytes']} at {r['expert_bytes']} bytes/expert)"
                    if r["budget_from"] == "hbm-bytes" else ""))
    cache = r.get("cache")
    if cache and cache.get("chosen") == "auto":
        tried = ", ".join(f"K={t['cache_slots']}: {_pct(t['tuning_miss_rate'])}" + ("*" if t["chosen"] else "")
                          for t in cache["tried"])
        how = "each half ranked on the other" if cache.get("cross_fitted") else "ranked on all of it"
        lines.append(f"cache slots chosen on trace {cache['trace']} (miss rate per split, {how}; * chosen): "
                     f"{tried}")
    lines.append(f"counts: {len(r['counts'])} file(s), {r['tokens']} tokens, {r['selections']} selections")
    lines.append(_bytes_line(r))
    for name in r["inconsistent_counts"]:
        lines.append(f"warning: {name}: per-layer selections do not all equal tokens x top_k (a flush mid-step, or "
                     "an incomplete count boot); check it with `pinsidecar counts show`")
    if r.get("cache_model") == "trace":
        lines.append(f"usage map miss rate on trace {r['trace']} (simulated): {_pct(r['predicted_cold_rate'])}")
    elif r.get("cache_model") == "independent":
        lines.append(f"usage map miss rate (in-sample, independent-reference cache model; no temporal reuse, so "
                     f"pessimistic when routing reuses experts; --trace simulates): {_pct(r['predicted_cold_rate'])}")
    else:
        lines.append(f"usage map cold-selection rate (in-sample):      {_pct(r['predicted_cold_rate'])}")
    lines.append(f"positional (--cpu-offload-gb, same budget):     {_pct(r['positional_cold_rate'])}"
                 f"   [{r['positional']['description']}]")
    if r["leave_one_out"]:
        lines.append("")
        lines.append("leave-one-out (map from the other counts, evaluated on this one):")
        lines.append(format_table(["held out", "workload", "cold rate", "train cold rate"],
                                  [[row["held_out"], row["workload"], _pct(row["cold_rate"]),
                                    _pct(row["train_cold_rate"])] for row in r["leave_one_out"]]))
    if r["mode"] == "positional":
        lines.append("")
        lines.append("positional baseline per layer (no map file written: it is not a fixed-geometry map):")
        lines.append(format_table(["layer", "cold experts", "cold rate"],
                                  [[p["layer_id"], p["cold_experts"], _pct(p["cold_rate"])]
                                   for p in r["positional"]["per_layer"]]))
    return "\n".join(lines)


def _bytes_line(r: dict[str, Any]) -> str:
    xbytes, counted, source = r["expert_bytes"], r["counts_expert_bytes"], r["expert_bytes_from"]
    if source == "unknown":
        return "bytes per expert: unknown (the counts do not record it; --expert-bytes N or --model DIR give it)"
    text = f"bytes per expert: {xbytes} ({_gib(xbytes)})"
    if source == "model":
        m = r["model"]
        text += (f" from --model {m['path']}: {m['format']}, {m['dtype']}, "
                 + ("measured on a GPU" if m["measured_on_gpu"] else "derived from vLLM's code, not yet measured"))
    elif source == "expert-bytes":
        text += " from --expert-bytes"
    else:
        text += " from the counts"
    if source != "counts" and counted and counted != xbytes:
        text += f"; the counted engine had {counted}"
    return text


# ---------------------------------------------------------------------------------------------------- eval


def _eval(map_path: str, counts_path: str) -> dict[str, Any]:
    emap = load_map(map_path)
    counts = load_counts(counts_path)
    usage = placement.evaluate(emap, counts, map_path, counts_path)
    positional = placement.evaluate(placement.positional_for(emap), counts, "positional baseline", counts_path)
    for row, pos in zip(usage["per_layer"], positional["per_layer"], strict=True):
        row["positional_cold_rate"] = pos["cold_rate"]
    usage.update(map=map_path, counts=counts_path, positional_cold_rate=positional["cold_rate"],
                 improvement=(positional["cold_rate"] / usage["cold_rate"]) if usage["cold_rate"] else None)
    return usage


def _eval_human(r: dict[str, Any]) -> str:
    lines = [
        f"map {r['map']} [{r['map_hash'].split(':')[-1][:12]}] {r['label'] or ''} on counts {r['counts']} "
        f"({r['tokens']} tokens, {r['selections']} selections)",
        f"cold-selection rate:           {_pct(r['cold_rate'])}  ({r['cold_selections']} of {r['selections']})",
        f"positional, same budget:       {_pct(r['positional_cold_rate'])}",
        f"predicted when built:          {_pct(r['predicted_cold_rate'])}",
    ]
    if r.get("cache_slots"):
        lines[1] = (f"miss rate (hot rows + {r['cache_slots']} {r['cache_policy']} cache slots, independent-reference "
                    f"model): {_pct(r['cold_rate'])}; hot set alone {_pct(r['static_cold_rate'])} "
                    f"({r['cold_selections']} of {r['selections']})")
    if r["improvement"]:
        lines.append(f"positional / usage:            {r['improvement']:.1f}x fewer cold selections")
    lines.append("")
    lines.append(format_table(
        ["layer", "cold rate", "positional", "selections", "cold sel", "cold touched"],
        [[p["layer_id"], _pct(p["cold_rate"]), _pct(p["positional_cold_rate"]), p["selections"], p["cold_selections"],
          f"{p['cold_experts_touched']}/{p['cold_experts']}"] for p in r["per_layer"]],
    ))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- show / diff


def _show_human(r: dict[str, Any]) -> str:
    g = r["geometry"]
    lines = [
        f"map [{r['short_hash']}] {r['label'] or '-'}  policy {r['policy']}  created {r['created_at'] or '-'}",
        # name, path and revision once each: a model served without a name is named by its path
        "model: " + (" ".join(dict.fromkeys(filter(None, (r["model"][k] for k in ("name", "path", "revision")))))
                     or "-"),
        f"geometry: {g['num_layers']} layers x {g['num_experts']} experts (top-{g['top_k']}), "
        f"{g['hot_rows']} hot / {g['cold_rows']} cold rows per layer"
        + (f" + {g['cache_slots']} cache slots ({r['cache_policy']})" if g.get("cache_slots") else "")
        + f", {g['expert_bytes']} bytes/expert",
        f"bytes: hot {_gib(r['hot_bytes'])}, cold {_gib(r['cold_bytes'])}"
        + (f", cache {_gib(r['cache_bytes'])}" if g.get("cache_slots") else ""),
        f"predicted cold-selection rate: {_pct(r['predicted_cold_rate'])}"
        + (f" (misses past the cache; model: {r.get('cache_model') or 'independent'})" if g.get("cache_slots")
           else ""),
        f"built from {len(r['source_counts'])} counts: " + ", ".join(d.split(':')[-1][:12] for d in r['source_counts']),
    ]
    ev = r.get("evaluation")
    if ev:
        lines.append(f"on {r['counts']}: cold-selection rate {_pct(ev['cold_rate'])}")
    rates = r.get("predicted_cold_rate_per_layer")
    per_layer = ev["per_layer"] if ev else None
    if per_layer or rates:
        lines.append("")
        hdr = ["layer", "cold rate (counts)" if per_layer else "predicted cold rate"]
        vals = [p["cold_rate"] for p in per_layer] if per_layer else rates
        lines.append(format_table(hdr, [[lid, _pct(v)] for lid, v in zip(r["layer_ids"], vals, strict=True)]))
    if r.get("png"):
        lines.append(f"\nwrote {r['png']}")
    return "\n".join(lines)


def _diff_human(r: dict[str, Any]) -> str:
    lines = [
        f"a: [{r['a']['hash'].split(':')[-1][:12]}] {r['a']['label'] or '-'} ({r['a']['policy']})",
        f"b: [{r['b']['hash'].split(':')[-1][:12]}] {r['b']['label'] or '-'} ({r['b']['policy']})",
        r["verdict"],
        f"compile-cache hit: {'yes' if r['compile_cache_hit'] else 'NO'}",
        f"moves: {r['hot_to_cold']} hot->cold, {r['cold_to_hot']} cold->hot in {r['layers_changed']} of "
        f"{r['comparable_layers']} comparable layers"
        + (f" ({_gib(r['moved_bytes'])} moved)" if r.get("moved_bytes") else ""),
    ]
    changed = [p for p in r["per_layer"] if p["hot_to_cold"] or p["cold_to_hot"]]
    if changed:
        lines.append("")
        lines.append(format_table(["layer", "hot->cold", "cold->hot"],
                                  [[p["layer_id"], _ids(p["hot_to_cold"]), _ids(p["cold_to_hot"])] for p in changed]))
    return "\n".join(lines)


def _ids(ids: list[int], limit: int = 10) -> str:
    shown = ",".join(str(i) for i in ids[:limit])
    return f"{len(ids)}: {shown}" + (",..." if len(ids) > limit else "")


# ---------------------------------------------------------------------------------------------------- click


def register(main: click.Group) -> None:
    @main.group("map")
    def map_group() -> None:
        """Build, evaluate, show and compare expert placement maps."""

    @map_group.command("build")
    @click.argument("counts", nargs=-1, required=True, type=click.Path(dir_okay=False))
    @click.option("--hot-rows", type=int, help="Experts kept in HBM per layer (1..num_experts-1).")
    @click.option("--hbm-bytes", type=int, help="HBM budget for experts, in bytes; converted to hot rows per layer.")
    @click.option("--expert-bytes", type=int,
                  help="Bytes of one expert as the hook measures them (default: from the counts' meta).")
    @click.option("--model", "model", type=click.Path(file_okay=False),
                  help="Take the bytes per expert from this checkpoint directory (its config.json): for a map of the "
                       "counted model's quantized twin (FP8 block, GPTQ), same experts, fewer bytes.")
    @click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default=None,
                  help="With --model: the engine's --dtype (default auto: the checkpoint's torch_dtype, float32 read "
                       "as bfloat16 as vLLM does).")
    @click.option("--quantization", type=click.Choice(["fp8", "fp8_per_tensor"]), default=None,
                  help="With --model: the engine's --quantization, for online FP8 of an unquantized checkpoint.")
    @click.option("--positional", is_flag=True,
                  help="Print the positional (--cpu-offload-gb) baseline for the budget instead of writing a map.")
    @click.option("--label", default="", help="A name for the map (e.g. the traffic class).")
    @click.option("--out", type=click.Path(), help="Where to write the map (atomically; directories are created).")
    @click.option("--cache-slots", "cache_slots", metavar="K|auto", default=None,
                  help="Cache tier: K of the budget's HBM rows per layer become cache slots (copies of recently used "
                       "cold experts), the other N - K the static hot set. 'auto' chooses K on --trace with the "
                       "placement simulator. Default 0 (no cache).")
    @click.option("--cache-policy", "cache_policy", metavar="lru|lfu", default="lru", show_default=True,
                  help="How the cache slots are evicted.")
    @click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
                  help="A routing trace of the same workload (pinsidecar count-boot --trace): the map's predicted "
                       "cold rate is the simulator's miss rate of the split on it, and --cache-slots auto chooses "
                       "on it. Without it, a cached map's figure comes from the counts under independent references "
                       "(pessimistic when routing reuses experts).")
    @json_option
    @handle_errors
    def build_cmd(counts: tuple[str, ...], hot_rows: int | None, hbm_bytes: int | None, expert_bytes: int | None,
                  model: str | None, dtype: str | None, quantization: str | None, positional: bool, label: str,
                  out: str | None, cache_slots: str | None, cache_policy: str, trace_path: str | None,
                  as_json: bool) -> None:
        """Make each layer's hot set from its most-selected experts in COUNTS (summed); same hot count everywhere.

        With several COUNTS, also prints a leave-one-out evaluation (the figure that says how well the map
        generalises). Always prints the positional baseline for the same budget. The map records the bytes per
        expert pin mode checks: the counted engine's, or --expert-bytes, or --model's (a quantized twin of the
        counted model routes the same, so its map comes from the same counts).

        With --cache-slots K the budget (--hot-rows N or --hbm-bytes) is split into N - K hot rows and K cache
        slots (docs/cache-tier.md).
        """
        emit(_build(counts, hot_rows, hbm_bytes, expert_bytes, positional, label, out, model, dtype, quantization,
                    cache_slots, cache_policy, trace_path), as_json, _build_human)

    @map_group.command("eval")
    @click.argument("map_path", metavar="MAP", type=click.Path(dir_okay=False))
    @click.argument("counts", type=click.Path(dir_okay=False))
    @json_option
    @handle_errors
    def eval_cmd(map_path: str, counts: str, as_json: bool) -> None:
        """Cold-selection rate of MAP on COUNTS, total and per layer, next to the positional baseline."""
        emit(_eval(map_path, counts), as_json, _eval_human)

    @map_group.command("show")
    @click.argument("map_path", metavar="MAP", type=click.Path(dir_okay=False))
    @click.option("--counts", "counts_path", type=click.Path(dir_okay=False),
                  help="Colour the heatmap by these counts' selection shares and evaluate on them.")
    @click.option("--png", type=click.Path(),
                  help="Write a heatmap of the placement and per-layer coverage (needs the plot extra: "
                       "pip install 'pinsidecar[plot]').")
    @json_option
    @handle_errors
    def show_cmd(map_path: str, counts_path: str | None, png: str | None, as_json: bool) -> None:
        """Summary of MAP (geometry, bytes, prediction), optionally a PNG heatmap."""
        if png:  # before any work: without the plot extra there is nothing to draw with
            from pinsidecar.placement.heatmap import PlotExtraMissing, require_matplotlib

            try:
                require_matplotlib()
            except PlotExtraMissing as exc:
                raise UserError(str(exc)) from None
        emap = load_map(map_path)
        inputs = [map_path, *([counts_path] if counts_path else [])]
        target = check_out_path(png, inputs, "heatmap") if png else None
        counts = load_counts(counts_path) if counts_path else None
        result: dict[str, Any] = {"map": map_path, **placement.summary(emap)}
        if counts is not None:
            result.update(counts=counts_path, evaluation=placement.evaluate(emap, counts, map_path, counts_path))
        if target is not None:
            from pinsidecar.placement.heatmap import write_map_png

            _write(lambda p: write_map_png(p, emap, counts), target)
            result["png"] = str(target)
        emit(result, as_json, _show_human)

    @map_group.command("diff")
    @click.argument("a", type=click.Path(dir_okay=False))
    @click.argument("b", type=click.Path(dir_okay=False))
    @json_option
    @handle_errors
    def diff_cmd(a: str, b: str, as_json: bool) -> None:
        """What a remap from A to B moves, and whether the reboot is a compile-cache hit."""
        ma, mb = load_map(a), load_map(b)
        emit({"a_path": a, "b_path": b, **placement.diff_maps(ma, mb)}, as_json, _diff_human)

