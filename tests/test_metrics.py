"""The exporter's collectors against fixture trees: cgroup files, /proc/<pid>/cgroup, a stats file, an engine
/metrics served over real HTTP, and a fake NVML. Plus: live inputs are read at scrape time, the real hook writer's
fallback is followed, promtool accepts the whole output, and a broken source only drops its own metrics (and is
logged once)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from pinsidecar.engine.ports import free_port
from pinsidecar.live_stats import StatsReader
from pinsidecar.metrics import Exporter
from pinsidecar.metrics.cgroup import cgroup_path_for_pid
from pinsidecar.metrics.daemon_state import ENGINE_STATES
from pinsidecar.metrics.gpu import GpuMemoryCollector
from pinsidecar.metrics.routing import RoutingTotals
from pinsidecar.testing.artifacts import make_map
from pinsidecar.testing.metrics import (
    FakeEngineMetrics,
    FakeNvml,
    LiveValue,
    make_stats,
    write_cgroup_tree,
    write_proc_cgroup,
)


@pytest.fixture
def engine() -> Iterator[FakeEngineMetrics]:
    with FakeEngineMetrics() as e:
        yield e


def make_cgroup(root: Path, rel: str = "system.slice/engine.scope", maxv: str = "68719476736") -> Path:
    return write_cgroup_tree(root / "cgroup", rel, max_value=maxv)


def make_proc(root: Path, pid: int, rel: str = "/system.slice/engine.scope") -> Path:
    return write_proc_cgroup(root / "proc", pid, rel)


stats = make_stats


def samples(exp: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(exp.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(exp_samples: dict, name: str, **labels: str) -> float:
    return exp_samples[(name, tuple(sorted(labels.items())))]


def names(exp_samples: dict) -> set[str]:
    return {n for n, _ in exp_samples}


def full_exporter(tmp_path: Path, engine: FakeEngineMetrics, **kw: Any) -> Exporter:
    """Every source present: engine pid 4242 (its cgroup tree), the stats file, the engine, a fake NVML."""
    make_cgroup(tmp_path)
    stats().save(tmp_path / "stats.json")
    args: dict[str, Any] = {"stats_path": tmp_path / "stats.json", "engine_url": engine.url, "engine_pid": 4242,
                            "cgroup_root": tmp_path / "cgroup", "proc_root": make_proc(tmp_path, 4242),
                            "nvml": FakeNvml(), "wall_clock": lambda: 1030.0}
    return Exporter(**(args | kw))


# ------------------------------------------------------------------------------------------------ collectors


def test_cgroup_memory_from_the_engine_pid(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine)
    s = samples(exp)
    assert value(s, "pinsidecar_engine_cgroup_memory_current_bytes") == 4294967296
    assert value(s, "pinsidecar_engine_cgroup_memory_max_bytes") == 68719476736
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="anon") == 1073741824
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="file") == 3221225472
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="shmem") == 2147483648
    assert ("pinsidecar_engine_cgroup_memory_stat_bytes", (("type", "kernel"),)) not in s
    assert value(s, "pinsidecar_exporter_source_up", source="cgroup") == 1


def test_cgroup_unlimited_max_is_left_out_and_no_pid_turns_the_source_off(tmp_path: Path) -> None:
    make_cgroup(tmp_path, maxv="max")
    pid: LiveValue[int] = LiveValue()
    exp = Exporter(engine_pid=pid, cgroup_root=tmp_path / "cgroup", proc_root=make_proc(tmp_path, 7), nvml=None)
    s = samples(exp)
    assert "pinsidecar_engine_cgroup_memory_current_bytes" not in names(s)
    assert ("pinsidecar_exporter_source_up", (("source", "cgroup"),)) not in s  # not configured is not down
    pid.value = 7  # the engine started: read at the next scrape, nobody tells the exporter
    s = samples(exp)
    assert "pinsidecar_engine_cgroup_memory_current_bytes" in names(s)
    assert "pinsidecar_engine_cgroup_memory_max_bytes" not in names(s)


def test_cgroup_from_a_container_id(tmp_path: Path) -> None:
    cid = "3f5a9c0e1b2d" + "0" * 52
    make_cgroup(tmp_path, rel=f"system.slice/docker-{cid}.scope")
    exp = Exporter(engine_container_id=cid[:12], cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                   nvml=None)
    assert value(samples(exp), "pinsidecar_engine_cgroup_memory_current_bytes") == 4294967296


def test_cgroup_v1_memory_controller_on_a_hybrid_host(tmp_path: Path) -> None:
    cg = tmp_path / "cgroup" / "memory" / "docker" / "abc"
    cg.mkdir(parents=True)
    (cg / "memory.usage_in_bytes").write_text("5000\n")
    (cg / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (cg / "memory.stat").write_text("cache 1\nrss 2\nshmem 3\ntotal_cache 300\ntotal_rss 200\ntotal_shmem 100\n")
    proc = tmp_path / "proc" / "8"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    exp = Exporter(engine_pid=8, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc", nvml=None)
    s = samples(exp)
    assert value(s, "pinsidecar_engine_cgroup_memory_current_bytes") == 5000
    assert "pinsidecar_engine_cgroup_memory_max_bytes" not in names(s)
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="anon") == 200
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="file") == 300
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="shmem") == 100
    (cg / "memory.limit_in_bytes").write_text("1073741824\n")
    assert value(samples(exp), "pinsidecar_engine_cgroup_memory_max_bytes") == 1073741824


def test_cgroup_memory_of_a_real_process_on_this_host() -> None:
    exp = Exporter(engine_pid=os.getpid(), nvml=None)
    s = samples(exp)
    if value(s, "pinsidecar_exporter_source_up", source="cgroup") == 0:
        pytest.skip("this host exposes no readable memory cgroup for our process")
    assert value(s, "pinsidecar_engine_cgroup_memory_current_bytes") > 0
    assert value(s, "pinsidecar_engine_cgroup_memory_stat_bytes", type="anon") > 0


def test_cgroup_path_for_pid_rejects_a_v1_only_host(tmp_path: Path) -> None:
    d = tmp_path / "proc" / "9"
    d.mkdir(parents=True)
    (d / "cgroup").write_text("4:memory:/a\n")
    with pytest.raises(ValueError, match="cgroup v1"):
        cgroup_path_for_pid(9, proc_root=tmp_path / "proc", cgroup_root=tmp_path)
    assert cgroup_path_for_pid(1, proc_root=Path("/proc")).is_dir()  # the real thing parses too


def test_engine_pid_gone_drops_cgroup_metrics_logged_once(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine, engine_pid=999999)
    with capture_logs() as logs:
        for _ in range(3):
            s = samples(exp)
    assert "pinsidecar_engine_cgroup_memory_current_bytes" not in names(s)
    assert value(s, "pinsidecar_exporter_source_up", source="cgroup") == 0
    assert "pinsidecar_expert_selections_total" in names(s)  # the others still export
    cg_logs = [e for e in logs if e.get("source") == "cgroup"]
    assert len(cg_logs) == 1 and "999999" in cg_logs[0]["reason"]


def test_stats_ratios_counters_tiers_and_errors(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    s = samples(full_exporter(tmp_path, engine))
    assert value(s, "pinsidecar_expert_selections_total") == 300
    assert value(s, "pinsidecar_expert_cold_selections_total") == 12
    assert value(s, "pinsidecar_cold_selection_ratio") == pytest.approx(12 / 300)
    assert value(s, "pinsidecar_layer_cold_selection_ratio", layer="0") == pytest.approx(0.02)
    assert value(s, "pinsidecar_layer_cold_selection_ratio", layer="3") == pytest.approx(0.05)
    assert value(s, "pinsidecar_layer_expert_selections_total", layer="3") == 200
    assert value(s, "pinsidecar_layer_expert_cold_selections_total", layer="3") == 10
    assert value(s, "pinsidecar_expert_bytes", tier="hbm") == 6 * 2**20
    assert value(s, "pinsidecar_expert_bytes", tier="host") == 2 * 2**20
    assert value(s, "pinsidecar_hook_errors_total", kind="stats_write") == 1
    assert value(s, "pinsidecar_stats_age_seconds") == 30.0
    assert value(s, "pinsidecar_engine_map_info", map_hash="sha256:feed", map_label="code") == 1
    assert "pinsidecar_tensor_parallel_ranks" not in names(s)  # the stats do not say


def test_tensor_parallel_ranks_are_exported_beside_one_rank_s_bytes(tmp_path: Path,
                                                                     engine: FakeEngineMetrics) -> None:
    import dataclasses

    exp = full_exporter(tmp_path, engine)
    dataclasses.replace(stats(), meta={"tp_size": 2}).save(tmp_path / "stats.json")
    s = samples(exp)
    assert value(s, "pinsidecar_tensor_parallel_ranks") == 2
    assert value(s, "pinsidecar_expert_bytes", tier="hbm") == 6 * 2**20  # one rank's


def test_routing_totals_stay_monotonic_over_engine_restarts_and_resets(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    reader, totals = StatsReader(path, use_fallback=False), RoutingTotals()

    def fold(snap: Any) -> None:
        snap.save(path)
        reading = reader.read()
        assert reading is not None
        totals.add(reading)

    fold(stats("b1", 1, (10, 20), (1, 2)))
    fold(stats("b1", 2, (100, 200), (2, 10)))
    assert sum(totals.selections.values()) == 300 and totals.restarts == 0
    fold(stats("b2", 1, (5, 5), (1, 1)))  # engine rebooted: counters restarted
    assert totals.selections == {0: 105, 3: 205}
    assert totals.cold_selections == {0: 3, 3: 11}
    fold(stats("b2", 2, (1, 1), (0, 0), errors={}))  # hook reset within one boot; errors never go negative
    assert totals.selections == {0: 106, 3: 206}
    assert totals.errors == {"stats_write": 2}
    assert totals.restarts == 1 and totals.resets == 1
    fold(stats("b2", 2, (1, 1), (0, 0), errors={}))  # no new write: nothing added
    assert totals.selections == {0: 106, 3: 206}


def test_stats_file_rewritten_by_a_new_boot_keeps_counters_monotonic(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine)
    assert value(samples(exp), "pinsidecar_expert_selections_total") == 300
    stats("b2", 1, (7, 3), (0, 1)).save(tmp_path / "stats.json")
    s = samples(exp)
    assert value(s, "pinsidecar_expert_selections_total") == 310
    assert value(s, "pinsidecar_cold_selection_ratio") == pytest.approx(1 / 10)  # since this boot


def test_corrupt_stats_file_is_local_and_logged_once(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine)
    (tmp_path / "stats.json").write_text('{"format": "pinsidecar.stats", "version": 1, "boot_id": "x"')
    with capture_logs() as logs:
        for _ in range(3):
            s = samples(exp)
    assert "pinsidecar_expert_selections_total" not in names(s)
    assert value(s, "pinsidecar_exporter_source_up", source="stats") == 0
    assert "pinsidecar_engine_cgroup_memory_current_bytes" in names(s)
    assert "pinsidecar_engine_generation_tokens_total" in names(s)
    stat_logs = [e for e in logs if e.get("source") == "stats"]
    assert len(stat_logs) == 1 and "stats.json" in stat_logs[0]["reason"]
    stats("b1", 2, (200, 200), (4, 4)).save(tmp_path / "stats.json")
    with capture_logs() as logs:
        s = samples(exp)
    assert value(s, "pinsidecar_exporter_source_up", source="stats") == 1
    assert [e["event"] for e in logs] == ["metrics source recovered"]


def test_engine_tokens_raw_and_rate_between_scrapes(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    now = [100.0]
    exp = full_exporter(tmp_path, engine, clock=lambda: now[0])
    s = samples(exp)
    assert value(s, "pinsidecar_engine_generation_tokens_total") == 1000
    assert "pinsidecar_engine_generation_tokens_per_second" not in names(s)  # one scrape has no rate
    assert value(s, "pinsidecar_engine_requests_running") == 3
    assert value(s, "pinsidecar_engine_requests_waiting") == 1
    assert value(s, "pinsidecar_engine_kv_cache_usage_ratio") == 0.25
    engine.tokens, now[0] = 1500.0, 110.0
    assert value(samples(exp), "pinsidecar_engine_generation_tokens_per_second") == pytest.approx(50.0)
    engine.tokens, now[0] = 1510.0, 110.2  # too soon: keep the last rate
    assert value(samples(exp), "pinsidecar_engine_generation_tokens_per_second") == pytest.approx(50.0)
    engine.tokens, now[0] = 40.0, 120.0  # engine restarted: the counter went down
    assert value(samples(exp), "pinsidecar_engine_generation_tokens_per_second") == pytest.approx(4.0)


def test_engine_unreachable_or_erroring_drops_engine_metrics(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    url = LiveValue(engine.url)
    exp = full_exporter(tmp_path, engine, engine_url=url)
    engine.status = 500
    with capture_logs() as logs:
        s = samples(exp)
        samples(exp)
    assert "pinsidecar_engine_generation_tokens_total" not in names(s)
    assert value(s, "pinsidecar_exporter_source_up", source="engine") == 0
    assert len([e for e in logs if e.get("source") == "engine"]) == 1
    url.value = f"http://127.0.0.1:{free_port()}"  # the engine moved (nothing listens there)
    s = samples(exp)
    assert value(s, "pinsidecar_exporter_source_up", source="engine") == 0
    assert "pinsidecar_host_memory_total_bytes" in names(s)


def test_gpu_memory_per_gpu_from_a_fake_nvml(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    s = samples(full_exporter(tmp_path, engine))
    assert value(s, "pinsidecar_gpu_memory_used_bytes", gpu="1", uuid="GPU-fake-1") == 20_000_000_000
    assert value(s, "pinsidecar_gpu_memory_total_bytes", gpu="0", uuid="GPU-fake-0") == 150_000_000_000
    assert value(s, "pinsidecar_exporter_source_up", source="gpu") == 1


def test_nvml_missing_means_absent_metrics_and_one_log_line() -> None:
    def no_nvml() -> Any:
        raise OSError("NVML Shared Library Not Found")

    gpu = GpuMemoryCollector(loader=no_nvml)
    with capture_logs() as logs:
        for _ in range(4):
            assert list(gpu.collect()) == []
    assert len(logs) == 1
    assert "NVML Shared Library Not Found" in logs[0]["reason"]


def _real_nvml_gpus() -> int | None:
    """GPUs the real NVML sees here, or None when it cannot start (no driver: every CI and development box)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def test_the_real_nvml_gives_gpu_metrics_where_it_runs_and_none_elsewhere() -> None:
    # The exporter's real pynvml loader on whatever machine this runs: without a driver (CI) the GPU metrics are
    # absent and the scrape still succeeds; on a GPU host (the lent H200) they are there, one series per GPU.
    exp = Exporter()
    s = samples(exp)
    gpus = _real_nvml_gpus()
    assert "pinsidecar_host_memory_total_bytes" in names(s)
    if not gpus:
        assert "pinsidecar_gpu_memory_used_bytes" not in names(s)
        return
    used = [v for (n, _), v in s.items() if n == "pinsidecar_gpu_memory_used_bytes"]
    total = [v for (n, _), v in s.items() if n == "pinsidecar_gpu_memory_total_bytes"]
    assert len(used) == len(total) == gpus and all(t > 0 for t in total)


