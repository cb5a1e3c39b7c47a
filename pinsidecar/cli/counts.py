"""``pinsidecar counts``: look inside a counts artifact, or merge several into one.

``show`` is how an operator checks a count boot before building a map from it: the dimensions, whether every
layer's selections add up to ``tokens * top_k``, and how skewed the routing is (the share taken by the hottest
quarter of experts, per layer). ``merge`` sums count boots of the same model into one file.
"""

from __future__ import annotations

from typing import Any

import click
from pinsidecar_hook.contract import load_counts

from pinsidecar import placement
from pinsidecar.cli._common import UserError, emit, handle_errors, json_option
from pinsidecar.cli.maps import check_out_path, format_table

__all__: list[str] = []  # nothing here is another package's business


def _show_human(r: dict[str, Any]) -> str:
    skew = r["skew"]
    model = r["model"]
    lines = [
        f"counts {r['path']}  workload {r['workload'] or '-'}  model {model['name'] or model['path'] or '-'}",
        f"num_layers {r['num_layers']}  num_experts {r['num_experts']}  top_k {r['top_k']}  tokens {r['tokens']}  "
        f"selections {r['selections']}",
        f"consistent (every layer sums to tokens x top_k): {'yes' if r['consistent'] else 'NO'}",
        f"skew (share of the hottest {r['skew_top_fraction']:.0%} experts): min {skew['min']:.1%}  "
        f"mean {skew['mean']:.1%}  max {skew['max']:.1%}",
        f"window {r['started_at'] or '-'} .. {r['ended_at'] or '-'}  expert_bytes {r['expert_bytes'] or 'unknown'}",
        "",
        format_table(["layer", "selections", "top-25% share", "experts used"],
                     [[p["layer_id"], p["selections"], f"{p['top_share']:.1%}", p["experts_used"]]
                      for p in r["per_layer"]]),
    ]
    return "\n".join(lines)


def register(main: click.Group) -> None:
    @main.group("counts")
    def counts_group() -> None:
        """Inspect and merge counts artifacts (from `pinsidecar count-boot` or the hook)."""

    @counts_group.command("show")
    @click.argument("counts", type=click.Path(dir_okay=False))
    @json_option
    @handle_errors
    def show_cmd(counts: str, as_json: bool) -> None:
        """Dimensions, totals, consistency and per-layer skew of COUNTS."""
        emit({"path": counts, **placement.counts_summary(load_counts(counts))}, as_json, _show_human)

    @counts_group.command("merge")
    @click.argument("counts", nargs=-1, required=True, type=click.Path(dir_okay=False))
    @click.option("--out", required=True, type=click.Path(), help="Where to write the summed counts (atomically).")
    @json_option
    @handle_errors
    def merge_cmd(counts: tuple[str, ...], out: str, as_json: bool) -> None:
        """Sum COUNTS files of the same model (same layers, experts, top-k) into one."""
        if len(counts) < 2:
            raise UserError("merge needs at least two counts files")
        target = check_out_path(out, counts, "counts")
        merged = placement.sum_counts(placement.load_counts_files(list(counts)), list(counts), record_sources=True)
        try:
            merged.save(target)
        except OSError as exc:
            raise UserError(f"cannot write {target}: {exc.strerror or exc}", "check the directory is writable"
                            ) from None
        emit({"out": str(target), "inputs": list(counts), **placement.counts_summary(merged)}, as_json,
             lambda r: f"wrote {r['out']}: {len(r['inputs'])} files, {r['tokens']} tokens, "
                       f"{r['selections']} selections")
