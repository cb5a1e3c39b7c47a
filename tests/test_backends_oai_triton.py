"""The ``oai_triton`` backend (gpt-oss MXFP4 through vLLM's modular OAI Triton experts), on the CPU.

The kernels are triton_kernels' ``matmul_ogs`` on a GPU; here they are **named fakes**, kept thin:
``fake_tier_rows`` computes each slot's router-weighted row in fp32 from per-expert dense weights (the arithmetic the
split must reproduce per row), ``fake_masked_moe_sum`` is vLLM's ``masked_moe_sum`` in torch (fp32 from 0, slot
order, ``-1`` skipped, one cast), and ``FakeTensor``/``FakeStorage`` have the fields of triton_kernels' ``Tensor`` and
``Storage`` that the seam touches. What is real: the backend's stages (partition, tier calls, merge, reduce), the
tier tensors it builds, the pinning of ``matmul_ogs``'s tiling to the unsplit expert count, and the release of vLLM's
second references before re-homing. The bit identity against vLLM's own kernel is the GPU lane's in-engine
self-check (``docs/backends.md``).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch
from pinsidecar_hook.backends import select_backend
from pinsidecar_hook.backends.base import Tier
from pinsidecar_hook.backends.oai_triton import OAIRows, OAITritonSplit
from pinsidecar_hook.vllm_seam import oai_triton

from pinsidecar.testing import moe

E, HIDDEN, INTER, TOP_K = 12, 32, 16, 4


@dataclasses.dataclass
class FakeStorage:
    """triton_kernels' ``Storage``: the data and its layout (a fake: the fields the seam reads)."""

    data: torch.Tensor
    layout: Any = None


@dataclasses.dataclass
class FakeTensor:
    """triton_kernels' ``Tensor``: storage, dtype, logical shape and its bound (a fake)."""

    storage: FakeStorage
    dtype: Any = "fp4"
    shape: list[int] | None = None
    shape_max: list[int] | None = None


def fake_tier_rows(form: str, *, hidden_states: torch.Tensor, w1: Any, w2: Any, w1_precision: Any,
                   w2_precision: Any, w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                   topk_weights: torch.Tensor, tier_ids: torch.Tensor, num_experts: int, activation: Any,
                   activation_fn: Any, apply_router_weight_on_input: bool) -> torch.Tensor:
    """A named fake of :func:`oai_triton.tier_rows`: each slot's row ``w * (silu(x W1g) * (x W1u) + b) W2 + b2`` of
    its tier-local expert, in fp32 then bf16, zero for another tier's slot. The weights come through the tier
    tensors the backend built (their storage data), scaled by the tier's per-expert block scale."""
    w13 = w1.storage.data.float() * w1_precision.weight_scale.storage.data.float()[:, None, None]
    w2_ = w2.storage.data.float() * w2_precision.weight_scale.storage.data.float()[:, None, None]
    tokens, k = tier_ids.shape
    rows = torch.zeros(tokens, k, hidden_states.shape[1], dtype=torch.bfloat16)
    x = hidden_states.float()
    for t in range(tokens):
        for j in range(k):
            e = int(tier_ids[t, j])
            if e < 0:
                continue
            h = x[t] @ w13[e] + w1_bias[e]
            act = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            rows[t, j] = (float(topk_weights[t, j]) * (act @ w2_[e] + w2_bias[e])).to(torch.bfloat16)
    return rows


