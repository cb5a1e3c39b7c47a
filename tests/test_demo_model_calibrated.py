"""The calibrated demo router (``pinsidecar demo-model DIR --router calibrated``).

The zipf router's skew is the toy's, not the reference deployment's; the calibrated one is the same model with each
layer's router gain set at build time so that a usage map with 23 % of the experts cold sees about 1.55 % cold
selections on held-out traffic (bench/placement.py's CALIBRATION). These tests measure that with a real forward
(``routing_counts``, transformers, the same 16 generated tokens the calibration assumes), check that the two
domains still route differently enough for drift to show, and that nothing but the routers changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from pinsidecar.cli import main
from pinsidecar.demo import model as dm

# The brief's band around the reference's 1.55 %: the build calibrates on a proxy of the router inputs (module
# docstring), so the measured figure lands near the target, not on it.
COLD_RATE_BAND = (0.010, 0.025)
# Each domain's own figure may sit further from the target (the gain is one per layer, shared by both domains).
DOMAIN_COLD_RATE_BAND = (0.003, 0.040)
# Drift: a map built on one domain must be visibly worse on the other domain's traffic than on its own.
MIN_DRIFT_RATIO = 3.0
# Small geometry on the 128 grid, for the quantized twin.
QUANT_GEO = dict(hidden=256, layers=2, experts=16, top_k=4, expert_intermediate=128)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def models(demo_model_factory: Callable[..., Path]) -> dict[str, Path]:
    return {router: demo_model_factory(router=router) for router in dm.ROUTERS}


@pytest.fixture(scope="module")
def routing(models: dict[str, Path]) -> dict[tuple[str, str], np.ndarray]:
    return {(split, d): dm.routing_counts(models["calibrated"], dm.load_prompts(d + suffix))
            for split, suffix in (("train", ""), ("heldout", "_heldout")) for d in dm.DOMAINS}


def test_held_out_cold_rate_is_the_reference_figure(routing: dict[tuple[str, str], np.ndarray]) -> None:
    own = {d: dm.cold_selection_rate(routing["train", d], routing["heldout", d]) for d in dm.DOMAINS}
    mean = float(np.mean([r.mean() for r in own.values()]))
    lo, hi = COLD_RATE_BAND
    assert lo <= mean <= hi, {d: r.round(4).tolist() for d, r in own.items()}
    for d, rates in own.items():
        assert DOMAIN_COLD_RATE_BAND[0] <= rates.mean() <= DOMAIN_COLD_RATE_BAND[1], (d, rates.round(4).tolist())


def test_the_two_domains_still_route_differently(routing: dict[tuple[str, str], np.ndarray]) -> None:
    for a, b in (dm.DOMAINS, dm.DOMAINS[::-1]):
        own = dm.cold_selection_rate(routing["train", a], routing["heldout", a]).mean()
        other = dm.cold_selection_rate(routing["train", a], routing["heldout", b]).mean()
        assert other >= MIN_DRIFT_RATIO * own, f"{a} map: {own:.4f} on {a}, {other:.4f} on {b}"
    figures = dm.skew_figures({d: routing["train", d] for d in dm.DOMAINS})
    assert max(figures.overlap) <= 0.5


def test_only_the_routers_change_and_the_default_is_untouched(models: dict[str, Path]) -> None:
    zipf, calibrated = _tensors(models["zipf"]), _tensors(models["calibrated"])
    assert set(zipf) == set(calibrated)
    info = json.loads((models["calibrated"] / "pinsidecar_demo.json").read_text())
    router = info["router"]
    assert router["kind"] == "calibrated" and router["target_cold_rate"] == dm.CALIBRATED_COLD_RATE
    assert len(router["gains"]) == 4 and len(router["proxy_cold_rate"]) == 4
    cols = [dm.DOMAIN_DIM, dm.BIAS_DIM]
    for name, tensor in zipf.items():
        if not name.endswith("mlp.gate.weight"):
            assert torch.equal(tensor, calibrated[name]), name
            continue
        layer = int(name.split(".")[2])
        rest = [c for c in range(tensor.shape[1]) if c not in cols]
        assert torch.equal(tensor[:, rest], calibrated[name][:, rest]), name
        torch.testing.assert_close(calibrated[name][:, cols].float(), router["gains"][layer] * tensor[:, cols].float(),
                                   rtol=1e-2, atol=1e-3)
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        assert (models["zipf"] / name).read_bytes() == (models["calibrated"] / name).read_bytes(), name
    # The zipf router is the default, byte for byte, and its metadata has no router entry (it never had one).
    assert "router" not in json.loads((models["zipf"] / "pinsidecar_demo.json").read_text())
    assert dm.weights_digest(models["zipf"]) != dm.weights_digest(models["calibrated"])


def test_same_seed_same_bytes_and_the_cli(models: dict[str, Path], tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["demo-model", str(tmp_path / "m"), "--router", "calibrated", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout)
    assert payload["router"] == "calibrated" and payload["digest"] == dm.weights_digest(models["calibrated"])
    with pytest.raises(dm.DemoModelError, match="router"):
        dm.build_demo_model(tmp_path / "bad", router="flat")


def test_quantized_twin_keeps_the_calibrated_router(tmp_path: Path) -> None:
    geo = dm.Geometry.scaled(**QUANT_GEO)
    bf16 = dm.build_demo_model(tmp_path / "bf16", geometry=geo, router="calibrated")
    fp8 = dm.build_demo_model(tmp_path / "fp8", geometry=geo, router="calibrated", quant="fp8-block")
    a, b = _tensors(bf16), _tensors(fp8)
    for layer in range(geo.layers):
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert torch.equal(a[name], b[name]), name
    info = json.loads((fp8 / "pinsidecar_demo.json").read_text())
    assert info["router"]["kind"] == "calibrated" and info["quant"]["method"] == "fp8-block"
    assert info["router"]["gains"] == json.loads((bf16 / "pinsidecar_demo.json").read_text())["router"]["gains"]
