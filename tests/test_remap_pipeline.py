"""The remap pipeline in the real daemon, without vLLM: the states in order, every way a remap ends, the gate in
front of it, and what a restart finds.

Each test runs the real :class:`~pinsidecar.daemon.service.Daemon` (gate, control API, supervisor, drift watch,
pipeline) on an instant engine (:mod:`pinsidecar.testing.remap`), with the pin-mode hook's stats file written from
synthetic traffic: "code" is domain 0 (the active map was built from it), "prose" is domain 1. The count boot,
parity and (where a test says so) the cold-rate probe are fakes; everything else is the production code.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pinsidecar_hook.contract import load_map
from pinsidecar_hook.contract.requests import apply_args, request_path, write_hook_request

from pinsidecar.counts.count_boot import CountBootError
from pinsidecar.daemon.config import load_config
from pinsidecar.daemon.control import ControlError
from pinsidecar.daemon.service import Daemon
from pinsidecar.engine import free_port
from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import counts_path_for
from pinsidecar.remap.commit import ACTIVE_MAP_FILE, write_active_map
from pinsidecar.remap.record import PRE_REBOOT_STATES, STATES, RecordStore, RemapRecord
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.fs import MountNotPermitted, fill, free_pages, remount, small_tmpfs
from pinsidecar.testing.remap import FakeApplyClient, FakeHookStats, FakeTools, InstantEngine
from pinsidecar.testing.wait import wait_until_async

CODE, PROSE = 0, 1
# Tests that request remaps themselves switch the detector's own trips off (it would race them on prose traffic).
MANUAL_ONLY = "enabled = false"
HOT_ROWS = 48  # the demo's geometry: 48 of 64 experts hot


@dataclass
class Harness:
    daemon: Daemon
    hook: FakeHookStats
    tools: FakeTools
    tmp: Path
    code_map: Path
    domain: int = CODE
    tokens_per_tick: int = 100
    skew: float = 1.2

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    def record(self, remap_id: str) -> dict[str, Any]:
        return json.loads((self.state_dir / "remaps" / f"{remap_id}.json").read_text())

    async def wait_for_end(self, remap_id: str, limit_s: float = 30.0) -> dict[str, Any]:
        await until(lambda: self.daemon.remaps.current is None and self.record(remap_id)["outcome"] is not None,
                    f"remap {remap_id} to end", limit_s)
        return self.record(remap_id)

    async def windows(self, n: int, limit_s: float = 20.0) -> None:
        """Wait until ``n`` more judged windows have closed."""
        watch = self.daemon.watch
        assert watch is not None
        start = sum(r.judged for r in watch.records)
        await until(lambda: sum(r.judged for r in watch.records) >= start + n, f"{n} judged windows", limit_s)


# The one poll loop (testing.wait), at this module's pace: the daemon under test runs in this event loop.
until = functools.partial(wait_until_async, step_s=0.02)
LIMIT_S = 20.0


def write_config(tmp: Path, code_map: Path, *, drift: str = "", remap: str = "", metrics: bool = False) -> Path:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    fixture = tmp / "fixture.jsonl"
    fixture.write_text("".join(json.dumps({"prompt": f"request {i}", "max_tokens": 8}) + "\n" for i in range(10)))
    ports: list[int] = []
    for _ in range(5):
        ports.append(free_port(ports[-1] + 1) if ports else free_port())
    engine, gate, control, metrics_port, count = ports
    # in_place off: most tests here are the drain-reboot deploy's; the in-place tests turn it on (the default)
    remap_defaults = {"workloads": f'["{fixture}"]', "count_boot_port": str(count), "watch_interval_s": "0.03",
                      "held_out_wait_s": "5", "verify_tokens": "400", "verify_timeout_s": "10", "in_place": "false"}
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model}"
port = {engine}
hook_mode = "pin"
map = "{code_map}"
[supervisor]
# the instant engine answers no /health: without this the liveness check would restart it every few seconds
# (a test that kills it tells the supervisor the way the exit watch does)
health_interval_s = 3600
[gate]
port = {gate}
[control]
port = {control}
token_file = "{tmp}/token"
create_token = true
drain_timeout_s = 5
[metrics]
enabled = {"true" if metrics else "false"}
port = {metrics_port}
nvml = false
[maps]
dir = "{tmp}/maps"
watch = false
[daemon]
state_dir = "{tmp}/state"
[drift]
window_tokens = 800
min_tokens = 400
consecutive_windows = 2
cooldown_s = 0
{drift}
[remap]
{_table(remap_defaults, remap)}
""")
    return cfg


def _table(defaults: dict[str, str], lines: str) -> str:
    """``defaults`` (key -> TOML value) with the ``key = value`` lines of ``lines`` over them."""
    table = dict(defaults)
    for line in lines.splitlines():
        if line.strip():
            key, _, value = line.partition("=")
            table[key.strip()] = value.strip()
    return "\n".join(f"{k} = {v}" for k, v in table.items())


def code_map(tmp: Path) -> Path:
    counts = make_counts(tokens=4000, domain=CODE, seed=1, workload="code")
    path = tmp / "boot" / "code.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    counts.save(counts_path_for(path))
    build_usage_map([counts], HOT_ROWS, label="code").save(path)
    return path


@asynccontextmanager
async def running(tmp: Path, tools: FakeTools, *, drift: str = "", remap: str = "", metrics: bool = False,
                  library: tuple[int, ...] = ()) -> AsyncIterator[Harness]:
    """The daemon on a code map, with synthetic traffic of ``h.domain`` flowing until the block ends."""
    boot_map = code_map(tmp)
    maps = tmp / "maps"
    maps.mkdir(exist_ok=True)
    for domain in library:  # labelled maps of other traffic classes, already on disk
        c = make_counts(tokens=4000, domain=domain, seed=7, workload=f"class{domain}")
        p = maps / f"class{domain}.json"
        c.save(counts_path_for(p))
        build_usage_map([c], HOT_ROWS, label=f"class{domain}").save(p)
    cfg = load_config(write_config(tmp, boot_map, drift=drift, remap=remap, metrics=metrics))
    daemon = Daemon(cfg, launcher_factory=InstantEngine, remap_tools=tools)

    def served() -> tuple[Any, Any, str]:
        sup = daemon.supervisor
        if sup is None or sup.map is None:
            return None, None, ""
        return sup.launcher, sup.map.hot_mask(), sup.map.content_hash

    hook = FakeHookStats(tmp / "state" / "stats.json", served)
    h = Harness(daemon, hook, tools, tmp, boot_map)
    await daemon.start()

    async def traffic() -> None:
        while True:
            if daemon.supervisor is not None and daemon.supervisor.launcher is not None:
                hook.add(h.domain, h.tokens_per_tick, h.skew)
            await asyncio.sleep(0.01)

    feeder = asyncio.create_task(traffic())
    try:
        await until(lambda: daemon.supervisor is not None and daemon.supervisor.state == "ready", "engine ready",
                    LIMIT_S)
        assert daemon.watch is not None
        yield h
    finally:
        feeder.cancel()
        await daemon.shutdown()


