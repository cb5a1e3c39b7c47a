"""The demo-model generator's geometry option (the GPU lane's model is the same design at hidden 2048, 128 experts,
16 layers): a non-default geometry writes a loadable sharded checkpoint of that shape, with the designed hot sets
scaled to the expert count; bad geometries are refused with the reason; the CLI passes the options through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from pinsidecar.demo import model as dm

SMALL = {"hidden": 256, "layers": 3, "experts": 32, "top_k": 4, "expert_intermediate": 64}


def test_a_scaled_geometry_writes_a_sharded_checkpoint_of_that_shape(tmp_path: Path) -> None:
    geo = dm.Geometry.scaled(**SMALL)
    assert not geo.is_default and dm.DEFAULT_GEOMETRY.is_default
    out = dm.build_demo_model(tmp_path / "m", geometry=geo)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_experts"],
            config["num_experts_per_tok"], config["moe_intermediate_size"]) == (256, 3, 32, 4, 64)
    assert config["num_attention_heads"] * config["head_dim"] == 256  # heads of 32 below hidden 512
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert shards == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    with safe_open(str(out / index["weight_map"]["model.layers.2.mlp.experts.31.down_proj.weight"]), "pt") as f:
        down = f.get_tensor("model.layers.2.mlp.experts.31.down_proj.weight")
    assert tuple(down.shape) == (256, 64) and str(down.dtype) == "torch.bfloat16"
    assert float(down[dm.DOMAIN_DIM].abs().sum()) == 0.0  # experts never write the domain coordinate
    info = json.loads((out / "pinsidecar_demo.json").read_text())
    assert info["geometry"] == geo.as_dict()
    hot = info["designed_hot"]["code"][0]
    assert len(hot) == geo.shared_hot + geo.domain_hot == 8  # 25 % of 32, as 16 of 64 in the tiny model
    again = dm.build_demo_model(tmp_path / "again", geometry=geo)
    assert dm.weights_digest(again) == dm.weights_digest(out)  # same seed, same device kind: same bytes


def test_the_default_geometry_keeps_its_single_file_and_metadata(demo_model_dir: Path) -> None:
    assert (demo_model_dir / "model.safetensors").exists()
    assert not (demo_model_dir / "model.safetensors.index.json").exists()
    assert "geometry" not in json.loads((demo_model_dir / "pinsidecar_demo.json").read_text())


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden": 100}, "multiples of 32"),
    ({"top_k": 40}, "top-k"),
    ({"experts": 8}, "too few"),
    ({"dtype": "int8"}, "dtype"),
])
def test_bad_geometries_are_refused_with_the_reason(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(dm.DemoModelError, match=message):
        dm.build_demo_model(tmp_path / "m", geometry=dm.Geometry.scaled(**{**SMALL, **change}))
    assert not (tmp_path / "m").exists()


def test_cli_geometry_options(tmp_path: Path) -> None:
    from pinsidecar.cli import main

    result = CliRunner().invoke(main, ["demo-model", str(tmp_path / "m"), "--hidden", "256", "--layers", "3",
                                       "--experts", "32", "--top-k", "4", "--expert-intermediate", "64", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert (payload["hidden_size"], payload["num_layers"], payload["num_experts"], payload["top_k"],
            payload["expert_intermediate"], payload["dtype"]) == (256, 3, 32, 4, 64, "bfloat16")
