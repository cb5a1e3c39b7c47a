"""The one map builder: every deployable map is made here, so a map says the same things about itself whoever made it.

Two callers, one set of rules. ``pinsidecar map build`` turns an operator's flags into a budget (``--hot-rows`` or
``--hbm-bytes``), bytes per expert (the counts', ``--expert-bytes`` or ``--model``'s) and a cache split
(``--cache-slots K|auto``); a remap rebuilds the serving map from new traffic with the active map's budget, bytes
and cache (:func:`rebuild_map`). Both end in :func:`build_map`, which writes the build's record into the map's meta:

- ``source_files``: the names of the counts it was built from (the files ``map build`` read; a remap's drift windows
  or count boot);
- ``expert_bytes_from``: where bytes per expert came from, when not from the counts (``{"expert_bytes": N}`` for a
  figure given, by ``--expert-bytes`` or by the active map a remap keeps; ``{"model", "format", "dtype",
  "measured_on_gpu"}`` for ``--model``);
- ``cache``: with cache slots, how many and how they were chosen (given, or on a trace: every split tried);
- and what :func:`~pinsidecar.placement.build.build_usage_map` records itself (per-layer predicted rates, tokens,
  workloads, the counted engine's format keys, the cache model).

Why one place: a remap's candidate and an operator's map of the same traffic must be comparable file to file (the
drift watch, ``map show`` and ``map diff`` read both), and a rule written twice drifts (the two builders once wrote
different meta). :mod:`~pinsidecar.placement.build` ranks counts into a placement; this module decides the inputs
of that ranking and records them. Bad input is an :class:`~pinsidecar_hook.contract.ArtifactError` whose message
names the flag to change (the CLI prints it as ``error: ...``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pinsidecar_hook.contract import CACHE_POLICIES, ArtifactError, CountsArtifact, ExpertMap, RoutingTrace, load_trace

from pinsidecar.placement.build import build_usage_map, check_hot_rows, hot_rows_for_budget
from pinsidecar.placement.counts import sum_counts
from pinsidecar.placement.expert_bytes import CheckpointExperts, ExpertBytesError, checkpoint_experts
from pinsidecar.placement.simulate import SLOT_MIN_GAIN, HotRanking, auto_split, check_trace_geometry

__all__: list[str] = []  # the package re-exports what other packages use

# Where bytes per expert come from (ExpertBytes.source): the counted engine's figure in the counts' meta, a figure
# given explicitly (--expert-bytes, or the active map's when a remap rebuilds it), a checkpoint (--model), or
# nowhere (the counts do not record it and none was given: 0, which pin mode does not check).
FROM_COUNTS, FROM_GIVEN, FROM_MODEL, FROM_NOWHERE = "counts", "expert-bytes", "model", "unknown"


@dataclass(frozen=True)
class ExpertBytes:
    """Bytes of one expert for the map, and where the figure comes from (see :func:`resolve_expert_bytes`)."""

    value: int
    source: str  # FROM_COUNTS, FROM_GIVEN, FROM_MODEL or FROM_NOWHERE
    counted: int | None = None  # the counted engine's figure (the counts' meta), None when they do not record it
    model: dict[str, Any] | None = None  # CheckpointExperts.as_dict(), with FROM_MODEL

    @property
    def same_format(self) -> bool:
        """Whether the map is for the checkpoint format the counts were counted on. A figure other than the counted
        engine's means another format (a quantized twin: same experts, same routing, other tensors), so the map
        must not carry the counted engine's ``dtype`` and ``expert_tensors`` (pin mode would refuse the twin)."""
        return self.source in (FROM_COUNTS, FROM_NOWHERE) or self.value == self.counted

    def meta(self) -> dict[str, Any] | None:
        """The map's ``expert_bytes_from``: None when the figure is the counts' own (or unknown)."""
        if self.source == FROM_MODEL and self.model is not None:
            m = self.model
            return {"model": m["path"], "format": m["format"], "dtype": m["dtype"],
                    "measured_on_gpu": m["measured_on_gpu"]}
        if self.source == FROM_GIVEN:
            return {"expert_bytes": self.value}
        return None


