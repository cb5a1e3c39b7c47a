"""The exporter against the real thing: a vLLM CPU engine in pin mode, its real stats file, its real /metrics and
its real cgroup. The fixture-tree tests (test_metrics.py) pin the arithmetic; this one shows the formats and names
we read are the ones the engine and the hook actually write, and that promtool accepts the result."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from pinsidecar_hook.contract import load_map
from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.live_stats import request_stats
from pinsidecar.metrics import Exporter
from pinsidecar.testing.fixtures import ServedPin

pytestmark = pytest.mark.vllm

PROMPTS = ["def parse_args(items, node):", "The river was quiet in the early morning, and"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_exporter_reads_a_real_pin_mode_engine(pin_engine: ServedPin) -> None:
    """On the session's shared pin engine (:mod:`pinsidecar.testing.fixtures`): 24 of its 64 experts are cold."""
    engine, map_path, label = pin_engine.engine, pin_engine.map_path, pin_engine.label
    generated = 0
    for prompt in PROMPTS:
        generated += engine.complete(prompt, max_tokens=16, ignore_eos=True)["usage"]["completion_tokens"]
    stats_path = engine.hook.stats_path
    assert stats_path is not None
    snap = request_stats(stats_path, "flush", alive=engine.alive)  # the counters after the traffic, written now
    assert snap.total_selections > 0, "the hook counted nothing"

    exp = Exporter(stats_path=stats_path, engine_url=engine.base_url, engine_pid=engine.pid, nvml=None)
    exp.on_state("ready")
    text = exp.render().decode()
    s = _samples(text)
    assert s[("pinsidecar_exporter_source_up", (("source", "stats"),))] == 1
    assert s[("pinsidecar_exporter_source_up", (("source", "engine"),))] == 1
    assert s[("pinsidecar_expert_selections_total", ())] == snap.total_selections
    assert s[("pinsidecar_expert_cold_selections_total", ())] == snap.total_cold_selections
    ratio = s[("pinsidecar_cold_selection_ratio", ())]
    assert 0 < ratio < 1  # 3/8 of the experts are cold under a random map
    for lid in snap.layer_ids:
        assert 0 <= s[("pinsidecar_layer_cold_selection_ratio", (("layer", str(lid)),))] <= 1
    assert s[("pinsidecar_engine_generation_tokens_total", ())] >= generated
    emap = load_map(map_path)
    assert s[("pinsidecar_engine_map_info", (("map_hash", emap.content_hash), ("map_label", label)))] == 1
    if snap.tier_bytes:
        assert s[("pinsidecar_expert_bytes", (("tier", "host"),))] == snap.tier_bytes["host"]
    if s.get(("pinsidecar_exporter_source_up", (("source", "cgroup"),))) == 1:
        assert s[("pinsidecar_engine_cgroup_memory_current_bytes", ())] > 0
    if shutil.which("promtool"):
        proc = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
        assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout.decode() + proc.stderr.decode()
