"""Bad inputs from the daemon's sources: a stats file that stops updating, one that goes backwards (an engine
restart), one that is corrupt; the cgroup files unreadable. What the exporter, the drift watch and ``status`` say.

The daemon runs in-process on the demo geometry (InstantEngine: the "engine" is this process, always ready), and
the test writes the hook's stats file itself (:class:`~pinsidecar.testing.remap.FakeHookStats`, or bytes for a
corrupt one), then calls the daemon's own ``watch_tick`` and renders its exporter. The drift watch's timer is
slowed to an hour so that only the test's ticks read the file. NVML absent and Prometheus absent are covered in
test_metrics.py and test_alert_chain.py (the table in docs/reliability.md names them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pinsidecar.cli.daemon import _fmt_drift_and_remap as status_lines
from pinsidecar.daemon.config import load_config
from pinsidecar.daemon.service import Daemon
from pinsidecar.engine import free_port
from pinsidecar.metrics import Exporter
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import counts_path_for
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.metrics import write_cgroup_tree, write_proc_cgroup
from pinsidecar.testing.remap import FakeHookStats, InstantEngine

CODE = 0
TICK_S = 1.0  # the test's own ticks: monotonic seconds passed to watch_tick


def _config(tmp: Path) -> Path:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    counts = make_counts(tokens=4000, domain=CODE, seed=1, workload="code")
    boot_map = tmp / "boot" / "code.json"
    boot_map.parent.mkdir()
    counts.save(counts_path_for(boot_map))
    build_usage_map([counts], 48, label="code").save(boot_map)
    ports: list[int] = []
    for _ in range(4):
        ports.append(free_port(ports[-1] + 1) if ports else free_port())
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model}"
port = {ports[0]}
hook_mode = "pin"
map = "{boot_map}"
[gate]
port = {ports[1]}
[control]
port = {ports[2]}
token_file = "{tmp}/token"
create_token = true
[metrics]
port = {ports[3]}
nvml = false
[maps]
dir = "{tmp}/maps"
watch = false
[daemon]
state_dir = "{tmp}/state"
[drift]
window_tokens = 800
min_tokens = 400
max_window_s = 30
consecutive_windows = 1
cooldown_s = 0
[remap]
watch_interval_s = 3600
""")
    return cfg


