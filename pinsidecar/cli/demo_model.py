"""``pinsidecar demo-model DIR``: write the deterministic tiny Qwen3-MoE that CI, tests and the demo run on."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pinsidecar.cli._common import UserError, emit, handle_errors, json_option

__all__ = ["register"]


@click.command("demo-model")
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights seed; the same seed gives the same bytes.")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and is not empty.")
@json_option
@handle_errors
def demo_model(out_dir: Path, seed: int, force: bool, as_json: bool) -> None:
    """Write a tiny Qwen3-MoE (4 layers, 64 experts, top-8) with skewed, domain-dependent routing to OUT_DIR.

    Prompt fixtures for its two domains ship with the package (code.jsonl, prose.jsonl and held-out sets).
    """
    from pinsidecar.demo.model import DemoModelError, build_demo_model, fixture_path, weights_digest

    try:
        path = build_demo_model(out_dir, seed=seed, force=force)
    except DemoModelError as exc:
        raise UserError(str(exc)) from exc
    config = json.loads((path / "config.json").read_text())
    payload = {
        "path": str(path),
        "seed": seed,
        "digest": weights_digest(path),
        "model_type": config["model_type"],
        "num_layers": config["num_hidden_layers"],
        "num_experts": config["num_experts"],
        "top_k": config["num_experts_per_tok"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "fixtures": {name: str(fixture_path(name)) for name in
                     ("code", "prose", "code_heldout", "prose_heldout")},
    }
    emit(payload, as_json, lambda p: (
        f"wrote demo model to {p['path']} ({p['num_layers']} layers x {p['num_experts']} experts, top-{p['top_k']}, "
        f"seed {p['seed']}, sha256 {p['digest'][:12]})\n"
        + "\n".join(f"  workload {k}: {v}" for k, v in p["fixtures"].items())))


def register(main: click.Group) -> None:
    main.add_command(demo_model)
