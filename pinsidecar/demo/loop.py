"""The demo loop: the whole product on one machine, on vLLM CPU, with the tiny local MoE model.

It is what ``bash scripts/demo.sh`` runs on a fresh clone, so it must work with nothing but the package: the
model is built locally (:mod:`pinsidecar.demo.model`), the traffic is the shipped prompt fixtures, the engine is
the vLLM CPU build. The steps are the loop of the product, in order:

1. ``model``   - build the demo model (skipped when the work folder already has it);
2. ``counts``  - count boots: the training traffic of domain A, and held-out traffic of A and of B;
3. ``maps``    - the usage map from A's counts, and the positional baseline (what ``--cpu-offload-gb`` would
   do with the same host budget);
4. ``eval``    - cold-selection rate of both on held-out A (in-domain) and held-out B (cross-domain);
5. ``pin``     - boot the engine in pin mode with the usage map, replay held-out A, and read the live cold
   rate from the hook's stats file: it must equal the rate the map predicts from the held-out counts, because
   pin mode changes where experts live, not what the router picks (the float32 CPU engine is bit-identical).

Every step writes its artifact into the work folder, so a later step (or a person) can pick them up; the summary
(``demo-summary.json``) holds every figure the demo prints.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
from pinsidecar_hook.contract import (
    StatsSnapshot,
    atomic_write_json,
    load_counts,
)
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar import placement

__all__ = ["DEFAULT_HOT_ROWS", "DemoOptions", "Display", "run_demo"]

log = structlog.get_logger(__name__)

# 48 of 64 experts hot per layer: 25 % of the experts in host memory, close to the reference system's split
# (295 hot / 89 cold of 384 experts per layer, 23 % cold; docs/design.md).
DEFAULT_HOT_ROWS = 48

# How long the demo waits for one engine to serve: a CPU boot takes 15-25 s, more on a loaded machine.
BOOT_TIMEOUT_S = 600.0


@dataclass
class DemoOptions:
    workdir: Path
    hot_rows: int = DEFAULT_HOT_ROWS
    train_domain: str = "code"
    other_domain: str = "prose"
    port: int = 8000
    concurrency: int = 4
    max_tokens: int | None = None
    rebuild_model: bool = False
    reuse_counts: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


class Display(Protocol):
    """What the loop tells a person as it goes. The CLI passes its terminal (:class:`pinsidecar.cli._terminal
    .Terminal`); ``None`` (tests, ``--json``) shows nothing."""

    @property
    def bars(self) -> bool:
        """Whether replays should draw their progress bar."""

    def step(self, title: str) -> None:
        """A step starts."""

    def note(self, text: str) -> None:
        """One line of the current step's result."""

    def engine_boot(self, base_url: str, what: str = ...) -> AbstractContextManager[None]:
        """The engine at ``base_url`` is booting during this block (show that it is, until it answers)."""