def fake_masked_moe_sum(rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's ``masked_moe_sum`` in torch (a named fake of the Triton kernel)."""
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for j in range(rows.shape[1]):
        acc += torch.where((ids[:, j] >= 0).unsqueeze(1), rows[:, j].float(), torch.zeros(()))
    out.copy_(acc.to(out.dtype))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, HIDDEN, 2 * INTER, generator=g) / 4).to(torch.bfloat16)
    w2 = (torch.randn(E, INTER, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    return {
        # stored transposed, as triton_kernels keeps a swizzled view: re-homing must keep that memory order
        "w13_weight": w13.transpose(1, 2).contiguous().transpose(1, 2),
        "w2_weight": w2,
        "w13_weight_scale": torch.rand(E, generator=g) + 0.5,
        "w2_weight_scale": torch.rand(E, generator=g) + 0.5,
        "w13_bias": torch.randn(E, 2 * INTER, generator=g),
        "w2_bias": torch.randn(E, HIDDEN, generator=g),
    }


_layer = moe.SplitLayerStub.from_tensors  # the pin state a backend is given


def _experts(tensors: dict[str, torch.Tensor]) -> Any:
    """vLLM's experts object as the backend reads it: a quant config with both GEMMs' precision configs (their
    weight scales triton_kernels tensors), and the weight templates ``before_rehome`` keeps."""
    def precision(name: str) -> Any:
        scale = tensors[f"{name}_weight_scale"]
        return types.SimpleNamespace(weight_scale=FakeTensor(FakeStorage(scale, "scale-layout"), "u8",
                                                             list(scale.shape), list(scale.shape)),
                                     flex_ctx="flex")

    qc = types.SimpleNamespace(w1_precision=precision("w13"), w2_precision=precision("w2"))
    experts = types.SimpleNamespace(quant_config=qc, activation=None, _lora_context=None)
    experts._pinsidecar_oai_templates = {
        f"{n}_weight": FakeTensor(FakeStorage(torch.empty(0), f"{n}-value-layout"), "fp4",
                                  list(tensors[f"{n}_weight"].shape), list(tensors[f"{n}_weight"].shape))
        for n in ("w13", "w2")}
    return experts


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oai_triton, "module", lambda: types.SimpleNamespace(masked_moe_sum=fake_masked_moe_sum))


@pytest.mark.parametrize("cold_fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("adversarial", [False, True])
def test_the_split_equals_the_unsplit_rows_and_counts(fake_module: None, cold_fraction: float,
                                                      adversarial: bool) -> None:
    g = torch.Generator().manual_seed(7)
    tensors = _weights(1)
    ids, weights, row_map, hot_rows = moe.routing_case(9, TOP_K, E, cold_fraction, adversarial, g)
    x = torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16)
    # the unsplit call: every expert in one call, rows reduced by vLLM's masked sum
    experts = _experts(tensors)
    everything = OAITritonSplit._tier_args(Tier("all", tensors, E, 0), experts._pinsidecar_oai_templates,
                                           experts.quant_config)
    unsplit = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    fake_masked_moe_sum(fake_tier_rows("unfused", hidden_states=x, topk_weights=weights, tier_ids=ids.to(torch.int32),
                                       num_experts=E, activation=None, activation_fn=None,
                                       apply_router_weight_on_input=False, **everything), ids, unsplit)
    layer = _layer(tensors, row_map, hot_rows)
    calls: list[dict[str, Any]] = []

    def recording(form: str, **kw: Any) -> torch.Tensor:
        calls.append({"form": form, "rows": int(kw["w1"].shape[0]), "num_experts": kw["num_experts"],
                      "layout": kw["w1"].storage.layout})
        return fake_tier_rows(form, **kw)

    split = OAITritonSplit(_experts(tensors), layer, rows_fn=recording, form="unfused", num_real=None)
    out = torch.empty(9, HIDDEN, dtype=torch.bfloat16)
    split.apply(out, x, None, None, weights, ids, "swigluoai", E, None, None, None, None, None, None, False)
    assert torch.equal(out, unsplit)
    assert int(layer.token_counts) == 9 and int(layer.expert_counts.sum()) == 9 * TOP_K
    assert int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())
    # each tier call: its own rows, the unsplit expert count for the tiling, vLLM's layout object
    assert all(c["num_experts"] == E and c["layout"] == "w13-value-layout" for c in calls)
    assert [c["rows"] for c in calls] == [n for n in (hot_rows, layer.cold_rows) if n]


