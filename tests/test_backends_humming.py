"""The ``humming`` backend (vLLM 0.34's ``HummingIndexedExperts``: int4 and NVFP4 on SM90), on the CPU.

Humming's kernels are CUDA only; here they are **named fakes**, kept thin, with the dataflow of vLLM's
``HummingIndexedExperts.apply``: ``FakeHummingExperts`` aligns the ids through an ``expert_map`` as vLLM's
``moe_align_block_size(ignore_invalid_experts=True)`` does (only the mapped slots, as local rows), its GEMM
(``fake_gemm``) writes one row per aligned slot from per-expert dequantized weights (a weight times its expert's
scale, plus the bias) and checks that the layer config's expert count is the weight table's, as the launcher does,
and ``fake_mul_sum`` is ``moe_fused_mul_sum`` in torch (fp32 from 0, slot order, the weight applied in the sum).
What is real: the backend's stages (partition, the tiers' GEMMs into the one call's buffers, the activation once,
the reduce), its tier configs, its refusals. Bit identity against Humming itself is the GPU lane's self-check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from pinsidecar_hook.backends import BackendUnavailable, select_backend
from pinsidecar_hook.backends.base import UnsupportedSplit
from pinsidecar_hook.backends.humming import HummingMulSum, HummingSplit
from pinsidecar_hook.vllm_seam import humming

from pinsidecar.testing import moe

E, HIDDEN, INTER, TOP_K = 10, 32, 16, 4


@dataclasses.dataclass(frozen=True)
class FakeLayerConfig:
    """humming's ``LayerConfig``, the fields the split touches (a fake)."""

    num_experts: int
    shape_n: int


