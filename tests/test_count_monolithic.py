"""Count mode on a monolithic MoE kernel (the experts call routes from the router's logits inside itself).

The kernel here is a fake, and named as one: a class with the shape of vLLM 0.34's ``FusedMoEExpertsMonolithic``
(``apply(hidden_states=, w1=, w2=, router_logits=, ...)``, called by keyword as ``modular_kernel.py`` calls it) that
routes with its own tie-break. The real one (gpt-oss's ``OAITritonMxfp4ExpertsMonolithic``) needs a GPU and
triton_kernels; the GPU lane proves its probe inside a vLLM 0.34 engine (``count._check_probes``). What is checked
here is the seam: the class switch counts exactly the kernel's ids and leaves its output alone, the check catches a
probe that breaks ties differently, and a class without a probe is refused with the flag that gives a modular one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pinsidecar_hook.vllm_seam import monolithic

E, K, H = 16, 4, 8


def _route_low_index(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The fake kernel's routing: top-k by value, ties to the lower expert id (a stable descending sort)."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def _route_high_index(logits: torch.Tensor, k: int) -> torch.Tensor:
    """A wrong probe: the same top-k, ties to the higher expert id."""
    flipped = logits.float().flip(-1)
    ids = torch.sort(flipped, dim=-1, descending=True, stable=True).indices[:, :k]
    return logits.shape[-1] - 1 - ids


class FakeMonolithicExperts:
    """A fake monolithic experts class: routes inside ``apply`` (renormalized softmax over the top-k), then mixes
    per-expert weights by the routing weights. It records the ids it routed, for the test to compare."""

    def __init__(self, topk: int = K, renormalize: bool = True) -> None:
        self.topk = topk
        self.renormalize = renormalize
        self.routed: list[torch.Tensor] = []

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              activation: Any = None, global_num_experts: int = -1, expert_map: Any = None, a1q_scale: Any = None,
              apply_router_weight_on_input: bool = False, **_: Any) -> torch.Tensor:
        ids = _route_low_index(router_logits, self.topk)
        self.routed.append(ids)
        weights = torch.softmax(router_logits.float().gather(1, ids), dim=-1)
        rows = torch.einsum("th,tkh->tkh", hidden_states.float(), w1[ids])
        return (weights.unsqueeze(-1) * rows).sum(1).to(hidden_states.dtype)


class FakeQuantMethod:
    """vLLM's quant method as ``check_probe`` calls it: ``apply_monolithic(layer=, x=, router_logits=)``."""

    def __init__(self, experts: FakeMonolithicExperts, w1: torch.Tensor) -> None:
        self.experts, self.w1 = experts, w1

    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.experts.apply(hidden_states=x, w1=self.w1, w2=self.w1, router_logits=router_logits)


@pytest.fixture
def fake_class(monkeypatch: pytest.MonkeyPatch) -> type:
    """Register the fake class's probe (its own routing step, as the real registry does for vLLM's class) and
    forget it after the test."""
    monkeypatch.setattr(monolithic, "_PROBES", dict(monolithic._PROBES))
    monkeypatch.setattr(monolithic, "MODULAR_FLAG", dict(monolithic.MODULAR_FLAG))
    monolithic.register_probe("FakeMonolithicExperts", lambda experts, logits: _route_low_index(logits, experts.topk),
                              modular_flag="--moe-backend fake_modular")
    return FakeMonolithicExperts


def _geometry(experts: Any, w1: torch.Tensor) -> Any:
    owner = SimpleNamespace(quant_method=FakeQuantMethod(experts, w1))
    return SimpleNamespace(experts=experts, param_owner=owner, experts_class=type(experts).__name__)


def _tie_heavy(t: int, gen: torch.Generator) -> torch.Tensor:
    return ((torch.randn((t, E), generator=gen) * 2).round() / 2).to(torch.bfloat16)


def test_the_switched_class_counts_the_kernels_ids_and_leaves_its_output_alone(fake_class: type) -> None:
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn((E, H), generator=gen)
    plain, counted = fake_class(), fake_class()
    captured: list[torch.Tensor] = []
    monolithic.bind_monolithic_capture(_geometry(counted, w1), lambda previous: captured.append)
    assert type(counted).__name__ == "PinCountFakeMonolithicExperts"
    for t in (1, 5, 64):
        x = torch.randn((t, H), generator=gen).to(torch.bfloat16)
        logits = _tie_heavy(t, gen)
        want = plain.apply(hidden_states=x, w1=w1, w2=w1, router_logits=logits)
        got = counted.apply(hidden_states=x, w1=w1, w2=w1, router_logits=logits)
        assert torch.equal(got, want)
        assert torch.equal(captured[-1], counted.routed[-1])  # the ids counted are the ids the kernel routed
    assert len(captured) == 3


def test_the_masking_check_passes_the_right_probe_and_catches_a_tie_break_that_differs(fake_class: type,
                                                                                         monkeypatch) -> None:
    gen = torch.Generator().manual_seed(2)
    w1 = torch.randn((E, H), generator=gen)
    geo = _geometry(fake_class(), w1)
    x = torch.randn((64, H), generator=gen).to(torch.bfloat16)
    logits = _tie_heavy(64, gen)
    right = monolithic.check_probe(geo, x, logits)
    assert right == {"tokens": 64, "equal_rows": 64, "bitwise": True}
    # negative control: a probe that breaks ties the other way picks other experts in tied rows
    monolithic.register_probe("FakeMonolithicExperts", lambda experts, lg: _route_high_index(lg, experts.topk))
    wrong = monolithic.check_probe(geo, x, logits)
    assert not wrong["bitwise"] and wrong["equal_rows"] < 64
    # on logits without ties both probes agree with the kernel: the check is about the kernel's routing, not luck
    distinct = torch.randn((64, E), generator=gen).to(torch.float32)
    assert monolithic.check_probe(geo, x, distinct)["bitwise"]


def test_the_masking_check_refuses_softmax_first_routing(fake_class: type) -> None:
    geo = _geometry(fake_class(renormalize=False), torch.zeros((E, H)))
    with pytest.raises(ValueError, match="softmax-first"):
        monolithic.check_probe(geo, torch.zeros((1, H)), torch.zeros((1, E)))


def test_a_monolithic_class_without_a_probe_is_refused_with_the_flag(fake_class: type) -> None:
    class OtherMonolithic:
        pass

    problem = monolithic.monolithic_capture_problem(_geometry(OtherMonolithic(), torch.zeros(1)))
    assert problem is not None
    assert "OtherMonolithic" in problem and "no routing probe" in problem and "--moe-backend" in problem
    assert monolithic.monolithic_capture_problem(_geometry(fake_class(), torch.zeros(1))) is None
    with pytest.raises(RuntimeError, match="OtherMonolithic"):
        monolithic.bind_monolithic_capture(_geometry(OtherMonolithic(), torch.zeros(1)), lambda previous: print)


def test_gpt_oss_triton_is_registered_with_its_modular_flag() -> None:
    assert "OAITritonMxfp4ExpertsMonolithic" in monolithic._PROBES
    assert monolithic.MODULAR_FLAG["OAITritonMxfp4ExpertsMonolithic"] == "--moe-backend triton_unfused"
