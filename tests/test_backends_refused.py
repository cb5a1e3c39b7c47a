"""A layer no backend splits is refused with what vLLM picked, what it serves, and the vLLM flag that helps.

The experts objects are instances of empty classes named as vLLM 0.34's (fakes: the refusal reads only the class
name and the quant config, which they lack). The table itself was read in 0.34's oracles (``backends/refused.py``).
"""

from __future__ import annotations

import pytest
import torch
from pinsidecar_hook.backends import BackendUnavailable, load_backend, select_backend
from pinsidecar_hook.backends.base import GUARANTEES
from pinsidecar_hook.backends.refused import KNOWN_UNSPLIT, advice
from pinsidecar_hook.contract.backends import BACKENDS


@pytest.mark.parametrize("name", sorted(KNOWN_UNSPLIT))
def test_a_known_unsplit_class_is_refused_with_its_formats_and_the_flag(name: str) -> None:
    experts = type(name, (), {})()
    with pytest.raises(BackendUnavailable) as info:
        select_backend("auto", torch.device("cuda"), experts)
    message = str(info.value)
    known = KNOWN_UNSPLIT[name]
    assert f"no split backend for experts {name}" in message
    assert f"vLLM picked {name} for {known.formats}" in message
    if known.flag is not None:
        assert f"boot vLLM with {known.flag}" in message
        assert known.flag.startswith("--moe-backend ") or known.flag.startswith("VLLM_"), known.flag
    else:
        assert "no vLLM flag gives a class pinsidecar splits yet" in message
    assert "count mode" in message or "triton_experts" in message or "marlin_experts" in message


def test_the_flags_that_give_tritonexperts_point_at_the_bitwise_backend() -> None:
    triton = load_backend("triton_experts")
    assert triton.GUARANTEE == "bitwise" and triton.AUTO
    for name, known in KNOWN_UNSPLIT.items():
        if known.flag == "--moe-backend triton":
            assert "TritonExperts, split bit-identical by triton_experts" in known.gives, name


def test_an_unknown_class_keeps_the_generic_advice() -> None:
    assert advice("SomeFutureExperts") == ""
    with pytest.raises(BackendUnavailable, match="Serve this model in count mode"):
        select_backend("auto", torch.device("cuda"), type("SomeFutureExperts", (), {})())


def test_auto_picks_bitwise_backends_and_the_cpu_engines_placement_invariant_one() -> None:
    """``auto`` picks a bitwise backend wherever one exists. The CPU engine's kernel reduces inside itself, so no
    split there can be bitwise to it; its backend guarantees placement invariance and is the one ``auto`` exception
    (named here, so a second exception is a decision, not an accident)."""
    for entry in BACKENDS:
        cls = load_backend(entry.name)
        assert cls.GUARANTEE in GUARANTEES, entry.name
        if cls.AUTO and cls.GUARANTEE != "bitwise":
            assert (entry.name, cls.GUARANTEE) == ("cpu", "placement-invariant"), \
                f"auto may pick {entry.name}, which guarantees {cls.GUARANTEE}"
