"""Two tier calls at once: the cold one on a side stream, forked from and joined to the current stream.

HBM and the host link are separate resources: the hot call reads HBM, the cold call reads pinned host memory over
the link, so running them concurrently hides the shorter one behind the longer (at decode the hot call behind the
cold reads). The fork and the join are stream waits (events), so a CUDA graph captures both branches, and the
split's output does not change: each call writes its own rows, and the reduce runs after the join.

Memory: buffers the side call writes and the main stream reads after the join are either allocated before the
fork, on the current stream, or by the side call on the side stream. A side-stream block freed later may be handed
out again only to side-stream work, which always starts with a fork that waits for everything the current stream
had queued, the reads of that block included; so no ``record_stream`` is needed, as long as the side stream is
used through :func:`fork_join` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["fork_join", "side_stream"]

A = TypeVar("A")
B = TypeVar("B")

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def fork_join(main: Callable[[], A], side: Callable[[], B], device: torch.device) -> tuple[A, B]:
    """``(main(), side())``, with ``side`` on the side stream concurrently with ``main`` on the current stream when
    ``device`` is CUDA (one after the other elsewhere). ``side`` is queued first, so it starts first."""
    if device.type != "cuda":
        b = side()
        return main(), b
    current = torch.cuda.current_stream(device)
    other = side_stream(device)
    other.wait_stream(current)  # fork: the side call sees everything queued so far (inputs, the partition)
    with torch.cuda.stream(other):
        b = side()
    a = main()
    current.wait_stream(other)  # join: what follows (the reduce) reads the side call's rows after it
    return a, b
