"""The cache tier's metrics, dashboard panel and status line, from the hook's stats file, without an engine: the
counters, the slots and the hit ratio as scraped; a lane with no cache (slots 0, counters 0, no ratio); totals that
stay monotonic over engine restarts, resets and boots without a cache; the dashboard's PromQL hit rate evaluated
by promtool; ``pinsidecar status``: the daemon's status and the CLI's line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pinsidecar_hook.contract import StatsSnapshot
from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.live_stats import StatsReader
from pinsidecar.metrics import Exporter
from pinsidecar.metrics.cache import CacheTotals, cache_status
from pinsidecar.testing.metrics import make_stats

DASHBOARD = Path(__file__).resolve().parent.parent / "grafana" / "pinsidecar-dashboard.json"


def _promtool() -> str:
    """promtool, from Debian's prometheus package (.ci/run installs it): missing, the test fails, not skips."""
    path = shutil.which("promtool")
    assert path, "promtool is missing: install Debian's prometheus package (apt install prometheus)"
    return path

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def cached(boot: str = "b1", seq: int = 1, sel: tuple[int, int] = (100, 200), cold: tuple[int, int] = (2, 10),
           hits: tuple[int, int] = (30, 50), fills: tuple[int, int] = (2, 10), evictions: tuple[int, int] = (1, 4),
           slots: int = 4, policy: str = "lfu") -> StatsSnapshot:
    """make_stats' two layers (ids 0 and 3) with a cache tier: ``cold`` are the misses."""
    return dataclasses.replace(make_stats(boot, seq, sel, cold), cache={
        "slots": slots, "policy": policy, "hits": list(hits), "fills": list(fills), "evictions": list(evictions)})


