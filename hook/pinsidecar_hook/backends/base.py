"""What a split backend is: one contract in three stages, of which a kernel family writes one.

vLLM states its fused-MoE kernel as stages behind small base classes (``modular_kernel.py``: prepare, experts,
finalize), one implementation of each chosen at build time. The split follows that shape. :meth:`SplitBackend.apply`
replaces vLLM's experts call for one layer; it is the same for every backend and runs three stages:

1. **partition** (here, shared by all): the cache tier's step when the layer has one (its fills, the row map's flip,
   and the tier maps' refresh where its fused step did not follow them), then each token's top-k ids split by
   residency into the two tiers' ids, with the live counters (per expert, cold, tokens) and the CUDA-graph padding
   mask (the worker's real-token scalar) in the same launch (:func:`pinsidecar_hook.kernels.partition`);
2. **tiers** (the kernel family's :meth:`SplitBackend.run_tier`): one call of the family's kernel per tier, which
   returns that tier's per-(token, slot) rows, dense ``[T, k, H]`` or permuted with an index per slot, weighted by
   the router or not (the family's reducer knows which). :meth:`SplitBackend.run_tiers` schedules the two calls
   (hot, then cold when there are cold rows; with ``overlap``, for a family whose two calls are independent
   (``OVERLAP``), the cold call on a side stream concurrently with the hot one, :mod:`.streams`); a family
   overrides it only when the two calls are not independent (Triton's phased FP8 path, CPU's one flat buffer,
   Humming's shared buffers, the torch reference's own rows);
3. **reduce** (a :class:`Reducer` chosen once, at attach, by :meth:`SplitBackend.choose_reducer`): each token's k
   rows into ``output``, once, in slot order, in the family's own arithmetic (fp32, one cast).

A family may also refuse a call (:meth:`check_call`: LoRA, a post-GEMM2 hook), cut it in token chunks
(:meth:`chunk_tokens`, for a kernel with a per-launch token limit; the partition runs once over the whole call),
derive state from the row map (``TIER_MAPS``: vLLM ``expert_map``-style maps per tier, refreshed by
:meth:`refresh`), and set up vLLM's own experts object before anything is measured (:meth:`configure_unsplit`:
switch off a path of the unsplit call the split cannot take, so that what the split reproduces is what the engine
would compute).

Under ``torch.compile`` (the CPU engine traces its MoE forward; vLLM's CUDA MoE forward is an opaque op of its
own) the three stages run inside one opaque custom op, ``pinsidecar::split_experts``, so data-dependent shapes stay
out of the traced graph; the op finds the backend by a key fixed at attach.

A backend class also says what it can split (:meth:`SplitBackend.supports`, asked once per layer before anything is
moved), which per-expert tensors it knows (:attr:`SplitBackend.SPLIT_TENSORS`: a layer with any other is refused,
since ignoring a tensor would silently compute something else), and whether it has run on the hardware it targets
(:attr:`SplitBackend.VERIFIED`). Nothing of vLLM's is patched per call: the layer's experts object is switched once,
at attach, to a subclass of its own class whose ``apply`` calls the split
(:func:`pinsidecar_hook.vllm_seam.install_split`).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import weakref
from typing import Any, ClassVar, Literal, Protocol, final, get_args

import torch

from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.streams import fork_join
from pinsidecar_hook.backends.tiers import tier_expert_maps
from pinsidecar_hook.kernels.partition import partition

__all__ = ["REAL_TOKENS", "BackendUnavailable", "ExpertsCall", "Partition", "Reducer", "Rows", "SplitBackend",
           "SplitLayer", "Tier", "TierRows", "UnsupportedSplit"]


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot be used here (its library is missing, or nothing fits the layer)."""


class UnsupportedSplit(RuntimeError):
    """The experts object is configured in a way this backend's split cannot reproduce bit for bit."""


class SplitLayer(Protocol):
    """One layer's pin state, as a backend reads it (pin mode's ``LayerPin``)."""

    row_map: torch.Tensor  # int32 [global experts]: hot rows 0..H-1, cold rows H.., -1 not on this rank
    hot_rows: int
    cold_rows: int
    hot: dict[str, torch.Tensor]  # per-expert tensors of the hot rows, by parameter name
    cold: dict[str, torch.Tensor]  # the same for the cold rows (a device view of host memory on CUDA)
    expert_counts: torch.Tensor  # int64 [global experts]: live selections per expert
    cold_counts: torch.Tensor  # int64 [1]: live selections landing on a cold row (with a cache: the misses)
    token_counts: torch.Tensor  # int64 [1]: tokens through this layer
    cache: Any  # pinsidecar_hook.cache.ExpertCache or None; its slots are the last cache_slots of the HBM rows
    cache_slots: int


