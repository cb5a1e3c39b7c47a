"""The README's first command: ``pinsidecar demo``, the whole loop, on the real vLLM CPU engine.

The end-to-end case is the one full adaptation loop in CI: a count boot on code, the code map, a real
``pinsidecar run`` daemon serving it in pin mode, clients sending held-out code through the gate and then prose,
the drift trip, the remap (captured prose counted on a second engine, a map of the same geometry, judged on a window
that began after the capture was cut, applied in place while the clients stream with parity checked token for
token on the same engine, the live cold rate verified) and the commit. It asserts the issue's figure (the cold
rate after the remap is at most half the rate at the trip), the timeline's stages, every gate request served
through the apply, and ``--json`` stdout being one JSON document. It is the test that keeps both the demo and
the remap pipeline on a real engine true.

The rest are fast: the demo's closing output, the command's wiring (the loop faked), its daemon config (validated
by the daemon's own loader), its ports and its terminal indicator.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner
from pinsidecar_hook.contract import load_map

from pinsidecar.cli import main
from pinsidecar.cli._terminal import Terminal, format_elapsed
from pinsidecar.cli.demo import format_summary
from pinsidecar.demo import loop
from pinsidecar.demo.options import DemoOptions, Display
from pinsidecar.demo.report import Prediction, verdict, window_line
from pinsidecar.demo.sidecar import DemoPorts, demo_config
from pinsidecar.engine.ports import free_port
from pinsidecar.remap.candidates import counts_path_for
from pinsidecar.testing.artifacts import write_counts, write_map
from pinsidecar.testing.figures import record_figure


def _one_json_document(text: str) -> Any:
    doc, end = json.JSONDecoder().raw_decode(text)
    assert text[end:].strip() == "", f"stdout holds more than one JSON document: {text[end:]!r}"
    return doc


SUMMARY: dict[str, Any] = {
    "ok": True, "workdir": "/w", "domains": {"a": "code", "b": "prose"}, "seconds": 431.0,
    "metrics_url": "http://127.0.0.1:9108/metrics",
    "timeline": [{"stage": "model", "label": "demo model", "start_s": 0.0, "seconds": 1.2},
                 {"stage": "remap.count_boot", "label": "remap: count boot", "start_s": 250.4, "seconds": 95.0}],
    "cold_rate": {"at_trip": 0.508, "after": 0.047, "predicted": 0.039, "ratio": 0.0925, "required_ratio": 0.5,
                  "ok": True, "domain_a": 0.059, "positional_domain_a": 0.248},
    "remap": {"id": "r1", "outcome": "committed", "reboot": {"hash_hit": True, "cache_miss": False, "hold_s": 31.0},
              "parity": {"ok": True}},
    "requests": {"sent": 812, "completed": 812, "failed": 0},
    "verdict": "PASS cold rate 50.8% at the trip -> 4.7% after the remap (0.09x; the demo needs <= 0.50x); 812 of "
               "812 requests served, none failed",
}


# ------------------------------------------------------------------------------------------------- fast cases


def test_the_demo_ends_with_the_timeline_the_figures_and_one_verdict_line() -> None:
    text = format_summary(SUMMARY)
    assert "     0:00  demo model" in text and "4:10  remap: count boot     1:35" in text
    assert "7:11 in all" in text
    assert "at the trip: 50.8%; after the remap: 4.7% (held-out 3.9%)" in text
    assert "held-out code under the code map: 5.9%; positional offload of the same budget: 24.8%" in text
    assert "hash hit, no cache miss, gate held 31.0 s; parity ok" in text
    assert "812 sent, 812 completed, 0 failed" in text
    assert text.splitlines()[-1] == "demo: " + SUMMARY["verdict"]
    assert sum(line.startswith("demo: ") for line in text.splitlines()) == 1
    in_place = {**SUMMARY, "remap": {"id": "r1", "outcome": "committed", "reboot": None, "parity": {"ok": True},
                                     "apply": {"outcome": "applied", "seconds": 0.0042, "rows": 40,
                                               "bytes_moved": 5 * 2**20}}}
    assert ("remap r1: committed; applied in place in 4.2 ms (40 rows, 5.00 MiB), the gate never held; parity ok"
            in format_summary(in_place))
    fell = {**SUMMARY, "remap": {**SUMMARY["remap"], "apply": {"outcome": "fell_back_reboot",
                                                               "reason": "the hook refused the apply: x"}}}
    assert "gate held 31.0 s (not in place: the hook refused the apply: x); parity ok" in format_summary(fell)
    early = format_summary({"verdict": "FAIL the loop did not complete: boom"})
    assert early.strip() == "demo: FAIL the loop did not complete: boom"


def test_the_verdict_says_pass_with_its_figure_or_fail_with_why() -> None:
    passed, why = verdict(SUMMARY)
    assert passed and why == SUMMARY["verdict"].removeprefix("PASS ")
    missed = {**SUMMARY, "cold_rate": {**SUMMARY["cold_rate"], "after": 0.4, "ratio": 0.79, "ok": False}}
    assert verdict(missed) == (False, "cold rate 50.8% at the trip -> 40.0% after the remap (0.79x; the demo needs "
                                      "<= 0.50x)")
    lost = {**SUMMARY, "requests": {"sent": 812, "completed": 811, "failed": 1, "errors": ["read timeout"]}}
    assert verdict(lost) == (False, "1 of 812 requests through the gate failed (first: read timeout)")
    retried = {**SUMMARY, "requests": {**SUMMARY["requests"], "retried": 1}}
    assert verdict(retried)[1].endswith("none failed (1 sent twice: a connection closed unanswered)")
    broke = {**SUMMARY, "error": "the daemon exited (code 1)", "logs": {"daemon": "/w/d.log", "engine": "/w/e.log"}}
    assert verdict(broke) == (False, "the loop did not complete: the daemon exited (code 1) (logs: /w/d.log, "
                                     "/w/e.log)")
    assert verdict({})[0] is False


def test_a_window_shows_the_one_figure_the_demo_gave_its_map_and_says_which() -> None:
    rec = {"index": 3, "window": {"tokens": 512}, "judged": True, "state": "steady", "active_map": "sha256:ab",
           "active_label": "code", "signals": {"cold_rate": 0.061, "predicted_cold_rate": 0.015,
                                               "projected_gain": 0.001}}
    assert "under map code, live cold rate 6.1% (in-sample 1.5%)" in window_line(rec)
    held = window_line({**rec, "active_label": "prose"}, Prediction(0.025, "held-out"))
    assert "under map prose, live cold rate 6.1% (held-out 2.5%)" in held and "in-sample" not in held


def test_elapsed_time_reads_as_minutes_and_seconds() -> None:
    assert [format_elapsed(s) for s in (0, 59.6, 61, 3725)] == ["0:00", "1:00", "1:01", "1:02:05"]


def test_demo_command_prints_steps_then_the_timeline_or_json_alone(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The command's wiring, with the loop faked."""

    def fake_run_demo(opts: DemoOptions, display: Display) -> dict[str, Any]:
        display.step("count boot: vLLM CPU in count mode")
        with display.waiting("remap") as update:
            update("remap: count_boot")
            display.note("window 3: 612 tokens")
        structlog.get_logger("pinsidecar.demo.loop").info("demo_step", step="counts")  # below a person's level
        return SUMMARY

    monkeypatch.setattr(loop, "run_demo", fake_run_demo)
    human = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])
    assert human.exit_code == 0, human.output
    lines = human.stdout.splitlines()
    assert lines[:2] == ["==> count boot: vLLM CPU in count mode", "    window 3: 612 tokens"]
    assert lines[-3].startswith("  metrics were live at http://127.0.0.1:9108/metrics")
    assert lines[-1] == "demo: " + SUMMARY["verdict"]
    assert "demo_step" not in human.stderr
    as_json = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path), "--json"])
    assert as_json.exit_code == 0 and _one_json_document(as_json.stdout) == SUMMARY
    assert as_json.stderr == ""


