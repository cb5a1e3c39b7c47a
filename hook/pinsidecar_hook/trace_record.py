"""Count mode's routing trace: every token's top-k ids in every MoE layer, in the order the engine ran them.

Counts say how often each expert was picked; a cache tier lives on the order (an expert one token picked is likely
picked by the next), so the simulator (``pinsidecar placement simulate``) reads a trace
(:mod:`pinsidecar_hook.contract.trace`). Recording one must cost the step what counting costs it: device ops in
the router's capture callback, no host copy, no sync, nothing that breaks ``torch.compile`` or a captured CUDA
graph. So the recording is a fixed device buffer ``[capacity + 1, layers, top_k]`` (the last row is a sink that
takes the rows not recorded, so every write has the same shape) and two device scalars: the write cursor (tokens
recorded) and the step number.

Per layer and step, :meth:`TraceRecorder.capture` writes the step's real rows (padding excluded, as the counter
excludes it) at ``cursor + row``; rows past the capacity, and every row of a step not sampled, go to the sink.
After the last layer it moves the cursor by the rows it recorded and counts the step. Rows of one step keep the
batch's order, steps their time order: a trace of a batched engine interleaves its sequences as the engine did,
which is what the simulator's batches model. ``every`` > 1 records one step in ``every`` (each sampled step
whole, so a token's layers stay together); the trace's counts then are a sample of the counts, not equal to them.

Bounded: once ``capacity`` tokens are in, later steps go to the sink and the trace stops growing; its meta says
``full``. :meth:`reset` (the counters' reset: after warm-up, on a ``reset`` request) starts it over.

The side thread takes :meth:`snapshot` under the step lock with the counts, so a trace and the counts written with
it describe the same steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pinsidecar_hook.contract.trace import RoutingTrace

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """The device buffer a count-mode worker records its routing into (see the module docstring)."""

    def __init__(self, layer_ids: list[int], num_experts: int, top_k: int, device: torch.device, *,
                 capacity: int, every: int = 1, meta: dict[str, Any] | None = None) -> None:
        if capacity < 1 or every < 1:
            raise ValueError(f"trace capacity and every must be >= 1, got {capacity} and {every}")
        self.layer_ids = list(layer_ids)
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity = capacity
        self.every = every
        self.meta = dict(meta or {})
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.buffer = torch.zeros((capacity + 1, len(layer_ids), top_k), dtype=dtype, device=device)
        self.cursor = torch.zeros((1,), dtype=torch.int64, device=device)  # tokens recorded
        self.step = torch.zeros((1,), dtype=torch.int64, device=device)  # steps seen since the reset
        self._last = len(layer_ids) - 1
        self._written_tokens = -1  # tokens in the last trace handed out by snapshot (-1: none yet)

    # ---------------------------------------------------------------------------------------- step path

    def capture(self, index: int, topk_ids: torch.Tensor, real: torch.Tensor | None) -> None:
        """Record layer ``index``'s ids for this step (``real``: the step's real-row count, None: every row)."""
        rows = topk_ids.shape[0]
        row = torch.arange(rows, device=topk_ids.device)
        n = torch.full((1,), rows, dtype=torch.int64, device=topk_ids.device) if real is None else real.clamp(max=rows)
        sampled = torch.remainder(self.step, self.every) == 0
        pos = self.cursor + row
        keep = (row < n) & (pos < self.capacity) & sampled
        target = torch.where(keep, pos, torch.full_like(pos, self.capacity))
        self.buffer[:, index, :].index_copy_(0, target, topk_ids.to(self.buffer.dtype))
        if index == self._last:
            taken = torch.clamp(n, max=self.capacity - self.cursor) * sampled
            self.cursor.add_(taken.clamp(min=0))
            self.step.add_(1)

    # ---------------------------------------------------------------------------------------- side thread

    def unwritten(self) -> None:
        """The last trace handed out was not written: hand the next snapshot out even if it did not grow."""
        self._written_tokens = -1

    def reset(self) -> None:
        """Start the recording over (call under the step lock)."""
        self.cursor.zero_()
        self.step.zero_()
        self._written_tokens = -1

    def snapshot(self) -> RoutingTrace | None:
        """The recording so far as a trace (call under the step lock), or None when it is empty or has not grown
        since the last trace handed out (a full trace is not written again every flush)."""
        tokens = int(self.cursor.item())
        if tokens == 0 or tokens == self._written_tokens:
            return None
        steps = int(self.step.item())
        ids = self.buffer[:tokens].cpu().numpy().astype(np.uint16)
        self._written_tokens = tokens
        meta = {**self.meta, "recorded_by": "pinsidecar count mode",
                "order": "engine order: each step's real rows in batch order, steps in time order",
                "every_steps": self.every, "steps_seen": steps, "capacity_tokens": self.capacity,
                "full": tokens >= self.capacity}
        return RoutingTrace(ids, self.num_experts, tuple(self.layer_ids), meta)
