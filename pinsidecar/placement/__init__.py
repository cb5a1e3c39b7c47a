"""Placement: from counts to row maps, and the figures that compare placements.

Everything here is a pure function over the contract's artifact objects (:mod:`pinsidecar_hook.contract`, the only
place the file formats live); the CLI (``pinsidecar map ...``, ``pinsidecar counts ...``), the demo and the remap
pipeline do the I/O around them. Import from this package; the modules behind it are:

- :mod:`~pinsidecar.placement.counts` — load, check and merge counts; skew figures;
- :mod:`~pinsidecar.placement.build` — the usage map and the positional baseline;
- :mod:`~pinsidecar.placement.builder` — the one map builder (``map build`` and a remap's candidate): budget,
  bytes per expert, cache split, and the build's record in the map's meta;
- :mod:`~pinsidecar.placement.expert_bytes` — bytes per expert per checkpoint format, read from a checkpoint
  directory (for a map built from one model's counts for its quantized twin);
- :mod:`~pinsidecar.placement.evaluate` — cold-selection rates, leave-one-out, diffs and summaries;
- :mod:`~pinsidecar.placement.simulate` — a routing trace replayed against hot rows plus a small expert cache
  (the cache tier's what-if);
- :mod:`~pinsidecar.placement.prefetch` — a routing trace replayed against a hot set and a predictor of each step's
  cold experts (the prefetch's what-if: recall, precision, link traffic);
- :mod:`~pinsidecar.placement.heatmap` — a PNG of a map over counts. Not re-exported here: it needs the optional
  ``plot`` extra (matplotlib), and nothing else in placement does.
"""

from pinsidecar.placement.build import (
    Placement,
    PlacementMask,
    build_usage_map,
    check_hot_rows,
    hot_rows_for_budget,
    positional_for,
    positional_mask,
    save_map,
)
from pinsidecar.placement.builder import (
    ExpertBytes,
    build_map,
    check_auto_has_trace,
    check_cache_policy,
    choose_cache_slots,
    load_build_trace,
    rebuild_map,
    resolve_expert_bytes,
    resolve_hbm_rows,
)
from pinsidecar.placement.counts import (
    SKEW_TOP_FRACTION,
    check_same_geometry,
    counts_summary,
    load_counts_files,
    sum_counts,
    top_share,
)
from pinsidecar.placement.evaluate import (
    check_compatible,
    diff_maps,
    evaluate,
    leave_one_out,
    summary,
)
from pinsidecar.placement.expert_bytes import (
    CheckpointExperts,
    ExpertBytesError,
    checkpoint_experts,
    fp8_block_expert_bytes,
    fp8_per_tensor_expert_bytes,
    gptq_expert_bytes,
    unquantized_expert_bytes,
)
from pinsidecar.placement.prefetch import PREDICTORS, evaluate_prefetch
from pinsidecar.placement.simulate import (
    POLICIES,
    SLOT_MIN_GAIN,
    TUNE_FRACTION,
    HotRanking,
    auto_split,
    check_trace_geometry,
    simulate,
)

__all__ = [
    "POLICIES",
    "PREDICTORS",
    "TUNE_FRACTION",
    "HotRanking",
    "PlacementMask",
    "auto_split",
    "build_map",
    "build_usage_map",
    "check_auto_has_trace",
    "check_cache_policy",
    "check_compatible",
    "check_trace_geometry",
    "choose_cache_slots",
    "counts_summary",
    "diff_maps",
    "evaluate",
    "evaluate_prefetch",
    "leave_one_out",
    "load_build_trace",
    "load_counts_files",
    "positional_for",
    "rebuild_map",
    "resolve_expert_bytes",
    "resolve_hbm_rows",
    "save_map",
    "simulate",
    "sum_counts",
    "summary",
]
