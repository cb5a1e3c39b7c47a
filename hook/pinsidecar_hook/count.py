"""Count mode: per-layer x per-expert router selection counts, kept on the device, written to the counts file.

Seam: the router's capture callback (``BaseRouter.set_capture_fn``, bound through
:func:`pinsidecar_hook.vllm_seam.bind_router_capture`), the same one vLLM's own routed-experts capturer binds.
Every router calls it once per forward with the *logical* top-k ids, before any EPLB remapping and on every
backend that routes in Python (CPU, Triton, FlashInfer modular): exactly the ids a row map is keyed on. We chose it
over wrapping ``select_experts`` or the experts ``apply`` because it is a supported, named extension point (no
monkeypatch at all on the step path), it sees ids before EPLB physical remapping, and it costs two small device
ops per layer. A monolithic kernel routes inside the kernel and never calls it: there the ids come from the
kernel's own routing step, run beside it (:mod:`pinsidecar_hook.vllm_seam.monolithic`, proven against the kernel
at attach), and a class without such a probe is refused at boot rather than counted as nothing.

What the callback does, per layer and step, and nothing else: ``counts[i].index_add_(0, ids, ones)`` and
``tokens[i] += num_tokens`` on tensors that live on the model's device. No ``.item()``, no ``.cpu()``: no host
sync per step. The callback is plain tensor code, so it works in eager mode (Python runs every step) and under
``torch.compile`` (Dynamo traces it once into the graph; the in-place updates of the counter tensors stay live in
the compiled graph) and inside captured CUDA graphs (the counters are fixed device buffers).

Reading the counters: :class:`CountState` is the source of the hook's side thread (:mod:`pinsidecar_hook.flusher`),
which writes the counts file periodically, on ``flush``/``reset`` requests, and at exit. Snapshots and resets take
the *step lock*, which the worker holds for the duration of each ``execute_model`` (:func:`step_guard`, wrapped
around it by :mod:`pinsidecar_hook.modes`); so a snapshot always falls between two steps, and every layer's row
sums to ``tokens * top_k`` exactly. A request waits at most one step.

Tensor parallel: the router is replicated, so every TP rank sees the same ids; only TP rank 0 runs the side thread
and writes the file (the others count too, which is cheap, but stay silent). Data and expert parallel ranks see
different tokens and are not supported by count mode yet: :func:`attach` refuses them at boot.

:func:`on_engine_ready` zeroes the counters after warm-up and profile forwards, so only real traffic counts.

Padding: with CUDA graphs on, vLLM pads a batch up to a captured size and the router sees the padded rows too. The
callback counts only the real ones (on a GPU in one launch of the partition kernel,
:func:`pinsidecar_hook.kernels.partition.partition_triton`, with an identity map): it masks ``row < real`` against
the worker's real-token scalar
(:func:`pinsidecar_hook.vllm_seam.real_token_count`), which the ``execute_model`` wrapper refills from the scheduler
output before every step, and adds that count (not the padded row count) to ``tokens``. Both are device ops, so a
captured graph replays them with the current step's value. Counts are exact with CUDA graphs on (checked on the
H200 with vLLM 0.26: selections == layers x tokens x top_k) and on the CPU (no padding there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ModelInfo, utc_now
from pinsidecar_hook.contract.env import HookConfig, HookConfigError
from pinsidecar_hook.contract.trace import RoutingTrace, save_trace
from pinsidecar_hook.flusher import Flusher, WriteInfo
from pinsidecar_hook.kernels.partition import partition_triton, triton_available
from pinsidecar_hook.trace_record import TraceRecorder

__all__ = ["CountState", "attach", "current", "on_engine_ready", "step_guard"]

log = logging.getLogger("pinsidecar_hook")

_state: CountState | None = None
# How often a growing routing trace is written without a request asking for it (CountState.snapshot).
TRACE_WRITE_INTERVAL_S = 30.0


class CountState:
    """The device counters of one worker: what the capture callbacks fill and the side thread snapshots.

    It is count mode's :class:`~pinsidecar_hook.flusher.FlushSource`: :meth:`snapshot` (a counts artifact taken
    between two steps) and :meth:`reset`.
    """

    def __init__(self, layer_ids: list[int], cfg: HookConfig, num_experts: int, top_k: int, device: torch.device,
                 writer: bool, meta: dict[str, Any], model_info: ModelInfo,
                 real_tokens: torch.Tensor | None = None, trace: TraceRecorder | None = None) -> None:
        self.cfg = cfg
        self.layer_ids = list(layer_ids)
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = device
        self.writer = writer
        self.meta = meta
        self.model_info = model_info
        # One tensor per layer rather than rows of one [L, E] tensor: the compiled graph then mutates whole
        # captured tensors, never views of a shared one (no aliasing for Dynamo/functionalization to untangle).
        self.counts = [torch.zeros((num_experts,), dtype=torch.int64, device=device) for _ in layer_ids]
        self.tokens = [torch.zeros((1,), dtype=torch.int64, device=device) for _ in layer_ids]
        # int64 [1]: the current step's real (unpadded) token count; None counts every row the router sees.
        self.real_tokens = real_tokens
        # On a GPU the count is one launch of pin mode's partition kernel (identity map, nothing cold): counts,
        # padding mask and token count together, instead of the half-dozen small torch ops of the CPU path (each
        # a node in the captured graph, every layer, every step).
        self._kernel = device.type == "cuda" and real_tokens is not None and triton_available(device)
        if self._kernel:
            self._identity = torch.arange(num_experts, dtype=torch.int32, device=device)
            self._cold_sink = torch.zeros((1,), dtype=torch.int64, device=device)
        # Re-entrant: the SIGTERM handler runs on the main thread, which may be inside a step holding the lock.
        self.step_lock = threading.RLock()
        self.started_at = utc_now()
        self.engine_ready = False
        self.flusher: Flusher | None = None
        self.trace = trace  # the routing trace recorder (cfg.trace_path), or None
        self.trace_write_errors = 0
        self._traced_token = ""  # the request token of the last write that took the trace along
        self._trace_at = time.monotonic()  # ... and when

    # ---------------------------------------------------------------------------------------- step path

    def capture_fn(self, index: int, previous: Callable[[torch.Tensor], None] | None) -> Callable[[torch.Tensor],
                                                                                                    None]:
        counts_row = self.counts[index]
        tokens_cell = self.tokens[index]
        real = self.real_tokens

        if getattr(previous, "_pinsidecar_count", False):
            previous = None  # a second attach (weights reloaded) replaces our old counter rather than chaining it

        trace = self.trace

        def capture(topk_ids: torch.Tensor) -> None:
            if previous is not None:  # e.g. vLLM's own routed-experts capturer, when enabled
                previous(topk_ids)
            if trace is not None:
                trace.capture(index, topk_ids, real)
            if self._kernel and topk_ids.is_cuda:
                partition_triton(topk_ids, self._identity, self.num_experts, counts_row, self._cold_sink,
                                 num_real=real, token_counts=tokens_cell)
                return
            ids = topk_ids.reshape(-1).long()
            if real is None:
                counts_row.index_add_(0, ids, torch.ones_like(ids))
                tokens_cell.add_(topk_ids.shape[0])
                return
            # Padded rows (CUDA graphs) sit after the real ones: count flat positions < real * k only.
            rows = topk_ids.shape[0]
            live = torch.arange(ids.shape[0], device=ids.device) < real * topk_ids.shape[1]
            counts_row.index_add_(0, ids, live.long())
            tokens_cell.add_(real.clamp(max=rows))

        capture._pinsidecar_count = True  # type: ignore[attr-defined]
        return capture

    # ---------------------------------------------------------------------------------------- flush source

    def reset(self) -> None:
        with self.step_lock:
            for t in (*self.counts, *self.tokens):
                t.zero_()
            if self.trace is not None:
                self.trace.reset()
            self.started_at = utc_now()
        if self.trace is not None and self.cfg.trace_path is not None:
            # a trace on disk describes the recording under way, or there is none
            with contextlib.suppress(OSError):
                self.cfg.trace_path.unlink()

    def snapshot(self, info: WriteInfo) -> CountsWrite:
        """The counters as a counts artifact (and the trace, when it grew), copied between two steps.

        The trace is large (tens of MB to compress and write), so it goes with a write that answers a new request
        (its client reads it beside those counts), with the exit write, and otherwise at most every
        :data:`TRACE_WRITE_INTERVAL_S`."""
        want_trace = self.trace is not None and (info.final or info.flush_token != self._traced_token
                                                 or time.monotonic() - self._trace_at >= TRACE_WRITE_INTERVAL_S)
        with self.step_lock:
            counts = torch.stack(self.counts)
            tokens = torch.cat(self.tokens)
            started = self.started_at
            trace = self.trace.snapshot() if want_trace and self.trace is not None else None
            recorded = None if self.trace is None else int(self.trace.cursor.item())
        if want_trace:
            self._traced_token, self._trace_at = info.flush_token, time.monotonic()
        counts_np, tokens_np = counts.cpu().numpy(), tokens.cpu().numpy()
        meta = dict(self.meta, seq=info.seq, pid=os.getpid(), engine_ready=self.engine_ready,
                    tokens_per_layer=[int(t) for t in tokens_np], write_errors=sum(info.errors.values()))
        if recorded is not None:
            meta["trace"] = {"path": str(self.cfg.trace_path), "tokens": recorded,
                             "write_errors": self.trace_write_errors}
        if info.apply is not None:  # an apply request was refused (count mode has no map): the client's answer
            meta["apply"] = dict(info.apply)
        artifact = CountsArtifact(
            layer_ids=list(self.layer_ids), num_experts=self.num_experts, top_k=self.top_k,
            counts=counts_np.astype(np.int64), tokens=int(tokens_np[0]), model=self.model_info,
            workload=self.cfg.workload, started_at=started, ended_at=utc_now(), flush_token=info.flush_token,
            meta=meta,
        )
        return CountsWrite(artifact, trace, self)

    def save_trace(self, trace: RoutingTrace) -> None:
        """Write the trace; a failure is counted (the next counts' ``meta.trace.write_errors``) and logged once,
        never raised: the counts still get written, and serving goes on."""
        assert self.cfg.trace_path is not None and self.trace is not None
        try:
            save_trace(self.cfg.trace_path, trace)
        except (OSError, ArtifactError) as exc:
            self.trace.unwritten()  # the next trace write tries again
            self.trace_write_errors += 1
            if self.trace_write_errors == 1:
                log.error("pinsidecar count: cannot write the routing trace to %s (%s); the counts go on (errors "
                          "counted in meta.trace.write_errors, logged once)", self.cfg.trace_path, exc)


class CountsWrite:
    """What count mode hands the flusher: the counts artifact, and the trace to write before it when it grew.

    The trace goes first, so a client that sees its request's token in the counts finds the trace of the same
    snapshot already on disk."""

    def __init__(self, counts: CountsArtifact, trace: RoutingTrace | None, state: CountState) -> None:
        self.counts = counts
        self.trace = trace
        self._state = state

    @property
    def flush_token(self) -> str:
        return self.counts.flush_token

    def save(self, path: str | os.PathLike[str]) -> None:
        if self.trace is not None:
            self._state.save_trace(self.trace)
            self.trace = None  # written once, even if the counts go to a fallback after
        self.counts.save(path)


def current() -> CountState | None:
    """The count state of this process, if count mode is attached (for tests)."""
    return _state


@contextlib.contextmanager
def step_guard() -> Iterator[None]:
    """Held around each ``execute_model``: snapshots and resets wait for the step to finish."""
    state = _state
    if state is None:
        yield
        return
    with state.step_lock:
        yield


def _expert_bytes(module: Any, local_experts: int) -> int:
    """Bytes of one expert on this rank: every parameter whose leading dimension is the local expert count."""
    total = 0
    for _, p in module.named_parameters():
        if p.dim() >= 1 and p.shape[0] == local_experts:
            total += p.numel() * p.element_size()
    return total // max(local_experts, 1)


# Batch sizes the routing probe of a monolithic layer is proven at, at attach (capped at max_num_batched_tokens).
PROBE_CHECK_TOKENS = (1, 7, 64, 512)


def _check_probes(layers: list[tuple[Any, vllm_seam.MoEGeometry]], worker: Any) -> dict[str, Any]:
    """Prove every monolithic layer's routing probe on the device (:func:`vllm_seam.monolithic.check_probe`), on
    random and on tie-heavy logits; a probe that disagrees with its kernel stops the boot (its counts would be wrong).
    A check that cannot run (no GPU, a kernel that wants more context) is reported, not fatal: the probe is the
    kernel's own routing step either way."""
    first = layers[0][1]
    if first.device.type != "cuda":
        return {"skipped": f"the layers are on {first.device.type}; the check runs on a GPU"}
    vllm_config = getattr(worker, "vllm_config", None)
    cap = vllm_seam.max_batched_tokens(vllm_config) if vllm_config is not None else None
    sizes = [t for t in PROBE_CHECK_TOKENS if cap is None or t <= cap]
    gen = torch.Generator(device=first.device).manual_seed(0)
    report: dict[str, Any] = {"sizes": sizes, "layers": 0, "tokens": 0, "equal_rows": 0}
    for ref, geo in layers:
        if not getattr(geo.experts, "renormalize", False):
            return dict(report, skipped=f"{geo.experts_class} routes softmax-first: the masking check needs "
                                         "renormalizing routing")
        for t in sizes:
            x = torch.randn((t, geo.hidden_size), generator=gen, device=geo.device).to(geo.act_dtype or torch.bfloat16)
            for ties in (False, True):
                logits = torch.randn((t, geo.global_num_experts), generator=gen, device=geo.device)
                if ties:  # a few distinct values: ties at the k-th place in most rows
                    logits = (logits * 2).round() / 2
                logits = logits.to(x.dtype)
                try:
                    got = vllm_seam.monolithic.check_probe(geo, x, logits, vllm_config)
                except Exception as exc:
                    log.warning("pinsidecar count: the routing probe check of %s could not run (%s: %s)",
                                ref.name, type(exc).__name__, exc)
                    return dict(report, error=f"{type(exc).__name__}: {exc}")
                report["tokens"] += got["tokens"]
                report["equal_rows"] += got["equal_rows"]
                if not got["bitwise"]:
                    flags = vllm_seam.monolithic.MODULAR_FLAG
                    raise HookConfigError(
                        f"count mode: the routing probe of {ref.name} ({geo.experts_class}) disagrees with its "
                        f"kernel on {got['tokens'] - got['equal_rows']} of {got['tokens']} tokens "
                        f"({'tie-heavy' if ties else 'random'} logits); the counts would be wrong. Boot the count "
                        f"engine with {flags.get(geo.experts_class, 'a modular MoE backend')}")
        report["layers"] += 1
    log.info("pinsidecar count: the routing probe matched its monolithic kernel on %d layers, %d tokens, sizes %s",
             report["layers"], report["tokens"], sizes)
    return report


def attach(model: Any, cfg: HookConfig, worker: Any = None) -> CountState:
    """Bind a counting capture callback to every MoE router of ``model`` and start the side thread (rank 0).

    Raises :class:`HookConfigError` (so the engine refuses to boot) when a layer cannot be counted.
    """
    global _state
    if cfg.counts_path is None:
        raise HookConfigError("count mode needs a counts path")
    refs = vllm_seam.moe_layers(model)
    if not refs:
        raise HookConfigError(f"count mode: no MoE layers found in {type(model).__name__}; is this an MoE model?")
    layers = [(ref, vllm_seam.moe_geometry(ref.module)) for ref in refs]
    first_ref, first = layers[0]
    top_k, num_experts = first.top_k, first.global_num_experts
    if first.dp_size > 1 or first.use_ep:
        raise HookConfigError(
            f"count mode supports tensor parallel only (dp_size={first.dp_size}, use_ep={first.use_ep}); "
            "run the count boot without data/expert parallel")
    for ref, geo in layers:
        if geo.monolithic:
            problem = vllm_seam.monolithic.monolithic_capture_problem(geo)
            if problem is not None:
                raise HookConfigError(f"count mode: layer {ref.name}: {problem}")
        elif not vllm_seam.router_capture_supported(geo):
            raise HookConfigError(f"count mode: router {type(geo.router).__name__} of {ref.name} has no capture "
                                  "callback (set_capture_fn); this vLLM is not supported")
        if geo.top_k != top_k or geo.global_num_experts != num_experts:
            raise HookConfigError(f"count mode: layer {ref.name} has top_k/num_experts different from layer "
                                  f"{first_ref.name}; mixed geometries are not supported")
    params = list(first.param_owner.parameters())
    device = params[0].device if params else torch.device("cpu")
    meta = {
        "expert_bytes": _expert_bytes(first.param_owner, first.local_num_experts),
        "dtype": str(params[0].dtype).replace("torch.", "") if params else "",
        "tp_rank": first.tp_rank, "tp_size": first.tp_size,
        "device": str(device), "moe_layers": [ref.name for ref, _ in layers],
        "counter": "router capture_fn", "padding_mask": "real-token scalar",
    }
    if any(geo.monolithic for _, geo in layers):
        meta["counter"] = f"routing probe beside {first.experts_class} (monolithic)"
        meta["probe_check"] = _check_probes(layers, worker)
    layer_ids = [ref.layer_id for ref, _ in layers]
    writer = first.tp_rank == 0
    model_info = vllm_seam.model_info(worker)
    trace = None
    if cfg.trace_path is not None and writer:  # the ranks of a TP group see the same ids: one records them
        trace = TraceRecorder(layer_ids, num_experts, top_k, device, capacity=cfg.trace_tokens, every=cfg.trace_every,
                              meta={"workload": cfg.workload, "model": dataclasses.asdict(model_info)})
    state = CountState(layer_ids, cfg, num_experts, top_k, device, writer=writer, meta=meta, model_info=model_info,
                       real_tokens=vllm_seam.real_token_count(device), trace=trace)
    for i, (_ref, geo) in enumerate(layers):
        bind = vllm_seam.monolithic.bind_monolithic_capture if geo.monolithic else vllm_seam.bind_router_capture
        bind(geo, lambda previous, i=i: state.capture_fn(i, previous))
    if state.writer:
        # Started at engine-ready, not here: a snapshot copies device counters from the side thread, and while the
        # worker captures CUDA graphs (warm-up, after load_model) any such copy invalidates the capture (seen on
        # the H200 with a long online-FP8 boot: cudaErrorStreamCaptureUnsupported). Nothing before engine-ready
        # is traffic anyway: the counters are zeroed there.
        state.flusher = Flusher(state, cfg.counts_path, interval_s=cfg.flush_interval_s, name="count",
                                what="counts", write_error_key="counts_write")
    _state = state
    log.info("pinsidecar count: counting %d MoE layers x %d experts (top-%d) on %s -> %s", len(layers), num_experts,
             top_k, device, cfg.counts_path)
    if trace is not None:
        log.info("pinsidecar count: recording the routing trace (at most %d tokens, every %d step(s)) -> %s",
                 cfg.trace_tokens, cfg.trace_every, cfg.trace_path)
    return state


def on_engine_ready() -> None:
    """Warm-up and profile forwards are over: zero the counters so only real traffic counts, and write once."""
    state = _state
    if state is None:
        return
    state.reset()
    state.engine_ready = True
    if state.flusher is not None:
        state.flusher.flush()
        if not state.flusher.started:
            state.flusher.start()
            state.flusher.flush_at_exit()
