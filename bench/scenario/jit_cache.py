"""Which Triton kernels an engine compiled, and when: read back from the Triton cache folder it wrote.

A step that meets a kernel variant for the first time (a new batch shape, a new specialization of an integer
argument) compiles it on the spot, and every stream waits: on the H200, with a cold Triton cache, every wait of
0.25 s or more outside the reboot and kill holds (1-3.5 s each, in the first minute of serving) overlapped a
compile of vLLM's ``fused_moe_kernel`` or the hook's ``_partition_kernel``; with a warm cache there were none
(``bench/results/heal_h200_c*_2026-12-04.json``, ``jit``). Triton writes each compile's files into one folder of
its cache (``TRITON_CACHE_DIR``) as the compile goes, so the folder's file times bound the compile. Give the
engine a cache folder of its own and this module lists what it compiled after a given moment, so a figure can say
whether a long gap was a compile (:func:`bench.scenario.figures.long_gaps`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

GROUP_PREFIX = "__grp__"  # Triton's index of a compile's files; the kernel's own files are named after it


def compiles_since(cache_dir: Path, since: float) -> list[dict[str, Any]]:
    """Kernels compiled into ``cache_dir`` at or after wall-clock ``since``: ``{"kernel", "t", "t_end"}`` with
    times in seconds from ``since`` (first and last file written), in time order. A folder written earlier is a
    compile an earlier process did: loading it later writes nothing, so it is not listed. Missing folder: []."""
    out = []
    try:
        folders = [d for d in cache_dir.iterdir() if d.is_dir()]
    except OSError:
        return []
    for d in folders:
        try:
            files = [(f.name, f.stat().st_mtime) for f in os.scandir(d) if f.is_file()]
        except OSError:
            continue
        if not files or max(t for _, t in files) < since:
            continue
        names = [n for n, _ in files if not n.startswith(GROUP_PREFIX)] or [n for n, _ in files]
        kernel = Path(sorted(names, key=len)[0]).stem
        out.append({"kernel": kernel, "t": round(min(t for _, t in files) - since, 3),
                    "t_end": round(max(t for _, t in files) - since, 3)})
    return sorted(out, key=lambda c: c["t"])


def per_kernel(compiles: list[dict[str, Any]]) -> dict[str, int]:
    """How many variants of each kernel were compiled."""
    counts: dict[str, int] = {}
    for c in compiles:
        counts[c["kernel"]] = counts.get(c["kernel"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
