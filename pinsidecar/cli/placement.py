"""``pinsidecar placement``: what-ifs for placements a static map cannot express, replayed on recorded routing.

``simulate`` answers whether a cache tier would pay before anyone builds one: of N HBM rows per layer, keep H
static (a map's hot set, or the most selected experts of counts or of a training trace) and let K = N - H follow
the traffic, and count the selections that still go to host memory. ``prefetch`` answers whether predicting each
step's cold experts from the last steps' choice would hide their reads: its recall and precision, and the experts
moved over the link. The hot set never comes from the trace being replayed: that would grade the placement on the
data it was chosen from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import structlog
from pinsidecar_hook.contract import RoutingTrace, load_counts, load_map, load_trace

from pinsidecar import placement
from pinsidecar.cli._common import UserError, emit, handle_errors, json_option, parse_cache_slots
from pinsidecar.cli.maps import format_table

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


def _ranking(map_path: str | None, counts_path: str | None, train_path: str | None,
             trace_path: str) -> tuple[placement.HotRanking, str, str, RoutingTrace | None]:
    """The hot set's source: (ranking, its kind, its description, the training trace when it is one)."""
    given = [(k, p) for k, p in (("map", map_path), ("counts", counts_path), ("train", train_path)) if p]
    if len(given) != 1:
        raise UserError("give exactly one source for the hot set: --map MAP, --counts COUNTS or --train TRACE",
                        "the hot set is never taken from the simulated trace itself")
    kind, path = given[0]
    if kind == "map":
        return placement.HotRanking.from_map(load_map(path)), kind, f"map {path}", None
    if kind == "counts":
        counts = load_counts(path)
        return placement.HotRanking.from_counts(counts.counts, kind, counts.layer_ids), kind, f"counts {path}", None
    if Path(path).resolve() == Path(trace_path).resolve():
        log.warning("train_is_the_simulated_trace", trace=trace_path,
                    hint="the hot set is ranked on the data it is graded on; the figures are in-sample")
    train = load_trace(path)
    return (placement.HotRanking.from_counts(train.counts(), kind, train.layer_ids), kind, f"training trace {path}",
            train)


def _simulate(trace_path: str, map_path: str | None, counts_path: str | None, train_path: str | None,
              hbm_rows: int, cache_slots: str, policy: str, batch: int) -> dict[str, Any]:
    parsed = parse_cache_slots(cache_slots)  # before any file is read: a typo costs nothing
    slots = None if parsed == "auto" else int(parsed)
    ranking, kind, source, train = _ranking(map_path, counts_path, train_path, trace_path)
    trace = load_trace(trace_path)
    placement.check_trace_geometry(trace, ranking, trace_path, source)
    result: dict[str, Any] = {
        "trace": trace_path, "tokens": trace.tokens, "layers": trace.num_layers, "num_experts": trace.num_experts,
        "top_k": trace.top_k, "hbm_rows": hbm_rows, "batch": batch, "hot_from": kind, "hot_source": source,
    }
    if slots is not None:
        result["results"] = [placement.simulate(trace, ranking, hbm_rows, slots, policy, batch).as_dict()]
        return result
    auto = placement.auto_split(trace, ranking, hbm_rows, policy, batch, train=train)
    result["results"] = [{**r.as_dict(), "tuning_miss_rate": t.miss_rate, "chosen": i == auto.chosen}
                         for i, (r, t) in enumerate(zip(auto.results, auto.tuning, strict=True))]
    result["auto"] = {
        "chosen_on": auto.tuned_on,  # "train": the --train trace; "trace_head": TRACE's first tuning_tokens
        "tuning_tokens": auto.tuning_tokens,
        "tuning_fraction": None if auto.tuned_on == "train" else placement.TUNE_FRACTION,
        # on --train the hot set of each tuning figure is ranked on the other half of the training trace
        "cross_fitted": auto.cross_fitted,
        "cache_slots": [r.cache_slots for r in auto.results],
    }
    return result


