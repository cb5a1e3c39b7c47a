"""Pin mode: apply a row map to the loaded model, split every experts call by residency, count live.

Runs inside the vLLM worker, called (through :mod:`pinsidecar_hook.modes`) after ``Worker.load_model`` (weights
loaded and repacked, KV cache not sized yet) and after warm-up. In order:

1. **Load and validate the map** against the model actually loaded: layer ids, number of experts, top-k, the
   per-expert tensors the backend must split, and the per-expert byte size when the map records one. Every
   difference is listed in one :class:`PinMapMismatch`; raising it from ``load_model`` makes the engine refuse
   to start, with the message in its log. There is no fallback placement: an engine serving another placement
   than the one asked for is worse than one that does not boot.
2. **Re-home** every MoE layer (:mod:`pinsidecar_hook.rehome`), one layer at a time, and log one summary line.
3. **Swap the experts call** of each layer for the backend's split invoke (:mod:`pinsidecar_hook.backends`),
   which partitions each token's top-k ids by residency and counts them into this layer's live counters.
4. At engine-ready, zero the counters (warm-up forwards are not traffic) and, on rank 0, start the side thread
   (:mod:`pinsidecar_hook.flusher`) with :class:`PinState` as its source: it writes the stats file
   (:class:`~pinsidecar_hook.contract.StatsSnapshot`) periodically and on request, to
   :func:`~pinsidecar_hook.contract.fallback_stats_path` when the stats directory cannot be written (counted in
   ``errors["stats_write"]``, logged once), and notices the map file changing on disk while serving (logged once,
   recorded as ``meta["map_changed_on_disk"]``; the running placement stays the one loaded at boot).

Tensor parallel: every rank applies the same map to its shard of each expert. Expert parallel: each rank maps
only its local experts (vLLM's ``expert_map``), so its row map sends non-local experts to -1.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends import BackendUnavailable, SplitBackend, load_backend, select_backend
from pinsidecar_hook.contract import ExpertMap, StatsSnapshot, fallback_stats_path, load_map
from pinsidecar_hook.contract.env import HookConfig
from pinsidecar_hook.flusher import Flusher, WriteInfo
from pinsidecar_hook.rehome import MemoryLedger, expert_tensor_names, rehome_layer, tensor_bytes

__all__ = ["LayerPin", "PinMapMismatch", "PinState", "attach", "on_engine_ready", "state", "validate"]

log = logging.getLogger("pinsidecar_hook")


def _ensure_visible_log() -> None:
    """vLLM configures only its own ``vllm`` loggers; without a handler our INFO summary line would be dropped."""
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s pinsidecar_hook %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class PinMapMismatch(RuntimeError):
    """The map does not fit the loaded model. The message lists every difference; the engine must not start."""


@dataclass
class LayerPin:
    """One layer's pin-mode state: what the split invoke reads on every call, and what the stats copy.
    It is the :class:`~pinsidecar_hook.backends.SplitLayer` the backends are given."""

    layer_id: int
    name: str
    row_map: torch.Tensor  # int32 [global experts]: global id -> row (hot 0..H-1, cold H..), -1 not on this rank
    hot_rows: int  # H on this rank
    cold_rows: int
    hot: dict[str, torch.Tensor]
    cold: dict[str, torch.Tensor]
    expert_counts: torch.Tensor  # int64 [global experts], on the layer's device
    cold_counts: torch.Tensor  # int64 [1]
    token_counts: torch.Tensor  # int64 [1]
    hot_bytes: int = 0
    cold_bytes: int = 0
    keepalive: list[Any] = field(default_factory=list)  # host storage behind the cold device views

    def reset(self) -> None:
        self.expert_counts.zero_()
        self.cold_counts.zero_()
        self.token_counts.zero_()


def _file_identity(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class PinState:
    """The running pin mode of one worker; on rank 0 also the side thread's source of stats snapshots."""

    emap: ExpertMap
    layers: list[LayerPin]
    backend: str
    rank: int
    tp_size: int
    summary: dict[str, Any]
    cfg: HookConfig
    flusher: Flusher | None = None
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # new each boot: readers tell restarts apart
    map_changed: bool = False

    def __post_init__(self) -> None:
        self._map_identity = _file_identity(self.cfg.map_path)

    # ------------------------------------------------------------------------------------------ flush source

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def check_map_file(self) -> bool:
        """Whether the map file changed on disk (size, mtime or inode) since boot; logged the first time."""
        if not self.map_changed and self.cfg.map_path is not None \
                and _file_identity(self.cfg.map_path) != self._map_identity:
            self.map_changed = True
            log.warning("pinsidecar pin: map file %s changed on disk while serving; ignored until the next boot "
                        "(the running placement is still map %s)", self.cfg.map_path, self.emap.short_hash)
        return self.map_changed

    def snapshot(self, info: WriteInfo) -> StatsSnapshot:
        """Copy the device counters (small) into a stats snapshot. Counts may be mid-step: a periodic write can
        land between two layers of one forward, so only a snapshot taken between steps is exactly
        layers x tokens x k."""
        emap = self.emap
        hist = [layer.expert_counts.to("cpu").tolist() for layer in self.layers]
        cold = [int(layer.cold_counts.to("cpu").item()) for layer in self.layers]
        tokens = int(self.layers[0].token_counts.to("cpu").item()) if self.layers else 0
        return StatsSnapshot(
            boot_id=self.boot_id, seq=info.seq, layer_ids=[layer.layer_id for layer in self.layers],
            num_experts=emap.num_experts, top_k=emap.top_k, selections=[int(sum(row)) for row in hist],
            cold_selections=cold, tokens=tokens, map_hash=emap.content_hash, map_label=emap.label, pid=os.getpid(),
            written_at=time.time(), tier_bytes=dict(self.summary["tier_bytes"]),
            histogram=hist if self.cfg.histogram else None, errors=dict(info.errors), flush_token=info.flush_token,
            meta={"map_path": str(self.cfg.map_path or ""), "map_changed_on_disk": self.check_map_file(),
                  "backend": self.backend, "tp_size": self.tp_size,
                  "peak_extra_bytes": self.summary["peak_extra_total_bytes"],
                  "predicted_cold_rate": emap.predicted_cold_rate, "stats_path": str(self.cfg.stats_path or "")},
        )

    def make_flusher(self) -> Flusher:
        """The side thread that writes this state's stats (not started)."""
        assert self.cfg.stats_path is not None
        return Flusher(self, self.cfg.stats_path, interval_s=self.cfg.flush_interval_s, name="pin", what="stats",
                       write_error_key="stats_write", fallback_path=fallback_stats_path(self.cfg.stats_path))


