"""The count boot: run a workload through a real engine with the hook in count mode and keep the counts.

This is the first half of every remap (count boot -> map -> reboot), and the only place counts come from. It is a
pipeline of plain steps with I/O at the edges:

1. validate the workload files (all of them, every line) and the output path, and check the port is free -
   before anything is started, so bad input costs nothing;
2. start the engine (:mod:`pinsidecar.engine`, the one launcher) with ``PINSIDECAR_HOOK_MODE=count`` writing to
   a temp file beside ``--out`` and wait until it serves;
3. ``reset`` the counters through the hook's request file and wait for the echoed token, so the readiness probe
   and anything before it is not counted;
4. replay the workload (:mod:`pinsidecar.counts.workload`);
5. ``flush`` and wait for the token: that file holds exactly the replay's routing (snapshots fall between steps);
6. stop the engine cleanly (SIGTERM to its process group);
7. validate the counts (every layer sums to ``tokens * top_k``) and write ``--out`` atomically, with the label
   and the replay's token totals in ``meta``.

Any failure stops the engine, removes the temp files and leaves ``--out`` untouched: nothing partial is ever
written there.

Exactness: with prefix caching off, the first MoE layer routes every prompt token and every sampled token but
the last of each request, so ``counts.tokens == sum(prompt_tokens + completion_tokens - 1)`` over the replay's
``usage`` and the total selections are ``layers * tokens * top_k``. Both are recorded in ``meta`` and checked by
the tests; a mismatch is logged (something else used the engine, or prefix caching was on), not fatal.

The engine is described by the ``[engine]`` table (:class:`~pinsidecar.engine.spec.EngineConfig`) of any config
file, the daemon's as is, read by :func:`count_boot_config` with the daemon's own validator: an unknown key or a
wrong type is refused with the daemon's message. Other tables are not the count boot's business. On top of that
one schema the count boot applies its own defaults (:data:`COUNT_BOOT_DEFAULTS`: eager, since a count does not
depend on CUDA graphs or compile and an eager boot is about twice as fast on CPU) and the command line (``--model``,
``--port``). It always runs the hook in count mode writing beside ``--out``, so the table's hook keys
(``hook_mode``, ``map``, ``counts_path``, ``stats_path``, ``workload``) and ``log_path``, which describe the
serving engine, are not used; the boot waits up to ``ready_timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from pinsidecar_hook.contract import CountsArtifact, HookRequestError, load_counts, request_and_wait, request_path
from pinsidecar_hook.contract.env import DEFAULT_TRACE_TOKENS, MAX_TRACE_TOKENS, HookConfig
from pinsidecar_hook.contract.trace import load_trace

from pinsidecar.counts.workload import ReplayResult, WorkloadError, WorkloadRequest, load_workload, replay
from pinsidecar.engine import (
    EngineBootError,
    EngineConfig,
    EngineError,
    EngineProcess,
    EngineSpec,
    PortInUseError,
    hooked_spec,
    load_engine_config,
    port_in_use,
)

__all__ = ["count_boot_config", "request_counts", "run_count_boot"]

log = structlog.get_logger(__name__)

# How long to wait for the hook to echo a reset/flush token: the hook polls every 0.2 s and serves after at most
# one step, so this only trips when the hook is not running at all.
HOOK_REPLY_TIMEOUT_S = 60.0
# The count engine flushes this often on its own; only matters if the engine is killed mid-replay.
COUNT_FLUSH_INTERVAL_S = 5.0
# The count boot's own defaults under the [engine] table: a key the file sets wins over these.
COUNT_BOOT_DEFAULTS: Mapping[str, object] = {"enforce_eager": True}


class CountBootError(RuntimeError):
    """The count boot ran and failed (engine died, hook never answered, requests failed). Exit code 1."""


# The [engine] keys that describe the serving engine's hook and log, which a count boot replaces with its own: not
# validated for it, so a config whose map is not built yet (the count boot is how it gets built) still counts.
SERVING_ONLY_KEYS = ("hook_mode", "map", "counts_path", "stats_path", "workload", "log_path")


def count_boot_config(path: Path | None = None, *, model: Path | None = None,
                      port: int | None = None) -> EngineConfig:
    """The engine a count boot runs: the ``[engine]`` table of ``path`` (None: no file), over
    :data:`COUNT_BOOT_DEFAULTS`, with ``model`` and ``port`` from the command line over both. Raises
    :class:`~pinsidecar.schema.ConfigError` (a ``ValueError``) naming the file and key, also when no model is set."""
    overrides: dict[str, object] = {}
    if model is not None:
        overrides["model"] = str(Path(model).absolute())
    if port is not None:
        overrides["port"] = port
    return load_engine_config(path, overrides, defaults=COUNT_BOOT_DEFAULTS, unused=SERVING_ONLY_KEYS)


@dataclass
class ProfileResult:
    counts: CountsArtifact
    out: Path
    replay: ReplayResult
    boot_s: float
    engine_exit_code: int | None
    trace: dict[str, Any] | None = None  # the routing trace written beside the counts (--trace), what it holds

    def summary(self) -> dict[str, Any]:
        c = self.counts
        return {
            "out": str(self.out), "label": c.workload, "num_layers": c.num_layers, "num_experts": c.num_experts,
            "top_k": c.top_k, "tokens": c.tokens, "selections": c.selections,
            "tokens_processed": self.replay.tokens_processed,
            "exact": c.tokens == self.replay.tokens_processed
            and c.selections == c.num_layers * c.tokens * c.top_k,
            **{k: v for k, v in self.replay.summary().items() if k != "tokens_processed"},
            "boot_s": round(self.boot_s, 2), "engine_exit_code": self.engine_exit_code,
            **({"trace": self.trace} if self.trace is not None else {}),
        }


def request_counts(counts_path: Path, op: str, engine: EngineProcess | None = None,
                   timeout_s: float = HOOK_REPLY_TIMEOUT_S) -> CountsArtifact:
    """Send ``flush``/``reset`` to the count hook and return the counts file that answers it: a thin wrapper over
    :func:`pinsidecar_hook.contract.request_and_wait` that raises :class:`CountBootError` (with the engine's last
    log lines when it exited)."""
    try:
        return request_and_wait(counts_path, op, load_counts, timeout_s=timeout_s,
                                alive=engine.alive if engine is not None else None)
    except HookRequestError as exc:
        tail = "" if engine is None or engine.alive() else "; last engine log lines:\n" + "\n".join(
            "  | " + line for line in engine.last_log_lines())
        raise CountBootError(f"{exc}{tail}") from None


def _default_label(paths: Sequence[Path]) -> str:
    return "+".join(Path(p).stem for p in paths)


def run_count_boot(model: Path | None, workloads: Sequence[Path], out: Path, *, concurrency: int = 4,
                max_tokens: int | None = None, port: int | None = None, label: str | None = None,
                engine: EngineConfig | None = None, progress: bool | None = None,
                engine_log: Path | None = None, pid_file: Path | None = None, trace: Path | None = None,
                trace_tokens: int | None = None) -> ProfileResult:
    """Run one count boot end to end (see the module docstring) on ``engine`` (default:
    :func:`count_boot_config` without a file); ``model`` and ``port``, when given, replace the table's. Raises
    :class:`WorkloadError`, :class:`PortInUseError` or ``ValueError`` for bad input (before anything starts),
    :class:`EngineBootError` when the engine does not come up, :class:`CountBootError` when the boot ran and
    failed. ``pid_file``: where the count engine records itself while it runs (see
    :func:`~pinsidecar.engine.process.stop_recorded_engine`), so a parent killed mid-boot can be cleaned up after.
    ``trace``: also record the routing trace (:mod:`pinsidecar_hook.contract.trace`, at most ``trace_tokens``
    tokens) and write it there, beside the counts."""
    if engine is None:
        engine = count_boot_config(model=model, port=port)
    else:
        engine = dataclasses.replace(engine, model=Path(model) if model is not None else engine.model,
                                     port=port if port is not None else engine.port)
    # The table's log_path is the serving engine's log; a count boot logs to --engine-log or a temp file.
    engine = dataclasses.replace(engine, log_path=engine_log)
    if engine.model is None:
        raise ValueError("no model to count with: pass --model or set engine.model in the config file")
    if engine.launcher != "process":
        raise ValueError(f"engine.launcher = {engine.launcher!r}: the count boot runs the engine as a local "
                         "process; run it where vLLM is installed, with a config whose engine.launcher is "
                         "\"process\"")
    model, out = engine.model, Path(out)
    requests: list[WorkloadRequest] = load_workload(workloads)
    if not model.is_dir():
        raise ValueError(f"model {model}: not a directory (pass the model folder, e.g. from `pinsidecar demo-model`)")
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory (pass a file path for the counts)")
    if trace is not None and (Path(trace).is_dir() or Path(trace).resolve() == out.resolve()):
        raise ValueError(f"--trace {trace}: pass a file path of its own for the trace, e.g. {out.with_suffix('')}"
                         ".trace.npz")
    if trace_tokens is not None and not 1 <= trace_tokens <= MAX_TRACE_TOKENS:
        raise ValueError(f"--trace-tokens must be between 1 and {MAX_TRACE_TOKENS}, got {trace_tokens}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out {out}: directory {out.parent} is not writable")
    if port_in_use(engine.host, engine.port):
        raise PortInUseError(f"port {engine.port} on {engine.host} is already in use; stop whatever listens there "
                             "or pass --port with a free one")
    label = label if label is not None else _default_label(workloads)

    tmp_counts = out.with_name(f".{out.name}.{os.getpid()}.engine-counts.json")
    tmp_trace = None if trace is None else Path(trace).with_name(f".{Path(trace).name}.{os.getpid()}.engine-trace.npz")
    if tmp_trace is not None:
        tmp_trace.parent.mkdir(parents=True, exist_ok=True)
    hook = HookConfig(mode="count", counts_path=tmp_counts.resolve(), flush_interval_s=COUNT_FLUSH_INTERVAL_S,
                      workload=label, trace_path=None if tmp_trace is None else tmp_trace.resolve(),
                      trace_tokens=trace_tokens or DEFAULT_TRACE_TOKENS)
    spec = hooked_spec(engine, hook)
    eng = EngineProcess(spec, pid_file=pid_file)
    exit_code: int | None = None
    try:
        eng.start()
        boot_s = eng.wait_ready(engine.ready_timeout_s)
        request_counts(tmp_counts, "reset", eng)
        log.info("replay_start", requests=len(requests), concurrency=concurrency, label=label)
        result = replay(requests, eng.base_url, spec.model_name, concurrency=concurrency, max_tokens=max_tokens,
                        progress=progress)
        if result.errors:
            first = "; ".join(f"{r.source}: {r.error}" for r in result.errors[:3])
            raise CountBootError(f"{len(result.errors)} of {result.requests} requests failed ({first})")
        counts = request_counts(tmp_counts, "flush", eng)
        exit_code = eng.stop(engine.stop_timeout_s)
        final = _finish(counts, result, label, workloads, concurrency, max_tokens, spec)
        traced = None if tmp_trace is None or trace is None else _keep_trace(tmp_trace, Path(trace), final)
        final.save(out)
        if eng.owns_log:  # a clean run needs no log; a failed one keeps it (its path is in the error)
            with contextlib.suppress(OSError):
                eng.log_path.unlink()
        log.info("count_boot_done", out=str(out), tokens=final.tokens, selections=final.selections)
        return ProfileResult(final, out, result, boot_s, exit_code, traced)
    finally:
        if eng.alive():
            eng.stop()
        for p in (tmp_counts, request_path(tmp_counts), *([tmp_trace] if tmp_trace is not None else [])):
            with contextlib.suppress(OSError):
                p.unlink()


def _keep_trace(engine_trace: Path, out: Path, counts: CountsArtifact) -> dict[str, Any]:
    """Move the trace the hook wrote into place once it reads back whole; what it holds, and whether its counts are
    the counts' (they must be, unless the recording hit its bound). Raises :class:`CountBootError` otherwise."""
    try:
        trace = load_trace(engine_trace)
    except (OSError, ValueError) as exc:
        raise CountBootError(f"the hook wrote no readable routing trace ({exc}); the engine log says why") from None
    full = bool(trace.meta.get("full"))
    matches = trace.tokens == counts.tokens and np.array_equal(trace.counts(), counts.counts)
    if not full and not matches:
        raise CountBootError(f"the routing trace ({trace.tokens} tokens) does not match the counts ({counts.tokens} "
                             "tokens) although it did not reach its bound: the hook recorded other steps than it "
                             "counted")
    os.replace(engine_trace, out)
    return {"out": str(out), "tokens": trace.tokens, "layers": trace.num_layers, "full": full,
            "capacity_tokens": trace.meta.get("capacity_tokens"), "matches_counts": matches}


