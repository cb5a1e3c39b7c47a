"""The two rules every placement figure rests on, kept in one place so building and evaluating cannot drift apart.

- which experts a usage placement keeps hot: per layer the most-selected, equal counts going to the lower expert
  id (:func:`usage_order`, :func:`usage_hot_mask`, :func:`first_ranked_mask` for any ranking);
- what a hot mask costs on some traffic: the share of selections that land on cold experts, in all and per layer
  (:func:`cold_rates`). A layer with no selections costs 0.

Everything is plain numpy over ``[num_layers, num_experts]`` arrays; the public modules wrap them in artifacts.
"""

from __future__ import annotations

import numpy as np

__all__: list[str] = []  # nothing here is another package's business


def usage_order(counts: np.ndarray) -> np.ndarray:
    """Per layer, expert ids from most to least selected; equal counts keep the lower expert id first."""
    return np.argsort(-np.asarray(counts), axis=1, kind="stable")


def usage_hot_mask(counts: np.ndarray, hot_rows: int) -> np.ndarray:
    """bool ``[layers, experts]``: the ``hot_rows`` experts of each layer that :func:`usage_order` ranks first."""
    return first_ranked_mask(usage_order(counts), hot_rows, np.shape(counts)[1])


def first_ranked_mask(order: np.ndarray, rows: int, num_experts: int) -> np.ndarray:
    """bool ``[layers, num_experts]``: True for the first ``rows`` experts of each layer's ``order`` (best first)."""
    mask = np.zeros((np.shape(order)[0], num_experts), dtype=bool)
    np.put_along_axis(mask, np.asarray(order)[:, :rows], True, axis=1)
    return mask


def cold_rates(hot: np.ndarray, counts: np.ndarray) -> tuple[float, np.ndarray]:
    """Share of the selections in ``counts`` that fall on experts ``hot`` leaves cold: (all layers, per layer)."""
    counts = np.asarray(counts)
    per_layer_total = counts.sum(axis=1)
    per_layer_cold = np.where(hot, 0, counts).sum(axis=1)
    per_layer = np.where(per_layer_total > 0, per_layer_cold / np.maximum(per_layer_total, 1), 0.0)
    all_sel = int(per_layer_total.sum())
    return (float(per_layer_cold.sum() / all_sel) if all_sel else 0.0), per_layer