class _Silent:
    bars = False

    def step(self, title: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def engine_boot(self, base_url: str, what: str = "") -> AbstractContextManager[None]:
        return nullcontext()


def _step(display: Display, name: str, title: str) -> None:
    display.step(title)
    log.info("demo_step", step=name)


def run_demo(opts: DemoOptions, display: Display | None = None) -> dict[str, Any]:
    """Run the loop and return the summary (also written to ``<workdir>/demo-summary.json``)."""
    from pinsidecar.demo.model import build_demo_model, fixture_path
    from pinsidecar.runs.count_boot import run_profile

    show: Display = display if display is not None else _Silent()
    work = opts.workdir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    engine_url = f"http://127.0.0.1:{opts.port}"

    _step(show, "model", "model: the tiny local MoE model, routing shaped per traffic domain")
    if opts.rebuild_model or not (model_dir / "config.json").exists():
        build_demo_model(model_dir, force=opts.rebuild_model)
        show.note(f"built {model_dir}")
    else:
        show.note(f"reusing {model_dir}")

    a, b = opts.train_domain, opts.other_domain
    workloads = {f"{a}_train": fixture_path(a), f"{a}_heldout": fixture_path(f"{a}_heldout"),
                 f"{b}_heldout": fixture_path(f"{b}_heldout")}
    _step(show, "counts", f"counts: {len(workloads)} count boots on vLLM CPU ({a} training traffic, held-out {a} "
          f"and {b})")
    counts_paths: dict[str, Path] = {}
    profiles: dict[str, Any] = {}
    for name, workload in workloads.items():
        out = work / f"counts-{name}.json"
        counts_paths[name] = out
        if opts.reuse_counts and out.exists():
            show.note(f"{name}: reusing {out}")
            continue
        with show.engine_boot(engine_url, f"{name}: engine booting"):
            result = run_profile(model_dir, [workload], out, concurrency=opts.concurrency,
                                 max_tokens=opts.max_tokens, port=opts.port, label=name, progress=show.bars)
        s = result.summary()
        profiles[name] = s
        show.note(f"{name}: {s['requests']} requests, {s['tokens']} tokens, {s['selections']} selections "
                  f"({'exact' if s['exact'] else 'NOT exact'}), boot {s['boot_s']:.1f} s -> {out}")
    counts = {name: load_counts(p) for name, p in counts_paths.items()}

    _step(show, "maps", f"maps: the usage map from {a}_train, and the positional baseline for the same budget")
    train = counts[f"{a}_train"]
    usage = placement.build_usage_map([train], opts.hot_rows, label=f"{a}",
                                      expert_bytes=int(train.meta.get("expert_bytes", 0) or 0))
    usage_path = work / f"map-{a}.json"
    placement.save_map(usage, usage_path)
    positional = placement.positional_for(usage)
    show.note(f"usage map {usage.short_hash}: {usage.hot_rows} hot / {usage.cold_rows} cold rows per layer, "
              f"predicted cold rate {usage.predicted_cold_rate:.2%} -> {usage_path}")
    show.note(f"positional baseline (what --cpu-offload-gb does): the same {positional.cold_total} cold experts, "
              "whole layers first")

    _step(show, "eval", "eval: both placements on held-out traffic (the table is at the end)")
    skew = {name: placement.counts_summary(c)["skew"] for name, c in counts.items()}
    table: dict[str, dict[str, float]] = {}
    for traffic in (f"{a}_heldout", f"{b}_heldout"):
        table[traffic] = {
            "usage": placement.evaluate(usage, counts[traffic])["cold_rate"],
            "positional": placement.evaluate(positional, counts[traffic], "positional")["cold_rate"],
        }

    _step(show, "pin", f"pin: boot with the usage map, replay held-out {a}, read the live stats")
    live = _pin_replay(model_dir, usage_path, fixture_path(f"{a}_heldout"), work, opts, show)
    live_rate = live.total_cold_selections / max(live.total_selections, 1)
    expected = table[f"{a}_heldout"]["usage"]
    show.note(f"live cold-selection rate {live_rate:.2%} over {live.total_selections} selections "
              f"(offline evaluation of the same traffic: {expected:.2%})")

    summary: dict[str, Any] = {
        "pin": {"live_cold_rate": live_rate, "selections": live.total_selections,
                "cold_selections": live.total_cold_selections, "tier_bytes": live.tier_bytes,
                "traffic": f"{a}_heldout", "matches_offline_eval": abs(live_rate - expected) < 1e-12},
        "workdir": str(work), "model": str(model_dir), "hot_rows": usage.hot_rows, "cold_rows": usage.cold_rows,
        "map": str(usage_path), "map_hash": usage.content_hash, "map_label": usage.label,
        "predicted_cold_rate": usage.predicted_cold_rate,
        "cold_rate": table,
        "in_domain": table[f"{a}_heldout"], "cross_domain": table[f"{b}_heldout"],
        "skew_top25_share": skew, "profiles": profiles,
    }
    atomic_write_json(work / "demo-summary.json", summary)
    show.note(f"summary -> {work / 'demo-summary.json'}")
    return summary


def _pin_replay(model_dir: Path, map_path: Path, workload: Path, work: Path, opts: DemoOptions,
                show: Display) -> StatsSnapshot:
    """One pin-mode boot: reset the live counters once ready, replay, flush, return the final stats."""
    from pinsidecar.engine import EngineConfig, EngineProcess, hooked_spec
    from pinsidecar.live_stats import request_stats
    from pinsidecar.runs.workload import load_workload, replay

    stats_path = (work / "stats-pin.json").resolve()
    hook = HookConfig(mode="pin", map_path=map_path.resolve(), stats_path=stats_path)
    spec = hooked_spec(EngineConfig(model=model_dir, enforce_eager=True), hook, port=opts.port,
                       log_path=work / "engine-pin.log")
    with EngineProcess(spec) as eng:
        with show.engine_boot(eng.base_url, "pin engine booting"):
            boot_s = eng.wait_ready(BOOT_TIMEOUT_S)
        show.note(f"engine ready in {boot_s:.1f} s (pin mode, map {map_path.name})")
        request_stats(stats_path, "reset", alive=eng.alive)
        result = replay(load_workload([workload]), eng.base_url, spec.model_name, concurrency=opts.concurrency,
                        max_tokens=opts.max_tokens, progress=show.bars)
        if result.errors:
            raise RuntimeError(f"{len(result.errors)} requests failed in the pin-mode replay: {result.errors[0].error}")
        return request_stats(stats_path, "flush", alive=eng.alive)