_state: PinState | None = None


def state() -> PinState | None:
    """The running pin state (for tests); None until :func:`attach` has run."""
    return _state


# ---------------------------------------------------------------------------------------------------- validation


def validate(emap: ExpertMap, layers: list[tuple[vllm_seam.MoELayerRef, vllm_seam.MoEGeometry]],
             backend: SplitBackend, tp_size: int, source: str) -> dict[str, list[str]]:
    """Compare the map with the loaded model; raise :class:`PinMapMismatch` listing every difference.

    Returns the per-expert tensor names per layer name (what re-homing splits).
    """
    problems: list[str] = []
    model_ids = [ref.layer_id for ref, _ in layers]
    if not layers:
        raise PinMapMismatch(f"map {source}: the loaded model has no MoE layers; pin mode needs a MoE model")
    if tuple(model_ids) != tuple(emap.layer_ids):
        problems.append(f"MoE layer ids: map has {list(emap.layer_ids)}, model has {model_ids}")
    geo0 = layers[0][1]
    if emap.num_experts != geo0.global_num_experts:
        problems.append(f"num_experts: map has {emap.num_experts}, model has {geo0.global_num_experts}")
    if emap.top_k != geo0.top_k:
        problems.append(f"top_k: map has {emap.top_k}, model has {geo0.top_k}")
    supported = set(backend.SPLIT_TENSORS)
    required = set(backend.REQUIRED_TENSORS)
    names_by_layer: dict[str, list[str]] = {}
    expert_bytes_seen: set[int] = set()
    for ref, geo in layers:
        if geo.global_num_experts != geo0.global_num_experts or geo.top_k != geo0.top_k:
            problems.append(f"layer {ref.layer_id}: {geo.global_num_experts} experts / top-{geo.top_k} differs from "
                            f"layer {layers[0][0].layer_id}")
        names = expert_tensor_names(geo.param_owner, geo.local_num_experts)
        names_by_layer[ref.name] = names
        if set(names) - supported:
            problems.append(f"layer {ref.layer_id}: per-expert tensors {sorted(set(names) - supported)} cannot be "
                            f"split by the {backend.NAME!r} backend (it splits {sorted(supported)})")
        if required - set(names):
            problems.append(f"layer {ref.layer_id}: per-expert tensors {sorted(required - set(names))} are missing "
                            f"(found {names})")
        if geo.local_num_experts:
            expert_bytes_seen.add(sum(tensor_bytes(getattr(geo.param_owner, n)) for n in names)
                                  // geo.local_num_experts)
    want_tensors = emap.meta.get("expert_tensors")
    if isinstance(want_tensors, list):
        found = names_by_layer[layers[0][0].name]
        if sorted(map(str, want_tensors)) != found:
            problems.append(f"per-expert tensors: map was built for {sorted(map(str, want_tensors))}, model has "
                            f"{found}")
    if emap.expert_bytes and expert_bytes_seen:
        per_rank = max(expert_bytes_seen)
        if emap.expert_bytes not in (per_rank, per_rank * tp_size):
            problems.append(f"bytes per expert: map says {emap.expert_bytes}, model has {per_rank} per rank "
                            f"(x{tp_size} ranks = {per_rank * tp_size})")
    if problems:
        raise PinMapMismatch(
            f"pin mode refuses map {source} (label {emap.label!r}, hash {emap.short_hash}) for this model: "
            + "; ".join(problems)
            + ". Build a map from counts of this model (`pinsidecar map build`), or run in count mode."
        )
    return names_by_layer


# ---------------------------------------------------------------------------------------------------- attach


def attach(model: Any, cfg: HookConfig, worker: Any = None) -> PinState:
    """Load, validate and apply the map to ``model``; raise (so the engine refuses to start) on any mismatch."""
    global _state
    _ensure_visible_log()
    if cfg.map_path is None:
        raise PinMapMismatch("pin mode needs PINSIDECAR_MAP_PATH (the row map to apply)")
    emap = load_map(cfg.map_path)  # ArtifactError: unreadable, corrupt or inconsistent map file
    rank, tp_size = vllm_seam.worker_rank(worker) if worker is not None else (0, 1)
    layers = [(ref, vllm_seam.moe_geometry(ref.module)) for ref in vllm_seam.moe_layers(model)]
    if not layers:
        raise PinMapMismatch(f"map {cfg.map_path}: the loaded model has no MoE layers")
    geo0 = layers[0][1]
    device = geo0.device
    try:
        backend_name = select_backend(cfg.backend, device, geo0.experts)
        backend = load_backend(backend_name)
    except BackendUnavailable as exc:
        raise PinMapMismatch(f"map {cfg.map_path}: {exc}") from exc
    names_by_layer = validate(emap, layers, backend, tp_size, str(cfg.map_path))

    ledger = MemoryLedger()
    pins: list[LayerPin] = []
    for ref, geo in layers:  # one layer at a time: each layer's original is freed before the next is copied
        expert_map = None if geo.expert_map is None else [int(v) for v in geo.expert_map.tolist()]
        rows, hot_local, cold_local = emap.layer(ref.layer_id).row_map(emap.num_experts, expert_map)
        rehomed = rehome_layer(geo.param_owner, names_by_layer[ref.name], hot_local, cold_local, ledger)
        pin = LayerPin(
            layer_id=ref.layer_id, name=ref.name,
            row_map=torch.tensor(rows, dtype=torch.int32, device=device),
            hot_rows=len(hot_local), cold_rows=len(cold_local), hot=rehomed.hot, cold=rehomed.cold,
            expert_counts=torch.zeros(emap.num_experts, dtype=torch.int64, device=device),
            cold_counts=torch.zeros(1, dtype=torch.int64, device=device),
            token_counts=torch.zeros(1, dtype=torch.int64, device=device),
            hot_bytes=rehomed.hot_bytes, cold_bytes=rehomed.cold_bytes, keepalive=list(rehomed.cold_host.values()),
        )
        vllm_seam.swap_experts_apply(geo, backend.make_split_apply(geo.experts, pin))
        pins.append(pin)

    hbm = sum(p.hot_bytes for p in pins)
    host = sum(p.cold_bytes for p in pins)
    summary = {
        "map": str(cfg.map_path), "map_hash": emap.content_hash, "label": emap.label, "backend": backend_name,
        "rank": rank, "tp_size": tp_size, "layers": len(pins), "hot_rows": emap.hot_rows, "cold_rows": emap.cold_rows,
        "rank_hot_rows": sorted({p.hot_rows for p in pins}), "rank_cold_rows": sorted({p.cold_rows for p in pins}),
        # "hbm" is the hot tier and "host" the cold one; on the CPU engine both are host memory.
        "tier_bytes": {"hbm": hbm, "host": host},
        "predicted_cold_rate": emap.predicted_cold_rate,
        "peak_extra_bytes": dict(ledger.peak), "peak_extra_total_bytes": ledger.peak_total,
    }
    log.info(
        "pinsidecar pin: map %s (%s, hash %s) on rank %d/%d via %s backend: %d layers, %d hot + %d cold rows/layer, "
        "hot %.1f MiB, cold %.1f MiB, predicted cold rate %s, peak extra while re-homing %.1f MiB",
        cfg.map_path, emap.label or "-", emap.short_hash, rank, tp_size, backend_name, len(pins), emap.hot_rows,
        emap.cold_rows, hbm / 2**20, host / 2**20,
        "n/a" if emap.predicted_cold_rate is None else f"{emap.predicted_cold_rate:.4f}", ledger.peak_total / 2**20,
    )
    _state = PinState(emap=emap, layers=pins, backend=backend_name, rank=rank, tp_size=tp_size, summary=summary,
                      cfg=cfg)
    return _state


def on_engine_ready() -> None:
    """Warm-up is over: zero the counters so they count real traffic only, and (rank 0) write once and start
    the side thread."""
    st = _state
    if st is None:
        return
    st.reset()
    if st.rank != 0 or st.cfg.stats_path is None or st.flusher is not None:
        return
    st.flusher = st.make_flusher()
    st.flusher.flush()
    st.flusher.start()
    st.flusher.flush_at_exit()
