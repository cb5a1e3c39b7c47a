"""Test helpers that boot a real vLLM CPU server with the hook in a given mode, and pytest fixtures around them.

Booting vLLM costs 15-60 s on a small CI box, so tests must share boots; and every test that needs an engine
needs the same things (a free port, the demo model, a hook config, a temp compile cache, a clean stop). They live
here, once, as public API (like ``structlog.testing``):

- :func:`free_port` - a free TCP port, from a range if given (helpers on a shared box each own a range);
- :func:`start_engine` - start the engine with the hook in ``off``/``count``/``pin`` mode and wait until it
  serves; returns a :class:`HookedEngine` (an :class:`~pinsidecar.engine.EngineProcess` that knows its hook
  files), usable as a context manager;
- fixtures, for ``pytest_plugins = ["pinsidecar.testing.engine"]`` in a ``conftest.py`` (or import them by name):
  ``demo_model_dir`` (session: the demo model, built once), ``engine_factory`` (session: starts engines and
  stops every one of them at the end of the session, so a module can keep one boot for all its tests).

Engines started here always use :mod:`pinsidecar.engine`, the same launcher as production, never a private one.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pinsidecar_hook.contract import CountsArtifact, load_counts, write_hook_request
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.engine import EngineProcess, EngineSpec, port_in_use

__all__ = [
    "HookedEngine",
    "demo_model_dir",
    "engine_factory",
    "free_port",
    "start_engine",
]

# Boot timeout for tests: a cold torch.compile on a busy 2-core box can take minutes; eager boots take ~20-60 s.
BOOT_TIMEOUT_S = 900.0
# Tests flush often so a "periodic flush" test does not wait long; production uses the hook's default.
TEST_FLUSH_INTERVAL_S = 1.0
# PINSIDECAR_TEST_PORTS="8150-8199" restricts free_port() to a range (each helper on a shared box owns one).
PORT_RANGE_ENV = "PINSIDECAR_TEST_PORTS"
# A model folder built beforehand (e.g. once per CI job) instead of building the demo model per session.
MODEL_DIR_ENV = "PINSIDECAR_TEST_MODEL_DIR"


def free_port(lo: int | None = None, hi: int | None = None, host: str = "127.0.0.1") -> int:
    """A port nobody listens on now: the first free one in ``lo..hi`` (or ``$PINSIDECAR_TEST_PORTS``), else one
    the OS picks."""
    if lo is None and os.environ.get(PORT_RANGE_ENV):
        a, _, b = os.environ[PORT_RANGE_ENV].partition("-")
        lo, hi = int(a), int(b or a)
    if lo is not None:
        for port in range(lo, (hi if hi is not None else lo) + 1):
            if not port_in_use(host, port):
                return port
        raise RuntimeError(f"no free port in {lo}-{hi}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class HookedEngine(EngineProcess):
    """An engine started by :func:`start_engine`: the process plus its hook configuration and small helpers."""

    def __init__(self, spec: EngineSpec, hook: HookConfig) -> None:
        super().__init__(spec)
        self.hook = hook
        self.boot_s = 0.0

    @property
    def counts_path(self) -> Path:
        assert self.hook.counts_path is not None, "not a count-mode engine"
        return self.hook.counts_path

    def complete(self, prompt: str, max_tokens: int = 8, **body: Any) -> dict[str, Any]:
        """One completion request (temperature 0); returns the response JSON, raising on an HTTP error."""
        resp = httpx.post(f"{self.base_url}/v1/completions", timeout=300.0, json={
            "model": self.spec.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **body})
        resp.raise_for_status()
        return resp.json()

    def hook_request(self, op: str, timeout_s: float = 60.0) -> CountsArtifact:
        """Send ``flush``/``reset`` to the count hook and return the counts file that answers it."""
        from pinsidecar.runs.count_boot import wait_for_token

        return wait_for_token(self.counts_path, write_hook_request(self.counts_path, op), self, timeout_s)

    def wait_for_counts(self, predicate: Callable[[CountsArtifact], bool], timeout_s: float = 60.0) -> CountsArtifact:
        """Poll the counts file until ``predicate`` holds (e.g. a periodic flush happened)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                counts = load_counts(self.counts_path)
                if predicate(counts):
                    return counts
            except Exception as exc:  # not written yet, or mid-replace on a slow FS
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"counts at {self.counts_path} never satisfied the condition ({last})")


def start_engine(model_dir: Path, mode: str = "count", tmp_path: Path | None = None, *, port: int | None = None,
                 flush_interval_s: float = TEST_FLUSH_INTERVAL_S, map_path: Path | None = None,
                 stats_path: Path | None = None, workload: str = "test", hook_env: dict[str, str] | None = None,
                 boot_timeout_s: float = BOOT_TIMEOUT_S, **spec_kwargs: Any) -> HookedEngine:
    """Start an engine on ``model_dir`` with the hook in ``mode`` and wait until it serves.

    Hook files go under ``tmp_path`` (a temp dir if None): ``counts.json`` in count mode, ``stats.json`` in pin
    mode (``map_path`` is required there). ``spec_kwargs`` go to :class:`EngineSpec` (``enforce_eager``,
    ``extra_args``, ``env``...). On a boot failure the process is stopped and the error re-raised.
    """
    tmp = Path(tmp_path) if tmp_path is not None else Path(tempfile.mkdtemp(prefix="pinsidecar-engine-"))
    tmp.mkdir(parents=True, exist_ok=True)
    hook = HookConfig(
        mode=mode,
        counts_path=tmp / "counts.json" if mode == "count" else None,
        map_path=map_path,
        stats_path=(stats_path or tmp / "stats.json") if mode == "pin" else None,
        flush_interval_s=flush_interval_s, workload=workload,
    )
    env = {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), **spec_kwargs.pop("env", {}), **hook.to_env(),
           **(hook_env or {})}
    spec = EngineSpec(model=Path(model_dir), port=port or free_port(), env=env,
                      log_path=spec_kwargs.pop("log_path", tmp / f"engine-{mode}.log"), **spec_kwargs)
    engine = HookedEngine(spec, hook)
    engine.start()
    try:
        engine.boot_s = engine.wait_ready(boot_timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (``pinsidecar.demo.model``), built once per session; ``$PINSIDECAR_TEST_MODEL_DIR`` points
    the tests at a model folder built beforehand instead."""
    prebuilt = os.environ.get(MODEL_DIR_ENV, "").strip()
    if prebuilt:
        if not (Path(prebuilt) / "config.json").is_file():
            raise pytest.UsageError(f"{MODEL_DIR_ENV}={prebuilt} has no config.json (build it with `pinsidecar "
                                    "demo-model DIR` or unset the variable)")
        return Path(prebuilt)
    from pinsidecar.demo.model import build_demo_model

    return Path(build_demo_model(tmp_path_factory.mktemp("demo-model") / "model"))


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., HookedEngine]]:
    """``engine_factory(model_dir, mode="count", **kw)`` -> a ready :class:`HookedEngine`; all are stopped at the
    end of the session (or earlier by the test with ``.stop()``)."""
    started: list[HookedEngine] = []

    def factory(model_dir: Path, mode: str = "count", **kwargs: Any) -> HookedEngine:
        kwargs.setdefault("tmp_path", tmp_path_factory.mktemp(f"engine-{mode}"))
        eng = start_engine(model_dir, mode, **kwargs)
        started.append(eng)
        return eng

    yield factory
    for eng in started:
        eng.stop()