@dataclass(frozen=True)
class BuiltMap:
    """A map and what its build resolved: the summed counts, all HBM rows per layer, the cache choice."""

    map: ExpertMap
    total: CountsArtifact
    hbm_rows: int  # hot rows + cache slots
    cache: dict[str, Any] | None  # the map's meta["cache"], None without slots


# ---------------------------------------------------------------------------------------------------- bytes


def counts_expert_bytes(counts: Sequence[CountsArtifact], names: Sequence[str]) -> int:
    """The counted engine's bytes per expert, as the counts record it (0 when none does); refused when the counts
    disagree or record something that is not a positive integer."""
    known = {(n, c.meta.get("expert_bytes")) for n, c in zip(names, counts, strict=True)
             if c.meta.get("expert_bytes") is not None}
    values = {v for _, v in known}
    if len(values) > 1:
        raise ArtifactError(None, f"counts files disagree on expert_bytes: {sorted(known)}",
                            "pass --expert-bytes X to say which is right")
    if not values:
        return 0
    value = values.pop()
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ArtifactError(None, f"counts meta expert_bytes={value!r} is not a positive integer",
                            "pass --expert-bytes X")
    return value


def _ids_span(ids: Sequence[int]) -> str:
    ids = list(ids)
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]} ({len(ids)})"
    return str(ids)


def model_expert_bytes(model: str, dtype: str, quantization: str | None,
                       total: CountsArtifact) -> CheckpointExperts:
    """The checkpoint's bytes per expert, after checking it is the counted model's twin (same experts and layers)."""
    try:
        info = checkpoint_experts(model, dtype=dtype, quantization=quantization)
    except ExpertBytesError as exc:
        raise ArtifactError(None, str(exc)) from None
    problems = []
    if info.num_experts != total.num_experts:
        problems.append(f"{info.num_experts} experts per layer in --model, {total.num_experts} in the counts")
    if list(info.moe_layer_ids) != list(total.layer_ids):
        problems.append(f"MoE layers {_ids_span(info.moe_layer_ids)} in --model, {_ids_span(total.layer_ids)} in "
                        "the counts")
    if info.top_k != total.top_k:
        problems.append(f"top-{info.top_k} in --model, top-{total.top_k} in the counts")
    if problems:
        raise ArtifactError(None, f"--model {model} is not a twin of the counted model: " + "; ".join(problems),
                            "pass the checkpoint of the model the counts were counted on (or its quantized twin), "
                            "or give the figure as --expert-bytes N")
    return info


def resolve_expert_bytes(counts: Sequence[CountsArtifact], names: Sequence[str], total: CountsArtifact,
                         given: int | None = None, model: str | None = None, dtype: str | None = None,
                         quantization: str | None = None) -> ExpertBytes:
    """Bytes per expert for the map, and where they come from: ``given`` (``--expert-bytes``), else ``model``'s
    checkpoint (``--model``, with the engine's ``dtype`` and ``quantization``), else the counts' meta (the engine
    the counts were counted on)."""
    if given is not None and model is not None:
        raise ArtifactError(None, "--expert-bytes and --model both give the bytes per expert", "pass one of them")
    if model is None and (dtype is not None or quantization is not None):
        raise ArtifactError(None, "--dtype and --quantization describe the engine that will run --model",
                            "add --model DIR, or drop them")
    counted = counts_expert_bytes(counts, names)
    if given is not None:
        if given <= 0:
            raise ArtifactError(None, f"--expert-bytes must be positive, got {given}")
        return ExpertBytes(given, FROM_GIVEN, counted or None)
    if model is not None:
        info = model_expert_bytes(model, dtype or "auto", quantization, total)
        return ExpertBytes(info.expert_bytes, FROM_MODEL, counted or None, info.as_dict())
    return ExpertBytes(counted, FROM_COUNTS if counted else FROM_NOWHERE, counted or None)


# ---------------------------------------------------------------------------------------------------- budget


