"""A test's figure, printed and kept: the numbers a test measured (a drain-reboot's stall, a crash's downtime) go to
its output, and to ``$PINSIDECAR_FIGURES_DIR/<name>.json`` when that is set, where a benchmark run or the device
lane collects them (``bench/results/`` holds the committed ones, with their commands)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

FIGURES_DIR_ENV = "PINSIDECAR_FIGURES_DIR"


def record_figure(name: str, figure: dict[str, Any], *, title: str | None = None,
                  doc: dict[str, Any] | None = None) -> Path | None:
    """Print ``figure`` under ``title`` (default: ``name`` in capitals) and write ``doc`` (default: the figure) to
    ``$PINSIDECAR_FIGURES_DIR/<name>.json`` when the variable is set; returns the file written, if any."""
    print(f"\n{title or name.upper().replace('_', ' ') + ' FIGURE'}:", json.dumps(figure, indent=1))
    out_dir = os.environ.get(FIGURES_DIR_ENV)
    if not out_dir:
        return None
    out = Path(out_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figure if doc is None else doc, indent=1) + "\n")
    return out
