"""Count mode: per-layer x per-expert router selection counts, kept on the device, flushed to the counts file.

Seam: the router's capture callback (``BaseRouter.set_capture_fn``), the same one vLLM's own
routed-experts capturer binds (``bind_routed_experts_capturer`` in ``fused_moe/routed_experts_capturer.py``).
Every router calls it once per forward with the *logical* top-k ids, before any EPLB remapping and on every
backend that routes in Python (CPU, Triton, FlashInfer modular): exactly the ids a row map is keyed on. We chose it
over wrapping ``select_experts`` or the experts ``apply`` because it is a supported, named extension point (no
monkeypatch at all on the step path), it sees ids before EPLB physical remapping, and it costs two small device
ops per layer. A monolithic kernel routes inside the kernel and never calls it, so :func:`attach` refuses such a
layer at boot rather than counting nothing.

What the callback does, per layer and step, and nothing else: ``counts[i].index_add_(0, ids, ones)`` and
``tokens[i] += num_tokens`` on tensors that live on the model's device. No ``.item()``, no ``.cpu()``: no host
sync per step. The callback is plain tensor code, so it works in eager mode (Python runs every step) and under
``torch.compile`` (Dynamo traces it once into the graph; the in-place updates of the counter tensors stay live in
the compiled graph) and inside captured CUDA graphs (the counters are fixed device buffers).

Reading the counters: a side thread copies them to the host every ``flush_interval_s`` and on request
(:func:`pinsidecar_hook.contract.read_hook_request`, polled every 0.2 s: ``flush`` writes now, ``reset`` zeroes
then writes; the request's token is echoed in ``flush_token`` and kept in later writes until the next request,
so a slow poller cannot miss it). Snapshots and resets take the *step lock*, which the worker holds for the
duration of each ``execute_model`` (``patches.py`` wraps it with :func:`step_guard`); so a snapshot always falls
between two steps, and every layer's row sums to ``tokens * top_k`` exactly. A request waits at most one step.
Counts are also flushed at exit (``atexit`` and a chained SIGTERM handler), but vLLM's front end may SIGKILL its
engine, so the periodic flush is what bounds the loss, never the exit handler.

Tensor parallel: the router is replicated, so every TP rank sees the same ids; only TP rank 0 writes the file
(the others count too, which is cheap, but stay silent). Data and expert parallel ranks see different tokens and
are not supported by count mode yet: :func:`attach` refuses them at boot.

``on_engine_ready`` zeroes the counters after warm-up and profile forwards, so only real traffic counts.

Padding: the callback counts every row the router sees. On the CPU (eager and compiled) that is exactly the
scheduled tokens (tested: selections == layers x tokens x top_k). On a GPU with CUDA graphs, vLLM pads a batch up
to a captured size and the padded rows are routed too, so they would be counted; the count boot therefore runs
with ``enforce_eager`` by default (``pinsidecar profile``), where nothing is padded.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from pinsidecar_hook import contract as artifacts
from pinsidecar_hook.contract.env import HookConfig, HookConfigError
from pinsidecar_hook.vllm_seam import MoELayerRef, moe_layers

__all__ = ["CountState", "attach", "current", "on_engine_ready", "step_guard"]

log = logging.getLogger("pinsidecar_hook")

# How often the side thread looks for a flush/reset request file: a request is served within this plus one step.
REQUEST_POLL_S = 0.2

_state: CountState | None = None


class CountState:
    """The device counters of one worker, and the thread that writes them out."""

    def __init__(self, layers: list[MoELayerRef], cfg: HookConfig, num_experts: int, top_k: int,
                 device: torch.device, writer: bool, meta: dict[str, Any], model_info: artifacts.ModelInfo) -> None:
        assert cfg.counts_path is not None
        self.cfg = cfg
        self.path = cfg.counts_path
        self.layer_ids = [ref.layer_id for ref in layers]
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = device
        self.writer = writer
        self.meta = meta
        self.model_info = model_info
        # One tensor per layer rather than rows of one [L, E] tensor: the compiled graph then mutates whole
        # captured tensors, never views of a shared one (no aliasing for Dynamo/functionalization to untangle).
        self.counts = [torch.zeros((num_experts,), dtype=torch.int64, device=device) for _ in layers]
        self.tokens = [torch.zeros((1,), dtype=torch.int64, device=device) for _ in layers]
        # Re-entrant: the SIGTERM handler runs on the main thread, which may be inside a step holding the lock.
        self.step_lock = threading.RLock()
        self.token = ""  # last served request token, echoed in every later write
        self.seq = 0
        self.started_at = artifacts.utc_now()
        self.engine_ready = False
        self.write_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    # ---------------------------------------------------------------------------------------- step path

    def capture_fn(self, index: int, previous: Callable[[torch.Tensor], None] | None) -> Callable[[torch.Tensor],
                                                                                                    None]:
        counts_row = self.counts[index]
        tokens_cell = self.tokens[index]

        if getattr(previous, "_pinsidecar_count", False):
            previous = None  # a second attach (weights reloaded) replaces our old counter rather than chaining it

        def capture(topk_ids: torch.Tensor) -> None:
            if previous is not None:  # e.g. vLLM's own routed-experts capturer, when enabled
                previous(topk_ids)
            ids = topk_ids.reshape(-1).long()
            counts_row.index_add_(0, ids, torch.ones_like(ids))
            tokens_cell.add_(topk_ids.shape[0])

        capture._pinsidecar_count = True  # type: ignore[attr-defined]
        return capture

    # ---------------------------------------------------------------------------------------- host side

    def reset(self) -> None:
        with self.step_lock:
            for t in (*self.counts, *self.tokens):
                t.zero_()
            self.started_at = artifacts.utc_now()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, str]:
        """A copy of the counters taken between two steps."""
        with self.step_lock:
            counts = torch.stack(self.counts)
            tokens = torch.cat(self.tokens)
            started = self.started_at
        return counts.cpu().numpy(), tokens.cpu().numpy(), started

    def write(self, token: str | None = None) -> None:
        """Write the counts file now (TP rank 0 only). ``token``, when given, becomes the echoed flush token."""
        counts, tokens, started = self.snapshot()
        with self._write_lock:
            if token is not None:
                self.token = token
            if not self.writer:
                return
            self.seq += 1
            meta = dict(self.meta, seq=self.seq, pid=os.getpid(), engine_ready=self.engine_ready,
                        tokens_per_layer=[int(t) for t in tokens], write_errors=self.write_errors)
            art = artifacts.CountsArtifact(
                layer_ids=list(self.layer_ids), num_experts=self.num_experts, top_k=self.top_k,
                counts=counts.astype(np.int64), tokens=int(tokens[0]), model=self.model_info,
                workload=self.cfg.workload, started_at=started, ended_at=artifacts.utc_now(),
                flush_token=self.token, meta=meta,
            )
            try:
                art.save(self.path)
            except OSError as exc:  # never take the engine down because a disk is full
                self.write_errors += 1
                log.error("pinsidecar count: cannot write %s: %s", self.path, exc)

    def serve_request(self) -> bool:
        """Serve a pending flush/reset request, if any. Returns True if one was served."""
        req = artifacts.read_hook_request(self.path)
        if req is None:
            return False
        op, token = req
        if op == "reset":
            self.reset()
        self.write(token)
        if artifacts.read_hook_request(self.path) == req:  # not replaced by a newer request meanwhile
            with contextlib.suppress(OSError):
                artifacts.request_path(self.path).unlink()
        log.info("pinsidecar count: served %s request %s", op, token)
        return True

    def _run(self) -> None:
        next_flush = time.monotonic() + self.cfg.flush_interval_s
        while not self._stop.wait(REQUEST_POLL_S):
            try:
                served = self.serve_request()
                if served or time.monotonic() >= next_flush:
                    if not served:
                        self.write()
                    next_flush = time.monotonic() + self.cfg.flush_interval_s
            except Exception:  # the flusher must outlive any one bad write or request
                self.write_errors += 1
                log.exception("pinsidecar count: flush failed")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pinsidecar-count-flush", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def current() -> CountState | None:
    """The count state of this process, if count mode is attached (for tests and the pin-mode helper)."""
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


def _model_info(vllm_config: Any) -> artifacts.ModelInfo:
    cfg = vllm_config
    if cfg is None:
        with contextlib.suppress(Exception):
            from vllm.config import get_current_vllm_config

            cfg = get_current_vllm_config()
    mc = getattr(cfg, "model_config", None)
    if mc is None:
        return artifacts.ModelInfo()
    return artifacts.ModelInfo(path=str(getattr(mc, "model", "") or ""),
                               revision=str(getattr(mc, "revision", "") or ""),
                               name=str(getattr(mc, "served_model_name", "") or ""))


def attach(model: Any, cfg: HookConfig, vllm_config: Any = None) -> CountState:
    """Bind a counting capture callback to every MoE router of ``model`` and start the flusher thread.

    Raises :class:`HookConfigError` (so the engine refuses to boot) when a layer cannot be counted.
    """
    global _state
    if cfg.counts_path is None:
        raise HookConfigError("count mode needs a counts path")
    layers = moe_layers(model)
    if not layers:
        raise HookConfigError(f"count mode: no MoE layers found in {type(model).__name__}; is this an MoE model?")
    first = layers[0].module
    router = first.router
    top_k = int(router.top_k)
    num_experts = int(router.global_num_experts)
    pc = first.moe_config.moe_parallel_config
    if pc.dp_size > 1 or pc.use_ep:
        raise HookConfigError(
            f"count mode supports tensor parallel only (dp_size={pc.dp_size}, use_ep={pc.use_ep}); "
            "run the count boot without data/expert parallel")
    for ref in layers:
        mod = ref.module
        if getattr(mod, "is_monolithic", False):
            raise HookConfigError(
                f"count mode: layer {ref.name} uses a monolithic MoE kernel that routes inside the kernel and "
                "never calls the router capture; boot the count engine with a modular MoE backend")
        if not hasattr(mod.router, "set_capture_fn"):
            raise HookConfigError(f"count mode: router {type(mod.router).__name__} of {ref.name} has no capture "
                                  "callback (set_capture_fn); this vLLM is not supported")
        if int(mod.router.top_k) != top_k or int(mod.router.global_num_experts) != num_experts:
            raise HookConfigError(f"count mode: layer {ref.name} has top_k/num_experts different from layer "
                                  f"{layers[0].name}; mixed geometries are not supported")
    experts_mod = getattr(first, "routed_experts", first)
    params = list(experts_mod.parameters())
    device = params[0].device if params else torch.device("cpu")
    local_experts = int(getattr(first.moe_config, "num_local_experts", num_experts) or num_experts)
    meta = {
        "expert_bytes": _expert_bytes(experts_mod, local_experts),
        "dtype": str(params[0].dtype).replace("torch.", "") if params else "",
        "tp_rank": int(pc.tp_rank), "tp_size": int(pc.tp_size),
        "device": str(device), "moe_layers": [ref.name for ref in layers],
        "counter": "router capture_fn",
    }
    state = CountState(layers, cfg, num_experts, top_k, device, writer=pc.tp_rank == 0, meta=meta,
                       model_info=_model_info(vllm_config))
    for i, ref in enumerate(layers):
        r = ref.module.router
        r.set_capture_fn(state.capture_fn(i, getattr(r, "capture_fn", None)))
    _state = state
    state.start()
    _install_exit_flush(state)
    log.info("pinsidecar count: counting %d MoE layers x %d experts (top-%d) on %s -> %s", len(layers), num_experts,
             top_k, device, cfg.counts_path)
    return state


def on_engine_ready() -> None:
    """Warm-up and profile forwards are over: zero the counters so only real traffic counts, and write once."""
    state = _state
    if state is None:
        return
    state.reset()
    state.engine_ready = True
    state.write()


def _install_exit_flush(state: CountState) -> None:
    def final_flush() -> None:
        state.stop()
        with contextlib.suppress(Exception):
            state.write()

    atexit.register(final_flush)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit and the periodic flush remain
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        final_flush()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # default action: die by SIGTERM, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, on_sigterm)