def test_a_missed_figure_prints_the_figures_and_a_fail_line_and_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    why = "cold rate 50.8% at the trip -> 40.0% after the remap (0.79x; the demo needs <= 0.50x)"
    missed = {**SUMMARY, "ok": False, "cold_rate": {**SUMMARY["cold_rate"], "after": 0.4, "ratio": 0.79,
                                                     "ok": False}, "verdict": f"FAIL {why}"}

    def fake_run_demo(opts: DemoOptions, display: Display) -> dict[str, Any]:
        raise loop.DemoFailed(why, missed)

    monkeypatch.setattr(loop, "run_demo", fake_run_demo)
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path), "--json"])
    assert result.exit_code == 1
    doc = _one_json_document(result.stdout)
    assert doc["cold_rate"]["ok"] is False and doc["verdict"] == f"FAIL {why}"
    assert result.stderr == f"demo: FAIL {why}\n"
    human = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])
    assert human.exit_code == 1 and human.stdout.splitlines()[-1] == f"demo: FAIL {why}"


def test_the_demo_daemon_config_passes_the_daemons_own_validation(tmp_path: Path) -> None:
    from pinsidecar.daemon.config import load_config

    model = tmp_path / "model"
    model.mkdir()
    map_path = write_map(tmp_path / "run" / "maps" / "code.json")
    write_counts(counts_path_for(map_path))
    ports = DemoPorts(engine=18000, gate=18080, control=18090, metrics=19108, count=18100)
    cfg = load_config(demo_config(tmp_path / "run" / "pinsidecar.toml", model_dir=model, map_path=map_path,
                                  run_dir=tmp_path / "run", ports=ports))
    assert cfg.engine.hook_mode == "pin" and cfg.engine.map == map_path and cfg.maps_dir == map_path.parent
    assert cfg.deprecations == ()  # written in today's layout: the demo does not open on warnings about itself
    assert cfg.gate.capture_dir == tmp_path / "run" / "capture" and cfg.remap.source == "capture"
    assert cfg.remap.count_port(cfg.engine.port) == 18100 and "VLLM_CPU_OMP_THREADS_BIND" in cfg.remap.count_boot_env
    assert cfg.drift.window_tokens < cfg.drift.__class__().window_tokens  # small windows: a quick demo
    assert cfg.gate.max_hold_s >= cfg.engine.ready_timeout_s  # held clients outwait a slow reboot


