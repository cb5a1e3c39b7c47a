"""PNG pictures of a placement: which experts are hot in each layer, and how much of the traffic that covers.

``map show --png`` draws this for a person deciding whether a map is sane: a layers x experts grid (hot/cold, or
each expert's share of its layer's selections with the cold ones dimmed, when counts are given) next to the
per-layer coverage (the share of selections that land on hot experts). It uses matplotlib's object API on the Agg
canvas (no pyplot state, no display), renders to memory, and writes atomically, so a failed render leaves no file.

matplotlib is an optional extra (``pip install 'pinsidecar[plot]'``): the daemon never draws, so it should not
carry a plotting library. This module imports without it; drawing without it raises :class:`PlotExtraMissing`,
whose message names the extra. Call :func:`require_matplotlib` before any other work to fail early.
"""

from __future__ import annotations

import io
import os
from types import ModuleType
from typing import Any

import numpy as np
from pinsidecar_hook.contract import CountsArtifact, ExpertMap, atomic_write_bytes

from pinsidecar.placement.evaluate import check_compatible

__all__ = ["PlotExtraMissing", "require_matplotlib", "write_map_png"]

PLOT_EXTRA_HINT = "install the plot extra: pip install 'pinsidecar[plot]'"

_HOT = "#d9480f"  # hot (HBM): strong
_COLD = "#c8d3e0"  # cold (host memory): light


class PlotExtraMissing(RuntimeError):
    """matplotlib is not installed, so no picture can be drawn. The message says how to install it."""


def require_matplotlib() -> ModuleType:
    """Import matplotlib (Agg, no display) or raise :class:`PlotExtraMissing` naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise PlotExtraMissing(f"drawing a map needs matplotlib, which is not installed ({PLOT_EXTRA_HINT})"
                               ) from None
    return matplotlib


def render_map_png(emap: ExpertMap, counts: CountsArtifact | None = None, title: str = "", dpi: int = 110) -> bytes:
    """The picture as PNG bytes. With ``counts``, colour by selection share and compute coverage from them."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    if counts is not None:
        check_compatible(emap, counts)
    hot = emap.hot_mask()
    coverage: np.ndarray | None = None
    if counts is not None:
        sel = counts.counts.astype(np.float64)
        totals = sel.sum(axis=1, keepdims=True)
        share = np.where(totals > 0, sel / np.maximum(totals, 1), 0.0)
        coverage = np.where(totals[:, 0] > 0, (share * hot).sum(axis=1), np.nan)
    elif emap.meta.get("predicted_cold_rate_per_layer") is not None:
        rates = np.asarray(emap.meta["predicted_cold_rate_per_layer"], dtype=np.float64)
        if rates.shape == (emap.num_layers,):
            coverage = 1.0 - rates

    height = max(3.0, min(12.0, 0.18 * emap.num_layers + 1.8))
    fig = Figure(figsize=(12, height), dpi=dpi)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 3, width_ratios=[5, 0.12, 1.2], wspace=0.3)
    ax = fig.add_subplot(grid[0, 0])
    extent = (-0.5, emap.num_experts - 0.5, emap.num_layers - 0.5, -0.5)
    if counts is not None:
        positive = share[share > 0]
        vmin = float(positive.min()) if positive.size else 1e-6
        img = ax.imshow(np.where(share > 0, share, np.nan), aspect="auto", interpolation="nearest", cmap="viridis",
                        norm=LogNorm(vmin=vmin, vmax=max(vmin * 10, float(share.max()))), extent=extent)
        ax.imshow(np.ma.masked_where(hot, np.ones_like(share)), aspect="auto", interpolation="nearest",
                  cmap=ListedColormap(["white"]), alpha=0.6, extent=extent)
        fig.colorbar(img, cax=fig.add_subplot(grid[0, 1]), label="share of the layer's selections")
        ax.set_xlabel("expert id (cold experts dimmed)")
    else:
        ax.imshow(hot.astype(np.int8), aspect="auto", interpolation="nearest", cmap=ListedColormap([_COLD, _HOT]),
                  vmin=0, vmax=1,
                  extent=extent)
        ax.set_xlabel("expert id (orange = hot in HBM, grey = cold in host memory)")
    ax.set_ylabel("MoE layer")
    _layer_ticks(ax, emap)
    ax.set_title(title or _default_title(emap), fontsize=10, loc="left")

    cov_ax = fig.add_subplot(grid[0, 2], sharey=ax)
    if coverage is not None:
        cold_rate = 1.0 - coverage
        y = np.arange(emap.num_layers)
        cov_ax.barh(y, cold_rate, color="#1864ab", height=0.8)
        top = float(np.nanmax(cold_rate)) if np.isfinite(cold_rate).any() else 0.0
        cov_ax.set_xlim(0, max(top * 1.1, 1e-3))
        mean = float(np.nanmean(cold_rate)) if np.isfinite(cold_rate).any() else 0.0
        cov_ax.axvline(mean, color="black", lw=0.8, ls="--")
        cov_ax.set_xlabel(f"cold rate = 1 - coverage\n({'from counts' if counts is not None else 'predicted'}; "
                          f"mean {mean:.2%})", fontsize=8)
        cov_ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
        cov_ax.tick_params(axis="x", labelsize=7)
    else:
        cov_ax.text(0.5, 0.5, "no per-layer\ncoverage\n(pass --counts)", ha="center", va="center",
                    transform=cov_ax.transAxes, fontsize=9)
        cov_ax.set_xticks([])
    cov_ax.tick_params(labelleft=False)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def write_map_png(path: str | os.PathLike[str], emap: ExpertMap, counts: CountsArtifact | None = None,
                  title: str = "") -> None:
    """Render and write atomically (the PNG appears whole or not at all)."""
    atomic_write_bytes(path, render_map_png(emap, counts, title))


def _layer_ticks(ax: Any, emap: ExpertMap) -> None:
    step = max(1, emap.num_layers // 20)
    idx = list(range(0, emap.num_layers, step))
    ax.set_yticks(idx)
    ax.set_yticklabels([str(emap.layer_ids[i]) for i in idx], fontsize=7)


def _default_title(emap: ExpertMap) -> str:
    label = f"{emap.label} " if emap.label else ""
    pred = "" if emap.predicted_cold_rate is None else f", predicted cold {emap.predicted_cold_rate:.2%}"
    return (f"{label}[{emap.short_hash}] {emap.policy}: {emap.hot_rows} hot / {emap.cold_rows} cold of "
            f"{emap.num_experts} experts x {emap.num_layers} layers{pred}")