def served_hash(h: Harness) -> str:
    sup = h.daemon.supervisor
    assert sup is not None and sup.map is not None
    return sup.map.content_hash


def active_map_record(h: Harness) -> dict[str, Any] | None:
    p = h.state_dir / ACTIVE_MAP_FILE
    return json.loads(p.read_text()) if p.exists() else None


def states(rec: dict[str, Any]) -> list[str]:
    return [s["state"] for s in rec["steps"]]


# ---------------------------------------------------------------------------------------------------- the loop


def test_a_drift_trip_count_boots_builds_evaluates_reboots_verifies_and_commits(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42))

    async def scenario() -> None:
        async with running(tmp_path, tools, metrics=True) as h:
            d = h.daemon
            await h.windows(3)  # steady code traffic under the code map: no trip
            assert d.remaps.current is None and d.remaps.last is None
            assert d.status()["drift"]["state"] == "steady"
            boots = InstantEngine.boots
            h.domain = PROSE
            await until(lambda: d.remaps.last is not None or d.remaps.current is not None, "a drift trip", LIMIT_S)
            rid = (d.remaps.current or d.remaps.last).id  # type: ignore[union-attr]
            rec = await h.wait_for_end(rid)
            assert rec["outcome"] == "committed", rec
            assert rec["trigger"] == "drift"
            assert states(rec) == [s for s in STATES if s != "applying"]  # every reboot-path state, in order
            assert all(s["seconds"] >= 0 for s in rec["steps"])
            # the count boot ran beside the serving engine, on its own port, with the fixture replayed
            (boot,) = tools.count_boots
            assert boot["port"] == d.cfg.remap.count_boot_port and boot["workloads"][-1].name == "fixture.jsonl"
            # the candidate landed in the library with its counts beside it; the active map's file untouched
            cand = Path(rec["candidate"]["path"])
            assert cand.parent == tmp_path / "maps" and counts_path_for(cand).is_file()
            assert load_map(cand).same_geometry(load_map(h.code_map))
            assert rec["decision"]["deploy"] and rec["decision"]["gain"] >= d.cfg.drift.margin
            assert rec["decision"]["after_capture_cut"] is True
            assert rec["verify"]["parity"]["ok"] and rec["verify"]["reboot"]["hash_hit"]
            assert rec["verify"]["reboot"]["cache_miss"] is False
            assert rec["verify"]["cold_rate"]["status"] == "verified"
            assert rec["verify"]["cold_rate"]["live_cold_rate"] < rec["decision"]["active_cold_rate"] / 2
            # committed: the engine serves the candidate, the next start boots it, the watch judges against it
            assert InstantEngine.boots == boots + 1
            assert served_hash(h) == rec["candidate"]["hash"]
            assert active_map_record(h)["hash"] == rec["candidate"]["hash"]  # type: ignore[index]
            assert d.watch is not None and d.watch.active.content_hash == rec["candidate"]["hash"]
            assert d.watch.reference_kind == "source counts" and not d.watch.detector.remap_running
            st = d.status()
            assert st["remap"]["last"]["id"] == rid and st["remap"]["current"] is None
            assert st["remap"]["history"][-1]["outcome"] == "committed"
            assert isinstance(st["drift"]["line"], str) and st["drift"]["line"]
            assert d.exporter is not None
            text = d.exporter.render().decode()
            assert 'pinsidecar_remaps_total{outcome="committed"} 1.0' in text

    asyncio.run(scenario())


def test_a_flat_router_says_no_exploitable_skew_and_never_remaps(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path, FakeTools()) as h:
            h.skew = 0.0  # the router picks uniformly: no map of this geometry can do better than any other
            await h.windows(6)
            st = h.daemon.status()
            assert st["drift"]["line"] == "no exploitable skew"
            assert st["drift"]["state"] == "steady"
            assert h.daemon.remaps.current is None and h.daemon.remaps.last is None

    asyncio.run(scenario())


def test_live_source_builds_from_the_drift_windows_without_a_count_boot(tmp_path: Path) -> None:
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, remap='source = "live"') as h:
            await h.windows(2)
            h.domain = PROSE
            d = h.daemon
            await until(lambda: d.remaps.last is not None or d.remaps.current is not None, "a drift trip", LIMIT_S)
            rec = await h.wait_for_end((d.remaps.current or d.remaps.last).id)  # type: ignore[union-attr]
            assert rec["outcome"] == "committed", rec
            assert "count_boot" not in states(rec) and not tools.count_boots
            lc = rec["steps"][1]["detail"]  # the library_check step holds what the workload step chose
            assert rec["steps"][0]["detail"]["source"] == "live" and rec["steps"][0]["detail"]["windows"]
            assert lc["checked"] is True
            assert rec["candidate"]["source"] == "live"

    asyncio.run(scenario())


def test_the_library_is_checked_first_and_a_hit_skips_the_count_boot(tmp_path: Path) -> None:
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, library=(PROSE, 5)) as h:
            h.domain = PROSE
            await h.windows(1)
            res = await h.daemon.request_remap(trigger="manual", reason="test")
            assert res["accepted"] and res["state"] == "choosing_workload"
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "committed", rec
            assert states(rec) == ["choosing_workload", "library_check", "evaluating", "rebooting", "verifying"]
            assert not tools.count_boots
            assert rec["candidate"]["label"] == f"class{PROSE}" and rec["candidate"]["source"] == "library"

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------- faults


def test_no_regressions_deployed_a_refused_candidate_never_reboots(tmp_path: Path) -> None:
    """The count boot counts traffic like the active map's: the candidate is no better by the margin, so it is
    refused with both figures, and the engine is never touched."""
    tools = FakeTools(make_counts(tokens=3000, domain=CODE, seed=5))

    async def scenario() -> None:
        async with running(tmp_path, tools) as h:
            await h.windows(1)
            boots, before = InstantEngine.boots, served_hash(h)
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "refused" and rec["state"] == "refused"
            dec = rec["decision"]
            assert dec["deploy"] is False and dec["reason"].startswith("refused")
            assert dec["candidate_cold_rate"] is not None and dec["active_cold_rate"] is not None
            assert "rebooting" not in states(rec)
            assert InstantEngine.boots == boots and served_hash(h) == before
            assert active_map_record(h) is None

    asyncio.run(scenario())