def test_a_taken_port_is_replaced_and_said() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports, notes = DemoPorts.pick(engine=free_port(), metrics=taken)
    assert ports.metrics != taken and len(set(ports.__dict__.values())) == 5
    assert any(f"port {taken} (metrics) is taken" in n for n in notes)


def test_lines_printed_during_a_wait_land_above_the_spinner(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    term = Terminal(bars=True)
    with term.waiting("remap: count_boot") as update:
        time.sleep(0.6)
        update("remap: building")
        time.sleep(0.6)
        term.note("window 4: 512 tokens")
    out, err = capsys.readouterr()
    assert out == "    window 4: 512 tokens\n"
    assert "remap: count_boot" in err and "remap: building" in err
    assert err.endswith("\r\x1b[2K")  # the indicator erased itself


# ------------------------------------------------------------------------------------------------- the loop


@pytest.mark.vllm
@pytest.mark.slow
# Five to seven minutes on a 2-core box (three engine boots, one of them beside the serving engine under traffic:
# the file took 329 s and 461 s in two full runs); the suite's 600 s default is too tight for a loaded box. The
# demo bounds each of its own waits; 20 minutes is a hang, and waiting 30 would only take CI's time.
@pytest.mark.timeout(1200)
def test_demo_runs_the_whole_loop_on_vllm_cpu(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--workdir", str(work), "--port", str(free_port()),
                                       "--metrics-port", str(free_port()), "--json"])
    # The operator's terminal: --json puts one JSON document on stdout (and nothing else), and hundreds of
    # requests leave no httpx line in either stream.
    summary = _one_json_document(result.stdout)
    figure = {k: summary.get(k) for k in ("error", "cold_rate", "timeline", "requests", "remap")}
    record_figure("demo_loop", figure, doc=summary)
    assert result.exit_code == 0, (result.stderr, figure)
    assert "HTTP Request:" not in result.stdout + result.stderr and "==>" not in result.stdout
    assert summary == json.loads((work / "demo-summary.json").read_text())
    assert summary["ok"] is True and summary["verdict"].startswith("PASS cold rate "), summary["verdict"]

    # The figure: the cold rate after the remap is at most half the rate at the trip.
    cold = summary["cold_rate"]
    assert cold["after"] is not None and cold["after"] <= cold["at_trip"] / 2, cold
    # What the first map bought on held-out code (usage vs positional), and that it is a per-workload artifact:
    # prose under the code map is far colder than the code it was built for.
    assert cold["domain_a"] < cold["positional_domain_a"] / 2, cold
    assert cold["at_trip"] > 2 * cold["domain_a"], cold

    # The timeline: every stage of the loop, in order, each with its minutes.
    stages = [s["stage"] for s in summary["timeline"]]
    assert stages == list(loop.STAGES), stages
    starts = [s["start_s"] for s in summary["timeline"]]
    assert starts == sorted(starts)

    # Every request through the gate was served, through the apply (which never held the gate).
    req = summary["requests"]
    assert req["failed"] == 0 and req["completed"] == req["sent"] > 0, req
    assert req["completed_by_domain"]["code"] > 0 and req["completed_by_domain"]["prose"] > 0

    # The remap, from its persisted record.
    rec = json.loads(Path(summary["remap"]["record"]).read_text())
    assert rec["outcome"] == "committed" and rec["trigger"] == "drift"
    assert [s["state"] for s in rec["steps"]] == list(loop.REMAP_STATES)
    assert rec["decision"]["deploy"] and rec["decision"]["after_capture_cut"] is True
    # deployed in place: the hook swapped the rows, no reboot; parity token for token on the same engine
    assert rec["apply"]["in_place"] is True and rec["apply"]["outcome"] == "applied", rec["apply"]
    assert rec["apply"]["requests"][0]["result"] == "applied" and rec["apply"]["requests"][0]["rows"] > 0
    assert rec["verify"]["in_place"] is True and "reboot" not in rec["verify"]
    assert summary["remap"]["deploy"] == "in place" and summary["remap"]["apply"]["seconds"] is not None
    assert rec["verify"]["parity"]["ok"] is True and rec["verify"]["parity"]["tokens"] > 0
    assert rec["verify"]["cold_rate"]["status"] == "verified"
    assert rec["verify"]["cold_rate"]["live_cold_rate"] == cold["after"]
    code_map = Path(summary["map"]["path"])
    cand = Path(rec["candidate"]["path"])
    assert load_map(cand).same_geometry(load_map(code_map)) and counts_path_for(cand).is_file()
    assert rec["candidate"]["hash"] != summary["map"]["hash"]
    state = Path(summary["logs"]["remaps"]).parent
    assert json.loads((state / "active-map.json").read_text())["hash"] == rec["candidate"]["hash"]

    # Stopped cleanly: the daemon exited 0 and left no engine to clean up after it.
    stop = summary["daemon_stop"]
    assert stop["exit_code"] == 0 and not stop["killed"] and stop["leftover_engines"] == [], stop