def _simulate_human(r: dict[str, Any]) -> str:
    lines = [
        f"trace {r['trace']}: {r['tokens']} tokens, {r['layers']} layers x {r['num_experts']} experts, "
        f"top-{r['top_k']}; steps of {r['batch']} token(s)",
        f"{r['hbm_rows']} HBM rows per layer; hot set from {r['hot_source']}",
    ]
    auto = r.get("auto")
    if auto:
        where = ("the training trace" if auto["chosen_on"] == "train"
                 else f"the trace's first {auto['tuning_tokens']} tokens")
        if auto.get("cross_fitted"):
            where += " (each half replayed with the hot set ranked on the other half)"
        lines.append(f"split chosen on {where} (lowest miss rate there); figures below are on the whole trace")
    headers = ["hot rows", "cache slots", "policy", "miss rate", "host fetches/token"]
    rows = [[x["hot_rows"], x["cache_slots"], x["policy"], f"{x['miss_rate']:.2%}",
             f"{x['host_fetches_per_token']:.3f}"] for x in r["results"]]
    if auto:
        headers += ["tuning miss rate", "chosen"]
        for row, x in zip(rows, r["results"], strict=True):
            row += [f"{x['tuning_miss_rate']:.2%}", "<-" if x["chosen"] else ""]
    lines += ["", format_table(headers, rows)]
    return "\n".join(lines)


def _prefetch(trace_path: str, map_path: str | None, counts_path: str | None, train_path: str | None,
              hot_rows: int | None, predictor: str, windows: str, batch: int) -> dict[str, Any]:
    try:
        window_list = [int(w) for w in windows.split(",") if w.strip()]
    except ValueError:
        raise UserError(f"--window {windows!r} is not a comma-separated list of step counts", "pass e.g. 1,2,4") \
            from None
    if not window_list:
        raise UserError("--window names no window", "pass e.g. 1,2,4")
    ranking, kind, source, _train = _ranking(map_path, counts_path, train_path, trace_path)
    if hot_rows is None:
        if ranking.fixed_hot_rows is None:
            raise UserError("--hot-rows is needed with --counts or --train", "pass the hot rows per layer the "
                            "budget buys (a map brings its own)")
        hot_rows = ranking.fixed_hot_rows
    trace = load_trace(trace_path)
    placement.check_trace_geometry(trace, ranking, trace_path, source)
    results = [placement.evaluate_prefetch(trace, ranking, hot_rows, predictor, w, batch).as_dict()
               for w in window_list]
    return {"trace": trace_path, "tokens": trace.tokens, "layers": trace.num_layers, "num_experts": trace.num_experts,
            "top_k": trace.top_k, "hot_rows": hot_rows, "batch": batch, "hot_from": kind, "hot_source": source,
            "results": results}


def _prefetch_human(r: dict[str, Any]) -> str:
    lines = [
        f"trace {r['trace']}: {r['tokens']} tokens, {r['layers']} layers x {r['num_experts']} experts, "
        f"top-{r['top_k']}; steps of {r['batch']} token(s)",
        f"{r['hot_rows']} hot rows per layer from {r['hot_source']}; per layer and step, in experts:",
    ]
    headers = ["predictor", "window", "recall", "precision", "cold today", "prefetched", "still missed",
               "moved with prefetch"]
    rows = [[x["predictor"], x["window"], f"{x['recall']:.1%}", f"{x['precision']:.1%}", f"{x['cold_per_step']:.2f}",
             f"{x['prefetched_per_step']:.2f}", f"{x['missed_per_step']:.2f}", f"{x['moved_per_step']:.2f}"]
            for x in r["results"]]
    return "\n".join([*lines, "", format_table(headers, rows)])