def test_a_remap_while_one_runs_is_refused_naming_it(tmp_path: Path) -> None:
    hold = threading.Event()
    tools = FakeTools(gate=hold)

    async def scenario() -> None:
        async with running(tmp_path, tools) as h:
            await h.windows(1)
            first = await h.daemon.request_remap(trigger="manual")
            await until(lambda: h.daemon.remaps.current is not None
                        and h.daemon.remaps.current.state == "count_boot", "count boot running", LIMIT_S)
            for trigger in ("manual", "alert", "timer", "drift"):
                with pytest.raises(ControlError) as err:
                    await h.daemon.request_remap(trigger=trigger)
                assert err.value.status == 409
                assert first["remap_id"] in str(err.value) and "count_boot" in str(err.value)
            with pytest.raises(ControlError) as err:
                await h.daemon.drain_reboot(None, None)
            assert err.value.status == 409 and first["remap_id"] in str(err.value)
            dry = await h.daemon.request_remap(trigger="manual", dry_run=True)  # read-only: allowed
            assert dry["dry_run"] and dry["remap_id"] is None
            hold.set()
            await h.wait_for_end(first["remap_id"])

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["error", "too_few_tokens"])
def test_a_failed_or_thin_count_boot_aborts_and_the_old_map_keeps_serving(tmp_path: Path, failure: str) -> None:
    counts: Any = CountBootError("engine exited with code 1 while booting") if failure == "error" \
        else make_counts(tokens=100, domain=PROSE, seed=3)
    tools = FakeTools(counts)

    async def scenario() -> None:
        async with running(tmp_path, tools) as h:
            await h.windows(1)
            boots, before = InstantEngine.boots, served_hash(h)
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "aborted" and states(rec)[-1] == "count_boot"
            assert "old map keeps serving" in rec["error"]
            assert ("engine exited" if failure == "error" else "remap.min_count_tokens") in rec["error"]
            assert InstantEngine.boots == boots and served_hash(h) == before
            assert not [p for p in (tmp_path / "maps").iterdir()]  # no candidate was written
            assert h.daemon.watch is not None and not h.daemon.watch.detector.remap_running

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_a_full_or_read_only_maps_folder_aborts_the_remap_and_the_old_map_keeps_serving(tmp_path: Path,
                                                                                       fault: str) -> None:
    """The candidate cannot be written (a real 64 KiB tmpfs as the maps folder, filled or remounted read-only):
    the remap aborts in ``building`` saying where and why, nothing reboots, no partial file is left, and once the
    disk takes writes again the next remap commits."""
    maps = tmp_path / "maps"
    try:
        mount = small_tmpfs(maps, "64k")
        mount.__enter__()
    except MountNotPermitted as exc:
        pytest.skip(str(exc))

    async def scenario() -> None:
        async with running(tmp_path, FakeTools(), drift=MANUAL_ONLY, remap='source = "live"') as h:
            fillers = fill(maps) if fault == "full" else []
            if fault == "read_only":
                remount(maps, read_only=True)
            h.domain = PROSE
            await h.windows(2)
            boots, before = InstantEngine.boots, served_hash(h)
            rec = await h.wait_for_end((await h.daemon.request_remap(trigger="manual"))["remap_id"])
            assert rec["outcome"] == "aborted" and states(rec) == ["choosing_workload", "library_check", "building"]
            cause = "No space left on device" if fault == "full" else "Read-only file system"
            assert "building the candidate failed: [Errno " in rec["error"]
            assert "cannot write candidate map manual-" in rec["error"]
            assert f"into {maps}: {cause}" in rec["error"] and "the old map keeps serving" in rec["error"]
            assert InstantEngine.boots == boots and served_hash(h) == before
            assert [p.name for p in maps.iterdir() if not p.name.startswith(".filler-")] == []
            assert h.daemon.status()["remap"]["last"]["outcome"] == "aborted"
            # the disk takes writes again: the next remap builds, reboots and commits
            if fault == "full":
                free_pages(fillers, len(fillers))
            else:
                remount(maps, read_only=False)
            rec = await h.wait_for_end((await h.daemon.request_remap(trigger="manual"))["remap_id"])
            assert rec["outcome"] == "committed", rec
            assert Path(rec["candidate"]["path"]).parent == maps and served_hash(h) == rec["candidate"]["hash"]

    try:
        asyncio.run(scenario())
    finally:
        mount.__exit__(None, None, None)


def test_too_few_requests_aborts_before_anything_runs(tmp_path: Path) -> None:
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, remap="min_requests = 50") as h:
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "aborted" and states(rec) == ["choosing_workload"]
            assert "too few requests" in rec["error"] and "remap.min_requests = 50" in rec["error"]
            assert not tools.count_boots

    asyncio.run(scenario())


def test_a_parity_difference_rolls_back_before_any_client_is_served(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42), parity_change=True)

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY) as h:
            h.domain = PROSE
            await h.windows(1)
            boots, before = InstantEngine.boots, served_hash(h)
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back", rec
            assert "parity" in rec["error"] and rec["verify"]["parity"]["ok"] is False
            assert rec["verify"]["reboot"]["rolled_back"] is True
            assert InstantEngine.boots == boots + 2  # the candidate, then the old map again
            assert served_hash(h) == before and active_map_record(h) is None
            assert h.daemon.watch is not None and h.daemon.watch.active.content_hash == before

    asyncio.run(scenario())


def test_a_cold_rate_above_the_prediction_rolls_back(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42), cold_rate=0.6)

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY) as h:
            h.domain = PROSE
            await h.windows(1)
            before = served_hash(h)
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back", rec
            assert states(rec)[-1] == "verifying"
            assert rec["verify"]["cold_rate"]["status"] == "failed" and "above the predicted" in rec["error"]
            assert rec["verify"]["rollback"]["ok"] is True
            assert served_hash(h) == before and active_map_record(h) is None
            assert h.daemon.watch is not None and h.daemon.watch.active.content_hash == before

    asyncio.run(scenario())


def test_thin_traffic_after_the_reboot_commits_unverified_or_rolls_back_per_config(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42))

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap="verify_requires_traffic = true") as h:
            h.domain = PROSE
            await h.windows(1)
            h.daemon.cfg = _with_remap(h.daemon.cfg, verify_timeout_s=0.3, verify_tokens=10**9)
            res = await h.daemon.request_remap(trigger="manual")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back" and rec["error"].startswith("unverified: only")

    asyncio.run(scenario())


def _with_remap(cfg: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, remap=dataclasses.replace(cfg.remap, **kw))