def test_a_wrong_merge_is_caught(fake_module: None) -> None:
    """Negative control: the reducer reading every slot from the hot tier's rows differs from the unsplit sum."""
    g = torch.Generator().manual_seed(3)
    tensors = _weights(2)
    ids, weights, row_map, hot_rows = moe.routing_case(8, TOP_K, E, 0.5, True, g)
    x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)

    class HotOnly(OAIRows):
        def reduce(self, call: Any, part: Any, rows: Any) -> None:
            fake_masked_moe_sum(rows.hot.values, part.row_ids(self.hot_rows), call.output)

    outs = []
    for reducer in (None, HotOnly(hot_rows)):
        split = OAITritonSplit(_experts(tensors), _layer(tensors, row_map, hot_rows), rows_fn=fake_tier_rows,
                               reducer=reducer, form="unfused", num_real=None)
        out = torch.empty(8, HIDDEN, dtype=torch.bfloat16)
        split.apply(out, x, None, None, weights, ids, "swigluoai", E, None, None, None, None, None, None, False)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


def test_tier_tensors_keep_vllms_layout_dtype_and_shape_with_the_tiers_rows() -> None:
    data = torch.arange(5 * 6 * 4, dtype=torch.uint8).reshape(5, 6, 4)
    full = FakeTensor(FakeStorage(torch.empty(0), "HOPPER_VALUE"), "fp4", [12, 8, 4], [12, 8, 4])
    tier = oai_triton.tier_tensor(full, data)
    assert tier.storage.data is data and tier.storage.layout == "HOPPER_VALUE" and tier.dtype == "fp4"
    assert tier.shape == [5, 8, 4] and tier.shape_max == [5, 8, 4]
    assert full.shape == [12, 8, 4] and full.storage.data.numel() == 0  # the template is not changed
    precision = types.SimpleNamespace(weight_scale="full", flex_ctx="flex")
    copy = oai_triton.precision_with_scale(precision, tier)
    assert copy.weight_scale is tier and copy.flex_ctx == "flex" and precision.weight_scale == "full"


def test_release_views_drops_vllms_second_references_and_keeps_the_templates() -> None:
    w13 = torch.ones(4, 3, dtype=torch.uint8)
    owner = torch.nn.Module()
    owner.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
    owner.w13_weight_triton = FakeTensor(FakeStorage(owner.w13_weight.data, "v"), "fp4", [4, 6], [4, 6])
    owner.w2_weight_triton = FakeTensor(FakeStorage(torch.ones(4, 2, dtype=torch.uint8), "v"), "fp4", [4, 4],
                                        [4, 4])
    scale = FakeTensor(FakeStorage(torch.ones(4, 2, dtype=torch.uint8), "s"), "u8", [4, 2], [4, 2])
    experts = types.SimpleNamespace(quant_config=types.SimpleNamespace(
        w1_precision=types.SimpleNamespace(weight_scale=scale), w2_precision=None))
    templates = oai_triton.release_views(owner, experts)
    assert owner.w13_weight_triton.storage.data.numel() == 0 and scale.storage.data.numel() == 0
    assert owner.w2_weight_triton.storage.data.numel() == 0
    assert templates == {"w13_weight": owner.w13_weight_triton, "w2_weight": owner.w2_weight_triton}
    assert owner.w13_weight.data.numel() == 12  # the parameter itself is re-homing's to move


