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
   recorded as ``meta["map_changed_on_disk"]``; the running placement stays the one loaded at boot, or applied
   since).
5. While serving, the side thread serves ``apply`` requests (:meth:`PinState.apply`, :mod:`pinsidecar_hook.swap`):
   a candidate map of the same geometry is swapped in place, in bounded batches between steps. That is why pin
   mode holds a *step lock* around each ``execute_model`` (:func:`step_guard`, wrapped around it by
   :mod:`pinsidecar_hook.modes`) and why it keeps the model's facts read at boot (:class:`ModelFacts`): the
   candidate is validated by the same checks as the boot map, after re-homing has changed the tensors those facts
   were read from.

Tensor parallel: every rank applies the same map to its shard of each expert. Expert parallel: each rank maps
only its local experts (vLLM's ``expert_map``), so its row map sends non-local experts to -1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pinsidecar_hook import swap, vllm_seam
from pinsidecar_hook.backends import BackendUnavailable, SplitBackend, describe_experts, select_backend
from pinsidecar_hook.cache import ExpertCache
from pinsidecar_hook.contract import ApplyResult, ExpertMap, StatsSnapshot, fallback_stats_path, load_map
from pinsidecar_hook.contract.env import HookConfig
from pinsidecar_hook.flusher import Flusher, WriteInfo
from pinsidecar_hook.rehome import MemoryLedger, TensorFate, plan_layer_tensors, rehome_layer, tensor_bytes
from pinsidecar_hook.selfcheck import SelfCheck
from pinsidecar_hook.selfcheck import cases as selfcheck_cases

__all__ = ["LayerPin", "ModelFacts", "PinMapMismatch", "PinState", "attach", "check_map", "model_facts",
           "on_engine_ready", "state", "step_guard", "validate"]

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
    hot_rows: int  # H on this rank: the HBM rows, cache slots included (the split's tier boundary)
    cold_rows: int
    hot: dict[str, torch.Tensor]
    cold: dict[str, torch.Tensor]
    expert_counts: torch.Tensor  # int64 [global experts], on the layer's device
    cold_counts: torch.Tensor  # int64 [1]
    token_counts: torch.Tensor  # int64 [1]
    hot_bytes: int = 0
    cold_bytes: int = 0
    keepalive: list[Any] = field(default_factory=list)  # host storage behind the cold device views
    cold_host: dict[str, torch.Tensor] = field(default_factory=dict)  # the same by name: an apply writes it
    # Backends that derive tensors from the row map (triton_experts' tier maps) add a refresher here; an in-place
    # apply calls them right after it flips the row map.
    row_map_listeners: list[Callable[[], None]] = field(default_factory=list)
    # The cache tier (pinsidecar_hook.cache): the last ``cache_slots`` of the HBM rows are slots; the split runs
    # ``cache.step`` before its tiers. None without one.
    cache: ExpertCache | None = None
    cache_slots: int = 0

    def reset(self) -> None:
        self.expert_counts.zero_()
        self.cold_counts.zero_()
        self.token_counts.zero_()
        if self.cache is not None:
            self.cache.reset_counters()


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
    facts: ModelFacts | None = None  # the model as read at boot, to validate an applied candidate
    # Held around each execute_model (step_guard) and by each batch of an in-place apply: batches fall between steps.
    # Re-entrant, as count mode's: the SIGTERM handler runs on the main thread, which may be mid-step.
    step_lock: Any = field(default_factory=threading.RLock)
    # Counts the steps and lets an apply batch that asks for the lock go before the next step: an apply moves its
    # rows in bounded batches with steps in between (:class:`pinsidecar_hook.swap.StepClock`).
    step_clock: swap.StepClock = field(default_factory=swap.StepClock)
    # Tensor parallel: the apply on every rank, through vLLM's group (None: one worker, or no group to reach the
    # others through, and an apply is refused).
    tp: swap.TPApply | None = None

    def __post_init__(self) -> None:
        self.map_path: Path | None = self.cfg.map_path  # the map file served: the boot map, or the last applied
        self._map_identity = _file_identity(self.map_path)

    # ------------------------------------------------------------------------------------------ flush source

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def check_map_file(self) -> bool:
        """Whether the served map file changed on disk (size, mtime or inode) since it was loaded; logged the first
        time."""
        if not self.map_changed and self.map_path is not None \
                and _file_identity(self.map_path) != self._map_identity:
            self.map_changed = True
            log.warning("pinsidecar pin: map file %s changed on disk while serving; ignored (the running placement "
                        "is still map %s; an apply request or a reboot changes it)", self.map_path,
                        self.emap.short_hash)
        return self.map_changed

    # ------------------------------------------------------------------------------------------ apply (remap)

    def apply(self, args: Mapping[str, Any], token: str, hold_budget_s: float | None = None,
              switch_interval_s: float | None = swap.SWITCH_INTERVAL_S, ordering: str | None = None) -> ApplyResult:
        """Serve an ``apply`` request: swap the candidate map in place, in bounded batches between steps
        (:func:`pinsidecar_hook.swap.apply_map`; ``hold_budget_s`` bounds one batch, ``switch_interval_s`` is the
        GIL's switch interval meanwhile, ``ordering`` how batches are ordered against the steps; None: the
        request's, else the hook's default). Never raises; the answer says applied, refused or failed. Under tensor
        parallel, rank 0 hands it to every rank's next step boundary (:mod:`pinsidecar_hook.swap.tp`: one hold,
        every rank or none; the hold budget and ordering do not apply)."""
        if self.tp is not None:
            return self.tp.submit(args, token)
        return swap.apply_map(self, args, token, hold_budget_s=hold_budget_s, switch_interval_s=switch_interval_s,
                              ordering=ordering)

    def step_guard(self) -> contextlib.AbstractContextManager[None]:
        """Held around one step (``execute_model``): the step lock, after any apply batch already asking for it;
        the step is counted when it ends, so the apply knows one ran between two of its batches. Under tensor
        parallel every rank first passes its step boundary (:meth:`~pinsidecar_hook.swap.tp.TPApply.at_step_boundary`),
        where a pending apply runs on all of them."""
        if self.tp is not None:
            self.tp.at_step_boundary(self)
        return self.step_clock.step(self.step_lock)

    def check_candidate(self, candidate: ExpertMap, source: str) -> None:
        """The boot checks (:func:`check_map`) for a candidate; :class:`PinMapMismatch` when it does not fit."""
        if self.facts is None:
            raise PinMapMismatch("this pin state holds no model facts (it was not built by attach)")
        check_map(candidate, self.facts, self.tp_size, source)

    def adopt(self, candidate: ExpertMap, map_path: Path) -> None:
        """The rows now follow ``candidate``: serve it under its hash and label, and watch its file from now on."""
        self.emap = candidate
        self.map_path = map_path
        self._map_identity = _file_identity(map_path)
        self.map_changed = False
        self.summary.update(map=str(map_path), map_hash=candidate.content_hash, label=candidate.label,
                            predicted_cold_rate=candidate.predicted_cold_rate)

    def snapshot(self, info: WriteInfo) -> StatsSnapshot:
        """Copy the device counters (small) into a stats snapshot. Counts may be mid-step: a periodic write can
        land between two layers of one forward, so only a snapshot taken between steps is exactly
        layers x tokens x k."""
        emap = self.emap
        hist = [layer.expert_counts.to("cpu").tolist() for layer in self.layers]
        cold = [int(layer.cold_counts.to("cpu").item()) for layer in self.layers]
        tokens = int(self.layers[0].token_counts.to("cpu").item()) if self.layers else 0
        caches = [layer.cache.counters() for layer in self.layers if layer.cache is not None]
        cache_stats = None if len(caches) != len(self.layers) or not caches else {
            "slots": emap.cache_slots, "policy": emap.cache_policy,
            **{key: [c[key] for c in caches] for key in ("hits", "fills", "evictions")}}
        return StatsSnapshot(
            boot_id=self.boot_id, seq=info.seq, layer_ids=[layer.layer_id for layer in self.layers],
            num_experts=emap.num_experts, top_k=emap.top_k, selections=[int(sum(row)) for row in hist],
            cold_selections=cold, tokens=tokens, map_hash=emap.content_hash, map_label=emap.label, pid=os.getpid(),
            written_at=time.time(), tier_bytes=dict(self.summary["tier_bytes"]),
            histogram=hist if self.cfg.histogram else None, errors=dict(info.errors), flush_token=info.flush_token,
            meta={"map_path": str(self.map_path or ""), "map_changed_on_disk": self.check_map_file(),
                  "backend": self.backend, "backend_verified": self.summary.get("backend_verified", True),
                  "backend_guarantee": self.summary.get("backend_guarantee"),
                  "tp_size": self.tp_size, "expert_bytes": self.summary.get("expert_bytes", 0),
                  **({"selfcheck": self.summary["selfcheck"]} if "selfcheck" in self.summary else {}),
                  "peak_extra_bytes": self.summary["peak_extra_total_bytes"],
                  "predicted_cold_rate": emap.predicted_cold_rate, "stats_path": str(self.cfg.stats_path or ""),
                  **({"apply": dict(info.apply)} if info.apply is not None else {})},
            cache=cache_stats,
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


@contextlib.contextmanager
def step_guard() -> Iterator[None]:
    """Held around each ``execute_model``: an in-place apply batch waits for the step to finish, and the next step
    waits for the batch (:meth:`PinState.step_guard`)."""
    st = _state
    if st is None:
        yield
        return
    with st.step_guard():
        yield


# ---------------------------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class ModelFacts:
    """What map validation needs to know about the loaded model, read once at boot, before re-homing: afterwards the
    layers' parameters hold only the hot rows, so the per-expert tensors could no longer be found by their
    leading dimension. Kept in :class:`PinState` so that an applied candidate passes the same checks as the boot
    map."""

    layer_ids: tuple[int, ...]
    num_experts: int  # global, of the first layer
    top_k: int
    first_tensors: tuple[str, ...]  # the first layer's per-expert tensor names (sorted)
    expert_bytes: int  # bytes of one expert on this rank, the largest over layers (0: unknown)
    names_by_layer: dict[str, list[str]]  # per layer name: its per-expert tensors (what re-homing splits)
    problems: tuple[str, ...]  # differences that do not depend on the map (mixed layers, unsplittable tensors)
    aliases_by_layer: dict[str, dict[str, str]] = field(default_factory=dict)  # another name -> split tensor
    first_fates: tuple[TensorFate, ...] = ()  # every tensor of the first layer and what re-homing does with it


def model_facts(layers: list[tuple[vllm_seam.MoELayerRef, vllm_seam.MoEGeometry]],
                backend: type[SplitBackend]) -> ModelFacts:
    """Read :class:`ModelFacts` from the loaded (not yet re-homed) layers, for ``backend``: every tensor of every
    layer gets a fate (:func:`pinsidecar_hook.rehome.plan_layer_tensors`); one the backend does not know is a
    problem that stops the boot, named with its shape and dtype."""
    if not layers:
        return ModelFacts((), 0, 0, (), 0, {}, ())
    geo0 = layers[0][1]
    required = set(backend.REQUIRED_TENSORS)
    problems: list[str] = []
    names_by_layer: dict[str, list[str]] = {}
    aliases_by_layer: dict[str, dict[str, str]] = {}
    fates_by_layer: dict[str, list[TensorFate]] = {}
    expert_bytes_seen: set[int] = set()
    for ref, geo in layers:
        if geo.global_num_experts != geo0.global_num_experts or geo.top_k != geo0.top_k:
            problems.append(f"layer {ref.layer_id}: {geo.global_num_experts} experts / top-{geo.top_k} differs from "
                            f"layer {layers[0][0].layer_id}")
        fates = plan_layer_tensors(geo.param_owner, geo.local_num_experts, backend.SPLIT_TENSORS,
                                   backend.SHARED_TENSORS)
        fates_by_layer[ref.name] = fates
        names = sorted(f.name for f in fates if f.fate == "split")
        names_by_layer[ref.name] = names
        aliases_by_layer[ref.name] = {f.name: f.alias_of for f in fates
                                      if f.fate == "alias" and f.alias_of in names}
        unknown = [f for f in fates if f.fate == "unknown"]
        if unknown:
            problems.append(f"layer {ref.layer_id}: the {backend.NAME!r} backend does not know "
                            + ", ".join(f.describe() for f in unknown)
                            + f" (it splits {sorted(backend.SPLIT_TENSORS)}; pin mode never serves a tensor left "
                            "unsplit)")
        present = set(names) | set(aliases_by_layer[ref.name])
        if required - present:
            problems.append(f"layer {ref.layer_id}: per-expert tensors {sorted(required - present)} are missing "
                            f"(found {names})")
        if geo.local_num_experts:
            expert_bytes_seen.add(sum(tensor_bytes(getattr(geo.param_owner, n)) for n in names)
                                  // geo.local_num_experts)
    first = layers[0][0].name
    return ModelFacts(
        layer_ids=tuple(ref.layer_id for ref, _ in layers), num_experts=geo0.global_num_experts, top_k=geo0.top_k,
        first_tensors=tuple(names_by_layer[first]), expert_bytes=max(expert_bytes_seen, default=0),
        names_by_layer=names_by_layer, problems=tuple(problems), aliases_by_layer=aliases_by_layer,
        first_fates=tuple(fates_by_layer[first]))


def refuse_eplb(layers: list[tuple[Any, Any]], source: str) -> None:
    """Refuse to pin when vLLM's expert-parallel load balancer (EPLB) runs: it rebalances by moving experts between
    ranks and rewriting the expert weights in place while the engine serves, so the rows pin mode re-homed by the
    map would hold other experts than the map says, and the map would be stale from the first rebalance on."""
    balanced = [ref.layer_id for ref, geo in layers if geo.eplb]
    if balanced:
        raise PinMapMismatch(
            f"pin mode refuses map {source}: EPLB (vLLM's expert-parallel load balancer, --enable-eplb) runs on "
            f"{len(balanced)} MoE layer(s) (first: {balanced[0]}); it moves experts between ranks while serving, "
            "and a row map cannot follow it. Boot without --enable-eplb to pin, or serve without pin mode "
            "(count mode works with EPLB: it counts the router's logical ids)")


def check_map(emap: ExpertMap, facts: ModelFacts, tp_size: int, source: str) -> None:
    """Compare a map with the model's facts; raise :class:`PinMapMismatch` listing every difference."""
    if not facts.layer_ids:
        raise PinMapMismatch(f"map {source}: the loaded model has no MoE layers; pin mode needs a MoE model")
    problems: list[str] = []
    if facts.layer_ids != tuple(emap.layer_ids):
        problems.append(f"MoE layer ids: map has {list(emap.layer_ids)}, model has {list(facts.layer_ids)}")
    if emap.num_experts != facts.num_experts:
        problems.append(f"num_experts: map has {emap.num_experts}, model has {facts.num_experts}")
    if emap.top_k != facts.top_k:
        problems.append(f"top_k: map has {emap.top_k}, model has {facts.top_k}")
    problems.extend(facts.problems)
    want_tensors = emap.meta.get("expert_tensors")
    if isinstance(want_tensors, list):
        found = list(facts.first_tensors)
        if sorted(map(str, want_tensors)) != found:
            problems.append(f"per-expert tensors: map was built for {sorted(map(str, want_tensors))}, model has "
                            f"{found}")
    built_tp = emap.meta.get("tp_size")
    if isinstance(built_tp, int) and not isinstance(built_tp, bool) and built_tp != tp_size:
        problems.append(f"tensor parallel: map was built for tp_size {built_tp} (from counts of an engine at "
                        f"{built_tp} ranks: {emap.expert_bytes} bytes per expert per rank there), this engine runs "
                        f"tp_size {tp_size} ({facts.expert_bytes} bytes per expert per rank); count-boot this "
                        f"engine's [engine] table (its --tensor-parallel-size) and build the map from those counts")
    elif emap.expert_bytes and facts.expert_bytes:
        per_rank = facts.expert_bytes
        if emap.expert_bytes not in (per_rank, per_rank * tp_size):
            problems.append(f"bytes per expert: map says {emap.expert_bytes}, model has {per_rank} per rank "
                            f"(x{tp_size} ranks = {per_rank * tp_size})")
    if problems:
        raise PinMapMismatch(
            f"pin mode refuses map {source} (label {emap.label!r}, hash {emap.short_hash}) for this model: "
            + "; ".join(problems)
            + ". Build a map from counts of this model (`pinsidecar map build`), or run in count mode."
        )


def validate(emap: ExpertMap, layers: list[tuple[vllm_seam.MoELayerRef, vllm_seam.MoEGeometry]],
             backend: SplitBackend, tp_size: int, source: str) -> dict[str, list[str]]:
    """Compare the map with the loaded model; raise :class:`PinMapMismatch` listing every difference.

    Returns the per-expert tensor names per layer name (what re-homing splits).
    """
    facts = model_facts(layers, backend)
    check_map(emap, facts, tp_size, source)
    return facts.names_by_layer


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
    refuse_eplb(layers, str(cfg.map_path))
    geo0 = layers[0][1]
    device = geo0.device
    try:
        backend = select_backend(cfg.backend, device, geo0.experts)
        for ref, geo in layers[1:]:  # one backend for the model: every layer must be one it splits
            reason = backend.supports(geo.experts, geo.device)
            if reason is not None:
                raise BackendUnavailable(f"layer {ref.layer_id} ({describe_experts(geo.experts)}): {reason}")
    except BackendUnavailable as exc:
        raise PinMapMismatch(f"map {cfg.map_path}: {exc}") from exc
    # Before anything is measured (the self-check's reference call included): the unsplit call takes only paths
    # the split reproduces.
    notes = {note for _ref, geo in layers if (note := backend.configure_unsplit(geo.experts)) is not None}
    for note in sorted(notes):
        log.info("pinsidecar pin: %s", note)
    slots = emap.cache_slots
    if slots and not backend.CACHE:
        raise PinMapMismatch(f"map {cfg.map_path} has a cache tier ({slots} slots per layer), which the "
                             f"{backend.NAME} backend does not run; serve a map built without --cache-slots, or "
                             "use a backend that runs the cache (cpu, triton_experts)")
    backend_name = backend.NAME
    if not backend.VERIFIED:
        log.warning("pinsidecar pin: the %s backend has not run on hardware against vLLM's unsplit kernel "
                    "(unverified); it runs because PINSIDECAR_PIN_BACKEND asks for it. Boot once with "
                    "PINSIDECAR_PIN_SELFCHECK=1 to compare it on this engine", backend_name)
    overlap = cfg.overlap_tiers and backend.OVERLAP
    if cfg.overlap_tiers and not overlap:
        log.warning("pinsidecar pin: PINSIDECAR_PIN_OVERLAP asks for the tier overlap, but the %s backend's two tier "
                    "calls share buffers; its tiers run one after the other", backend_name)
    facts = model_facts(layers, backend)
    check_map(emap, facts, tp_size, str(cfg.map_path))
    log.info("pinsidecar pin: layer %d tensors: %s", facts.layer_ids[0],
             "; ".join(f.describe() for f in facts.first_fates))
    names_by_layer = facts.names_by_layer
    checker = SelfCheck(vllm_config=getattr(worker, "vllm_config", None),
                        expected_equal=backend.GUARANTEE == "bitwise") if cfg.selfcheck else None

    ledger = MemoryLedger()
    pins: list[LayerPin] = []
    for ref, geo in layers:  # one layer at a time: each layer's original is freed before the next is copied
        expert_map = None if geo.expert_map is None else [int(v) for v in geo.expert_map.tolist()]
        rows, hot_local, cold_local = emap.layer(ref.layer_id).row_map(emap.num_experts, expert_map)
        hbm_rows = len(hot_local) + slots  # with a cache the slots follow the hot rows, the cold rows move up
        # Two spare elements after the experts: the cache's masked writes land there (pinsidecar_hook.cache).
        row_map_ext = torch.tensor([r + slots if r >= len(hot_local) else r for r in rows] + [-1, -1],
                                   dtype=torch.int32, device=device)
        row_map = row_map_ext[: emap.num_experts]
        check = None
        if checker is not None:
            hidden = geo.hidden_size or int(geo.param_owner.w2_weight.shape[1])
            check = checker.before(geo, ref.layer_id, selfcheck_cases(
                emap.num_experts, geo.top_k, hidden, geo.act_dtype or torch.bfloat16, device, row_map,
                hbm_rows, seed=ref.layer_id, tokens=checker.tokens, monolithic=geo.monolithic))
        backend.before_rehome(geo.experts, geo.param_owner)
        rehomed = rehome_layer(geo.param_owner, names_by_layer[ref.name], hot_local, cold_local, ledger,
                               aliases=facts.aliases_by_layer.get(ref.name), slot_rows=slots)
        pin = LayerPin(
            layer_id=ref.layer_id, name=ref.name, row_map=row_map,
            hot_rows=hbm_rows, cold_rows=len(cold_local), hot=rehomed.hot, cold=rehomed.cold,
            expert_counts=torch.zeros(emap.num_experts, dtype=torch.int64, device=device),
            cold_counts=torch.zeros(1, dtype=torch.int64, device=device),
            token_counts=torch.zeros(1, dtype=torch.int64, device=device),
            hot_bytes=rehomed.hot_bytes, cold_bytes=rehomed.cold_bytes, keepalive=list(rehomed.cold_host.values()),
            cold_host=dict(rehomed.cold_host), cache_slots=slots,
        )
        if slots:
            try:
                pin.cache = ExpertCache(row_map_ext, len(hot_local), slots, emap.cache_policy, pin.cold_counts)
            except ValueError as exc:
                raise PinMapMismatch(f"map {cfg.map_path}: {exc}") from exc
        split = backend(geo.experts, pin)
        split.overlap = overlap
        pin.row_map_listeners.append(split.refresh)  # an in-place apply flips the row map: the split follows
        vllm_seam.install_split(geo, split)
        if check is not None:
            checker.after(geo, check)
        pins.append(pin)

    hbm = sum(p.hot_bytes for p in pins)
    host = sum(p.cold_bytes for p in pins)
    summary = {
        "map": str(cfg.map_path), "map_hash": emap.content_hash, "label": emap.label, "backend": backend_name,
        "rank": rank, "tp_size": tp_size, "layers": len(pins), "hot_rows": emap.hot_rows, "cold_rows": emap.cold_rows,
        "cache_slots": slots, "cache_policy": emap.cache_policy if slots else None,
        "rank_hot_rows": sorted({p.hot_rows - p.cache_slots for p in pins}),
        "rank_cold_rows": sorted({p.cold_rows for p in pins}),
        # "hbm" is the hot tier and "host" the cold one; on the CPU engine both are host memory.
        "tier_bytes": {"hbm": hbm, "host": host},
        "predicted_cold_rate": emap.predicted_cold_rate,
        "peak_extra_bytes": dict(ledger.peak), "peak_extra_total_bytes": ledger.peak_total,
        "backend_verified": backend.VERIFIED, "backend_guarantee": backend.GUARANTEE,
        "overlap_tiers": overlap,
        "expert_bytes": facts.expert_bytes,
        "tensors": [f.describe() for f in facts.first_fates],
    }
    if checker is not None:
        summary["selfcheck"] = checker.summary()
        sc = summary["selfcheck"]
        bad = sc.get("errors") or (sc.get("mismatch_count") and backend.GUARANTEE == "bitwise")
        design = "" if backend.GUARANTEE == "bitwise" else (
            f" (the {backend_name} backend guarantees {backend.GUARANTEE}, not bit identity to the unsplit kernel)")
        (log.error if bad else log.info)(
            "pinsidecar pin selfcheck: %s",
            f"{sc['equal']}/{sc['cases']} cases bitwise equal to vLLM's unsplit call over {sc['layers']} layers"
            f"{design}{'; mismatches: ' + str(sc['mismatches'][:3]) if sc.get('mismatch_count') else ''}"
            f"{'; errors: ' + str(sc['errors'][:2]) if sc.get('errors') else ''}")
    log.info(
        "pinsidecar pin: map %s (%s, hash %s) on rank %d/%d via %s backend (%s): %d layers, %d hot + %d cold "
        "rows/layer, "
        "hot %.1f MiB, cold %.1f MiB, predicted cold rate %s, peak extra while re-homing %.1f MiB",
        cfg.map_path, emap.label or "-", emap.short_hash, rank, tp_size, backend_name, backend.GUARANTEE, len(pins),
        emap.hot_rows,
        emap.cold_rows, hbm / 2**20, host / 2**20,
        "n/a" if emap.predicted_cold_rate is None else f"{emap.predicted_cold_rate:.4f}", ledger.peak_total / 2**20,
    )
    tp = None
    if tp_size > 1:
        group = vllm_seam.tp_cpu_group()
        if group is not None:
            tp = swap.TPApply(swap.TorchRankGroup(*group))
        else:
            log.warning("pinsidecar pin: tensor parallel %d without vLLM's group to reach the other ranks: an "
                        "in-place apply will be refused (a reboot deploys a new map)", tp_size)
    _state = PinState(emap=emap, layers=pins, backend=backend_name, rank=rank, tp_size=tp_size, summary=summary,
                      cfg=cfg, facts=facts, tp=tp)
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