def test_every_trigger_passes_the_cooldown_and_the_daily_cap(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=CODE, seed=5))  # refused quickly, no reboot

    async def scenario() -> None:
        async with running(tmp_path, tools, drift="max_remaps_per_day = 2") as h:  # and cooldown_s = 0
            await h.windows(1)
            watch = h.daemon.watch
            assert watch is not None
            for _ in range(2):
                res = await h.daemon.request_remap(trigger="timer")
                await h.wait_for_end(res["remap_id"])
            with pytest.raises(ControlError) as err:
                await h.daemon.request_remap(trigger="manual")
            assert err.value.status == 429 and "daily cap of 2" in str(err.value)
            # a cooldown: the detector's own figures, shared by every trigger
            watch.detector.config = _with_fields(watch.detector.config, cooldown_s=300.0, max_remaps_per_day=10)
            with pytest.raises(ControlError) as err:
                await h.daemon.request_remap(trigger="alert")
            assert err.value.status == 429 and "cooldown" in str(err.value)
            dry = await h.daemon.request_remap(trigger="manual", dry_run=True)  # no cooldown used or needed
            assert dry["dry_run"] and dry["decision"] is not None

    asyncio.run(scenario())


def _with_fields(cfg: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_a_dry_run_returns_the_decision_and_changes_nothing(tmp_path: Path) -> None:
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY) as h:
            empty = await h.daemon.request_remap(trigger="manual", dry_run=True)
            assert not empty["accepted"] and "nothing to judge yet" in empty["reason"]
            h.domain = PROSE
            await h.windows(2)
            boots = InstantEngine.boots
            res = await h.daemon.request_remap(trigger="manual", dry_run=True)
            assert res["accepted"] and res["dry_run"] and res["remap_id"] is None and res["state"] == "dry_run"
            assert res["decision"]["deploy"] is True and res["decision"]["gain"] > 0.05
            assert res["decision"]["candidate_cold_rate"] < res["decision"]["active_cold_rate"]
            assert InstantEngine.boots == boots and not tools.count_boots
            assert not list((h.state_dir / "remaps").glob("*.json"))  # no record: nothing ran
            assert h.daemon.watch is not None and not h.daemon.watch.detector.remap_running

    asyncio.run(scenario())


def test_bad_requests_are_refused_with_the_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path, FakeTools()) as h:
            for kw, status, text in (({"trigger": "cron"}, 400, "unknown remap trigger"),
                                     ({"trigger": "manual", "map_ref": "no-such-map"}, 400, "no map")):
                with pytest.raises(ControlError) as err:
                    await h.daemon.request_remap(**kw)
                assert err.value.status == status and text in str(err.value)

    asyncio.run(scenario())


def test_a_named_map_by_label_is_evaluated_and_deployed(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path, FakeTools(), drift=MANUAL_ONLY, library=(PROSE,)) as h:
            h.domain = PROSE
            await h.windows(1)
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            assert res["state"] == "evaluating"
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "committed" and rec["candidate"]["source"] == "named"
            assert states(rec) == ["evaluating", "rebooting", "verifying"]

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------- in place
IN_PLACE = "in_place = true"


def kill_engine(h: Harness) -> Callable[[], None]:
    """What the fake apply client calls to make the engine die mid-apply (from its thread): the instant engine
    stops, and the supervisor hears it the way the pidfd exit watch tells it of a real engine's exit."""
    loop = asyncio.get_running_loop()

    def die() -> None:
        sup = h.daemon.supervisor
        assert sup is not None and sup.launcher is not None
        launcher = sup.launcher
        launcher.stop()
        loop.call_soon_threadsafe(sup._engine_exited, launcher)

    return die


def boot_hashes(h: Harness) -> list[str | None]:
    sup = h.daemon.supervisor
    assert sup is not None
    return [b.map_hash for b in sup.boots]


def metric(text: str, line: str) -> bool:
    return any(row == line for row in text.splitlines())


def test_a_drift_trip_applies_in_place_verifies_and_commits_without_a_reboot(tmp_path: Path) -> None:
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42))

    async def scenario() -> None:
        async with running(tmp_path, tools, remap=IN_PLACE, metrics=True) as h:
            d = h.daemon
            await h.windows(2)
            boots, before = InstantEngine.boots, served_hash(h)
            h.domain = PROSE
            await until(lambda: d.remaps.last is not None or d.remaps.current is not None, "a drift trip", LIMIT_S)
            rec = await h.wait_for_end((d.remaps.current or d.remaps.last).id)  # type: ignore[union-attr]
            assert rec["outcome"] == "committed", rec
            assert states(rec) == [s for s in STATES if s != "rebooting"]  # applying, never rebooting
            assert InstantEngine.boots == boots  # no drain, no boot
            cand = rec["candidate"]
            # the hook was asked once, with the candidate's absolute path and hash
            (call,) = tools.apply_client.calls
            assert call["map"] == str(Path(cand["path"]).absolute()) and call["hash"] == cand["hash"]
            assert call["timeout_s"] == d.cfg.remap.apply_timeout_s
            assert call["ordering"] == d.cfg.remap.apply_ordering == "host"  # [remap.advanced] apply_ordering
            assert call["hold_ms"] is None  # apply_hold_ms 0: the hook's own budget
            app = rec["apply"]
            assert app["in_place"] and app["outcome"] == "applied" and app["plan"]["from_hash"] == before
            assert app["plan"]["rows"] > 0 and app["plan"]["to_hash"] == cand["hash"]
            (req,) = app["requests"]
            assert req["result"] == "applied" and req["rows"] == 8 and req["served_hash"] == cand["hash"]
            # parity on the same engine, token for token, then the cold rate, then the commit
            assert rec["verify"]["in_place"] and rec["verify"]["parity"]["ok"]
            assert rec["verify"]["parity"]["compared"] == "token ids" and tools.parity_calls == 2
            assert rec["verify"]["cold_rate"]["status"] == "verified"
            assert served_hash(h) == cand["hash"] and active_map_record(h)["hash"] == cand["hash"]  # type: ignore
            sup = d.supervisor
            assert sup is not None and sup.restart_map is None  # committed: a restart boots the candidate now
            assert d.watch is not None and d.watch.active.content_hash == cand["hash"]
            # the gate never held for it
            assert d.gate is not None and not d.gate.snapshot()["holding"]
            st = d.status()
            last = st["remap"]["last_apply"]
            assert last["remap"] == rec["id"] and last["outcome"] == "applied" and last["rows"] == 8
            assert last["result"] == "applied" and last["seconds"] == 0.002
            assert st["remap"]["history"][-1]["apply"] == "applied"
            assert d.exporter is not None
            text = d.exporter.render().decode()
            for line in ('pinsidecar_remap_apply_total{outcome="applied"} 1.0',
                         'pinsidecar_remap_apply_total{outcome="fell_back_reboot"} 0.0',
                         'pinsidecar_remap_apply_requests_total{result="applied"} 1.0',
                         "pinsidecar_remap_apply_rows_swapped_total 8.0",
                         f"pinsidecar_remap_apply_bytes_moved_total {16.0 * load_map(h.code_map).expert_bytes}",
                         "pinsidecar_remap_apply_seconds_count 1.0", "pinsidecar_remap_apply_last_seconds 0.002",
                         'pinsidecar_remaps_total{outcome="committed"} 1.0'):
                assert metric(text, line), line

    asyncio.run(scenario())