def _mismatch_hint(counted: int, expected: int) -> str:
    """What a count off the replay's token total points at, by its sign. Prefix caching skips cached prompt
    tokens, so it only ever counts fewer. More is other traffic, or a request the engine stepped again before it
    saw the request end. That happens when a request ends on a stop string, which the API server finds after the
    engine has run on, and under asynchronous scheduling, which runs a step ahead. The H200 guide's prose count
    boot counted 2498 for 2497 twice (2026-12-02 and 2026-12-03). It is a hint, not a diagnosis: counts that
    far off still describe the traffic."""
    if counted < expected:
        return "fewer than the replay ran: prefix caching on (enable-prefix-caching = false for a count boot)"
    return ("more than the replay ran: other traffic reached the engine, or requests that ended on a stop "
            "string or under asynchronous scheduling were stepped once more before the engine saw them end")


def _finish(counts: CountsArtifact, result: ReplayResult, label: str, workloads: Sequence[Path], concurrency: int,
            max_tokens: int | None, spec: EngineSpec) -> CountsArtifact:
    if not counts.consistent:
        sums = counts.counts.sum(axis=1).tolist()
        raise CountBootError(f"counts are inconsistent: per-layer selections {sums} != tokens {counts.tokens} x "
                           f"top_k {counts.top_k}; the hook flushed mid-step")
    if counts.tokens == 0:
        raise CountBootError("the engine routed no tokens during the replay (is the hook counting this model?)")
    expected = result.tokens_processed
    if counts.tokens != expected:
        log.warning("token_mismatch", counted=counts.tokens, expected=expected, hint=_mismatch_hint(counts.tokens,
                                                                                                  expected))
    meta = dict(counts.meta)
    for key in ("seq", "pid", "write_errors", "engine_ready"):
        meta.pop(key, None)
    meta.update(
        requests=result.requests, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        tokens_processed=expected, workload_files=[str(p) for p in workloads], concurrency=concurrency,
        max_tokens=max_tokens, prefix_caching=spec.enable_prefix_caching, enforce_eager=spec.enforce_eager,
        engine_argv=spec.argv()[1:],
    )
    return dataclasses.replace(counts, workload=label, flush_token="", meta=meta)


# Re-exported for the CLI's error mapping.
USER_ERRORS: tuple[type[Exception], ...] = (WorkloadError, PortInUseError, ValueError)
RUN_ERRORS: tuple[type[Exception], ...] = (EngineBootError, EngineError, CountBootError)
