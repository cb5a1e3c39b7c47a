"""Fixture sources for the exporter: a fake NVML, an engine ``/metrics`` over real HTTP, cgroup and /proc trees.

The exporter's collectors take their inputs as constructor arguments (cgroup root, /proc root, stats path, NVML
module) or as callables asked at every scrape (the engine's pid, container id and URL; a :class:`LiveValue` is one
that a test changes between scrapes), precisely so that tests can hand them these. Everything here is named for
what it fakes, and only NVML is an in-process fake (no NVML can exist on CI); the engine endpoint is a real HTTP
server on loopback and the cgroup and /proc trees are real files laid out like the kernel's.
"""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any, Generic, TypeVar

from pinsidecar_hook.contract import StatsSnapshot

__all__: list[str] = []  # nothing here is another package's business

T = TypeVar("T")

# What vLLM 0.32's /metrics looks like (names, labels, _created lines), trimmed to the series the exporter reads
# plus neighbours it must ignore. ``{tokens}`` is replaced by the generation token count.
VLLM_METRICS_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 8123.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="demo"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="demo"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="demo"} 5120.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="demo"} 1.7644e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="demo"} {tokens}
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="demo"} 1.7644e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="demo"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="demo"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="demo"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="demo"} 0.84
"""


@dataclass
class LiveValue(Generic[T]):
    """A live input for the exporter that a test changes between scrapes: ``pid = LiveValue(4242)``,
    ``Exporter(engine_pid=pid, ...)``, later ``pid.value = None`` (the engine is gone)."""

    value: T | None = None

    def __call__(self) -> T | None:
        return self.value


class FakeEngineMetrics:
    """An HTTP server on loopback serving :data:`VLLM_METRICS_TEXT` at ``/metrics`` with a settable token count
    and status code. A context manager; ``url`` is the base URL."""

    def __init__(self, tokens: float = 1000.0) -> None:
        self.tokens = tokens
        self.status = 200
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = VLLM_METRICS_TEXT.replace("{tokens}", repr(float(fake.tokens))).encode()
                self.send_response(fake.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeEngineMetrics:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class FakeNvml:
    """A fake of the few ``pynvml`` functions the GPU collector calls, for machines without NVML: ``count`` GPUs
    of ``total`` bytes, GPU i using (i + 1) x ``used_step`` bytes. ``fail_query`` makes queries raise (a lost GPU).
    """

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 2, total: int = 150_000_000_000, used_step: int = 10_000_000_000,
                 fail_query: bool = False) -> None:
        self.count = count
        self.total = total
        self.used_step = used_step
        self.fail_query = fail_query
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.fail_query:
            raise self.NVMLError("GPU is lost")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-fake-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        used = (handle + 1) * self.used_step
        return SimpleNamespace(total=self.total, used=used, free=self.total - used)


def write_cgroup_tree(cgroup_root: Path, rel: str = "system.slice/engine.scope", *, current: int = 4294967296,
                      max_value: str = "68719476736", anon: int = 1073741824, file: int = 3221225472,
                      shmem: int = 2147483648) -> Path:
    """A cgroup v2 directory with memory.current, memory.max and memory.stat, as the kernel lays them out."""
    cg = cgroup_root / rel
    cg.mkdir(parents=True, exist_ok=True)
    (cg / "memory.current").write_text(f"{current}\n")
    (cg / "memory.max").write_text(f"{max_value}\n")
    (cg / "memory.stat").write_text(f"anon {anon}\nfile {file}\nkernel 12345\nshmem {shmem}\nfile_mapped 100\n")
    return cg


def write_proc_cgroup(proc_root: Path, pid: int, rel: str = "/system.slice/engine.scope") -> Path:
    """``<proc_root>/<pid>/cgroup`` of a hybrid host: v1 hierarchies first, then the cgroup v2 ``0::`` line."""
    d = proc_root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup").write_text(f"4:memory:/something/else\n1:name=systemd:/x\n0::{rel}\n")
    return proc_root


def make_stats(boot: str = "b1", seq: int = 1, sel: tuple[int, ...] = (100, 200), cold: tuple[int, ...] = (2, 10),
               errors: dict[str, int] | None = None, written_at: float = 1000.0) -> StatsSnapshot:
    """A pin-mode stats snapshot for two MoE layers (ids 0 and 3) of 8 experts, top-2."""
    return StatsSnapshot(boot_id=boot, seq=seq, layer_ids=[0, 3], num_experts=8, top_k=2, selections=list(sel),
                         cold_selections=list(cold), tokens=sum(sel) // 2, map_hash="sha256:feed", map_label="code",
                         pid=4242, written_at=written_at, tier_bytes={"hbm": 6 * 2**20, "host": 2 * 2**20},
                         errors=errors if errors is not None else {"stats_write": 1})