@pytest.mark.parametrize("answer", ["refused", "failed", "timeout"])
def test_an_apply_the_hook_refuses_or_fails_falls_back_to_the_drain_reboot(tmp_path: Path, answer: str) -> None:
    tools = FakeTools(apply=FakeApplyClient((answer,)))

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, metrics=True,
                           library=(PROSE,)) as h:
            h.domain = PROSE
            await h.windows(1)
            boots = InstantEngine.boots
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "committed", rec
            assert states(rec) == ["evaluating", "applying", "rebooting", "verifying"]
            assert InstantEngine.boots == boots + 1  # the reboot deployed it
            app = rec["apply"]
            assert app["outcome"] == "fell_back_reboot" and app["requests"][0]["result"] == answer
            want = {"refused": "the hook refused the apply", "failed": "the apply failed (the hook swapped back)",
                    "timeout": "the hook did not answer within remap.apply_timeout_s"}[answer]
            assert app["reason"].startswith(want) and app["reason"].endswith("deploying by a drain-reboot instead")
            assert rec["steps"][1]["detail"]["in_place"] == app["reason"]  # the applying step says why too
            assert rec["verify"]["reboot"]["ok"] and rec["verify"]["reboot"]["hash_hit"]
            assert served_hash(h) == rec["candidate"]["hash"]
            assert not request_path(h.state_dir / "stats.json").exists()  # nothing left for the next engine
            text = h.daemon.exporter.render().decode()  # type: ignore[union-attr]
            assert metric(text, 'pinsidecar_remap_apply_total{outcome="fell_back_reboot"} 1.0')
            assert metric(text, f'pinsidecar_remap_apply_requests_total{{result="{answer}"}} 1.0')
            assert metric(text, "pinsidecar_remap_apply_rows_swapped_total 0.0")

    asyncio.run(scenario())


@pytest.mark.parametrize("rollback", ["in_place", "reboot"])
def test_a_parity_difference_after_the_apply_puts_the_old_map_back(tmp_path: Path, rollback: str) -> None:
    """The candidate applies, the same engine then answers the parity prompts differently: the old map goes back
    in place (the cheap way); if the hook cannot do that either, a reboot with the old map does."""
    answers = ("applied", "applied") if rollback == "in_place" else ("applied", "failed")
    tools = FakeTools(parity_change=True, apply=FakeApplyClient(answers))

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, metrics=True,
                           library=(PROSE,)) as h:
            h.domain = PROSE
            await h.windows(1)
            boots, before = InstantEngine.boots, served_hash(h)
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back", rec
            assert states(rec) == ["evaluating", "applying"] and "parity after the apply" in rec["error"]
            assert rec["verify"]["parity"]["ok"] is False and rec["verify"]["parity"]["differing_prompts"] > 0
            first, back = rec["apply"]["requests"]
            assert first["purpose"] == "candidate" and first["result"] == "applied"
            assert back["purpose"] == "rollback" and back["map_hash"] == before
            assert tools.apply_client.calls[1]["map"] == str(h.code_map.absolute())
            if rollback == "in_place":
                assert "rolled back in place: the old map serves" in rec["outcome_reason"]
                assert InstantEngine.boots == boots
            else:
                assert "so the old map was rebooted: it serves" in rec["outcome_reason"]
                assert InstantEngine.boots == boots + 1 and boot_hashes(h)[-1] == before
            assert rec["apply"]["outcome"] == "rolled_back"
            assert served_hash(h) == before and active_map_record(h) is None
            assert h.daemon.watch is not None and h.daemon.watch.active.content_hash == before
            sup = h.daemon.supervisor
            assert sup is not None and sup.restart_map is None
            text = h.daemon.exporter.render().decode()  # type: ignore[union-attr]
            assert metric(text, 'pinsidecar_remap_apply_total{outcome="rolled_back"} 1.0')

    asyncio.run(scenario())


def test_a_candidate_of_another_geometry_is_rebooted_onto_saying_why(tmp_path: Path) -> None:
    """An operator names a map with more hot rows (a budget change): judged like any other, it cannot be applied
    in place (the hot tensor would change shape), so the drain-reboot deploys it and the record says why."""
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, metrics=True) as h:
            bigger = build_usage_map([make_counts(tokens=4000, domain=PROSE, seed=7)], HOT_ROWS + 8, label="big")
            bigger.save(tmp_path / "maps" / "big.json")
            h.domain = PROSE
            await h.windows(1)
            boots = InstantEngine.boots
            res = await h.daemon.request_remap(trigger="manual", map_ref=str(tmp_path / "maps" / "big.json"))
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "committed", rec
            assert states(rec) == ["evaluating", "rebooting", "verifying"]
            assert "another geometry" in rec["decision"]["reason"] and rec["decision"]["deploy"]
            why = rec["apply"]["reason"]
            assert why.startswith("cannot apply in place: candidate big has another geometry") and \
                why.endswith("; rebooting")
            assert "hot_rows 48 -> 56" in why
            assert rec["steps"][0]["detail"]["in_place"] == why  # the evaluating step hands over with it
            assert rec["apply"]["outcome"] == "fell_back_reboot" and rec["apply"]["requests"] == []
            assert not tools.apply_client.calls and InstantEngine.boots == boots + 1
            assert rec["verify"]["reboot"]["hash_hit"] is False
            assert served_hash(h) == bigger.content_hash
            text = h.daemon.exporter.render().decode()  # type: ignore[union-attr]
            assert metric(text, 'pinsidecar_remap_apply_total{outcome="fell_back_reboot"} 1.0')

    asyncio.run(scenario())


def test_with_in_place_off_the_remap_reboots_and_records_no_apply(tmp_path: Path) -> None:
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, library=(PROSE,)) as h:  # in_place = false
            h.domain = PROSE
            await h.windows(1)
            rec = await h.wait_for_end((await h.daemon.request_remap(trigger="manual",
                                                                     map_ref=f"class{PROSE}"))["remap_id"])
            assert rec["outcome"] == "committed" and states(rec) == ["evaluating", "rebooting", "verifying"]
            assert rec["apply"] is None and not tools.apply_client.calls
            assert "in_place" not in rec["steps"][0]["detail"]

    asyncio.run(scenario())


