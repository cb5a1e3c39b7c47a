"""``pinsidecar demo-model DIR``: write the deterministic tiny Qwen3-MoE that CI, tests and the demo run on, or the
same routing design at another geometry (``--hidden 2048 --experts 128 --top-k 8 --expert-intermediate 768
--layers 16``: a model large enough for experts to dominate, which the GPU lane builds on the device), with the
designed router or one calibrated to the reference deployment's skew (``--router calibrated``); or, with
``--replay-trace T.npz``, a model whose routing replays a routing trace token by token (the cache-tier benches')."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

if TYPE_CHECKING:
    from pinsidecar.demo.model import Geometry

__all__: list[str] = []  # nothing here is another package's business


@click.command("demo-model")
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights seed; the same seed gives the same bytes.")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and is not empty.")
@click.option("--hidden", type=int, default=None, help="Hidden size (default 128, the tiny CI model).")
@click.option("--layers", type=int, default=None, help="MoE layers (default 4).")
@click.option("--experts", type=int, default=None, help="Routed experts per layer (default 64).")
@click.option("--top-k", "top_k", type=int, default=None, help="Experts per token (default 8).")
@click.option("--expert-intermediate", type=int, default=None, help="Each expert's intermediate size (default 64).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="Weights dtype.")
@click.option("--quant", type=click.Choice(["none", "fp8-block", "gptq-int4", "awq-int4", "nvfp4", "mxfp4"]),
              default="none", show_default=True,
              help="Store the routed experts quantized, the rest in --dtype: fp8-block (128x128 block scales), "
                   "gptq-int4 or awq-int4 (groups of 128; these three need hidden and expert intermediate sizes "
                   "that are multiples of 128), nvfp4 (ModelOpt, blocks of 16), or mxfp4 (a gpt-oss model built "
                   "from the same tensors, experts in MXFP4 as gpt-oss ships them; multiples of 32).")
@click.option("--router", type=click.Choice(["zipf", "calibrated"]), default="zipf", show_default=True,
              help="zipf: the designed router (the toy's skew). calibrated: the same router with its gains set at "
                   "build time so that a usage map with 23 % of the experts cold sees about 1.55 % cold selections "
                   "on held-out prompts (the reference deployment's figure).")
@click.option("--replay-trace", "replay_trace", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write instead the model that replays this routing trace (.npz): its greedy decode walks the "
                   "cycle t0 t1 ... of the trace's tokens and each token routes, in every layer, to the trace's "
                   "experts. Layers, experts and top-k must be the trace's; at most --hidden tokens.")
@json_option
@handle_errors
def demo_model(out_dir: Path, seed: int, force: bool, hidden: int | None, layers: int | None, experts: int | None,
               top_k: int | None, expert_intermediate: int | None, dtype: str, quant: str, router: str,
               replay_trace: Path | None, as_json: bool) -> None:
    """Write a tiny Qwen3-MoE (4 layers, 64 experts, top-8) with skewed, domain-dependent routing to OUT_DIR.

    Prompt fixtures for its two domains ship with the package (code.jsonl, prose.jsonl and held-out sets). The
    geometry options build the same routing design at another size (attention heads of 128 from hidden 512 up);
    without them the model is byte for byte the tiny default. --quant writes the quantized twin of a geometry
    (e.g. --hidden 256 --expert-intermediate 128 --quant fp8-block): the same router, so the same routing.
    --quant mxfp4 writes a gpt-oss model (GptOssForCausalLM) instead, from the same tensors.
    --router calibrated keeps everything but the routers' gains, so placement figures see the reference skew.
    --replay-trace T.npz writes a model whose routing is the trace's, token by token (docs/cache-tier.md).
    """
    from pinsidecar.demo.model import (
        DEFAULT_GEOMETRY,
        DemoModelError,
        Geometry,
        build_demo_model,
        fixture_path,
    )

    d = DEFAULT_GEOMETRY
    geometry = Geometry.scaled(
        hidden=hidden or d.hidden, layers=layers or d.layers, experts=experts or d.experts, top_k=top_k or d.top_k,
        expert_intermediate=expert_intermediate or d.expert_intermediate, dtype=dtype)
    if replay_trace is not None:
        _replay_model(out_dir, replay_trace, seed, force, geometry, quant, router, as_json)
        return
    try:
        path = build_demo_model(out_dir, seed=seed, force=force, geometry=geometry,
                                quant=None if quant == "none" else quant, router=router)
    except DemoModelError as exc:
        raise UserError(str(exc)) from exc
    payload = {
        **_written(path, seed, quant, router),
        "fixtures": {name: str(fixture_path(name)) for name in
                     ("code", "prose", "code_heldout", "prose_heldout")},
    }
    emit(payload, as_json, lambda p: (
        f"wrote demo model to {p['path']} ({p['num_layers']} layers x {p['num_experts']} experts, top-{p['top_k']}, "
        f"seed {p['seed']}{'' if p['quant'] == 'none' else ', experts ' + p['quant']}"
        f"{'' if p['router'] == 'zipf' else ', router ' + p['router']}, sha256 {p['digest'][:12]})\n"
        + "\n".join(f"  workload {k}: {v}" for k, v in p["fixtures"].items())))


def _written(path: Path, seed: int, quant: str, router: str) -> dict[str, Any]:
    """What every demo-model build reports: where it went, its digest and its geometry (from its config.json)."""
    from pinsidecar.demo.model import weights_digest

    config = json.loads((path / "config.json").read_text())
    return {
        "path": str(path),
        "seed": seed,
        "digest": weights_digest(path),
        "model_type": config["model_type"],
        "num_layers": config["num_hidden_layers"],
        # gpt-oss (--quant mxfp4) names them num_local_experts and intermediate_size
        "num_experts": config.get("num_experts", config.get("num_local_experts")),
        "top_k": config["num_experts_per_tok"],
        "hidden_size": config["hidden_size"],
        "expert_intermediate": config.get("moe_intermediate_size", config["intermediate_size"]),
        "dtype": config["torch_dtype"],
        "quant": quant,
        "router": router,
        "vocab_size": config["vocab_size"],
    }


def _replay_model(out_dir: Path, trace: Path, seed: int, force: bool, geometry: Geometry, quant: str, router: str,
                  as_json: bool) -> None:
    """``--replay-trace``: the replay model (pinsidecar/demo/replay_model.py) at the given geometry."""
    from pinsidecar.demo.model import DemoModelError
    from pinsidecar.demo.replay_model import build_replay_model

    if quant != "none":
        raise UserError(f"--replay-trace writes a bf16/fp16/fp32 model; --quant {quant} is not supported with it",
                        "drop --quant, or pass --quant none")
    if router != "zipf":
        raise UserError(f"--replay-trace builds its router from the trace; --router {router} does not apply",
                        "drop --router")
    try:
        path = build_replay_model(out_dir, trace, seed=seed, force=force, geometry=geometry)
    except DemoModelError as exc:
        raise UserError(str(exc)) from exc
    replay = json.loads((path / "pinsidecar_demo.json").read_text())["replay"]
    payload = {
        **_written(path, seed, "none", "replay"),
        "replay": {k: replay[k] for k in ("cycle_tokens", "routing_sha256", "trace_file", "trace_file_sha256",
                                          "margins")},
    }
    emit(payload, as_json, lambda p: (
        f"wrote replay model to {p['path']} ({p['num_layers']} layers x {p['num_experts']} experts, "
        f"top-{p['top_k']}, a cycle of {p['replay']['cycle_tokens']} tokens t0..t{p['replay']['cycle_tokens'] - 1}, "
        f"routing sha256 {p['replay']['routing_sha256'][:12]}, sha256 {p['digest'][:12]})"))


def register(main: click.Group) -> None:
    main.add_command(demo_model)
