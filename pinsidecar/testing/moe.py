"""Generators for tests and benchmarks of pin mode's split invoke: routing steps, row maps, re-homed weights.

They build what a backend is given in an engine (top-k ids and weights, a row map, hot and cold weight tensors)
without booting one, so the backend tests, the GPU tests and the GPU benchmark all draw their cases from one
place. Everything here imports only torch and the hook's contract (no pytest, no vLLM); row maps come from the
contract's one builder, :func:`pinsidecar_hook.contract.placement_row_map`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pinsidecar_hook.contract import placement_row_map

__all__: list[str] = []  # nothing here is another package's business


def row_map_tensor(num_experts: int, hot_experts: Sequence[int], cold_experts: Sequence[int],
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The int32 row map that puts ``hot_experts`` in hot rows ``0..H-1`` and ``cold_experts`` in cold rows
    ``H..H+C-1``, in the order given; experts in neither list are ``-1`` (another rank's, under expert parallel).
    Raises ``ValueError`` for an expert listed twice."""
    rows = placement_row_map(list(hot_experts), list(cold_experts), num_experts).rows
    return torch.tensor(rows, dtype=torch.int32, device=device)


def experts_by_row(row_map: torch.Tensor) -> torch.Tensor:
    """The inverse of a row map: the local experts (int64, on the CPU) in row order, so ``experts[:H]`` are the hot
    experts and ``experts[H:]`` the cold ones, each in its tier's row order (experts mapped to -1 are left out)."""
    rows = row_map.to(torch.int64).cpu()
    local = torch.nonzero(rows >= 0).squeeze(1)
    return local[torch.argsort(rows[local])]


def rehome_weights(weights: torch.Tensor, row_map: torch.Tensor, hot_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte copies of one per-expert tensor ``[E, ...]`` split by the row map: (hot ``[H, ...]``, cold
    ``[C, ...]``), row ``r`` holding the expert whose ``row_map`` entry is ``r``. A stand-in for pin mode's
    re-homing (:func:`pinsidecar_hook.rehome.rehome_layer`) where a test needs the two tiers without an engine."""
    ordered = weights.index_select(0, experts_by_row(row_map).to(weights.device))
    return ordered[:hot_rows].clone(), ordered[hot_rows:].clone()


class SplitLayerStub:
    """The pin state a backend is given in an engine (:class:`pinsidecar_hook.backends.SplitLayer`: a row map, the
    two tiers' per-expert tensors, the live counters on the CPU, no cache tier), for backend tests without one.
    Build it from the tiers, or with :meth:`from_tensors` from a layer's tensors cut by the row map."""

    def __init__(self, hot: dict[str, torch.Tensor], cold: dict[str, torch.Tensor], row_map: torch.Tensor,
                 hot_rows: int) -> None:
        self.row_map, self.hot_rows = row_map, hot_rows
        self.cold_rows = int((row_map >= 0).sum()) - hot_rows
        self.hot, self.cold = hot, cold
        self.expert_counts = torch.zeros(row_map.shape[0], dtype=torch.int64)
        self.cold_counts = torch.zeros(1, dtype=torch.int64)
        self.token_counts = torch.zeros(1, dtype=torch.int64)
        self.cache, self.cache_slots = None, 0

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], row_map: torch.Tensor, hot_rows: int) -> SplitLayerStub:
        """Every tensor of ``tensors`` (dim 0 = experts) cut into the tiers by :func:`rehome_weights`."""
        hot, cold = {}, {}
        for name, t in tensors.items():
            hot[name], cold[name] = rehome_weights(t, row_map, hot_rows)
        return cls(hot, cold, row_map, hot_rows)


def routing_case(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    cold_fraction: float,
    adversarial: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A routing step and a map for placement tests: ``(topk_ids [T, k] int64, topk_weights [T, k] fp32,
    row_map [E] int32, hot_rows)``. ``cold_fraction`` of the experts are cold, chosen at random. A random case
    routes each token to k distinct random experts; an adversarial one alternates each token's slots between the
    tiers (hot, cold, hot, ...) wherever both tiers are non-empty, so every token's k ids straddle the split."""
    num_cold = round(num_experts * cold_fraction)
    hot_rows = num_experts - num_cold
    perm = torch.randperm(num_experts, generator=generator)
    hot, cold = perm[:hot_rows], perm[hot_rows:]
    row_map = row_map_tensor(num_experts, hot.tolist(), cold.tolist())
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64)
    for t in range(num_tokens):
        if adversarial and hot.numel() and cold.numel():
            h = hot[torch.randperm(hot.numel(), generator=generator)]
            c = cold[torch.randperm(cold.numel(), generator=generator)]
            picked, hi, ci = [], 0, 0
            for j in range(top_k):
                if (j % 2 == 0 and hi < h.numel()) or ci >= c.numel():
                    picked.append(int(h[hi]))
                    hi += 1
                else:
                    picked.append(int(c[ci]))
                    ci += 1
            ids[t] = torch.tensor(picked)
        else:
            ids[t] = torch.randperm(num_experts, generator=generator)[:top_k]
    weights = torch.rand((num_tokens, top_k), generator=generator, dtype=torch.float32)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids, weights, row_map, hot_rows