def test_an_engine_dying_mid_apply_restarts_with_the_committed_map_never_the_candidate(tmp_path: Path) -> None:
    apply = FakeApplyClient(("die",))
    tools = FakeTools(apply=apply)

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, metrics=True,
                           library=(PROSE,)) as h:
            apply.on_die = kill_engine(h)
            h.domain = PROSE
            await h.windows(1)
            before = served_hash(h)
            booted = len(boot_hashes(h))
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back", rec
            assert states(rec) == ["evaluating", "applying"]
            assert rec["outcome_reason"] == "the engine died mid-apply; it restarts with the committed map code"
            assert rec["apply"]["outcome"] == "engine_died" and rec["apply"]["requests"][0]["result"] == "engine_died"
            sup = h.daemon.supervisor
            assert sup is not None
            await until(lambda: sup.state == "ready" and len(sup.boots) > booted, "the supervisor's restart", LIMIT_S)
            assert boot_hashes(h)[booted:] == [before]  # restarted with the old map, never the candidate
            assert sup.boots[-1].reason == "crash" and served_hash(h) == before
            assert active_map_record(h) is None
            assert not request_path(h.state_dir / "stats.json").exists()
            assert h.daemon.watch is not None and h.daemon.watch.active.content_hash == before
            text = h.daemon.exporter.render().decode()  # type: ignore[union-attr]
            assert metric(text, 'pinsidecar_remap_apply_total{outcome="engine_died"} 1.0')
            assert metric(text, 'pinsidecar_remap_apply_requests_total{result="engine_died"} 1.0')

    asyncio.run(scenario())


def test_an_engine_restart_before_the_commit_boots_the_committed_map_and_rolls_back(tmp_path: Path) -> None:
    """Applied in place, the engine then crashes while the new map is verified: the supervisor boots the committed
    map (a map applied in place is not what a restart boots), verification sees it and the remap rolls back."""
    tools = FakeTools()

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, library=(PROSE,)) as h:
            h.daemon.cfg = _with_remap(h.daemon.cfg, verify_tokens=10**9, verify_timeout_s=60)
            h.domain = PROSE
            await h.windows(1)
            before = served_hash(h)
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            d = h.daemon
            await until(lambda: d.remaps.current is not None and d.remaps.current.state == "verifying", "verifying",
                        LIMIT_S)
            sup = d.supervisor
            assert sup is not None and sup.restart_map is not None and sup.restart_map[1] is not None
            assert sup.restart_map[1].content_hash == before and served_hash(h) != before
            assert d.status()["engine"]["restart_map"]["hash"] == before
            kill_engine(h)()
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["outcome"] == "rolled_back" and states(rec) == ["evaluating", "applying", "verifying"]
            assert "the engine restarted while the new map was being verified and serves code" in rec["error"]
            assert "the engine serves the committed map code again" in rec["outcome_reason"]
            assert served_hash(h) == before and boot_hashes(h)[-1] == before and active_map_record(h) is None
            assert len(tools.apply_client.calls) == 1  # nothing to apply back: the restart did it

    asyncio.run(scenario())


def test_a_second_remap_during_an_apply_is_refused_naming_the_first_and_the_gate_keeps_serving(
        tmp_path: Path) -> None:
    hold = threading.Event()
    tools = FakeTools(apply=FakeApplyClient(hold=hold))

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE, library=(PROSE,)) as h:
            h.domain = PROSE
            await h.windows(1)
            d = h.daemon
            first = await d.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            await until(lambda: bool(tools.apply_client.calls), "the apply request sent", LIMIT_S)
            assert d.remaps.current is not None and d.remaps.current.state == "applying"
            for trigger in ("manual", "alert", "timer", "drift"):
                with pytest.raises(ControlError) as err:
                    await d.request_remap(trigger=trigger)
                assert err.value.status == 409
                assert first["remap_id"] in str(err.value) and "state applying" in str(err.value)
            with pytest.raises(ControlError) as err:
                await d.drain_reboot(None, None)
            assert err.value.status == 409 and first["remap_id"] in str(err.value)
            # the engine keeps serving meanwhile: the gate does not hold, the supervisor is not draining
            assert d.gate is not None and not d.gate.snapshot()["holding"]
            assert d.supervisor is not None and d.supervisor.state == "ready"
            assert d.status()["remap"]["current"]["state"] == "applying"
            hold.set()
            rec = await h.wait_for_end(first["remap_id"])
            assert rec["outcome"] == "committed" and states(rec) == ["evaluating", "applying", "verifying"]

    asyncio.run(scenario())


def test_status_shows_the_last_apply() -> None:
    from pinsidecar.cli.daemon import _fmt_status

    st = {"engine": {"state": "ready"}, "maps": {"entries": [], "dir": "/m"}, "daemon": {}, "drift": None,
          "remap": {"current": None, "last": None, "history": [], "last_apply": {
              "remap": "r7", "remap_state": "committed", "in_place": True, "outcome": "applied", "reason": None,
              "result": "applied", "seconds": 0.0123, "rows": 96, "bytes_moved": 3 * 2**20}}}
    assert "apply    last (remap r7): applied; the hook swapped 96 rows (3.0 MiB) in 12.3 ms" in _fmt_status(st)
    st["remap"]["last_apply"] = {"remap": "r8", "remap_state": "rebooting", "outcome": "fell_back_reboot",
                                 "result": "refused", "reason": "the hook refused the apply: tp_size 2"}
    assert ("apply    last (remap r8): fell_back_reboot; the hook's answer: refused  (the hook refused the apply: "
            "tp_size 2)") in _fmt_status(st)


@pytest.mark.parametrize("launcher", ["process", "container"])
def test_the_apply_request_names_the_map_as_the_engine_sees_it(tmp_path: Path, launcher: str) -> None:
    """A local engine reads the daemon's own absolute path; one in a container reads it through the mount of the
    state folder (maps read-only at <state_mount>/maps), so that is the path the hook is asked to apply."""
    text = write_config(tmp_path, code_map(tmp_path)).read_text()
    text = text.replace(f'dir = "{tmp_path}/maps"', f'dir = "{tmp_path}/state/maps"')
    if launcher == "container":
        text = text.replace('hook_mode = "pin"', 'hook_mode = "pin"\nlauncher = "container"')
        text += '\n[container]\nimage = "vllm/vllm-openai:test"\nstate_mount = "/var/lib/pinsidecar"\n'
    (tmp_path / "pinsidecar.toml").write_text(text)
    daemon = Daemon(load_config(tmp_path / "pinsidecar.toml"), launcher_factory=InstantEngine)
    cand = tmp_path / "state" / "maps" / "prose.json"
    want = "/var/lib/pinsidecar/maps/prose.json" if launcher == "container" else str(cand)
    assert daemon.remaps.host.engine_map_path(cand) == want
    if launcher == "container":  # a map the container cannot see is an error the pipeline turns into a fallback
        from pinsidecar.engine.launcher import EngineSetupError

        with pytest.raises(EngineSetupError, match="outside the state folder"):
            daemon.remaps.host.engine_map_path(tmp_path / "elsewhere.json")


# ---------------------------------------------------------------------------------------------------- commit


