"""The heal scenario under load: a real ``pinsidecar run`` daemon through a traffic shift, its automatic in-place
remap, an operator's drain-reboot onto another geometry and a SIGKILLed engine, with N streaming clients all along.

The scenario is :class:`~bench.scenario.heal.HealScenario` (the stages, the per-second sampler, the
figures); this is its command line. Two forms:

- ``--short``: the CPU/CI form (short stages, small drift windows) on vLLM CPU and the demo model (built when
  ``--model`` is not given); ``tests/test_heal_scenario.py`` runs the same with 2 clients;
- the full form (the default): longer stages and larger windows, for a GPU vLLM engine. ``--engine-toml FILE``
  gives the engine: its ``[engine]`` keys go over the demo's (``enforce_eager = false``, ``dtype = "auto"``,
  ``kv_cache_bytes``, ``max_model_len``, ``extra_args`` with vLLM flags, ``env``); ``--nvml`` turns the exporter's
  NVML metrics on. The maps come from the model's routing under transformers on the CPU (seconds for the demo
  model), or prebuilt with ``--maps DIR`` (``code.json``, ``prose.json``, ``prose-<H>.json``, each with its
  ``.counts.json`` beside it) for a model too large for that.

Run: ``python bench/heal_scenario.py --short --clients 2 --work /tmp/heal --out /tmp/heal/heal.json
--png /tmp/heal/heal.png``. Prints the checks and the headline figures; writes the JSON document (also when the
run fails: with its ``error``) and the timeline PNG. Exits 1 when a check fails.

On the H200 (vLLM 0.26, the GPU lane's model: ``bench/gpu_lane.py``'s 16 layers x 128 experts, top-8),
``scripts/gpu_lane/device_loop.sh`` (``step_heal``) writes the engine file (the lane's own engine settings:
``enforce_eager = false``, ``kv_cache_bytes``, ``max_model_len``, the vLLM flags in ``extra_args``, the compile
cache in ``env``), builds the maps from count boots (``pinsidecar count-boot`` + ``pinsidecar map build``) and runs
this with ``--maps``, ``--engine-toml``, ``--nvml`` and the hot-row counts of those maps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root, so that siblings import as bench.<name>
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pinsidecar_hook.contract import APPLY_ORDERINGS, atomic_write_json

from bench.scenario.heal import FULL, SHORT, HealScenario
from bench.scenario.plot import draw_timeline
from bench.scenario.remap_lane import HOT_ROWS, OTHER_HOT_ROWS, lane_maps, load_lane_maps

__all__ = ["main"]


def _engine_keys(path: Path | None) -> dict[str, Any]:
    """The ``[engine]`` table of ``path`` (nothing else in the file is read)."""
    if path is None:
        return {}
    with open(path, "rb") as fh:
        doc = tomllib.load(fh)
    engine = doc.get("engine")
    if not isinstance(engine, dict):
        raise SystemExit(f"{path}: no [engine] table")
    return engine


def _headline(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures worth a glance; a cut run's document lacks some, which show as empty."""
    rem, reb, kill, reqs = (doc.get(k) or {} for k in ("remap", "reboot", "kill", "requests"))
    return {"ok": doc.get("ok"), "error": doc.get("error"), "checks": doc.get("checks"),
            "stages": {s["stage"]: s["seconds"] for s in doc.get("stages") or []},
            "requests": {k: reqs.get(k) for k in ("sent", "completed", "failed", "lost")},
            "remap": {"states": rem.get("states"), "outcome": rem.get("outcome"), "apply": rem.get("apply")},
            "reboot": {k: reb.get(k) for k in ("ok", "boot_s", "initial_boot_s", "hash_hit", "cache_miss", "hold_s")},
            "kill": {k: kill.get(k) for k in ("pid", "new_pid", "in_flight_at_kill", "failed_after_kill")},
            "recovery": doc.get("recovery"),
            "cold_rate": {k: v for k, v in (doc.get("cold_rate") or {}).items() if k != "source"}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=None, help="concurrent streaming clients (1, 4, 16, ...)")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the demo model)")
    ap.add_argument("--work", type=Path, required=True, help="work folder (the daemon's files; renewed)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON document")
    ap.add_argument("--png", type=Path, required=True, help="the timeline picture")
    ap.add_argument("--short", action="store_true", help="the CPU/CI form: short stages, small windows")
    ap.add_argument("--engine-toml", type=Path, default=None,
                    help="a TOML file whose [engine] keys go over the demo's (a GPU engine)")
    ap.add_argument("--nvml", action="store_true", help="[metrics] nvml = true (GPU)")
    ap.add_argument("--maps", type=Path, default=None,
                    help="prebuilt maps (code.json, prose.json, prose-<H>.json with their counts) instead of "
                         "the model's routing under transformers")
    ap.add_argument("--hot-rows", type=int, default=HOT_ROWS, help="hot rows of the code and prose maps")
    ap.add_argument("--other-hot-rows", type=int, default=OTHER_HOT_ROWS, help="hot rows of the drain-reboot's map")
    ap.add_argument("--window-tokens", type=int, default=None, help="drift window size (routed tokens)")
    ap.add_argument("--prose-s", type=float, default=None, help="seconds of prose under the new map")
    ap.add_argument("--settle-s", type=float, default=None, help="seconds served after the reboot and the kill")
    ap.add_argument("--apply-ordering", choices=APPLY_ORDERINGS, default=None,
                    help="[remap.advanced] apply_ordering: how the hook orders the in-place apply's batches")
    ap.add_argument("--jit-cache", type=Path, default=None,
                    help="a Triton cache folder for the engine (TRITON_CACHE_DIR): the document lists the kernels "
                         "compiled during the run and which long gaps they overlapped")
    args = ap.parse_args(argv)

    base = SHORT if args.short else FULL
    changes: dict[str, Any] = {"engine": _engine_keys(args.engine_toml), "nvml": args.nvml,
                               "other_hot_rows": args.other_hot_rows}
    for key in ("clients", "window_tokens", "prose_s", "settle_s", "apply_ordering"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    if args.jit_cache is not None:
        args.jit_cache.mkdir(parents=True, exist_ok=True)
        changes["jit_cache_dir"] = str(args.jit_cache.absolute())
    opts = dataclasses.replace(base, **changes)
    work = args.work.absolute()
    lane_dir = work / "lane"
    shutil.rmtree(lane_dir, ignore_errors=True)  # a renewed daemon folder: no state of an earlier run
    model = args.model
    if model is None and (work / "model" / "config.json").is_file():
        model = work / "model"  # the demo model an earlier run built here
    elif model is None:
        from pinsidecar.demo.model import build_demo_model

        model = Path(build_demo_model(work / "model"))
    t0 = time.monotonic()
    if args.maps is not None:
        shutil.copytree(args.maps, lane_dir / "maps")  # the daemon's library: candidates are saved beside them
        maps = load_lane_maps(lane_dir / "maps")
    else:
        maps = lane_maps(model, lane_dir / "maps", hot_rows=(args.hot_rows, args.other_hot_rows))
    maps_s = time.monotonic() - t0
    scenario = HealScenario(lane_dir, model.absolute(), maps, opts)
    command = "python bench/heal_scenario.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def write(partial: bool) -> dict[str, Any]:
        doc = scenario.document()
        doc.update(command=command, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), model=str(model),
                   maps_s=round(maps_s, 1), form="short" if args.short else "full", partial=partial,
                   engine_toml=str(args.engine_toml) if args.engine_toml else None)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, doc)
        return doc

    def checkpoint(stage: str) -> None:
        try:
            write(partial=True)
        except Exception as exc:  # a document of a half-run scenario may lack figures: the run goes on
            print(f"heal_scenario: partial document not written at {stage or 'the end'}: {exc}", file=sys.stderr)

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated(f"signal {signum}: stopped before the end (a deadline?)")

    scenario.on_stage = checkpoint
    # SIGTERM (timeout, a device call's deadline) unwinds the run: the daemon and its engine are stopped, and the
    # document says how far it got, instead of a daemon left running that the next run would share a folder with.
    signal.signal(signal.SIGTERM, terminated)
    failure: BaseException | None = None
    try:
        scenario.run()
    except Exception as exc:  # the document is written either way, with the error in it
        failure = exc
    doc = write(partial=failure is not None)
    draw_timeline(doc, args.png)
    print(json.dumps(_headline(doc), indent=1))
    if failure is not None:
        raise SystemExit(f"the scenario failed: {failure} (the document: {args.out})")
    if not all(doc["checks"].values()):
        raise SystemExit(f"checks failed: {[k for k, v in doc['checks'].items() if not v]}")
    return doc


class Terminated(Exception):
    """SIGTERM arrived: the run unwinds like any failure (see main)."""


if __name__ == "__main__":
    main()
