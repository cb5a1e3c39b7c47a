"""The demo loop: the whole product on one machine, unattended, on vLLM CPU with the tiny local MoE model.

It is what ``bash scripts/demo.sh`` runs on a fresh clone, so it needs nothing but the package: the model is built
locally (:mod:`pinsidecar.demo.model`), the traffic is the shipped prompt fixtures, the engine is the vLLM CPU
build. The stages, in order (each one is a line of the timeline at the end):

1. ``model`` - build the demo model (skipped when the work folder has it);
2. ``count_boot`` - a count boot on domain A (code): the engine in count mode replays A's training prompts;
3. ``map`` - the usage map from those counts (48 hot / 16 cold experts per layer), its counts beside it (what
   the drift watch measures divergence against);
4. ``daemon_start`` - a daemon config in the work folder, and ``pinsidecar run``: the gate, the control API, the
   metrics exporter (live from here to the end), and the engine in pin mode serving that map;
5. ``domain_a`` - a few clients send held-out A prompts through the gate; windows close with their live cold
   rate. What the map buys: the same traffic's cold rate under the positional baseline (the same number of
   cold experts, whole layers first: what ``--cpu-offload-gb`` does), from the routing the hook counted;
6. ``detect`` - the clients shift to domain B (prose); the code map's cold rate jumps (a map is a per-workload
   artifact) and the drift watch trips;
7. ``remap.*`` - the remap, followed state by state: the captured B traffic, the library check, the count boot
   on a second engine beside the serving one, the new map, its evaluation on a held-out window, the apply in
   place (the hook swaps the rows that change while the engine keeps serving; parity checked token for token on
   the same engine), the verification of the live cold rate, the commit. Should the apply not be possible, the
   remap falls back to a drain and hash-hit reboot (parity checked inside the hold) and the demo shows that;
8. ``after`` - B under the new map: the cold rate back down;
9. ``stop`` - the daemon is stopped (it drains and stops its engine); so it is on Ctrl-C or any failure, and
   nothing is left running (:meth:`~pinsidecar.demo.sidecar.Sidecar.stop`).

**The figure**: the live cold rate after the remap (the pipeline's verification, over ``remap.verify_tokens``)
is at most half the rate of the window that tripped; otherwise the demo fails with the figures. The summary
(``demo-summary.json``, and ``--json`` on stdout) holds the timeline, the cold rates, the remap's essentials and
the requests sent, completed and failed through the gate (none should fail: an apply only pauses the engine's
steps while the hook copies, and if the remap falls back to a reboot the gate holds them through it). The daemon's
files (config, logs, state, maps) are under ``<workdir>/run``, renewed by each run.

**The verdict**: the summary's ``verdict`` is one line, ``PASS <the figure that decided it>`` or ``FAIL <why>``
(:func:`~pinsidecar.demo.report.verdict`), and ``pinsidecar demo`` ends with it.

This module is the loop's outline (the order of the stages and the verdict); its options and display are
:mod:`pinsidecar.demo.options`, the stages themselves :mod:`pinsidecar.demo.stages`, what they report
:mod:`pinsidecar.demo.report`, and the timeline :mod:`pinsidecar.demo.timeline`.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import structlog
from pinsidecar_hook.contract import atomic_write_json

from pinsidecar.demo.options import DemoOptions, Display, Silent
from pinsidecar.demo.report import cold_rate_figures, remap_essentials, verdict
from pinsidecar.demo.sidecar import DemoPorts
from pinsidecar.demo.stages import DemoRun

__all__ = ["DemoFailed", "run_demo"]

log = structlog.get_logger(__name__)

# The demo's remap deploys in place (remap.in_place, the default): no "rebooting" unless the apply falls back.
REMAP_STATES = ("choosing_workload", "library_check", "count_boot", "building", "evaluating", "applying",
                "verifying")
STAGES = ("model", "count_boot", "map", "daemon_start", "domain_a", "detect",
          *(f"remap.{s}" for s in REMAP_STATES), "after", "stop")


class DemoFailed(RuntimeError):
    """The demo could not complete the loop, or the figure missed; ``summary`` has what was measured and its
    ``verdict`` line."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def run_demo(opts: DemoOptions, display: Display | None = None) -> dict[str, Any]:
    """Run the loop and return the summary (also written to ``<workdir>/demo-summary.json``).

    Raises :class:`DemoFailed` (with the summary so far) when the loop does not complete or the figure misses;
    ``KeyboardInterrupt`` goes through, after the daemon and its engines are stopped. Either way the summary's
    ``verdict`` says PASS or FAIL and why."""
    show: Display = display if display is not None else Silent()
    run = DemoRun(opts, show)
    run.work.mkdir(parents=True, exist_ok=True)
    if run.run_dir.exists():  # the daemon's state of a previous run (its active map, records) must not carry over
        shutil.rmtree(run.run_dir)
    summary = run.summary
    try:
        run.build_model()
        ports, moved = DemoPorts.pick(engine=opts.port, metrics=opts.metrics_port)
        counts = run.count_boot(ports.count)
        map_path, usage, positional = run.build_map(counts)
        for note in moved:
            show.note(note)
        engine_env = run.start_daemon(map_path, ports)
        run.domain_a(engine_env, positional, usage)
        trip = run.detect()
        rec = run.follow_remap(trip["id"])
        state_dir = Path(summary["logs"]["remaps"]).parent
        summary["remap"] = remap_essentials(rec, state_dir)
        if rec.get("outcome") != "committed":
            raise RuntimeError(f"remap {rec.get('id')} ended {rec.get('outcome')}: "
                               f"{rec.get('outcome_reason') or rec.get('error')} (record: "
                               f"{summary['remap']['record']})")
        summary["cold_rate"] = cold_rate_figures(summary, run.after())
    except KeyboardInterrupt:
        summary["error"] = "interrupted"
        raise
    except Exception as exc:  # any failure: stop everything (below), say what and where the logs are
        expected = isinstance(exc, RuntimeError | TimeoutError | OSError | ValueError)
        summary["error"] = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        log.warning("demo_failed", error=summary["error"], exc_info=not expected)
    finally:
        run.stop()
        summary["timeline"] = run.timeline.as_list()
        summary["windows"] = run.windows
        summary["seconds"] = round(run.timeline.now(), 1)
        passed, why = verdict(summary)
        summary["ok"] = passed
        summary["verdict"] = f"{'PASS' if passed else 'FAIL'} {why}"
        with contextlib.suppress(OSError):
            atomic_write_json(run.work / "demo-summary.json", summary)
    if not summary["ok"]:
        raise DemoFailed(why, summary)
    return summary