def disk_full(calls: list[Path]) -> Callable[[Path, Path, str | None], None]:
    """A commit writer whose disk is full: what ``write_active_map`` raises on ENOSPC (the real one on a full
    tmpfs: tests/test_remap_commit.py), and nothing written."""
    def write(file: Path, map_path: Path, map_hash: str | None) -> None:
        calls.append(file)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return write


@pytest.mark.parametrize("deploy", ["reboot", "in_place"])
def test_a_commit_that_cannot_write_active_map_ends_commit_failed_and_the_old_map_serves(tmp_path: Path,
                                                                                      deploy: str) -> None:
    """Verified, then the disk is full at the commit: the record never says committed (active-map.json was never
    written), the old map is put back the way the candidate came (in place, or a reboot), the remap ends
    commit_failed saying why and what to do, and once the disk has room the next remap commits."""
    calls: list[Path] = []
    tools = FakeTools(make_counts(tokens=3000, domain=PROSE, seed=42))
    tools.write_active_map = disk_full(calls)

    async def scenario() -> None:
        async with running(tmp_path, tools, drift=MANUAL_ONLY, remap=IN_PLACE if deploy == "in_place" else "",
                           metrics=True, library=(PROSE,)) as h:
            h.domain = PROSE
            await h.windows(1)
            boots, before = InstantEngine.boots, served_hash(h)
            res = await h.daemon.request_remap(trigger="manual", map_ref=f"class{PROSE}")
            rec = await h.wait_for_end(res["remap_id"])
            assert rec["state"] == rec["outcome"] == "commit_failed", rec
            file = h.state_dir / ACTIVE_MAP_FILE
            assert calls == [file] and active_map_record(h) is None  # never written, so never "committed"
            assert "committed" not in states(rec)
            assert rec["error"] == (f"commit failed: cannot write {file}: [Errno {errno.ENOSPC}] No space left on "
                                    f"device; free space on {h.state_dir} and run `pinsidecar remap` again")
            assert rec["verify"]["commit"] == {"ok": False, "file": str(file), "errno": errno.ENOSPC,
                                               "error": rec["error"].split("; free space")[0]}
            assert rec["verify"]["cold_rate"]["status"] == "verified"  # the map was fine; the disk was not
            reason = rec["outcome_reason"]
            assert reason.endswith(f"free space on {h.state_dir} and run `pinsidecar remap` again")
            if deploy == "in_place":
                assert states(rec) == ["evaluating", "applying", "verifying"]
                assert "rolled back in place: the old map serves" in reason
                assert InstantEngine.boots == boots and rec["apply"]["outcome"] == "rolled_back"
                assert [r["purpose"] for r in rec["apply"]["requests"]] == ["candidate", "rollback"]
            else:
                assert states(rec) == ["evaluating", "rebooting", "verifying"]
                assert "rolled back: the old map serves" in reason and rec["verify"]["rollback"]["ok"]
                assert InstantEngine.boots == boots + 2 and boot_hashes(h)[-1] == before
            # the old map serves, and is what a restart boots; the watch judges against it
            assert served_hash(h) == before
            sup = h.daemon.supervisor
            assert sup is not None and sup.restart_map is None
            assert h.daemon.watch is not None and h.daemon.watch.active.content_hash == before
            assert not h.daemon.watch.detector.remap_running
            st = h.daemon.status()
            assert st["remap"]["last"]["outcome"] == "commit_failed" and st["remap"]["current"] is None
            text = h.daemon.exporter.render().decode()  # type: ignore[union-attr]
            assert metric(text, 'pinsidecar_remaps_total{outcome="commit_failed"} 1.0')
            assert metric(text, 'pinsidecar_remaps_total{outcome="committed"} 0.0')
            # the disk has room again: the next remap commits, and active-map.json names the candidate
            tools.write_active_map = write_active_map
            rec = await h.wait_for_end((await h.daemon.request_remap(trigger="manual",
                                                                     map_ref=f"class{PROSE}"))["remap_id"])
            assert rec["outcome"] == "committed", rec
            assert rec["verify"]["commit"] == {"ok": True, "file": str(h.state_dir / ACTIVE_MAP_FILE)}
            assert active_map_record(h)["hash"] == rec["candidate"]["hash"] == served_hash(h)  # type: ignore[index]

    asyncio.run(scenario())


def test_the_daemons_remap_host_is_the_pipelines_host_and_the_host_stays_narrow(tmp_path: Path) -> None:
    """Everything :class:`RemapHost` names, the daemon's host (:mod:`pinsidecar.daemon.remap_host`) has; and the
    protocol stays what the pipeline needs (it was 20 members with the daemon's whole config, the drain flag, the
    map resolver and three metric callbacks)."""
    from pinsidecar.daemon.remap_host import DaemonRemapHost
    from pinsidecar.remap.host import RemapHost, RemapSettings

    daemon = Daemon(load_config(write_config(tmp_path, code_map(tmp_path))), launcher_factory=InstantEngine)
    host = daemon.remaps.host
    assert isinstance(host, DaemonRemapHost)
    members = [n for n in vars(RemapHost) if not n.startswith("_")]
    assert len(members) <= 15, members
    assert [n for n in members if not hasattr(host, n)] == []
    assert all(hasattr(host.cfg, n) for n in vars(RemapSettings) if not n.startswith("_"))
    daemon.cfg = _with_remap(daemon.cfg, verify_tokens=7)  # read at every use: a swapped config is seen
    assert host.cfg.remap.verify_tokens == 7


# ---------------------------------------------------------------------------------------------------- recovery


@pytest.mark.parametrize("state", STATES)
def test_a_record_left_open_in_any_state_is_closed_at_start_and_the_old_map_serves(tmp_path: Path,
                                                                                  state: str) -> None:
    """What a SIGKILL in ``state`` leaves: the record on disk in that state, the candidate in the library, and
    active-map.json (written only at commit) naming the old map. The next daemon serves the old map."""
    async def scenario() -> None:
        boot_map = code_map(tmp_path)
        old = load_map(boot_map)
        cand_path = tmp_path / "maps" / "cand.json"
        cand_path.parent.mkdir(parents=True, exist_ok=True)
        cand = build_usage_map([make_counts(tokens=2000, domain=PROSE, seed=3)], HOT_ROWS, label="cand")
        cand.save(cand_path)
        store = RecordStore(tmp_path / "state" / "remaps")
        rec = RemapRecord.new("drift", previous_map={"path": str(boot_map), "hash": old.content_hash,
                                                     "label": "code"}, state=state)
        rec.candidate = {"path": str(cand_path), "hash": cand.content_hash, "label": "cand", "source": "count_boot"}
        store.save(rec)
        (store.directory / f".{rec.id}.json.x1.tmp").write_text("{")  # a torn atomic write
        (tmp_path / "state" / ACTIVE_MAP_FILE).write_text(json.dumps({"path": str(boot_map),
                                                                     "hash": old.content_hash}))
        request = request_path(tmp_path / "state" / "stats.json")
        if state == "applying":  # killed with its apply request unanswered: the next engine must never see it
            write_hook_request(tmp_path / "state" / "stats.json", "apply", apply_args(cand_path, cand.content_hash))
        cfg = load_config(write_config(tmp_path, boot_map))
        daemon = Daemon(cfg, launcher_factory=InstantEngine, remap_tools=FakeTools())
        await daemon.start()
        try:
            await until(lambda: daemon.supervisor is not None and daemon.supervisor.state == "ready", "ready", LIMIT_S)
            closed = json.loads(store.path(rec.id).read_text())
            want = "aborted" if state in PRE_REBOOT_STATES else "rolled_back"
            assert closed["state"] == closed["outcome"] == want
            assert f"during {state}" in closed["error"]
            assert daemon.supervisor is not None and daemon.supervisor.map is not None
            assert daemon.supervisor.map.content_hash == old.content_hash
            assert load_map(cand_path).content_hash == cand.content_hash  # whole, never half-written
            assert not [p for p in store.directory.iterdir() if p.name.startswith(".")]
            assert daemon.status()["remap"]["last"]["id"] == rec.id
            assert not request.exists()
        finally:
            await daemon.shutdown()

    asyncio.run(scenario())