@dataclasses.dataclass
class ExpertsCall:
    """One call of vLLM's ``FusedMoEExpertsModular.apply``, by name, less the weights (the layer state holds both
    tiers; the ones vLLM passes are the layer's parameters, which hold only the hot rows). ``counters``: where the
    partition counts, when not the layer's own counters (the opaque op's stand-ins under ``torch.compile``)."""

    output: torch.Tensor
    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: Any
    global_num_experts: int
    expert_map: torch.Tensor | None
    a1q_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None
    workspace13: torch.Tensor | None
    workspace2: torch.Tensor | None
    expert_tokens_meta: Any
    apply_router_weight_on_input: bool
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    def tokens(self, start: int, end: int) -> ExpertsCall:
        """The call restricted to tokens ``start:end`` (every per-token tensor sliced; workspaces kept)."""
        n = self.num_tokens

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[start:end] if t is not None and t.dim() > 0 and t.shape[0] == n else t

        return dataclasses.replace(self, output=self.output[start:end], hidden_states=self.hidden_states[start:end],
                                   topk_weights=self.topk_weights[start:end], topk_ids=self.topk_ids[start:end],
                                   a1q_scale=cut(self.a1q_scale))


@dataclasses.dataclass(frozen=True)
class Partition:
    """Each slot's row in its tier: ``hot_ids`` (``0..H-1``, -1 elsewhere) and ``cold_ids`` (``0..C-1``)."""

    hot_ids: torch.Tensor
    cold_ids: torch.Tensor

    def ids(self, tier: Tier) -> torch.Tensor:
        return self.hot_ids if tier.name == "hot" else self.cold_ids

    def tokens(self, start: int, end: int) -> Partition:
        return Partition(self.hot_ids[start:end], self.cold_ids[start:end])

    def row_ids(self, hot_rows: int, absent: int = -1) -> torch.Tensor:
        """Each slot's row in the re-homed numbering (hot ``0..H-1``, cold ``H..``), ``absent`` for an expert with
        no row on this rank; int32 ``[T, k]``."""
        rows = torch.where(self.cold_ids >= 0, self.cold_ids + hot_rows, self.hot_ids)
        if absent != -1:
            rows = torch.where(rows >= 0, rows, absent)
        return rows.to(torch.int32)


@dataclasses.dataclass(frozen=True)
class Tier:
    """One residency tier of a layer, as a family's :meth:`SplitBackend.run_tier` gets it: its per-expert tensors
    (rows in tier order), its row count, its first row in the row map's numbering, and its vLLM ``expert_map``
    (global id -> row of this tier, -1 elsewhere) when the family uses tier maps."""

    name: str  # "hot" or "cold"
    tensors: dict[str, torch.Tensor]
    rows: int
    offset: int
    expert_map: torch.Tensor | None = None


@dataclasses.dataclass
class Rows:
    """One tier call's rows: dense per (token, slot) (``index`` None: ``[T, k, H]``, or ``[T * k, H]`` in flat
    order), or permuted ``[P, H]`` with ``index [T, k]`` giving each slot's row (-1: not this call's slot)."""

    values: torch.Tensor
    index: torch.Tensor | None = None


@dataclasses.dataclass
class TierRows:
    """What the tiers computed for one call: the hot call's rows and the cold call's (None when there was no cold
    call, or when ``hot`` already holds every slot)."""

    hot: Rows
    cold: Rows | None = None


class Reducer(abc.ABC):
    """The reduce stage: each token's k rows into ``call.output``, once, in slot order. Chosen at attach
    (:meth:`SplitBackend.choose_reducer`); implementations in :mod:`pinsidecar_hook.backends.reduce` and, for
    the CPU kernel's own arithmetic, :mod:`pinsidecar_hook.backends.cpu`."""

    @abc.abstractmethod
    def reduce(self, call: ExpertsCall, part: Partition, rows: TierRows) -> None:
        """Write ``call.output`` from the tiers' rows."""


class _RealTokens:
    def __repr__(self) -> str:
        return "REAL_TOKENS"


# Default ``num_real`` of a backend: the worker's real-token scalar (``vllm_seam.real_token_count``).
REAL_TOKENS: Any = _RealTokens()