def resolve_hbm_rows(hot_rows: int | None, hbm_bytes: int | None, expert_bytes: int, counts: CountsArtifact) -> int:
    """HBM rows per layer (hot rows + cache slots) from exactly one budget: ``hot_rows``, or ``hbm_bytes`` at
    ``expert_bytes`` a row."""
    if (hot_rows is None) == (hbm_bytes is None):
        raise ArtifactError(None, "give exactly one budget: --hot-rows N or --hbm-bytes B")
    if hot_rows is not None:
        check_hot_rows(hot_rows, counts.num_experts)
        return hot_rows
    assert hbm_bytes is not None
    if expert_bytes <= 0:
        raise ArtifactError(
            None, f"--hbm-bytes {hbm_bytes} needs the size of one expert, and the counts do not record it",
            "pass --expert-bytes X (bytes of one expert: weights, scales and biases of all its tensors), "
            "or give the budget as --hot-rows N",
        )
    return hot_rows_for_budget(hbm_bytes, counts.num_layers, expert_bytes, counts.num_experts)


# ---------------------------------------------------------------------------------------------------- cache split


def check_cache_policy(policy: str) -> str:
    """``policy`` when it is a cache policy the hook runs (``lru``, ``lfu``)."""
    if policy not in CACHE_POLICIES:
        hint = (" (static is the simulator's baseline, not a cache: a static set of N rows is a map with "
                "--cache-slots 0)" if policy == "static" else "")
        raise ArtifactError(None, f"--cache-policy {policy!r} is not one of {', '.join(CACHE_POLICIES)}{hint}",
                            "pass --cache-policy lru or --cache-policy lfu")
    return policy


def check_auto_has_trace(slots: int | str, has_trace: bool) -> None:
    """``--cache-slots auto`` chooses on a routing trace: refuse it without one (before any file is read)."""
    if slots == "auto" and not has_trace:
        raise ArtifactError(None, "--cache-slots auto chooses the split on a routing trace, and none was given",
                            "add --trace TRACE.npz (recorded with `pinsidecar count-boot --trace`), or pass "
                            "--cache-slots K")


def load_build_trace(trace_path: str, total: CountsArtifact) -> RoutingTrace:
    """The routing trace at ``trace_path``, refused when it is of another model than the counts (the simulator's
    check, naming both sides)."""
    trace = load_trace(trace_path)
    ranking = HotRanking.from_counts(total.counts, "counts", total.layer_ids)
    check_trace_geometry(trace, ranking, trace_path, "the counts")
    return trace


def choose_cache_slots(slots: int | str, policy: str, hbm_rows: int, total: CountsArtifact,
                       trace: RoutingTrace | None, trace_path: str | None) -> tuple[int, dict[str, Any]]:
    """K, and what the choice was (recorded in the map's meta as ``cache``). ``auto`` runs the simulator's
    :func:`~pinsidecar.placement.auto_split` on the trace, the hot set ranked by the counts (as the map's).

    This is what ``map build --cache-slots K|auto`` runs; benchmarks that ask "which split would map build choose"
    call it as it is."""
    if slots != "auto":
        assert isinstance(slots, int)
        if slots > hbm_rows - 1:
            raise ArtifactError(None, f"--cache-slots {slots} leaves no hot row: the budget gives {hbm_rows} HBM rows "
                                f"per layer, and the slots are taken out of them (H = {hbm_rows} - {slots})",
                                f"pass --cache-slots 0..{hbm_rows - 1}, or a larger budget")
        info: dict[str, Any] = {"slots": slots, "policy": policy, "hbm_rows": hbm_rows, "hot_rows": hbm_rows - slots,
                                "chosen": "given"}
        return slots, info
    check_auto_has_trace(slots, trace is not None)
    assert trace is not None
    ranking = HotRanking.from_counts(total.counts, "counts", total.layer_ids)
    # A map keeps at least one hot row; the simulator's grid also tries K = N (no hot row), which is only reported.
    auto = auto_split(trace, ranking, hbm_rows, policy, train=trace, max_slots=hbm_rows - 1)
    grid = [r.cache_slots for r in auto.tuning]
    admissible = [i for i, k in enumerate(grid) if k <= hbm_rows - 1]
    chosen = auto.chosen
    k = grid[chosen]
    info = {
        "slots": k, "policy": policy, "hbm_rows": hbm_rows, "hot_rows": hbm_rows - k, "chosen": "auto",
        "chosen_on": "trace", "trace": os.path.basename(trace_path or ""), "trace_tokens": trace.tokens,
        "cross_fitted": auto.cross_fitted,
        "rule": f"lowest miss rate on the trace, each half replayed with the hot set ranked on the other half"
                f"{'' if auto.cross_fitted else ' (the trace is too short to halve: ranked on all of it)'}; equal "
                f"rates to fewer host fetches, then fewer slots; at least one hot row; slots only when they miss "
                f"{SLOT_MIN_GAIN:.0%} fewer than no slots",
        # miss_rate: the split on the whole trace, hot set ranked by the counts (the map's own figure, in-sample);
        # tuning_miss_rate: what the choice was made on (cross-fitted, so a static set is not graded on its own
        # training tokens)
        "tried": [{"cache_slots": r.cache_slots, "hot_rows": r.hot_rows, "miss_rate": r.miss_rate,
                   "host_fetches_per_token": r.host_fetches_per_token, "tuning_miss_rate": t.miss_rate,
                   "chosen": i == chosen, **({} if i in admissible else {"admissible": False})}
                  for i, (r, t) in enumerate(zip(auto.results, auto.tuning, strict=True))],
    }
    return k, info


