"""Step a of a remap: what traffic the candidate map is built from.

A row map is a per-workload artifact: a map built from one traffic class serves that class, and a map built from a
blend was measured to cost the majority class 10 % against its own map. So the traffic a candidate is built from
must be *what is served now*, and only that:

- **capture** (:func:`captured_workload`): the newest requests the gate captured, newest first, cut at the moment
  the remap started (the capture store is rotated then), i.e. the traffic that tripped the detector; plus the
  fixture files the operator configured for the traffic they expect. They are replayed by a count boot.
- **live** (:func:`live_build_windows`): the drift watch's own windows of the current drift streak. Pin mode's
  partition kernel already counts the full per-layer expert histogram of every routed token online, so the
  candidate can be built from served traffic directly, with no count boot and no second engine: the advantage of
  counting online over systems that can only count offline. The held-out window (the newest) is left out.

Captured bodies are client requests: they are cut down to what a replay sends (the prompt or messages and the
sampling keys; ``stream``, ``n``, ``logprobs`` and the like are dropped) and validated like any workload line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import atomic_write_bytes

from pinsidecar.counts.workload import WorkloadError, WorkloadRequest, load_workload, parse_request
from pinsidecar.drift import DriftWatch, Window

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# What a replay keeps of a captured body (the workload format's keys); everything else a client sent is dropped.
_KEEP = ("prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_tokens", "stop", "ignore_eos",
         "seed")
# Drift states of a window that belongs to the current streak (the state after the window was judged).
_STREAK_STATES = ("rising", "drifted")


class NotEnoughTraffic(ValueError):
    """Too little traffic to build a candidate from; the remap is aborted with this message."""


@dataclass
class WorkloadChoice:
    """What the candidate is built from: workload files for a count boot, or live windows."""

    source: str  # "capture" or "live"
    files: list[Path] = field(default_factory=list)
    requests: int = 0
    captured: int = 0
    windows: list[Window] = field(default_factory=list)
    tokens: int = 0  # live: routed tokens in the windows
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "notes": self.notes}
        if self.source == "live":
            out.update(windows=[w.index for w in self.windows], tokens=self.tokens)
        else:
            out.update(files=[str(f) for f in self.files], requests=self.requests, captured=self.captured)
        return out


def replayable(body: Any) -> dict[str, Any] | None:
    """A captured request body cut down to a workload line, or None when it cannot be replayed."""
    if not isinstance(body, dict):
        return None
    line = {k: body[k] for k in _KEEP if k in body}
    try:
        parse_request(json.dumps(line), "capture")
    except WorkloadError:
        return None
    return line


def _newest_lines(files: Sequence[Path], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` replayable requests, newest first: the files newest first, each file from its end."""
    out: list[dict[str, Any]] = []
    for path in sorted(files, reverse=True):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("capture_file_unreadable", path=str(path), error=str(exc))
            continue
        for raw in reversed(lines):
            try:
                line = replayable(json.loads(raw))
            except ValueError:
                line = None
            if line is not None:
                out.append(line)
                if len(out) >= limit:
                    return out
    return out


def captured_workload(capture: Any, fixtures: Sequence[Path], out: Path, *, limit: int,
                      min_requests: int) -> WorkloadChoice:
    """Rotate the capture store (so what was captured so far is a completed file), take its newest ``limit``
    requests into ``out`` (one JSONL workload, written atomically), and add ``fixtures``. Raises
    :class:`NotEnoughTraffic` with fewer than ``min_requests`` requests in all, and
    :class:`~pinsidecar.counts.workload.WorkloadError` for a bad fixture file."""
    choice = WorkloadChoice(source="capture")
    if capture is not None:
        capture.rotate()
        lines = _newest_lines(capture.files(), limit)
        if lines:
            atomic_write_bytes(out, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode())
            choice.files.append(out)
        choice.captured = len(lines)
    else:
        choice.notes.append("no capture store (gate.capture_dir is not set): fixtures only")
    fixture_requests: list[WorkloadRequest] = load_workload(list(fixtures)) if fixtures else []
    choice.files.extend(fixtures)
    choice.requests = choice.captured + len(fixture_requests)
    if choice.requests < min_requests:
        how = "set gate.capture_dir and send traffic through the gate, add remap.workloads, or use remap.source " \
              "= \"live\""
        raise NotEnoughTraffic(f"too few requests to count: {choice.captured} captured + {len(fixture_requests)} "
                               f"from remap.workloads < remap.min_requests = {min_requests} ({how})")
    return choice


def live_build_windows(watch: DriftWatch, held_out: Window, *, max_windows: int, min_tokens: int) -> WorkloadChoice:
    """The windows of the traffic served now, before ``held_out`` (at most ``max_windows``, newest kept).

    A window in the current drift streak had a high projected gain, which is measured with a candidate built on
    the window *before* it: so the window before each streak window is traffic of the new class. Those windows
    are taken, from the one before the streak's first window up to the one before ``held_out``. With no streak
    (an operator's remap on steady traffic) the one window before ``held_out`` is taken. Raises
    :class:`NotEnoughTraffic` when they hold fewer than ``min_tokens`` routed tokens.
    """
    state_of = {r.index: r.state for r in watch.records}
    judged = [w for w in watch.recent if w.histogram is not None and w.judgeable(watch.config.min_tokens)
              and w.index <= held_out.index]
    pos = next((i for i, w in enumerate(judged) if w.index == held_out.index), None)
    choice = WorkloadChoice(source="live")
    if pos is None:
        raise NotEnoughTraffic(f"window {held_out.index} is not a judged window of the drift watch")
    before = pos  # walk back over the streak that ends at the held-out window
    while before >= 0 and state_of.get(judged[before].index) in _STREAK_STATES:
        before -= 1
    if before < pos:  # streak judged[before + 1 .. pos]; the windows before its members are judged[before .. pos - 1]
        chosen = judged[max(before, 0):pos]
    else:
        chosen = judged[pos - 1:pos] if pos > 0 else []
        choice.notes.append("no drift streak: built from the window before the held-out one")
    choice.windows = chosen[-max_windows:]
    choice.tokens = sum(w.tokens for w in choice.windows)
    if choice.tokens < min_tokens:
        raise NotEnoughTraffic(f"the live windows hold {choice.tokens} routed tokens (windows "
                               f"{[w.index for w in choice.windows]}), fewer than remap.min_count_tokens = "
                               f"{min_tokens}; send more traffic, or lower drift.window_tokens")
    return choice