class Lane:
    """The daemon, its hook's stats file, and the test's monotonic "now" for the drift watch."""

    def __init__(self, daemon: Daemon, tmp: Path) -> None:
        self.daemon = daemon
        self.now = 0.0
        self.stats_path = tmp / "state" / "stats.json"

        def served() -> tuple[Any, Any, str]:
            sup = daemon.supervisor
            assert sup is not None and sup.map is not None
            return self.boot, sup.map.hot_mask(), sup.map.content_hash

        self.boot = 1
        self.hook = FakeHookStats(self.stats_path, served)
        assert daemon.watch is not None
        daemon.watch.clock = lambda: self.now  # status reads the watch at the test's time, as the ticks do

    async def tick(self, tokens: int = 0) -> list[Any]:
        """``tokens`` of code traffic served (then one stats write) unless 0; one look by the watch."""
        if tokens:
            self.hook.add(CODE, tokens)
        self.now += TICK_S
        return await self.daemon.drift.tick(self.now)

    @property
    def drift(self) -> dict[str, Any]:
        st = self.daemon.status()["drift"]
        assert st is not None
        return st

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        exp = self.daemon.exporter
        assert exp is not None
        out = {}
        for fam in text_string_to_metric_families(exp.render().decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


@asynccontextmanager
async def lane(tmp: Path) -> AsyncIterator[Lane]:
    daemon = Daemon(load_config(_config(tmp)), launcher_factory=InstantEngine)
    await daemon.start()
    try:
        for _ in range(200):
            if daemon.supervisor is not None and daemon.supervisor.state == "ready" and daemon.watch is not None:
                break
            await asyncio.sleep(0.02)
        ln = Lane(daemon, tmp)
        for _ in range(10):  # code traffic under the code map until a window is judged: steady
            await ln.tick(400)
            if (ln.drift["last_window"] or {}).get("judged"):
                break
        assert ln.drift["state"] == "steady" and ln.drift["last_window"]["judged"]
        yield ln
    finally:
        await daemon.shutdown()


def _selections(m: dict[Any, float]) -> float:
    return m[("pinsidecar_expert_selections_total", ())]


def test_a_stats_file_that_stops_updating_leaves_the_watch_blind_and_says_so(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with lane(tmp_path) as ln:
            before = ln.metrics()
            windows = len(ln.daemon.watch.records)  # type: ignore[union-attr]
            time.sleep(1.2)  # the exporter's age is wall time since the hook's last write
            for _ in range(40):  # 40 s of the watch's clock with no new write (the engine still "ready")
                assert await ln.tick() == []
            st = ln.daemon.status()
            assert st["engine"]["state"] == "ready"
            assert st["drift"]["stats"]["unchanged_s"] == 40.0 and st["drift"]["stats"]["error"] is None
            assert not st["drift"]["stats"]["stale"] and not any(x.startswith("stats") for x in status_lines(st))
            for _ in range(80):  # 120 s: stale, as the PinsidecarStatsStale alert sees it
                assert await ln.tick() == []
            st = ln.daemon.status()
            assert st["drift"]["stats"]["stale"]
            assert "stats    no new write for 120 s, the drift watch is blind" in status_lines(st)
            assert st["drift"]["state"] == "steady" and st["remap"]["current"] is None  # nothing decided on no data
            assert len(ln.daemon.watch.records) == windows  # type: ignore[union-attr]
            m = ln.metrics()
            assert m[("pinsidecar_stats_age_seconds", ())] >= 1.2  # PinsidecarStatsStale fires past 120 s for 5 m
            assert _selections(m) == _selections(before)  # no invented traffic
            assert m[("pinsidecar_exporter_source_up", (("source", "stats"),))] == 1  # the file reads fine
            await ln.tick(400)  # the hook writes again: seen at once
            assert ln.drift["stats"]["unchanged_s"] == 0.0

    asyncio.run(scenario())


def test_a_stats_file_that_goes_backwards_is_an_engine_restart_never_negative_traffic(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with lane(tmp_path) as ln:
            total = _selections(ln.metrics())
            ln.boot = 2  # the engine restarted: a new boot id, seq and counters from zero
            await ln.tick(100)
            st = ln.drift
            assert st["stats"]["restarts"] == 1 and st["stats"]["seq"] == 1 and st["stats"]["boot_id"] == "boot2"
            m = ln.metrics()
            assert _selections(m) == total + 100 * 8 * 4  # 4 layers x top-8: totals go on
            for _ in range(4):  # code traffic goes on: windows judged, no trip
                await ln.tick(400)
            assert ln.drift["state"] == "steady" and ln.daemon.remaps.current is None
            last = ln.drift["last_window"]
            assert last["judged"] and last["window"]["tokens"] >= 400
            assert ln.daemon.status()["remap"]["last"] is None

    asyncio.run(scenario())


def test_a_corrupt_stats_file_is_named_in_status_and_the_metrics_and_nothing_is_judged_on_it(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with lane(tmp_path) as ln:
            total = _selections(ln.metrics())
            windows = len(ln.daemon.watch.records)  # type: ignore[union-attr]
            ln.stats_path.write_bytes(b'{"format": "pinsidecar.stats", "version": 1, "sel')  # torn write
            for _ in range(5):
                assert await ln.tick() == []
            err = ln.drift["stats"]["error"]
            assert err is not None and str(ln.stats_path) in err and "corrupt or truncated" in err
            assert f"stats    unreadable, the drift watch is blind: {err}" in status_lines(ln.daemon.status())
            assert len(ln.daemon.watch.records) == windows  # type: ignore[union-attr]
            m = ln.metrics()
            assert m[("pinsidecar_exporter_source_up", (("source", "stats"),))] == 0
            assert ("pinsidecar_expert_selections_total", ()) not in m  # left out, not zero
            assert ("pinsidecar_engine_state", (("state", "ready"),)) in m  # the rest still exports
            await ln.tick(400)  # a whole file again: error cleared, counting goes on
            assert ln.drift["stats"]["error"] is None
            assert _selections(ln.metrics()) > total

    asyncio.run(scenario())


def test_unreadable_cgroup_files_drop_only_the_cgroup_metrics(tmp_path: Path) -> None:
    """memory.current or /proc/<pid>/cgroup unreadable (a directory in place of the file: unreadable even for
    root): the cgroup source is down with the path in the reason, the scrape still answers."""
    cg = tmp_path / "cgroup"
    write_cgroup_tree(cg)
    proc = write_proc_cgroup(tmp_path / "proc", 7)
    exp = Exporter(engine_pid=lambda: 7, cgroup_root=cg, proc_root=proc, nvml=None)

    def up() -> tuple[float | None, bool]:
        fams = {f.name: f for f in text_string_to_metric_families(exp.render().decode())}
        vals = {tuple(s.labels.items()): s.value for s in fams["pinsidecar_exporter_source_up"].samples}
        return vals.get((("source", "cgroup"),)), "pinsidecar_engine_cgroup_memory_current_bytes" in fams

    assert up() == (1.0, True)
    current = cg / "system.slice" / "engine.scope" / "memory.current"
    current.unlink()
    current.mkdir()
    assert up() == (0.0, False)
    assert "memory.current" in (exp.cgroup.status.reason or "")
    current.rmdir()
    current.write_text("4096\n")
    assert up() == (1.0, True)
    (proc / "7" / "cgroup").unlink()
    (proc / "7" / "cgroup").mkdir()
    assert up() == (0.0, False)
    assert "engine cgroup not found" in (exp.cgroup.status.reason or "")