def test_the_tier_calls_get_the_unsplit_calls_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unsplit_flags`` makes matmul_ogs's flag function see the layer's expert count, leaves the tier's routing
    data alone, and puts the function back (after an error too)."""
    seen: list[int] = []
    fake = types.ModuleType("fake_triton_kernels_matmul_ogs")  # where matmul_ogs looks its flag function up

    def make_opt_flags(out_dtype: Any, lhs: Any, rhs: Any, pc: Any, m: int, n: int, k: int, routing_data: Any,
                       *rest: Any) -> str:
        seen.append(routing_data.n_expts_tot)
        return "flags"

    def matmul_ogs() -> None: ...

    matmul_ogs.__module__ = fake.__name__
    fake.make_opt_flags = make_opt_flags
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(oai_triton, "module", lambda: types.SimpleNamespace(matmul_ogs=matmul_ogs))
    tier_routing = types.SimpleNamespace(n_expts_tot=40)
    with oai_triton.unsplit_flags(128):
        assert fake.make_opt_flags(None, None, None, None, 64, 2048, 768, tier_routing, False, True, None) == "flags"
    assert seen == [128] and tier_routing.n_expts_tot == 40 and fake.make_opt_flags is make_opt_flags
    with pytest.raises(RuntimeError), oai_triton.unsplit_flags(128):
        raise RuntimeError("a kernel failed")
    assert fake.make_opt_flags is make_opt_flags
    with pytest.raises(RuntimeError, match="has no n_expts_tot"), oai_triton.unsplit_flags(128):
        fake.make_opt_flags(None, None, None, None, 64, 2048, 768, types.SimpleNamespace(), False, True, None)
    assert fake.make_opt_flags is make_opt_flags


def test_auto_picks_oai_triton_for_the_default_mxfp4_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verified on the H100 (vLLM 0.34.0), the backend is auto's for gpt-oss MXFP4: a layer it accepts (here a fake
    of the monolithic class, accepted by a patched ``supports``) gets it, and every other backend refuses it."""
    assert OAITritonSplit.VERIFIED and OAITritonSplit.AUTO and OAITritonSplit.GUARANTEE == "bitwise"
    experts = type("OAITritonMxfp4ExpertsMonolithic", (), {})()
    assert OAITritonSplit.supports(experts, torch.device("cuda")) is not None  # not vLLM's class
    monkeypatch.setattr(OAITritonSplit, "supports", classmethod(lambda cls, e, d: None))
    assert select_backend("auto", torch.device("cuda"), experts) is OAITritonSplit


# ---------------------------------------------------------------------------------------------- the monolithic class


def test_routing_logits_route_to_the_cases_experts_in_slot_order() -> None:
    from pinsidecar_hook.selfcheck import routing_logits

    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(64)])
    for dtype in (torch.bfloat16, torch.float32):
        logits = routing_logits(ids, E, dtype, g)
        vals, top = torch.topk(logits.float(), TOP_K, dim=1)
        assert torch.equal(top, ids) and bool((vals[:, :-1] > vals[:, 1:]).all()), dtype  # distinct, in order


class FakeMonolithic:
    """vLLM's monolithic experts class as modular_kernel calls it (a fake: ``apply`` by keyword, logits in)."""

    renormalize = True

    def apply(self, hidden_states: Any, w1: Any, w2: Any, router_logits: Any, activation: Any,
              global_num_experts: int, expert_map: Any, a1q_scale: Any, apply_router_weight_on_input: bool,
              **kwargs: Any) -> Any:
        raise AssertionError("the split replaces this")


class RoutingFakeSplit(OAITritonSplit):
    """The OAI split with a torch top-k as its routing (the engine's is the kernel's own topk call); it keeps the
    routing arguments it was given."""

    routing: dict[str, Any] | None = None

    def route(self, router_logits: torch.Tensor, **routing: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.routing = routing
        vals, ids = torch.topk(router_logits.float(), TOP_K, dim=1)
        return torch.softmax(vals, dim=1).to(router_logits.dtype), ids


def test_a_monolithic_layer_is_routed_then_split(fake_module: None) -> None:
    """install_split switches a monolithic experts object to a class whose apply routes the logits, then splits;
    the output is the split of that routing, and the counters count it. The call's other routing arguments, as
    vLLM 0.34's modular kernel passes them, reach the backend's routing."""
    from pinsidecar_hook import vllm_seam
    from pinsidecar_hook.selfcheck import routing_logits

    g = torch.Generator().manual_seed(9)
    tensors = _weights(4)
    ids, _w, row_map, hot_rows = moe.routing_case(6, TOP_K, E, 0.5, True, g)
    logits = routing_logits(ids, E, torch.bfloat16, g)
    x = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16)
    mono = FakeMonolithic()
    layer = _layer(tensors, row_map, hot_rows)
    split = RoutingFakeSplit(_experts(tensors), layer, rows_fn=fake_tier_rows, form="monolithic", num_real=None)
    assert split.form == "fused"  # the monolithic kernel's arithmetic
    geometry = types.SimpleNamespace(experts=mono, monolithic=True)
    vllm_seam.install_split(geometry, split)
    assert type(mono).__name__ == "PinSplitFakeMonolithic" and vllm_seam.vllm_class(mono) is FakeMonolithic
    routing = {"num_expert_group": None, "e_score_correction_bias": None, "routed_scaling_factor": 1.0,
               "topk_group": None, "routing_replay_out": None}
    got = mono.apply(hidden_states=x, w1=None, w2=None, router_logits=logits, activation="swigluoai",
                     global_num_experts=E, expert_map=None, a1q_scale=None, apply_router_weight_on_input=False,
                     **routing)
    assert split.routing == routing
    weights, routed = split.route(logits)
    assert torch.equal(routed, ids)
    want = torch.empty(6, HIDDEN, dtype=torch.bfloat16)
    modular = OAITritonSplit(_experts(tensors), _layer(tensors, row_map, hot_rows), rows_fn=fake_tier_rows,
                             form="fused", num_real=None)
    modular.apply(want, x, None, None, weights, routed, "swigluoai", E, None, None, None, None, None, None, False)
    assert torch.equal(got, want)
    assert int(layer.token_counts) == 6 and int(layer.cold_counts) == int((row_map.long()[ids] >= hot_rows).sum())