def fake_gemm(experts: Any, sub: str, config: FakeLayerConfig, tensors: dict[str, torch.Tensor], *,
              inputs: torch.Tensor, input_scale: Any, input_scale_2: Any, outputs: torch.Tensor,
              sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_padded: torch.Tensor, top_k: int,
              **_: Any) -> torch.Tensor:
    """A named fake of one Humming GEMM call: row ``sorted_ids[i]`` (< rows) gets ``inputs[row // top_k] @
    W[e]`` in fp32, stored once in bf16, ``e`` the row's aligned local expert."""
    weight = tensors[f"{sub}_weight"]
    assert config.num_experts == weight.shape[0], "the kernel's expert count is the weight table's (launcher check)"
    w = weight.float() * tensors[f"{sub}_weight_scale"].float()[:, None, None]
    bias = tensors[f"{sub}_bias"].float()
    rows = outputs.shape[0]
    for i in range(int(num_tokens_padded[0])):
        row = int(sorted_ids[i])
        if row >= rows:
            continue
        e = int(expert_ids[i])
        outputs[row] = (inputs[row // top_k].float() @ w[e] + bias[e]).to(outputs.dtype)
    return outputs


def fake_mul_sum(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_map: Any,
                 out: torch.Tensor) -> None:
    """vLLM's ``moe_fused_mul_sum`` in torch (a named fake of the Triton kernel)."""
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for j in range(rows.shape[1]):
        acc += torch.where((ids[:, j] >= 0).unsqueeze(1), rows[:, j].float() * weights[:, j:j + 1].float(),
                           torch.zeros(()))
    out.copy_(acc.to(out.dtype))


class FakeHummingExperts:
    """vLLM's ``HummingIndexedExperts`` in miniature (a named fake): the methods the split calls, and an ``apply``
    with the unsplit call's dataflow over the layer's whole tables."""

    def __init__(self, tensors: dict[str, torch.Tensor], tuning_stream_k: bool = False) -> None:
        self.tensors = tensors
        self.humming_configs = {"w13": FakeLayerConfig(E, 2 * INTER), "w2": FakeLayerConfig(E, HIDDEN)}
        entry = {"block_shape": [4, 64], "use_stream_k": tuning_stream_k}
        self.w13_tuning_config = [(0, 8, dict(entry)), (8, 10**9, {"block_shape": [4, 64], "use_stream_k": False})]
        self.w2_tuning_config = [(0, 10**9, {"block_shape": [4, 64], "use_stream_k": False})]
        self.compute_config = {"use_batch_invariant": not tuning_stream_k}
        self.locks = torch.zeros(8, dtype=torch.int32)
        self.quant_config = None
        self._lora_context = None
        self.block = 4
        self.valid_shapes: list[int] = []

    def prepare_humming_moe_kwargs(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                                   meta: Any) -> tuple[dict[str, Any], dict[str, Any], None]:
        """vLLM's alignment: each mapped slot's flat row grouped by local expert, blocks padded with ``rows``."""
        rows = topk_ids.numel()
        flat = topk_ids.reshape(-1)
        local = flat if expert_map is None else expert_map[flat].to(torch.int64)
        sorted_ids: list[int] = []
        expert_ids: list[int] = []
        for e in range(int(local.max().item()) + 1 if (local >= 0).any() else 0):
            mine = (local == e).nonzero().flatten().tolist()
            if not mine:
                continue
            pad = -len(mine) % self.block
            sorted_ids += mine + [rows] * pad
            expert_ids += [e] * (len(mine) + pad)
        common = {"sorted_ids": torch.tensor(sorted_ids, dtype=torch.int32),
                  "expert_ids": torch.tensor(expert_ids, dtype=torch.int32),
                  "num_tokens_padded": torch.tensor([len(sorted_ids)], dtype=torch.int32),
                  "valid_shape_m": rows, "compute_config": "{}"}
        self.valid_shapes.append(rows)
        return {"top_k": topk_ids.shape[1], "tuning_config": "w13", **common}, \
               {"top_k": 1, "tuning_config": "w2", **common}, None

    def process_input(self, sub: str, inputs: torch.Tensor, quanted_input: torch.Tensor | None,
                      input_scale: Any = None, activation: Any = None, scatter_idx: Any = None) -> tuple[Any, ...]:
        if activation is None:
            return inputs, None, None
        gate, up = inputs.float().split(INTER, dim=-1)
        quanted_input.copy_((torch.nn.functional.silu(gate) * up).to(quanted_input.dtype))
        return quanted_input, None, None

    def get_buffer_metas(self, m: int, k: int, activation: Any) -> tuple[dict[str, Any], list[str]]:
        metas = {"gate_up_output": {"shape": (m * k, 2 * INTER), "dtype": torch.bfloat16},
                 "quanted_down_input": {"shape": (m * k, INTER), "dtype": torch.bfloat16},
                 "down_output": {"shape": (m * k, HIDDEN), "dtype": torch.bfloat16}}
        return metas, list(metas)

    def prepare_buffers(self, *args: Any) -> dict[str, torch.Tensor]:
        raise AssertionError("the tests pass no workspaces")

    def apply(self, output: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> None:
        """The unsplit call: vLLM's ``HummingIndexedExperts.apply`` dataflow over the whole tables."""
        m, k = ids.shape
        metas, _ = self.get_buffer_metas(m, k, "silu")
        buf = {n: torch.full(meta["shape"], float("nan"), dtype=meta["dtype"]) for n, meta in metas.items()}
        kw1, kw2, _ = self.prepare_humming_moe_kwargs(ids, None, None)
        fake_gemm(self, "w13", self.humming_configs["w13"], self.tensors, inputs=hidden, input_scale=None,
                  input_scale_2=None, outputs=buf["gate_up_output"], **kw1)
        inputs, _, _ = self.process_input("w2", buf["gate_up_output"], buf["quanted_down_input"], activation="silu")
        fake_gemm(self, "w2", self.humming_configs["w2"], self.tensors, inputs=inputs, input_scale=None,
                  input_scale_2=None, outputs=buf["down_output"], **kw2)
        fake_mul_sum(buf["down_output"].view(m, k, -1), weights, ids, None, output)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w13_weight": torch.randint(-8, 8, (E, HIDDEN, 2 * INTER), generator=g, dtype=torch.int32),
            "w2_weight": torch.randint(-8, 8, (E, INTER, HIDDEN), generator=g, dtype=torch.int32),
            "w13_weight_scale": (torch.rand(E, generator=g) / 8 + 0.01).to(torch.bfloat16),
            "w2_weight_scale": (torch.rand(E, generator=g) / 8 + 0.01).to(torch.bfloat16),
            "w13_bias": torch.randn(E, 2 * INTER, generator=g).to(torch.bfloat16),
            "w2_bias": torch.randn(E, HIDDEN, generator=g).to(torch.bfloat16)}


def _split(tensors: dict[str, torch.Tensor], row_map: torch.Tensor, hot_rows: int,
           experts: FakeHummingExperts, **kw: Any) -> HummingSplit:
    layer = moe.SplitLayerStub.from_tensors(tensors, row_map, hot_rows)
    return HummingSplit(experts, layer, gemm=kw.pop("gemm", fake_gemm),
                        reducer=kw.pop("reducer", HummingMulSum(fake_mul_sum)), num_real=None)


def _run(split: HummingSplit, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(hidden)
    split.apply(out, hidden, None, None, weights, ids, "silu", E, None, None, None, None, None, None, False)
    return out


@pytest.mark.parametrize("cold", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("adversarial", [False, True])
def test_the_split_is_the_unsplit_call_bit_for_bit(cold: float, adversarial: bool) -> None:
    g = torch.Generator().manual_seed(7)
    tensors = _tensors(1)
    experts = FakeHummingExperts(tensors)
    for tokens in (1, 3, 9):
        ids, weights, row_map, hot_rows = moe.routing_case(tokens, TOP_K, E, cold, adversarial, g)
        hidden = (torch.randn(tokens, HIDDEN, generator=g) / 4).to(torch.bfloat16)
        want = torch.empty_like(hidden)
        experts.apply(want, hidden, ids, weights)
        split = _split(tensors, row_map, hot_rows, experts)
        got = _run(split, hidden, weights, ids)
        assert torch.equal(got, want), (tokens, cold, adversarial)
        # every tier call used the unsplit call's valid_shape_m (tokens x k), never the tier's own slot count
        assert set(experts.valid_shapes) == {tokens * TOP_K}
        experts.valid_shapes.clear()
        assert int(split.layer.cold_counts) == int((row_map[ids] >= hot_rows).sum())


def test_each_tier_runs_under_the_layers_config_with_its_own_row_count() -> None:
    tensors = _tensors(2)
    row_map = moe.row_map_tensor(E, [3, 1, 4, 0], [2, 5, 6, 7, 8, 9])
    split = _split(tensors, row_map, 4, FakeHummingExperts(tensors))
    assert [split.configs["hot"][s].num_experts for s in ("w13", "w2")] == [4, 4]
    assert [split.configs["cold"][s].num_experts for s in ("w13", "w2")] == [6, 6]
    assert split.configs["cold"]["w2"].shape_n == HIDDEN


def test_a_split_that_drops_a_tiers_down_projection_is_caught() -> None:
    """Negative control: a cold tier's GEMM2 that leaves zeros where its rows belong changes the output."""
    g = torch.Generator().manual_seed(3)
    tensors = _tensors(3)
    experts = FakeHummingExperts(tensors)
    ids, weights, row_map, hot_rows = moe.routing_case(5, TOP_K, E, 0.5, True, g)
    hidden = (torch.randn(5, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    want = torch.empty_like(hidden)
    experts.apply(want, hidden, ids, weights)

    def lossy(experts: Any, sub: str, config: Any, tensors: dict[str, torch.Tensor], **kw: Any) -> Any:
        if sub == "w2" and config.num_experts == E - hot_rows:
            outputs = kw.pop("outputs")
            mine = fake_gemm(experts, sub, config, tensors, outputs=torch.zeros_like(outputs), **kw)
            outputs[mine.abs().sum(-1) > 0] = 0
            return outputs
        return fake_gemm(experts, sub, config, tensors, **kw)

    got = _run(_split(tensors, row_map, hot_rows, experts, gemm=lossy), hidden, weights, ids)
    assert not torch.equal(got, want)


def test_stream_k_tuning_is_refused_naming_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(humming, "is_indexed", lambda experts: True)
    streamk = FakeHummingExperts(_tensors(4), tuning_stream_k=True)
    reason = HummingSplit.supports(streamk, torch.device("cuda"))
    assert reason is not None and "stream-K" in reason and "w13 (0, 8]" in reason
    assert "VLLM_BATCH_INVARIANT=1" in reason and "--moe-backend marlin" in reason
    with pytest.raises(BackendUnavailable, match="VLLM_BATCH_INVARIANT=1"):
        select_backend("humming", torch.device("cuda"), streamk)
    # the flag's effect as vLLM 0.34 passes it on: no tuning entry uses stream-K, and the split takes the layer
    assert HummingSplit.supports(FakeHummingExperts(_tensors(4)), torch.device("cuda")) is None
    assert "CUDA only" in HummingSplit.supports(FakeHummingExperts(_tensors(4)), torch.device("cpu"))


def test_what_the_split_cannot_reproduce_is_refused() -> None:
    tensors = _tensors(5)
    row_map = moe.row_map_tensor(E, list(range(5)), list(range(5, E)))
    split = _split(tensors, row_map, 5, FakeHummingExperts(tensors))
    hidden = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(2, TOP_K, dtype=torch.int64)
    weights = torch.ones(2, TOP_K)
    with pytest.raises(UnsupportedSplit, match="expert parallel"):
        split.apply(torch.empty_like(hidden), hidden, None, None, weights, ids, "silu", E,
                    torch.arange(E, dtype=torch.int32), None, None, None, None, None, False)
    with pytest.raises(UnsupportedSplit, match="router weights on the input"):
        split.apply(torch.empty_like(hidden), hidden, None, None, weights, ids, "silu", E, None, None, None, None,
                    None, None, True)
    assert not HummingSplit.VERIFIED and not HummingSplit.AUTO and HummingSplit.GUARANTEE == "bitwise"
    assert HummingSplit.supports(object(), torch.device("cuda")) is not None  # not vLLM's class


def test_a_tier_missing_a_tensor_vllm_passes_is_refused_at_attach() -> None:
    """A layer whose tiers lack a per-expert tensor vLLM's quant config carries (zero points, global scales) is
    refused when the split is built, not at every call: the kernel would run without them."""
    tensors = _tensors(6)
    experts = FakeHummingExperts(tensors)
    experts.quant_config = type("QC", (), {"w1_zp": torch.zeros(1), "w1_scale": None, "w1_bias": None,
                                           "g1_alphas": None})()
    row_map = moe.row_map_tensor(E, list(range(5)), list(range(5, E)))
    with pytest.raises(UnsupportedSplit, match="vLLM passes w1_zp but the tier has no w13_zero_point"):
        _split(tensors, row_map, 5, experts)
    assert humming.missing_tensor(experts, "w2", tensors) is None  # w2's quant config fields are absent