def samples(exp: Exporter) -> Samples:
    out = {}
    for fam in text_string_to_metric_families(exp.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(s: Samples, name: str, **labels: str) -> float:
    return s[(name, tuple(sorted(labels.items())))]


def names(s: Samples) -> set[str]:
    return {n for n, _ in s}


def scrape(path: Path, snap: StatsSnapshot, exp: Exporter) -> Samples:
    snap.save(path)
    return samples(exp)


# ------------------------------------------------------------------------------------------------ exporter


def test_cache_counters_slots_and_hit_ratio_are_exported(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    exp = Exporter(stats_path=path, nvml=None, process_metrics=False)
    s = scrape(path, cached(), exp)
    assert value(s, "pinsidecar_exporter_source_up", source="stats") == 1
    assert value(s, "pinsidecar_cache_hits_total") == 80
    assert value(s, "pinsidecar_cache_fills_total") == 12
    assert value(s, "pinsidecar_cache_evictions_total") == 5
    assert value(s, "pinsidecar_layer_cache_hits_total", layer="0") == 30
    assert value(s, "pinsidecar_layer_cache_hits_total", layer="3") == 50
    assert value(s, "pinsidecar_layer_cache_fills_total", layer="3") == 10
    assert value(s, "pinsidecar_layer_cache_evictions_total", layer="0") == 1
    assert value(s, "pinsidecar_cache_slots") == 4
    # hits / (hits + misses), the misses being the cold selections (hot-row selections are in neither)
    assert value(s, "pinsidecar_cache_hit_ratio") == pytest.approx(80 / (80 + 12))
    assert value(s, "pinsidecar_expert_cold_selections_total") == 12  # the misses, as before


def test_without_a_cache_slots_are_0_counters_0_and_no_ratio(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    exp = Exporter(stats_path=path, nvml=None, process_metrics=False)
    s = scrape(path, make_stats(), exp)
    assert value(s, "pinsidecar_expert_selections_total") == 300  # the stats were read
    assert value(s, "pinsidecar_cache_slots") == 0
    for key in ("hits", "fills", "evictions"):
        assert value(s, f"pinsidecar_cache_{key}_total") == 0
        assert not any(n == f"pinsidecar_layer_cache_{key}_total" for n, _ in s)  # no per-layer zeros
    assert "pinsidecar_cache_hit_ratio" not in names(s)  # a ratio of no cache is unknown, not 0


def test_hit_ratio_is_absent_before_any_slot_or_miss_and_the_stats_without_traffic(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    exp = Exporter(stats_path=path, nvml=None, process_metrics=False)
    s = scrape(path, cached(sel=(0, 0), cold=(0, 0), hits=(0, 0), fills=(0, 0), evictions=(0, 0)), exp)
    assert value(s, "pinsidecar_cache_slots") == 4 and value(s, "pinsidecar_cache_hits_total") == 0
    assert "pinsidecar_cache_hit_ratio" not in names(s)
    s = scrape(path, cached(seq=2, sel=(10, 10), cold=(0, 0), hits=(10, 5), fills=(0, 0), evictions=(0, 0)), exp)
    assert value(s, "pinsidecar_cache_hit_ratio") == 1.0


def test_cache_totals_stay_monotonic_over_restarts_resets_and_boots_without_a_cache(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    exp = Exporter(stats_path=path, nvml=None, process_metrics=False)
    s = scrape(path, cached("b1", 1, hits=(30, 50), fills=(2, 10), evictions=(1, 4)), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 80
    s = scrape(path, cached("b1", 2, sel=(150, 260), cold=(4, 20), hits=(40, 70), fills=(4, 20),
                            evictions=(3, 16)), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 110
    assert value(s, "pinsidecar_cache_fills_total") == 24 and value(s, "pinsidecar_cache_evictions_total") == 19
    assert value(s, "pinsidecar_layer_cache_hits_total", layer="3") == 70
    s = scrape(path, cached("b1", 2, sel=(150, 260), cold=(4, 20), hits=(40, 70), fills=(4, 20),
                            evictions=(3, 16)), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 110  # no new write: nothing added
    # the engine restarted: its counters began again from zero (and passed the old values since); ours go on
    s = scrape(path, cached("b2", 1, sel=(100, 200), cold=(1, 1), hits=(45, 75), fills=(1, 1), evictions=(0, 0),
                            slots=8, policy="lru"), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 230
    assert value(s, "pinsidecar_cache_fills_total") == 26 and value(s, "pinsidecar_cache_evictions_total") == 19
    assert value(s, "pinsidecar_layer_cache_hits_total", layer="0") == 85
    assert value(s, "pinsidecar_cache_slots") == 8  # the new boot's map
    assert value(s, "pinsidecar_cache_hit_ratio") == pytest.approx(120 / 122)  # since this boot
    # a reset within the boot (layer 0's selections went down): the new values are the delta, in every layer
    s = scrape(path, cached("b2", 2, sel=(4, 300), cold=(1, 0), hits=(1, 100), fills=(1, 0), evictions=(0, 0)), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 331
    assert value(s, "pinsidecar_cache_fills_total") == 27
    # a boot with a map without a cache: slots 0, the totals stay (flat), no ratio
    s = scrape(path, make_stats("b3", 1, (50, 50), (5, 5)), exp)
    assert value(s, "pinsidecar_cache_slots") == 0
    assert value(s, "pinsidecar_cache_hits_total") == 331
    assert value(s, "pinsidecar_layer_cache_hits_total", layer="0") == 86
    assert "pinsidecar_cache_hit_ratio" not in names(s)
    # and a cache again: counted from that boot's values, on top
    s = scrape(path, cached("b4", 1, hits=(7, 0), fills=(2, 0), evictions=(0, 0)), exp)
    assert value(s, "pinsidecar_cache_hits_total") == 338
    assert value(s, "pinsidecar_cache_fills_total") == 29


def test_a_cache_counter_that_goes_down_within_a_boot_is_never_negative(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    reader, totals = StatsReader(path, use_fallback=False), CacheTotals()

    def fold(snap: StatsSnapshot) -> None:
        snap.save(path)
        reading = reader.read()
        assert reading is not None
        totals.add(reading)

    fold(cached("b1", 1, hits=(30, 50)))
    # same boot, selections up (no reset seen by the reader), but layer 0's hits went down: counted from 0 again
    fold(cached("b1", 2, sel=(120, 220), hits=(4, 60)))
    assert totals.hits == {0: 34, 3: 60}
    assert all(v >= 0 for d in totals.copy().values() for v in d.values())


def test_promtool_lints_the_cache_metrics(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    exp = Exporter(stats_path=path, nvml=None, process_metrics=False)
    cached().save(path)
    text = exp.render()
    assert b"pinsidecar_cache_hits_total 80.0" in text
    proc = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------ dashboard


def cache_panel() -> dict[str, Any]:
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == "Cache tier"]
    assert len(panels) == 1
    return panels[0]


def test_cache_panel_draws_the_rates_and_the_slot_hit_rate_of_exported_metrics(tmp_path: Path) -> None:
    panel = cache_panel()
    exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    for key in ("hits", "fills", "evictions"):
        assert f"rate(pinsidecar_cache_{key}_total{{" in exprs[f"{key} / s"]
    hit = exprs["slot hit rate {{instance}}"]
    assert "pinsidecar_cache_hits_total" in hit and "pinsidecar_expert_cold_selections_total" in hit
    assert "pinsidecar_cache_slots" in hit
    # every metric the panel reads is exported, with a cache and without one (the grafana tests' fixture has none)
    for i, snap in enumerate((cached(), make_stats())):
        path = tmp_path / f"stats{i}.json"
        exported = names(scrape(path, snap, Exporter(stats_path=path, nvml=None, process_metrics=False)))
        for expr in exprs.values():
            for name in re.findall(r"\b(pinsidecar_[a-zA-Z0-9_]*)", expr):
                assert name in exported, f"{name} not exported ({'no ' if snap.cache is None else ''}cache)"


def test_the_dashboards_hit_rate_is_hits_over_hits_plus_misses_and_absent_without_slots(tmp_path: Path) -> None:
    """The panel's own PromQL, evaluated by promtool over two sidecars: one with a cache (hits +45/min, cold
    +15/min: 75 %), one without (slots 0: no hit rate drawn, not 0 %)."""
    exprs = {t["refId"]: t["expr"] for t in cache_panel()["targets"]}

    def q(expr: str) -> str:
        return expr.replace("$instance", ".*").replace("$__rate_interval", "5m")

    series = [
        ('pinsidecar_cache_hits_total{instance="a", job="p"}', "0+45x20"),
        ('pinsidecar_expert_cold_selections_total{instance="a", job="p"}', "0+15x20"),
        ('pinsidecar_cache_fills_total{instance="a", job="p"}', "0+6x20"),
        ('pinsidecar_cache_evictions_total{instance="a", job="p"}', "0+3x20"),
        ('pinsidecar_cache_slots{instance="a", job="p"}', "8x20"),
        ('pinsidecar_cache_hits_total{instance="b", job="p"}', "0x20"),
        ('pinsidecar_expert_cold_selections_total{instance="b", job="p"}', "0+50x20"),
        ('pinsidecar_cache_fills_total{instance="b", job="p"}', "0x20"),
        ('pinsidecar_cache_evictions_total{instance="b", job="p"}', "0x20"),
        ('pinsidecar_cache_slots{instance="b", job="p"}', "0x20"),
    ]
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "promql_expr_test": [
            {"expr": q(exprs["D"]), "eval_time": "15m", "exp_samples": [{"labels": '{instance="a"}', "value": 0.75}]},
            {"expr": q(exprs["A"]), "eval_time": "15m", "exp_samples": [{"labels": "{}", "value": 0.75}]},
            {"expr": q(exprs["B"]), "eval_time": "15m", "exp_samples": [{"labels": "{}", "value": 0.1}]},
            {"expr": q(exprs["C"]), "eval_time": "15m", "exp_samples": [{"labels": "{}", "value": 0.05}]},
        ],
    }]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    proc = subprocess.run([_promtool(), "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------ status


def test_cache_status_of_a_snapshot() -> None:
    assert cache_status(make_stats()) is None
    st = cache_status(cached())
    assert st == {"slots": 4, "policy": "lfu", "hits": 80, "misses": 12, "fills": 12, "evictions": 5,
                  "hit_ratio": pytest.approx(80 / 92)}
    assert cache_status(cached(sel=(0, 0), cold=(0, 0), hits=(0, 0), fills=(0, 0), evictions=(0, 0)))[
        "hit_ratio"] is None


def test_status_line_shows_slots_policy_and_hit_rate() -> None:
    from pinsidecar.cli.daemon import _fmt_status

    pin = {"backend": "triton_experts", "backend_verified": True, "cache": cache_status(cached())}
    st: dict[str, Any] = {"engine": {"state": "ready"}, "maps": {"entries": [], "dir": "/m"}, "daemon": {}, "pin": pin}
    text = _fmt_status(st)
    assert ("cache    4 slots per layer, lfu: hit rate 87.0 % since boot (80 hits, 12 misses; 12 fills, "
            "5 evictions)") in text
    st["pin"]["cache"] = cache_status(cached(sel=(0, 0), cold=(0, 0), hits=(0, 0), fills=(0, 0), evictions=(0, 0)))
    assert "cache    4 slots per layer, lfu: no selection has reached a slot or host memory since boot" in \
        _fmt_status(st)
    st["pin"]["cache"] = None
    assert "cache " not in _fmt_status(st)


def test_the_daemons_status_reports_the_cache_from_the_engines_stats_file(tmp_path: Path) -> None:
    from pinsidecar.daemon.status_view import pin_status

    stats = tmp_path / "stats.json"
    cached(slots=16, policy="lru").save(stats)
    c = pin_status(stats, "pin")["cache"]  # type: ignore[index]
    assert (c["slots"], c["policy"], c["hits"], c["misses"], c["fills"], c["evictions"]) == (16, "lru", 80, 12, 12, 5)
    assert c["hit_ratio"] == pytest.approx(80 / 92)
    make_stats().save(stats)
    assert pin_status(stats, "pin")["cache"] is None  # type: ignore[index]
    assert pin_status(stats, "count") is None  # the split is pin mode's
