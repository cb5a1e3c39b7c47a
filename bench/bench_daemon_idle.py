"""What does the sidecar cost when nothing happens? Issue 4's budget: RSS <= 80 MiB and CPU <= 1 % of a core,
with Prometheus scraping ``/metrics`` every second.

Starts the real daemon (``pinsidecar run``, as the systemd unit does) supervising the real vLLM CPU engine with
the demo model, waits for ``READY=1`` on a notify socket, lets it settle, then measures **the daemon process
alone** (the engine is a separate process group and is not counted) in two phases, side by side:

- ``idle``: no traffic, no scrapes (the liveness loop, the systemd watchdog pings and the maps watcher only);
- ``scraped``: a scrape of the daemon's ``/metrics`` every ``--scrape-interval`` seconds (each scrape also reads
  the engine's ``/metrics``, the cgroup and host memory).

CPU is the process's user+system CPU time over the phase divided by its wall time (100 % = one core); RSS is
sampled every second (max and mean), USS at the end.

Run: ``python bench/bench_daemon_idle.py [--model DIR] [--seconds 60] [--out bench/results/daemon_idle.json]``.
Without ``--model`` the demo model is built into a temporary folder. Prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

__all__ = ["main"]

RSS_BUDGET_MIB = 80.0  # issue 4
CPU_BUDGET_PCT = 1.0  # issue 4: percent of one core
PORTS = {"gate": 8290, "engine": 8291, "control": 8292, "metrics": 8293}


def _config(tmp: Path, model: Path) -> Path:
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model}"
served_model_name = "demo"
port = {PORTS['engine']}
enforce_eager = true
ready_timeout_s = 900
[gate]
port = {PORTS['gate']}
[control]
port = {PORTS['control']}
token_file = "{tmp}/control.token"
create_token = true
[metrics]
port = {PORTS['metrics']}
nvml = false
[maps]
dir = "{tmp}/maps"
[daemon]
state_dir = "{tmp}/state"
log_level = "warning"
""")
    return cfg


def _wait_ready(sock: socket.socket, proc: subprocess.Popen[bytes], limit_s: float) -> float:
    t0 = time.monotonic()
    sock.settimeout(1.0)
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited with {proc.returncode} before READY=1")
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            continue
        if "READY=1" in msg.splitlines():
            return time.monotonic() - t0
    raise SystemExit(f"no READY=1 within {limit_s} s")


def _drain(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.5)
    while not stop.is_set():
        try:
            sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return


def _phase(proc: psutil.Process, seconds: float, scrape_interval: float | None) -> dict[str, Any]:
    rss: list[int] = []
    scrape_ms: list[float] = []
    failures = 0
    c0, t0 = proc.cpu_times(), time.monotonic()
    next_tick = t0
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() - t0 < seconds:
            rss.append(proc.memory_info().rss)
            if scrape_interval is not None:
                s0 = time.perf_counter()
                try:
                    r = client.get(f"http://127.0.0.1:{PORTS['metrics']}/metrics")
                    failures += int(r.status_code != 200)
                except httpx.HTTPError:
                    failures += 1
                scrape_ms.append((time.perf_counter() - s0) * 1e3)
            next_tick += scrape_interval or 1.0
            time.sleep(max(0.0, next_tick - time.monotonic()))
    c1, t1 = proc.cpu_times(), time.monotonic()
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    out: dict[str, Any] = {
        "seconds": round(t1 - t0, 2),
        # CPU time inflates on a contended box (shared caches, SMT): read the figure together with the load
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "cpu_pct_of_core": round(100.0 * cpu_s / (t1 - t0), 3),
        "rss_mib_max": round(max(rss) / 2**20, 1),
        "rss_mib_mean": round(statistics.fmean(rss) / 2**20, 1),
        "uss_mib_end": round(proc.memory_full_info().uss / 2**20, 1),
    }
    if scrape_interval is not None:
        out.update(scrapes=len(scrape_ms), scrape_failures=failures,
                   scrape_ms_p50=round(statistics.median(scrape_ms), 2),
                   scrape_ms_max=round(max(scrape_ms), 2))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the demo model)")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds to wait after READY=1")
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    from pinsidecar import log as pslog

    pslog.configure("warning", json_logs=False)  # logs to stderr: stdout carries only the JSON document

    with tempfile.TemporaryDirectory(prefix="pinsidecar-idle-") as tmp_s:
        tmp = Path(tmp_s)
        model = args.model
        if model is None:
            from pinsidecar.demo.model import build_demo_model

            model = Path(build_demo_model(tmp / "model"))
        cfg = _config(tmp, model.resolve())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(tmp / "notify.sock"))
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp / "notify.sock"), "WATCHDOG_USEC": "30000000",
               "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
        exe = str(Path(sys.executable).parent / "pinsidecar")
        with open(tmp / "daemon.log", "wb") as log:
            proc = subprocess.Popen([exe, "run", "--config", str(cfg)], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        stop = threading.Event()
        try:
            boot_s = _wait_ready(sock, proc, 900.0)
            threading.Thread(target=_drain, args=(sock, stop), daemon=True).start()
            time.sleep(args.settle)
            p = psutil.Process(proc.pid)
            idle = _phase(p, args.seconds, None)
            scraped = _phase(p, args.seconds, args.scrape_interval)
        finally:
            stop.set()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            sock.close()
    worst_rss = max(idle["rss_mib_max"], scraped["rss_mib_max"])
    worst_cpu = max(idle["cpu_pct_of_core"], scraped["cpu_pct_of_core"])
    result = {
        "benchmark": "daemon_idle",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                 "load_avg_1m": round(os.getloadavg()[0], 2)},
        "engine_boot_to_ready_s": round(boot_s, 1),
        "idle": idle,
        f"scraped_every_{args.scrape_interval:g}s": scraped,
        "budget": {"rss_mib": RSS_BUDGET_MIB, "cpu_pct_of_core": CPU_BUDGET_PCT},
        "ratios_to_budget": {"rss": round(worst_rss / RSS_BUDGET_MIB, 3),
                             "cpu": round(worst_cpu / CPU_BUDGET_PCT, 3)},
        "within_budget": worst_rss <= RSS_BUDGET_MIB and worst_cpu <= CPU_BUDGET_PCT,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