# ---------------------------------------------------------------------------------------------------- the map


def build_map(counts: Sequence[CountsArtifact], hbm_rows: int, expert_bytes: ExpertBytes, *,
              names: Sequence[str], label: str = "", cache_slots: int | str = 0, cache_policy: str = "lru",
              trace: RoutingTrace | None = None, trace_path: str | None = None) -> BuiltMap:
    """The map of ``counts`` (summed) for ``hbm_rows`` HBM rows per layer, ``cache_slots`` of them (a number, or
    ``"auto"`` to choose on ``trace``) cache slots under ``cache_policy``, the rest the static hot set; its meta
    records the build (module docstring). ``names`` name the counts in the meta and in error messages;
    ``trace_path`` names the trace."""
    names = list(names)
    policy = check_cache_policy(cache_policy)
    total = sum_counts(counts, names)
    slots, cache_info = choose_cache_slots(cache_slots, policy, hbm_rows, total, trace, trace_path)
    build_meta: dict[str, Any] = {"source_files": [os.path.basename(n) for n in names]}
    bytes_from = expert_bytes.meta()
    if bytes_from is not None:
        build_meta["expert_bytes_from"] = bytes_from
    with_cache = bool(slots) or cache_slots == "auto"
    if with_cache:
        build_meta["cache"] = cache_info
    emap = build_usage_map(counts, hbm_rows - slots, label, expert_bytes=expert_bytes.value, names=names,
                           meta=build_meta, same_format=expert_bytes.same_format, cache_slots=slots,
                           cache_policy=policy, trace=trace,
                           trace_name=os.path.basename(trace_path) if trace_path else "the trace")
    return BuiltMap(emap, total, hbm_rows, cache_info if with_cache else None)


def rebuild_map(counts: Sequence[CountsArtifact], active: ExpertMap, *, label: str = "",
                names: Sequence[str] | None = None) -> ExpertMap:
    """A map of ``counts`` with ``active``'s geometry: its HBM rows, cache slots and policy, and bytes per expert.

    What a remap deploys, and what the drift watch's projected gain scores: the same geometry keeps the reboot a
    compile-cache hit and the candidate eligible for an in-place apply, and a remap never drops the cache. The
    active map's bytes per expert are given (``expert_bytes_from``), as ``map build --expert-bytes`` gives them.
    ``names`` default to each counts' workload."""
    names = list(names) if names is not None else [c.workload or f"counts{i}" for i, c in enumerate(counts)]
    counted = counts_expert_bytes(counts, names)
    xbytes = (ExpertBytes(active.expert_bytes, FROM_GIVEN, counted or None) if active.expert_bytes > 0
              else ExpertBytes(0, FROM_NOWHERE, counted or None))
    return build_map(counts, active.hbm_rows, xbytes, names=names, label=label, cache_slots=active.cache_slots,
                     cache_policy=active.cache_policy).map
