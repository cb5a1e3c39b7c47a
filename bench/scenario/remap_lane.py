"""The CPU demo lane for in-place remap figures: a real ``pinsidecar run`` daemon, real vLLM CPU, maps of two
traffic classes at two geometries, and a remap (or a drain-reboot) measured under streaming clients.

Shared by ``tests/test_remap_in_place.py`` (what must hold) and ``bench/remap_in_place.py`` (the figures, side by
side with a drain-reboot on the same daemon), so both measure the same thing the same way:

- :func:`lane_maps` builds the usage maps of the demo's code and prose traffic from the demo model's routing under
  transformers (:func:`~pinsidecar.demo.model.routing_counts`: seconds, no engine boot), at 48 hot rows (the demo's
  geometry) and 56 (another geometry: only a reboot can deploy it), each with its counts beside it;
- :class:`RemapLane` is the daemon (a :class:`~pinsidecar.testing.daemon.DaemonUnderTest`), with the demo's config
  (:func:`~pinsidecar.demo.sidecar.demo_tables`) changed for remaps on demand: no automatic trips, no cooldown, the
  live source (a named map skips the count boot anyway);
- :meth:`RemapLane.remap_under_load` / :meth:`RemapLane.drain_reboot_under_load` run ``clients`` streaming clients
  through the gate (:func:`~pinsidecar.testing.streaming.load_during`), wait for a drift window of their traffic
  (a remap's decision is judged on one), do the thing, and return the record and the figures: the longest gap
  between two tokens a client saw *during* the deploy (within one stream, and counting a response's wait for its
  first token, which is what a held request sees), the requests failed and lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pinsidecar.demo.sidecar import SERVED_MODEL_NAME, DemoPorts, Sidecar, demo_tables, merge_tables
from pinsidecar.testing.daemon import DaemonUnderTest
from pinsidecar.testing.streaming import LoadResult, load_during

__all__: list[str] = []  # nothing here is another package's business

HOT_ROWS = 48  # the demo's geometry (pinsidecar.demo.options.DEFAULT_HOT_ROWS)
OTHER_HOT_ROWS = 56  # another geometry: the hot tensor changes shape, so only a reboot deploys it
EVENT_LIMIT_S = 900.0  # a boot on a loaded 2-core box can take minutes
# The lane's changes to the demo's config (remaps on demand, see the module docstring); ``overrides`` go over them.
LANE_CHANGES: dict[str, dict[str, Any]] = {
    "remap": {"source": "live", "verify_timeout_s": 120},
    "drift": {"cooldown_s": 0, "auto_remap": False, "max_remaps_per_day": 100},
}
LANE_NEW_KEYS = {"auto_remap", "max_remaps_per_day"}  # keys the demo's config leaves at their defaults


@dataclass(frozen=True)
class LaneMap:
    path: Path
    hash: str
    label: str


def lane_maps(model_dir: Path, maps: Path, hot_rows: tuple[int, ...] = (HOT_ROWS, OTHER_HOT_ROWS)
              ) -> dict[str, LaneMap]:
    """``{"code": ..., "prose": ..., "code-56": ..., "prose-56": ...}``: usage maps of each domain's training
    prompts, the counts beside each (the drift watch's reference). The first of ``hot_rows`` is the lane's own
    geometry (labelled by the domain alone), the others ``<domain>-<hot rows>``. The model's geometry (layers,
    experts, top-k) is whatever its ``config.json`` says; the routing runs the whole model under transformers on
    the CPU, in float32: seconds for the demo model, too much for a large one (give :func:`load_lane_maps`
    prebuilt maps there)."""
    from pinsidecar.demo.model import DOMAINS, load_prompts, routing_counts
    from pinsidecar.placement import build_usage_map
    from pinsidecar.remap.candidates import counts_path_for
    from pinsidecar.testing.artifacts import counts_from

    maps.mkdir(parents=True, exist_ok=True)
    geo = json.loads((model_dir / "config.json").read_text())
    out: dict[str, LaneMap] = {}
    for domain in DOMAINS:
        rows = routing_counts(model_dir, load_prompts(domain))
        counts = counts_from(rows, top_k=geo["num_experts_per_tok"], workload=domain)
        for hot in hot_rows:
            label = domain if hot == hot_rows[0] else f"{domain}-{hot}"
            emap = build_usage_map([counts], hot, label=label)
            path = maps / f"{label}.json"
            counts.save(counts_path_for(path))
            emap.save(path)
            out[label] = LaneMap(path, emap.content_hash, label)
    return out


def load_lane_maps(maps: Path) -> dict[str, LaneMap]:
    """Prebuilt lane maps in ``maps`` (``code.json``, ``prose.json``, ``prose-<H>.json``, ... each with its counts
    beside it, as :func:`lane_maps` writes them), keyed by file stem: for a model whose routing is too big to run
    under transformers here (a GPU lane's). A map without its counts is refused: the drift watch needs them."""
    from pinsidecar_hook.contract import load_map

    from pinsidecar.remap.candidates import COUNTS_SUFFIX, counts_path_for

    out: dict[str, LaneMap] = {}
    for path in sorted(maps.glob("*.json")):
        if path.name.endswith(COUNTS_SUFFIX):
            continue
        if not counts_path_for(path).is_file():
            raise FileNotFoundError(f"{path}: no counts beside it ({counts_path_for(path).name})")
        out[path.stem] = LaneMap(path, load_map(path).content_hash, path.stem)
    return out


def domain_prompts(domain: str) -> list[str]:
    """The demo's prompts of one traffic class (training and held-out), as text."""
    from pinsidecar.demo.model import load_prompts

    return [p["prompt"] for p in load_prompts(domain) + load_prompts(f"{domain}_heldout")]


@dataclass
class RemapLane:
    """One daemon on the CPU demo lane (see the module docstring): a :class:`DaemonUnderTest` on the demo's config.
    ``engine_env`` goes into ``[engine] env``; ``overrides`` (TOML table -> keys) go over the demo's config and the
    lane's changes to it, last: the heal scenario turns automatic remaps on there, and a GPU lane gives its engine
    keys (``enforce_eager = false``, ``dtype``, ``extra_args``, ...) that the CPU demo's config does not have."""

    tmp: Path
    model_dir: Path
    boot_map: Path
    engine_env: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    ports: DemoPorts | None = None
    daemon: DaemonUnderTest | None = None
    killed_at: float | None = None  # wall clock of the last kill_engine's SIGKILL

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def gate_url(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.gate}"

    @property
    def sidecar(self) -> Sidecar | None:
        return self.daemon.sidecar if self.daemon is not None else None

    @property
    def starts(self) -> int:
        return self.daemon.starts if self.daemon is not None else 0

    def _changes(self) -> dict[str, dict[str, Any]]:
        """The lane's changes and ``overrides`` over them, checked against the demo's config (the lane's changes
        assume the demo's keys: say so when the demo config moved on), with ``engine_env`` over the overrides'
        engine env (a GPU lane's), not instead of it."""
        assert self.ports is not None
        demo = demo_tables(model_dir=self.model_dir, map_path=self.boot_map, run_dir=self.tmp, ports=self.ports)
        for table, keys in LANE_CHANGES.items():
            missing = [k for k in keys if k not in demo.get(table, {}) and k not in LANE_NEW_KEYS]
            if missing:
                raise AssertionError(f"the demo config changed: [{table}] has no {missing}")
        changes = merge_tables(LANE_CHANGES, self.overrides)
        if self.engine_env:
            changes["engine"] = {**changes.get("engine", {}),
                                 "env": {**changes.get("engine", {}).get("env", {}), **self.engine_env}}
        return changes

    def start(self) -> dict[str, Any]:
        """Start the daemon (a new config from the current ``engine_env``) and wait until its engine serves."""
        if self.ports is None:
            self.ports = DemoPorts.free()  # the count engine's port is unused: the live source
        if self.daemon is None:
            self.daemon = DaemonUnderTest(self.tmp, self.model_dir, self.boot_map, ports=self.ports, base="demo",
                                          own_compile_cache=False, limit_s=EVENT_LIMIT_S)
        self.daemon.overrides = self._changes()
        st = self.daemon.start()
        assert st is not None
        return st

    def stop(self) -> dict[str, Any]:
        return self.daemon.stop() if self.daemon is not None else {}

    def restart(self, engine_env: dict[str, str]) -> dict[str, Any]:
        self.stop()
        self.engine_env = dict(engine_env)
        return self.start()

    # ------------------------------------------------------------------------------------------------ reading
    def status(self) -> dict[str, Any]:
        assert self.daemon is not None
        return self.daemon.status()

    def wait(self, what: str, done: Any, limit_s: float = EVENT_LIMIT_S) -> dict[str, Any]:
        assert self.daemon is not None
        return self.daemon.wait_status(done, what, limit_s, step_s=0.25)

    def record(self, remap_id: str) -> dict[str, Any]:
        return json.loads((self.state_dir / "remaps" / f"{remap_id}.json").read_text())

    def metrics(self) -> str:
        assert self.ports is not None
        return httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=10).text

    def stats(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "stats.json").read_text())

    def active_map(self) -> dict[str, Any] | None:
        p = self.state_dir / "active-map.json"
        return json.loads(p.read_text()) if p.exists() else None

    def _control(self) -> httpx.Client:
        assert self.daemon is not None
        return self.daemon.control(EVENT_LIMIT_S)

    def wait_for_windows(self, n: int) -> None:
        """Until ``n`` more drift windows have closed (judged ones: a remap is decided on the newest)."""
        start = self._window_index()

        def more(st: dict[str, Any]) -> bool:
            last = (st.get("drift") or {}).get("last_window") or {}
            return bool(last.get("judged")) and int(last.get("index", -1)) >= start + n

        self.wait(f"{n} more judged drift windows", more, 300.0)

    def _window_index(self) -> int:
        last = (self.status().get("drift") or {}).get("last_window") or {}
        return int(last.get("index", -1))

    # ------------------------------------------------------------------------------------------------ actions
    def request_remap(self, map_path: Path) -> str:
        with self._control() as c:
            r = c.post("/remap", json={"trigger": "manual", "map": str(map_path), "reason": "in-place figure"})
        if r.status_code != 202:
            raise AssertionError(f"POST /remap answered {r.status_code}: {r.text}")
        return str(r.json()["remap_id"])

    def wait_remap_end(self, remap_id: str) -> dict[str, Any]:
        def ended(st: dict[str, Any]) -> bool:
            last = st["remap"]["last"]
            return bool(last and last["id"] == remap_id and st["remap"]["current"] is None)

        self.wait(f"remap {remap_id} to end", ended)
        return self.record(remap_id)

    def drain_reboot(self, map_path: Path) -> dict[str, Any]:
        with self._control() as c:
            r = c.post("/drain-reboot", json={"map": str(map_path)})
        doc: dict[str, Any] = r.json()
        if r.status_code != 200:
            raise AssertionError(f"POST /drain-reboot answered {r.status_code}: {doc}")
        return doc

    def kill_engine(self) -> int:
        """SIGKILL the engine's whole process group (vLLM's API server and its engine core), as the kernel's OOM
        killer or a crash would end it."""
        pid = int(self.status()["engine"]["pid"])
        self.killed_at = time.time()  # the moment itself: what was in flight then is what the kill may fail
        os.killpg(pid, signal.SIGKILL)  # the engine leads its own process group
        return pid

    # ------------------------------------------------------------------------------------------------ figures
    async def remap_under_load(self, map_path: Path, prompts: list[str], *, clients: int = 8,
                               windows: int = 2) -> dict[str, Any]:
        """Stream ``prompts`` through the gate with ``clients`` clients, let ``windows`` drift windows of them
        close, remap onto ``map_path`` and wait for the remap to end; the record, and the longest waits during the
        apply request (or, when the remap fell back, the reboot)."""
        async def action() -> dict[str, Any]:
            await asyncio.to_thread(self.wait_for_windows, windows)
            remap_id = await asyncio.to_thread(self.request_remap, map_path)
            return await asyncio.to_thread(self.wait_remap_end, remap_id)

        result = await load_during(self.gate_url, SERVED_MODEL_NAME, action, clients=clients, prompts=prompts,
                                   limit_s=EVENT_LIMIT_S)
        rec: dict[str, Any] = result.action
        return {"record": rec, **_figures(result, _deploy_window(rec))}

    async def drain_reboot_under_load(self, map_path: Path, prompts: list[str], *,
                                      clients: int = 8) -> dict[str, Any]:
        """The same load around a drain-reboot onto ``map_path`` (the control API's, the one remaps fall back to)."""
        async def action() -> dict[str, Any]:
            t0 = time.time()
            res = await asyncio.to_thread(self.drain_reboot, map_path)
            return {"result": res, "window": (t0, time.time())}

        result = await load_during(self.gate_url, SERVED_MODEL_NAME, action, clients=clients, prompts=prompts,
                                   limit_s=EVENT_LIMIT_S)
        return {"drain_reboot": result.action["result"], **_figures(result, result.action["window"])}


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _deploy_window(rec: dict[str, Any]) -> tuple[float, float] | None:
    """Wall-clock start and end of the deploy: the candidate's apply request (sent to answered) when the remap
    applied in place, else the ``rebooting`` step."""
    reqs = ((rec.get("apply") or {}).get("requests") or [])
    if reqs and reqs[0].get("result") == "applied" and reqs[0].get("at"):
        t0 = _epoch(reqs[0]["at"])
        return t0, t0 + float(reqs[0].get("wait_s") or 0.0)
    for step in rec.get("steps") or []:
        if step["state"] == "rebooting":
            t0 = _epoch(step["at"])
            return t0, t0 + float(step["seconds"])
    return None


def _figures(result: LoadResult, window: tuple[float, float] | None) -> dict[str, Any]:
    fig = result.figure()
    out: dict[str, Any] = {"clients": fig["clients"], "sent": fig["sent"], "completed": fig["completed"],
                           "failed": fig["failed"], "lost": fig["lost"], "errors": fig["errors"],
                           "longest_stall_whole_run_s": fig["longest_stall_s"]}
    if window is not None:
        t0, t1 = window
        # within a stream: between two tokens of one response; any: also a response's wait for its first token
        # (what a client that streams request after request sees as its longest time without a token)
        out.update(deploy_window_s=round(t1 - t0, 3),
                   longest_gap_within_stream_s=round(result.longest_gap(t0, t1, "token"), 3),
                   longest_gap_s=round(result.longest_gap(t0, t1, None), 3))
    return out