# Backends reachable from the opaque op by key (weakly: a backend lives as long as its layer's experts object).
_BACKENDS: weakref.WeakValueDictionary[int, SplitBackend] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# What a split backend may promise (SplitBackend.GUARANTEE), strongest first.
Guarantee = Literal["bitwise", "placement-invariant", "none"]
GUARANTEES: tuple[str, ...] = get_args(Guarantee)


class SplitBackend(abc.ABC):
    """One layer's split invoke (module docstring). A kernel family sets the class attributes and implements
    :meth:`supports`, :meth:`run_tier` and :meth:`choose_reducer`; the registry
    (:mod:`pinsidecar_hook.contract.backends`) says where each class lives."""

    NAME: ClassVar[str]
    # Per-expert tensors (dim 0 = local experts) this backend splits and reads, by layer parameter name.
    SPLIT_TENSORS: ClassVar[tuple[str, ...]]
    REQUIRED_TENSORS: ClassVar[tuple[str, ...]] = ("w13_weight", "w2_weight")
    # Tensors of the layer that are not per expert and that the backend leaves shared by both tiers (a per-tensor
    # input scale, say). Anything else on the layer that is not per expert is listed as "shared" by the re-homing
    # plan too, but only after a check that it cannot be per-expert data in another layout.
    SHARED_TENSORS: ClassVar[tuple[str, ...]] = ()
    # Has run on the hardware it targets, bit-identical to vLLM's unsplit kernel. An unverified backend still runs
    # when asked for by name, with a warning at boot, and `pinsidecar status` says so.
    VERIFIED: ClassVar[bool] = True
    # May ``auto`` pick it? A reference (torch_ref) or an adapter that never ran (FlashInfer) may not.
    AUTO: ClassVar[bool] = True
    # What the split promises against vLLM's unsplit call of the same layer (GUARANTEES): "bitwise", equal bit
    # for bit (what the self-check expects); "placement-invariant", every row map gives the same bits, but not
    # vLLM's (the CPU kernel reduces inside itself, backends/cpu.py; the torch reference); "none", it runs but was
    # measured to differ (Marlin). VERIFIED says whether it was shown on the hardware it targets.
    GUARANTEE: ClassVar[Guarantee] = "bitwise"
    # Runs the cache tier (pinsidecar_hook.cache): the partition stage steps the cache before the tiers, treating
    # the slots as HBM rows, and the cache counts the misses. A map with cache slots is refused on a backend
    # without it.
    CACHE: ClassVar[bool] = False
    # Calls vLLM with ``expert_map``-style tier maps (:func:`pinsidecar_hook.backends.tiers.tier_expert_maps`),
    # built here from the row map, kept in step with it by :meth:`refresh` and the cache's fused step.
    TIER_MAPS: ClassVar[bool] = False
    # Stands in for a kernel that routes inside itself (a monolithic experts class, which takes the router's
    # logits): :meth:`route` computes the ids and weights the kernel would, then the three stages run as for a
    # modular call (:meth:`apply_routed`).
    ROUTES: ClassVar[bool] = False
    # The two tier calls are independent once each has its own buffers (:meth:`side_call`), so the cold one may run
    # on a side stream while the hot one runs (``self.overlap``, set by pin mode from ``PINSIDECAR_PIN_OVERLAP``).
    OVERLAP: ClassVar[bool] = False

    def __init__(self, experts: Any, layer: SplitLayer, *, num_real: Any = REAL_TOKENS) -> None:
        """``num_real``: the real-token scalar that masks CUDA-graph padding out of the counters (default: the
        worker's; None: count every row). A family's constructor stores its own options first, then calls this,
        which ends by choosing the reducer."""
        self.experts = experts
        self.layer = layer
        self.num_real = vllm_seam.real_token_count(layer.row_map.device) if num_real is REAL_TOKENS else num_real
        self.global_num_experts = int(layer.row_map.shape[0])
        self.hot_map: torch.Tensor | None = None
        self.cold_map: torch.Tensor | None = None
        if self.TIER_MAPS:
            self.hot_map, self.cold_map = tier_expert_maps(layer.row_map, layer.hot_rows)
        # With a cache the cache counts the misses; the partition's own cold count (what is still cold after the
        # step's fills) goes to a scratch counter.
        self._still_cold = torch.zeros_like(layer.cold_counts) if layer.cache is not None else None
        if layer.cache is not None and self.hot_map is not None:
            layer.cache.tier_maps = (self.hot_map, self.cold_map)  # the fused CUDA step updates them with the row map
        self.hot = Tier("hot", layer.hot, layer.hot_rows, 0, self.hot_map)
        self.cold = Tier("cold", layer.cold, layer.cold_rows, layer.hot_rows, self.cold_map)
        self.overlap = False  # pin mode turns it on for an OVERLAP family when asked (PINSIDECAR_PIN_OVERLAP)
        self.key = next(_KEYS)
        _BACKENDS[self.key] = self
        self.reducer = self.choose_reducer()

    # ------------------------------------------------------------------------------------------ what a family says

    @classmethod
    @abc.abstractmethod
    def supports(cls, experts: Any, device: torch.device) -> str | None:
        """``None`` when this backend can split ``experts`` (its class and its quant config) on ``device``, else
        the reason it cannot, in words an operator can act on. Asked at attach, before anything is moved."""

    @classmethod
    def configure_unsplit(cls, experts: Any) -> str | None:
        """Set vLLM's experts object up, at attach and before the self-check's reference call, so that its own
        unsplit call takes only paths the split reproduces; a line for the boot log when that changed anything.
        Most families change nothing."""
        return None

    @classmethod
    def before_rehome(cls, experts: Any, owner: Any) -> None:
        """Called once per layer just before its tensors are re-homed (after the self-check's reference call): drop
        the references vLLM keeps to the original per-expert tensors besides the layer's parameters (a second
        wrapper over the same storage), or re-homing cannot free them. Most families have none."""
        return

    @abc.abstractmethod
    def choose_reducer(self) -> Reducer:
        """The reduce stage for this layer, chosen once (called at the end of the constructor)."""

    @abc.abstractmethod
    def run_tier(self, tier: Tier, call: ExpertsCall, part: Partition) -> Rows:
        """One tier's call of the family's kernel: its rows (see :class:`Rows`)."""

    def run_tiers(self, call: ExpertsCall, part: Partition) -> TierRows:
        """Both tiers' calls: hot, then cold when the layer has cold rows; with ``overlap`` (on CUDA), the cold call
        on the side stream concurrently with the hot one (:func:`.streams.fork_join`), given buffers of its own before
        the fork (:meth:`side_call`). Overridden only where the two calls depend on each other or share a buffer."""
        if self.cold.rows == 0:
            return TierRows(self.run_tier(self.hot, call, part))
        if self.overlap:  # on the CPU fork_join runs the side call first, then the main one: the same buffers
            cold_call = self.side_call(call)
            hot, cold = fork_join(lambda: self.run_tier(self.hot, call, part),
                                  lambda: self.run_tier(self.cold, cold_call, part), call.output.device)
            return TierRows(hot, cold)
        return TierRows(self.run_tier(self.hot, call, part), self.run_tier(self.cold, call, part))

    def side_call(self, call: ExpertsCall) -> ExpertsCall:
        """The call as the cold tier runs it on the side stream: with buffers of its own for whatever the hot call
        also writes (vLLM's workspaces), allocated here, before the fork. The default shares nothing to replace."""
        return call

    def check_call(self, call: ExpertsCall) -> None:
        """Raise :class:`UnsupportedSplit` for a call the split cannot reproduce (what only shows while serving)."""
        return

    def chunk_tokens(self, call: ExpertsCall) -> int:
        """Tokens per tier launch (the family's kernel limit); the whole call by default."""
        return call.num_tokens

    def refresh(self) -> None:
        """The layer's row map was flipped in place (an in-place apply, or a cache step whose launch did not
        update the tier maps): recompute, in place, what this split derived from it, writing the same tensors
        (captured CUDA graphs read them by address), on the current stream, in order after the flip."""
        if self.hot_map is None or self.cold_map is None:
            return
        hot_map, cold_map = tier_expert_maps(self.layer.row_map, self.layer.hot_rows)
        self.hot_map.copy_(hot_map)
        self.cold_map.copy_(cold_map)

    # ------------------------------------------------------------------------------------------ the stages

    @final
    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor | None,
              w2: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any,
              global_num_experts: int, expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor | None, workspace2: torch.Tensor | None,
              expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> None:
        """vLLM's ``FusedMoEExpertsModular.apply``: write the layer's experts output into ``output`` (and return
        None: the split never defers its reduction). ``w1``/``w2`` are not used (:class:`ExpertsCall`)."""
        layer = self.layer
        if torch.compiler.is_compiling():  # one opaque op, traced as such (module docstring)
            output.copy_(torch.ops.pinsidecar.split_experts(
                output, hidden_states, topk_weights, topk_ids, expert_map, a1q_scale, a2_scale, layer.expert_counts,
                layer.cold_counts, layer.token_counts, self.key, str(getattr(activation, "value", activation)),
                int(global_num_experts), bool(apply_router_weight_on_input)))
            return
        self._run(ExpertsCall(output, hidden_states, topk_weights, topk_ids, activation, global_num_experts,
                              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                              apply_router_weight_on_input))

    def route(self, router_logits: torch.Tensor, **routing: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights, topk_ids)`` exactly as the monolithic kernel this backend stands in for routes
        ``router_logits``, given the rest of that kernel's routing arguments (grouped top-k, a correction bias, a
        scaling factor: whatever its ``apply`` takes); a backend with ``ROUTES`` writes it, and refuses what its
        kernel's routing would use and it cannot reproduce."""
        raise NotImplementedError(f"the {self.NAME} backend does not route")

    @final
    def apply_routed(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, activation: Any,
                     global_num_experts: int, expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
                     **routing: Any) -> torch.Tensor:
        """A monolithic experts class's ``apply`` (it routes inside itself): route as it does, then split; returns
        the layer's experts output."""
        topk_weights, topk_ids = self.route(router_logits, **routing)
        output = torch.empty_like(hidden_states)
        self._run(ExpertsCall(output, hidden_states, topk_weights, topk_ids, activation, global_num_experts,
                              expert_map, None, None, None, None, None, apply_router_weight_on_input))
        return output

    @final
    def partition(self, call: ExpertsCall) -> Partition:
        """The shared partition stage (module docstring)."""
        layer = self.layer
        expert_counts, cold_counts, token_counts = call.counters or (
            layer.expert_counts, layer.cold_counts, layer.token_counts)
        if layer.cache is not None:  # fill the slots, flip the row map (and the tier maps), partition
            hot_ids, cold_ids = layer.cache.step_partition(
                call.topk_ids, layer.hot, layer.cold, expert_counts=expert_counts, cold_counts=self._still_cold,
                num_real=self.num_real, token_counts=token_counts, misses=cold_counts)
            if not layer.cache.maps_followed:
                self.refresh()
        else:
            hot_ids, cold_ids = partition(call.topk_ids, layer.row_map, layer.hot_rows, expert_counts, cold_counts,
                                          num_real=self.num_real, token_counts=token_counts)
        return Partition(hot_ids, cold_ids)

    @final
    def _run(self, call: ExpertsCall) -> None:
        self.check_call(call)
        part = self.partition(call)
        num_tokens = call.num_tokens
        step = max(1, self.chunk_tokens(call))
        if step >= num_tokens:
            self.reducer.reduce(call, part, self.run_tiers(call, part))
            return
        for start in range(0, num_tokens, step):
            end = min(start + step, num_tokens)
            chunk, chunk_part = call.tokens(start, end), part.tokens(start, end)
            self.reducer.reduce(chunk, chunk_part, self.run_tiers(chunk, chunk_part))