def test_a_backend_that_does_not_route_is_not_installed_on_a_monolithic_layer() -> None:
    from pinsidecar_hook import vllm_seam

    split = types.SimpleNamespace(ROUTES=False, NAME="triton_experts")
    with pytest.raises(RuntimeError, match="routes inside its kernel and the triton_experts backend does not route"):
        vllm_seam.install_split(types.SimpleNamespace(experts=FakeMonolithic(), monolithic=True), split)


def test_the_selfcheck_calls_a_monolithic_layer_on_logits_that_route_to_its_cases(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """The self-check's cases reach a monolithic layer as router logits (the layer routes them itself); a split that
    computes something else is reported as a mismatch. The layer calls are a named fake of vLLM's."""
    from pinsidecar_hook import vllm_seam
    from pinsidecar_hook.selfcheck import SelfCheck, cases

    seen: list[torch.Tensor] = []
    shift = {"after": 0.0}

    def fake_layer_call(geometry: Any, x: torch.Tensor, logits: torch.Tensor, cfg: Any) -> torch.Tensor:
        seen.append(torch.topk(logits.float(), TOP_K, dim=1).indices)
        return x * logits.float().amax(dim=1, keepdim=True).to(x.dtype) + shift["after"]

    def modular_call(*args: Any) -> torch.Tensor:
        raise AssertionError("a monolithic layer is never called with top-k ids")

    monkeypatch.setattr(vllm_seam, "run_layer_monolithic", fake_layer_call)
    monkeypatch.setattr(vllm_seam, "run_layer_experts", modular_call)
    row_map = torch.arange(E, dtype=torch.int32)
    layer_cases = cases(E, TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"), row_map, 8, tokens=(1, 7),
                        monolithic=True)
    assert all(c.router_logits is None for c in cases(E, TOP_K, HIDDEN, torch.bfloat16, torch.device("cpu"),
                                                      row_map, 8, tokens=(1, 7)))  # modular layers: ids only
    geometry = types.SimpleNamespace(monolithic=True)
    for after, want_equal in ((0.0, True), (1.0, False)):
        checker = SelfCheck()
        check = checker.before(geometry, 0, layer_cases)
        shift["after"] = after
        checker.after(geometry, check)
        shift["after"] = 0.0
        summary = checker.summary()
        assert summary["errors"] == [] and summary["cases"] == len(layer_cases)
        assert (summary["equal"] == len(layer_cases)) is want_equal and (summary["mismatch_count"] == 0) is want_equal
    # per round: each case twice before (the unsplit kernel against itself), then once after
    order = [c for c in layer_cases for _ in range(2)] + layer_cases
    assert len(seen) == 2 * len(order)
    assert all(torch.equal(ids, c.topk_ids.long()) for ids, c in zip(seen, order + order, strict=True))