def register(main: click.Group) -> None:
    @main.group("placement")
    def placement_group() -> None:
        """What-ifs beyond a static map, replayed on a routing trace (a cache tier, a prefetch)."""

    @placement_group.command("simulate")
    @click.argument("trace", type=click.Path(dir_okay=False))
    @click.option("--map", "map_path", type=click.Path(dir_okay=False),
                  help="Hot set: this map's hot experts (it fixes the hot rows: --hbm-rows minus --cache-slots must "
                       "equal them).")
    @click.option("--counts", "counts_path", type=click.Path(dir_okay=False),
                  help="Hot set: each layer's most selected experts in this counts file.")
    @click.option("--train", "train_path", type=click.Path(dir_okay=False),
                  help="Hot set: each layer's most selected experts in this training trace (and, with --cache-slots "
                       "auto, the trace the split is chosen on).")
    @click.option("--hbm-rows", type=int, required=True, help="HBM rows per layer: hot rows plus cache slots.")
    @click.option("--cache-slots", default="0", show_default=True,
                  help="Rows of --hbm-rows that follow the traffic, or auto: try 0, N/8, N/4, ... N and choose.")
    @click.option("--policy", type=click.Choice(placement.POLICIES), default="lru", show_default=True,
                  help="What a cache slot does: lru or lfu eviction, or static (the next experts by rank, filled "
                       "once: the baseline).")
    @click.option("--batch", type=int, default=1, show_default=True,
                  help="Tokens per step; one step's misses of one expert share one host fetch.")
    @json_option
    @handle_errors
    def simulate_cmd(trace: str, map_path: str | None, counts_path: str | None, train_path: str | None,
                     hbm_rows: int, cache_slots: str, policy: str, batch: int, as_json: bool) -> None:
        """Replay TRACE against HBM rows split into a static hot set and cache slots; print miss rates.

        A selection is a miss when its expert is neither hot nor in a slot at the start of its step; it is then
        read from host memory. With --cache-slots auto, the split is chosen on --train if given, else on TRACE's
        first quarter, and every split tried is reported on all of TRACE.
        """
        emit(_simulate(trace, map_path, counts_path, train_path, hbm_rows, cache_slots, policy, batch), as_json,
             _simulate_human)

    @placement_group.command("prefetch")
    @click.argument("trace", type=click.Path(dir_okay=False))
    @click.option("--map", "map_path", type=click.Path(dir_okay=False),
                  help="Hot set: this map's hot experts (and its hot rows).")
    @click.option("--counts", "counts_path", type=click.Path(dir_okay=False),
                  help="Hot set: each layer's most selected experts in this counts file.")
    @click.option("--train", "train_path", type=click.Path(dir_okay=False),
                  help="Hot set: each layer's most selected experts in this training trace.")
    @click.option("--hot-rows", type=int, default=None, help="Hot rows per layer (a map brings its own).")
    @click.option("--predictor", type=click.Choice(placement.PREDICTORS), default="last-step", show_default=True,
                  help="How each step's cold experts are predicted (last-step: the layer's picks in the last "
                       "--window steps).")
    @click.option("--window", "windows", default="1,2,4", show_default=True,
                  help="Steps of history the last-step predictor looks back, one figure per value.")
    @click.option("--batch", type=int, default=1, show_default=True, help="Tokens per step.")
    @json_option
    @handle_errors
    def prefetch_cmd(trace: str, map_path: str | None, counts_path: str | None, train_path: str | None,
                     hot_rows: int | None, predictor: str, windows: str, batch: int, as_json: bool) -> None:
        """Replay TRACE against a hot set and predict each step's cold experts from the last steps' choice.

        Prints the predictor's recall (the share of cold-expert reads a prefetch would have on their way), its
        precision (the share of prefetched experts the step uses) and, per layer and step, the experts read over
        the link today and with the prefetch.
        """
        emit(_prefetch(trace, map_path, counts_path, train_path, hot_rows, predictor, windows, batch), as_json,
             _prefetch_human)