@torch.library.custom_op("pinsidecar::split_experts", mutates_args=("expert_counts", "cold_counts", "token_counts"))
def split_experts(output: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
                  a2_scale: torch.Tensor | None, expert_counts: torch.Tensor, cold_counts: torch.Tensor,
                  token_counts: torch.Tensor, backend_key: int, activation: str, global_num_experts: int,
                  apply_router_weight_on_input: bool) -> torch.Tensor:
    """A split's three stages as one op that ``torch.compile`` treats as opaque: the backend registered as
    ``backend_key`` runs on a fresh output (``output`` gives its shape and dtype), counting into the counters it is
    given (under functionalization, stand-ins the compiler copies back). The cache tier's writes to the row map and
    the slot rows land in the real tensors: they are the backend's, read by address, never op inputs. Activations
    arrive by name (``MoEActivation.value``), and no workspaces: the family that runs traced (the CPU kernel, whose
    scratch is its own) takes neither."""
    backend = _BACKENDS.get(backend_key)
    if backend is None:
        raise RuntimeError(f"error: no split backend registered as {backend_key} (the layer it served is gone)")
    out = torch.empty_like(output)
    backend._run(ExpertsCall(out, hidden_states, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                             a1q_scale, a2_scale, None, None, None, apply_router_weight_on_input,
                             counters=(expert_counts, cold_counts, token_counts)))
    return out


@split_experts.register_fake
def _(output: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(output)
