"""Stand-ins for driving the remap pipeline without vLLM: an instant engine, a fake pin-mode hook, fake tools.

The remap pipeline's state machine, its recovery and its faults are about bookkeeping, files and order, not about
models; booting vLLM for each of them would make every case a minute. These stand-ins let a test run the real
:class:`~pinsidecar.daemon.service.Daemon` (real gate, control API, supervisor, drift watch, pipeline) in a second:

- :class:`InstantEngine` — a :class:`~pinsidecar.engine.Launcher` that is ready at once (no process);
- :class:`FakeHookStats` — writes the pin-mode hook's live stats file the way the hook does (cumulative counters
  since boot, the full histogram, cold selections under the map the daemon serves; a new boot id whenever the
  daemon boots an engine), from synthetic traffic of a chosen domain (:func:`~pinsidecar.testing.make_counts`);
- :class:`FakeTools` — :class:`~pinsidecar.remap.tools.RemapTools` whose count boot returns synthetic counts,
  whose parity answers a fixed greedy output (or a different one, to fail parity), whose cold-rate probe is the
  real one or a fixed figure, and whose apply client is a :class:`FakeApplyClient`;
- :class:`FakeApplyClient` — the hook's answers to apply requests, scripted per request (applied, refused, failed,
  no answer, the engine dying mid-apply), read from and consistent with the stats file :class:`FakeHookStats`
  writes. The real client and the real hook are exercised on vLLM in ``tests/test_remap_in_place.py``.

The real engine end to end is in ``tests/test_demo_loop.py`` (``pinsidecar demo``, the whole loop).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pinsidecar_hook.contract import CountsArtifact, StatsSnapshot, load_map, load_stats
from pinsidecar_hook.contract.requests import HookRequestError
from pinsidecar_hook.contract.swap import ApplyResult

from pinsidecar.counts.parity import PromptOutput
from pinsidecar.counts.workload import WorkloadRequest
from pinsidecar.engine import EngineSpec
from pinsidecar.remap.tools import RemapTools
from pinsidecar.remap.verify import ColdRateProbe, ColdRateResult
from pinsidecar.testing.artifacts import make_counts

__all__: list[str] = []  # nothing here is another package's business


class InstantEngine:
    """A :class:`~pinsidecar.engine.Launcher` whose "engine" is this test process, ready at once. ``boots`` counts
    the starts of every instance (a class attribute), so a test can see that a reboot did or did not happen."""

    boots = 0

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.running = False

    @property
    def pid(self) -> int | None:
        return os.getpid() if self.running else None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def start(self) -> None:
        type(self).boots += 1
        self.running = True

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        return 0.0

    def alive(self) -> bool:
        return self.running

    def health(self) -> bool:
        return self.running

    def stop(self, timeout_s: float = 60.0) -> int | None:
        self.running = False
        return 0

    def last_log_lines(self, n: int = 40) -> list[str]:
        return []


class FakeHookStats:
    """The pin-mode hook's stats file, written from synthetic traffic (see the module docstring).

    ``served()`` returns what the daemon serves now as ``(boot_marker, hot_mask, map_hash)``; a new
    ``boot_marker`` starts a new engine life (a new boot id, counters from zero), as a reboot does.
    """

    def __init__(self, path: Path, served: Callable[[], tuple[Any, np.ndarray | None, str]], *,
                 num_layers: int = 4, num_experts: int = 64, top_k: int = 8) -> None:
        self.path = Path(path)
        self.served = served
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._marker: Any = object()
        self._boot = 0
        self._seq = 0
        self._hist = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._cold = np.zeros(num_layers, dtype=np.int64)
        self._tokens = 0
        self._seed = 0
        self._lock = threading.Lock()

    def add(self, domain: int, tokens: int, skew: float = 1.2) -> None:
        """``tokens`` more tokens of traffic of ``domain`` served, then one stats write (``skew=0``: a router that
        picks uniformly)."""
        with self._lock:
            marker, hot, map_hash = self.served()
            if marker != self._marker:
                self._marker, self._boot, self._seq = marker, self._boot + 1, 0
                self._hist[:] = 0
                self._cold[:] = 0
                self._tokens = 0
            self._seed += 1
            if tokens > 0:
                c = make_counts(self.num_layers, self.num_experts, self.top_k, tokens, seed=self._seed, skew=skew,
                                domain=domain)
                self._hist += c.counts
                self._tokens += tokens
                if hot is not None:
                    self._cold += np.where(hot, 0, c.counts).sum(axis=1)
            self._seq += 1
            snap = StatsSnapshot(
                boot_id=f"boot{self._boot}", seq=self._seq, layer_ids=list(range(self.num_layers)),
                num_experts=self.num_experts, top_k=self.top_k, selections=self._hist.sum(axis=1).tolist(),
                cold_selections=self._cold.tolist(), tokens=self._tokens, map_hash=map_hash, pid=os.getpid(),
                written_at=time.time(), histogram=self._hist.tolist())
            snap.save(self.path)


class FixedColdRate:
    """A cold-rate probe that reports ``rate`` over ``tokens`` tokens at once (the real probe reads stats)."""

    def __init__(self, rate: float, tokens: int = 10_000) -> None:
        self.result = ColdRateResult(tokens, tokens * 8, round(rate * tokens * 8))
        self.restarted = False

    def poll(self) -> ColdRateResult:
        return self.result


class FakeApplyClient:
    """The hook's side of apply requests, faked (a stand-in for :func:`~pinsidecar.remap.apply.request_apply`).

    ``outcomes`` scripts the answers, one per request in order (the last one repeats): ``applied``, ``refused``
    and ``failed`` are answered like the hook answers them (a ``meta["apply"]`` in the current stats file);
    ``timeout`` raises the client's no-answer error; ``die`` calls ``on_die`` (the test's way to stop the engine),
    waits until the pipeline's ``alive()`` says the engine is gone, and raises the same error the real client
    does then. ``hold``, when given, is waited on (while the engine lives) before answering: a test holds a
    remap in ``applying`` with it. ``rows`` is what an applied request reports swapping.
    """

    def __init__(self, outcomes: Sequence[str] = ("applied",), *, hold: threading.Event | None = None,
                 on_die: Callable[[], None] | None = None, rows: int = 8) -> None:
        self.outcomes = list(outcomes)
        self.hold = hold
        self.on_die = on_die
        self.rows = rows
        self.calls: list[dict[str, Any]] = []

    def __call__(self, stats_path: Path, engine_map: str, map_hash: str, *, timeout_s: float,
                 alive: Callable[[], bool], ordering: str | None = None,
                 hold_ms: float | None = None) -> tuple[ApplyResult, StatsSnapshot]:
        self.calls.append({"stats": Path(stats_path), "map": engine_map, "hash": map_hash, "timeout_s": timeout_s,
                           "ordering": ordering, "hold_ms": hold_ms})
        outcome = self.outcomes[min(len(self.calls), len(self.outcomes)) - 1]
        token = f"apply-fake-{len(self.calls)}"
        if self.hold is not None:
            while not self.hold.wait(0.02):
                if not alive():
                    break
        if outcome == "timeout":
            raise HookRequestError(f"the hook did not answer the apply request {token} within {timeout_s:g} s "
                                   "(fake)")
        if outcome == "die":
            if self.on_die is not None:
                self.on_die()
            end = time.monotonic() + 10.0
            while alive() and time.monotonic() < end:
                time.sleep(0.01)
            raise HookRequestError(f"the engine exited while waiting for the hook to answer the apply request "
                                   f"{token} (fake)")
        snap = load_stats(stats_path)
        emap = load_map(engine_map)  # the path the pipeline passed must be a readable map, as for the hook
        if outcome == "applied":
            result = ApplyResult(token, "applied", map_hash=map_hash, from_hash=snap.map_hash, to_hash=map_hash,
                                 rows=self.rows, bytes_moved=2 * self.rows * emap.expert_bytes, seconds=0.002,
                                 layers=emap.num_layers)
            snap = dataclasses.replace(snap, map_hash=map_hash)
        else:
            result = ApplyResult(token, outcome, reason=f"fake hook: {outcome}", map_hash=snap.map_hash,
                                 from_hash=snap.map_hash, to_hash=map_hash)
        snap = dataclasses.replace(snap, flush_token=token, meta={**snap.meta, "apply": result.to_json()})
        return result, snap


class FakeTools(RemapTools):
    """Pipeline tools without engines. ``counts``: what the count boot returns (or an exception to raise);
    ``gate``: a threading.Event the count boot waits on (to hold a remap in ``count_boot``); ``parity_change``:
    the new engine answers differently (parity fails); ``cold_rate``: a fixed figure instead of the real probe;
    ``apply``: the hook's answers to apply requests (default: every one applied)."""

    def __init__(self, counts: CountsArtifact | BaseException | None = None, *, gate: threading.Event | None = None,
                 parity_change: bool = False, cold_rate: float | None = None,
                 apply: FakeApplyClient | None = None) -> None:
        self.apply_client = apply if apply is not None else FakeApplyClient()
        super().__init__(count_boot=self._count_boot, parity=self._parity,
                         cold_probe=self._probe, apply=self.apply_client)
        self.counts = counts
        self.gate = gate
        self.parity_change = parity_change
        self.cold_rate = cold_rate
        self.count_boots: list[dict[str, Any]] = []
        self.parity_calls = 0

    def _count_boot(self, workloads: Sequence[Path], out: Path, **kw: Any) -> tuple[CountsArtifact, dict[str, Any]]:
        self.count_boots.append({"workloads": list(workloads), "out": out, **kw})
        if self.gate is not None:
            self.gate.wait(60)
        if isinstance(self.counts, BaseException):
            raise self.counts
        counts = self.counts if self.counts is not None else make_counts(tokens=2000, domain=1, seed=99)
        counts.save(out)
        return counts, {"requests": 10, "boot_s": 0.0, "exact": True, "label": kw.get("label")}

    def _parity(self, url: str, model: str, prompts: Sequence[WorkloadRequest]) -> list[PromptOutput]:
        self.parity_calls += 1
        shift = 1 if self.parity_change and self.parity_calls > 1 else 0
        return [PromptOutput(p.source, [1 + shift, 2, 3], [-0.5, -0.25, -0.125]) for p in prompts]

    def _probe(self, stats_path: Path, map_hash: str) -> Any:
        if self.cold_rate is not None:
            return FixedColdRate(self.cold_rate)
        return ColdRateProbe(stats_path, map_hash)