def test_a_commit_written_before_the_kill_is_recognised(tmp_path: Path) -> None:
    async def scenario() -> None:
        boot_map = code_map(tmp_path)
        cand_path = tmp_path / "maps" / "cand.json"
        cand_path.parent.mkdir(parents=True, exist_ok=True)
        cand = build_usage_map([make_counts(tokens=2000, domain=PROSE, seed=3)], HOT_ROWS, label="cand")
        cand.save(cand_path)
        store = RecordStore(tmp_path / "state" / "remaps")
        rec = RemapRecord.new("manual", state="verifying")
        rec.candidate = {"path": str(cand_path), "hash": cand.content_hash, "label": "cand", "source": "library"}
        store.save(rec)
        (tmp_path / "state" / ACTIVE_MAP_FILE).write_text(json.dumps({"path": str(cand_path),
                                                                     "hash": cand.content_hash}))
        daemon = Daemon(load_config(write_config(tmp_path, boot_map)), launcher_factory=InstantEngine)
        await daemon.start()
        try:
            await until(lambda: daemon.supervisor is not None and daemon.supervisor.state == "ready", "ready", LIMIT_S)
            assert json.loads(store.path(rec.id).read_text())["outcome"] == "committed"
            assert daemon.supervisor is not None and daemon.supervisor.map is not None
            assert daemon.supervisor.map.content_hash == cand.content_hash
        finally:
            await daemon.shutdown()

    asyncio.run(scenario())


def test_a_restart_keeps_the_cooldown(tmp_path: Path) -> None:
    async def scenario() -> None:
        boot_map = code_map(tmp_path)
        store = RecordStore(tmp_path / "state" / "remaps")
        rec = RemapRecord.new("manual", state="evaluating")
        rec.finish("refused", reason="test")
        store.save(rec)
        daemon = Daemon(load_config(write_config(tmp_path, boot_map, drift="")), launcher_factory=InstantEngine)
        daemon.cfg = _with_fields(daemon.cfg, drift=_with_fields(daemon.cfg.drift, cooldown_s=600.0))
        await daemon.start()
        try:
            await until(lambda: daemon.watch is not None, "watch", LIMIT_S)
            assert daemon.watch is not None and daemon.watch.detector.remaps_last_day(
                daemon.watch.detector.clock()) == 1
            with pytest.raises(ControlError) as err:
                await daemon.request_remap(trigger="manual")
            assert err.value.status == 429 and "cooldown" in str(err.value)
        finally:
            await daemon.shutdown()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("line", "message"), [
    ('source = "replay"', "remap.source: expected one of capture, live"),
    ("capture_requests = 0", "remap.capture_requests: must be > 0"),
    ("verify_tolerance = 5", "remap.verify_tolerance: a fraction of selections"),
    ('workloads = ["missing.jsonl"]', "remap.workloads:"),
    ("count_boot_port = 70000", "remap.count_boot_port: expected an integer 1-65535"),
    ("verify_tokns = 5", "remap.verify_tokns: unknown key"),
])
def test_a_bad_remap_table_is_refused_naming_the_key(tmp_path: Path, line: str, message: str) -> None:
    from pinsidecar.schema import ConfigError

    cfg = write_config(tmp_path, code_map(tmp_path), remap=line)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(cfg)


def test_the_count_boot_port_may_not_be_another_listeners(tmp_path: Path) -> None:
    from pinsidecar.schema import ConfigError

    path = write_config(tmp_path, code_map(tmp_path))
    cfg = load_config(path)
    path.write_text(path.read_text().replace(f"count_boot_port = {cfg.remap.count_boot_port}",
                                             f"count_boot_port = {cfg.gate.port}"))
    with pytest.raises(ConfigError, match=r"port \d+ is also used by gate\.port"):
        load_config(path)


def test_relative_workloads_are_taken_from_the_config_files_folder(tmp_path: Path) -> None:
    (tmp_path / "traffic.jsonl").write_text('{"prompt": "x"}\n')
    cfg = load_config(write_config(tmp_path, code_map(tmp_path), remap='workloads = ["traffic.jsonl"]'))
    assert [Path(w) for w in cfg.remap.workloads] == [tmp_path / "traffic.jsonl"]


def test_an_operators_drain_reboot_onto_a_map_moves_the_drift_watch_with_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path, FakeTools(), drift=MANUAL_ONLY, library=(PROSE,)) as h:
            res = await h.daemon.drain_reboot(f"class{PROSE}.json", None)
            assert res["ok"] and res["hash_hit"] and res["reason"] == "drain-reboot"
            watch = h.daemon.watch
            assert watch is not None and watch.active.label == f"class{PROSE}"
            assert watch.reference_kind == "source counts"  # the counts beside the map
            assert active_map_record(h)["hash"] == watch.active.content_hash  # type: ignore[index]

    asyncio.run(scenario())


def test_the_record_store_keeps_the_newest_records_and_their_files(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    ids = []
    for i in range(5):
        rec = RemapRecord.new("manual", state="evaluating")
        rec.id = f"2026010{i}T000000Z-00000{i}"
        rec.finish("refused", reason="test")
        store.save(rec)
        store.file(rec.id, ".workload.jsonl").write_text("{}\n")
        ids.append(rec.id)
    (tmp_path / "garbage.json").write_text("{")
    assert store.prune(2) == 4  # the unreadable file sorts last, so it counts as one of the newest
    assert [r.id for r in store.records()] == ids[-1:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{ids[-1]}.json", f"{ids[-1]}.workload.jsonl", "garbage.json"])