def test_nvml_query_failure_is_local(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine)
    exp.gpu._nvml = FakeNvml(fail_query=True)
    s = samples(exp)
    assert "pinsidecar_gpu_memory_used_bytes" not in names(s)
    assert value(s, "pinsidecar_exporter_source_up", source="gpu") == 0
    assert "pinsidecar_expert_selections_total" in names(s)


def test_host_memory_from_psutil(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    s = samples(full_exporter(tmp_path, engine))
    assert value(s, "pinsidecar_host_memory_total_bytes") == psutil.virtual_memory().total
    assert 0 < value(s, "pinsidecar_host_memory_available_bytes") <= psutil.virtual_memory().total


def test_live_inputs_are_read_at_every_scrape(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    from pinsidecar.daemon.gate import Gate

    pid, gate = LiveValue(4242), LiveValue[Gate]()
    exp = full_exporter(tmp_path, engine, engine_pid=pid, gate=gate)
    s = samples(exp)
    assert value(s, "pinsidecar_engine_cgroup_memory_current_bytes") == 4294967296
    assert "pinsidecar_gate_holding" not in names(s)  # no gate configured: nothing, not zeros
    write_cgroup_tree(tmp_path / "cgroup", "system.slice/engine2.scope", current=123)
    make_proc(tmp_path, 5151, "/system.slice/engine2.scope")
    pid.value = 5151  # the engine restarted as another process, in another cgroup
    gate.value = Gate("127.0.0.1", 0, "http://127.0.0.1:1")
    s = samples(exp)
    assert value(s, "pinsidecar_engine_cgroup_memory_current_bytes") == 123
    assert value(s, "pinsidecar_gate_holding") == 0
    pid.value = None  # stopped: the source is off, not down
    assert ("pinsidecar_exporter_source_up", (("source", "cgroup"),)) not in samples(exp)


def test_a_collector_that_raises_is_left_out_and_logged_once(tmp_path: Path, engine: FakeEngineMetrics,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    exp = full_exporter(tmp_path, engine)

    def broken() -> Any:
        raise ZeroDivisionError("a bug, not an OSError")

    monkeypatch.setattr(exp.host, "_virtual_memory", broken)
    with capture_logs() as logs:
        for _ in range(3):
            s = samples(exp)
    assert value(s, "pinsidecar_exporter_source_up", source="host") == 0
    assert "pinsidecar_host_memory_total_bytes" not in names(s)
    assert value(s, "pinsidecar_expert_selections_total") == 300
    assert len([e for e in logs if e.get("source") == "host"]) == 1


def test_stats_in_the_fallback_file_and_two_readers_of_one_file(tmp_path: Path) -> None:
    from pinsidecar_hook.contract import fallback_stats_path

    configured = tmp_path / "stats.json"
    fallback = fallback_stats_path(configured)
    try:
        stats("b1", 1, errors={"stats_write": 3}).save(fallback)
        first, second = Exporter(stats_path=configured, nvml=None), Exporter(stats_path=configured, nvml=None)
        for exp in (first, second, first):  # each exporter's reader keeps its own previous reading
            s = samples(exp)
            assert value(s, "pinsidecar_exporter_source_up", source="stats") == 1
            assert value(s, "pinsidecar_expert_selections_total") == 300
            assert value(s, "pinsidecar_hook_errors_total", kind="stats_write") == 3
    finally:
        fallback.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ the real hook


def _hook_stats_writer(tmp_path: Path, stats_path: Path) -> tuple[Any, Any]:
    """Pin mode's real stats writer (its :class:`PinState` as the source of the hook's flusher) over real counter
    tensors, the ones the split invoke fills, without an engine: two MoE layers of 8 experts, 6 hot.
    Returns (flusher, pin state)."""
    import torch
    from pinsidecar_hook.contract import load_map
    from pinsidecar_hook.contract.env import HookConfig
    from pinsidecar_hook.pin import LayerPin, PinState

    from pinsidecar.testing.artifacts import write_map

    map_path = write_map(tmp_path / "map.json", num_layers=2, num_experts=8, hot_rows=6, top_k=2, label="t")
    layers = [LayerPin(layer_id=lid, name=f"layers.{lid}", row_map=torch.arange(8, dtype=torch.int32), hot_rows=6,
                       cold_rows=2, hot={}, cold={}, expert_counts=torch.zeros(8, dtype=torch.int64),
                       cold_counts=torch.zeros(1, dtype=torch.int64), token_counts=torch.zeros(1, dtype=torch.int64))
              for lid in (0, 1)]
    cfg = HookConfig(mode="pin", map_path=map_path, stats_path=stats_path, flush_interval_s=60.0)
    state = PinState(emap=load_map(map_path), layers=layers, backend="cpu", rank=0, tp_size=1, cfg=cfg,
                     summary={"tier_bytes": {"hbm": 6 * 1024, "host": 2 * 1024}, "peak_extra_total_bytes": 0})
    return state.make_flusher(), state


def _route(state: Any, tokens: int) -> None:
    """``tokens`` tokens through every layer, top-2: one selection on hot expert 0, one on cold expert 7."""
    for layer in state.layers:
        layer.expert_counts[0] += tokens
        layer.expert_counts[7] += tokens
        layer.cold_counts += tokens
        layer.token_counts += tokens


def test_exporter_exports_the_hooks_stats_write_error_when_the_hook_falls_back(tmp_path: Path) -> None:
    from pinsidecar_hook.contract import fallback_stats_path

    blocker = tmp_path / "not-a-dir"  # a file where the stats directory should be: unwritable even for root
    blocker.write_text("")
    stats_path = blocker / "stats.json"
    fallback = fallback_stats_path(stats_path)
    fallback.unlink(missing_ok=True)
    writer, state = _hook_stats_writer(tmp_path, stats_path)
    try:
        _route(state, 5)
        assert writer.flush() == fallback  # the hook could not write its path, and fell back
        exp = Exporter(stats_path=stats_path, nvml=None)
        s = samples(exp)
        assert value(s, "pinsidecar_exporter_source_up", source="stats") == 1
        assert value(s, "pinsidecar_hook_errors_total", kind="stats_write") == 1
        assert value(s, "pinsidecar_expert_selections_total") == 2 * 5 * 2
        assert value(s, "pinsidecar_expert_cold_selections_total") == 2 * 5
        assert value(s, "pinsidecar_layer_expert_cold_selections_total", layer="1") == 5
        assert value(s, "pinsidecar_cold_selection_ratio") == pytest.approx(0.5)
        _route(state, 3)
        writer.flush()
        s = samples(exp)
        assert value(s, "pinsidecar_hook_errors_total", kind="stats_write") == 2
        assert value(s, "pinsidecar_expert_cold_selections_total") == 2 * 8
    finally:
        fallback.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ daemon state


def test_engine_state_is_an_enum_gauge() -> None:
    exp = Exporter(nvml=None)
    exp.on_state("draining")
    s = samples(exp)
    assert [st for st in ENGINE_STATES if value(s, "pinsidecar_engine_state", state=st) == 1] == ["draining"]
    with pytest.raises(ValueError, match="unknown engine state 'bogus'"):
        exp.on_state("bogus")


def test_boots_map_and_remaps(tmp_path: Path) -> None:
    exp = Exporter(nvml=None, wall_clock=lambda: 1_800_000_000.0)
    exp.on_boot(reason="start", seconds=21.5, map_hash="sha256:aa", cache_miss=False)
    exp.on_boot(reason="drain-reboot", seconds=95.0, map_hash="sha256:bb", cache_miss=True)
    emap = dataclasses.replace(make_map(label="code"), created_at="2027-01-15T07:00:00Z", predicted_cold_rate=0.0155)
    exp.on_map(emap)
    exp.record_remap("activated")
    exp.record_remap("activated")
    exp.record_remap("rejected_worse")
    s = samples(exp)
    assert value(s, "pinsidecar_engine_boots_total", reason="start") == 1
    assert value(s, "pinsidecar_engine_boots_total", reason="drain-reboot") == 1
    assert value(s, "pinsidecar_engine_boot_cache_misses_total") == 1
    assert value(s, "pinsidecar_engine_boot_duration_seconds_bucket", le="30.0") == 1
    assert value(s, "pinsidecar_engine_boot_duration_seconds_bucket", le="120.0") == 2
    assert value(s, "pinsidecar_engine_boot_duration_seconds_sum") == 116.5
    assert value(s, "pinsidecar_engine_last_boot_duration_seconds") == 95.0
    assert value(s, "pinsidecar_engine_last_boot_info", reason="drain-reboot", map_hash="sha256:bb",
                 cache_miss="true") == 1
    assert value(s, "pinsidecar_map_info", hash=emap.content_hash, label="code") == 1
    assert value(s, "pinsidecar_map_created_timestamp_seconds") == 1_800_000_000.0 - 3600
    assert value(s, "pinsidecar_map_age_seconds") == 3600
    assert value(s, "pinsidecar_map_predicted_cold_selection_ratio") == 0.0155
    assert value(s, "pinsidecar_remaps_total", outcome="activated") == 2
    assert value(s, "pinsidecar_remaps_total", outcome="rejected_worse") == 1
    with pytest.raises(ValueError, match="boot seconds"):
        exp.on_boot(reason="start", seconds=-1.0, map_hash="", cache_miss=False)


# ------------------------------------------------------------------------------------------------ exposition


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_metrics_is_clean(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    from pinsidecar.daemon.gate import Gate

    exp = full_exporter(tmp_path, engine, gate=Gate("127.0.0.1", 0, "http://127.0.0.1:1"))
    exp.on_state("ready")
    exp.on_boot(reason="start", seconds=12.0, map_hash="sha256:aa", cache_miss=False)
    exp.on_map(make_map(label="code"))
    exp.record_remap("activated")
    samples(exp)
    engine.tokens = 2000.0
    text = exp.render()
    assert b"pinsidecar_gpu_memory_used_bytes" in text and b"pinsidecar_gate_requests_total" in text
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.strip() == b"" and proc.stderr.strip() == b"", "promtool lint warnings"


def test_http_endpoint_serves_the_registry(tmp_path: Path, engine: FakeEngineMetrics) -> None:
    exp = full_exporter(tmp_path, engine)
    port = free_port()
    exp.start_http("127.0.0.1", port)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 200
        assert "pinsidecar_cold_selection_ratio" in r.text
        assert "pinsidecar_process_resident_memory_bytes" in r.text
    finally:
        exp.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
