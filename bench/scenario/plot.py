"""The heal scenario's document as one picture (``bench/heal_scenario.py --png``, and the test's figure).

Kept apart from the scenario so that the scenario needs no plotting library: matplotlib is imported only when a
picture is drawn (it is the ``plot`` extra).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.scenario.figures import RECOVERED_SHARE

__all__: list[str] = []  # nothing here is another package's business


def draw_timeline(doc: dict[str, Any], png: Path) -> Path:
    """The run as one picture: decode tok/s (each second, and the rolling median), the cold rate (live and per
    drift window) and the longest wait per second, the stages shaded and labelled, the shift, the remap's apply,
    the drain-reboot and the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = doc["samples"]
    t = [s["t"] for s in samples]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, sharex=True, figsize=(12, 8), height_ratios=[3, 2, 1.5])
    rate = [s["tok_s"] for s in samples]
    ax1.plot(t, rate, lw=0.8, color="tab:blue", label="decode tok/s (each second)")
    rec = doc.get("recovery") or {}
    w = int(rec.get("rolling_s") or 5)
    ax1.plot(t, [statistics.median(rate[max(0, i - w + 1):i + 1]) for i in range(len(rate))], lw=1.8,
             color="navy", label=f"rolling median ({w} s)")
    if rec.get("baseline_tok_s"):
        ax1.axhline(rec["baseline_tok_s"] * rec.get("share", RECOVERED_SHARE), ls=":", color="gray",
                    label=f"{rec.get('share', RECOVERED_SHARE):g} x pre-shift rate")
    ax1.set_ylabel("tok/s")
    ax2.plot(t, [s.get("live_cold_rate") for s in samples], color="tab:red", lw=1.2, label="live cold rate (stats)")
    win = doc.get("windows") or []
    ax2.scatter([x["t"] for x in win], [x["cold_rate"] for x in win], s=14, color="darkred", zorder=3,
                label="drift window cold rate")
    ax2.set_ylabel("cold rate")
    ax2.set_ylim(bottom=0)
    ax3.plot(t, [s["stall_s"] for s in samples], color="tab:purple", lw=1, label="longest wait (s)")
    ax3.plot(t, [s.get("gate_held") or 0 for s in samples], color="tab:orange", lw=1, label="gate: held requests")
    ax3.set_ylabel("stall s / held")
    ax3.set_xlabel("seconds since the run began")
    colors = ("#f2f2f2", "#dde8f5")
    for n, s in enumerate(doc["stages"]):
        for ax in (ax1, ax2, ax3):
            ax.axvspan(s["start_s"], s["end_s"], color=colors[n % 2], zorder=0)
        ax1.text((s["start_s"] + s["end_s"]) / 2, 1.01 + 0.05 * (n % 2), s["stage"],  # staggered: short stages
                 transform=ax1.get_xaxis_transform(), ha="center", va="bottom", fontsize=8)
    marks = [(doc["shift_t"], "shift")] if doc.get("shift_t") is not None else []
    for w in (doc.get("remap") or {}).get("waits") or []:
        if w["state"] == "applying" and w.get("t") is not None:
            marks.append((w["t"], "apply"))
    if (doc.get("kill") or {}).get("t") is not None:
        marks += [(doc["kill"]["t"], "SIGKILL"), (doc["kill"].get("back_t"), "serving again")]
    marks = [(x, label) for x, label in marks if x is not None]
    for n, (x, label) in enumerate(marks):
        for ax in (ax1, ax2, ax3):
            ax.axvline(x, color="black", lw=0.8, ls="--")
        ax1.text(x, 0.95 - 0.07 * (n % 2), f" {label}", transform=ax1.get_xaxis_transform(), fontsize=8, va="top")
    for ax in (ax1, ax2, ax3):
        ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
        ax.grid(alpha=0.3)
    apply = (doc.get("remap") or {}).get("apply") or {}
    title = (f"heal scenario: {doc['options']['clients']} clients; remap {apply.get('result')} in place "
             f"({apply.get('rows')} rows, {apply.get('seconds')} s); recovery "
             f"{rec.get('recovery_s')} s; lost {doc['requests']['lost']}, failed {doc['requests']['failed']}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
