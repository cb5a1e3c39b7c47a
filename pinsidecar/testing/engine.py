"""Boot a real vLLM CPU server with the hook in a given mode, for tests and benchmarks.

Booting vLLM costs 15-60 s on a small CI box, so tests must share boots; and every test that needs an engine
needs the same things (a free port, the demo model, a hook config, a temp compile cache, a clean stop). They live
here, once, as public API (like ``structlog.testing``), and import without pytest:

- :func:`start_engine` - start the engine with the hook in ``off``/``count``/``pin`` mode and wait until it
  serves; returns a :class:`HookedEngine` (an :class:`~pinsidecar.engine.EngineProcess` that knows its hook
  files), usable as a context manager;
- :func:`free_port` - :func:`pinsidecar.engine.ports.free_port`, here because tests reach for it next to
  :func:`start_engine` (``$PINSIDECAR_TEST_PORTS`` keeps a run's ports in its own range).

The pytest fixtures around them (``demo_model_dir``, ``engine_factory``) are in
:mod:`pinsidecar.testing.fixtures`, loaded once per session by ``pytest_plugins`` in ``conftest.py``.

Engines started here are built by :func:`pinsidecar.engine.hooked_spec` and run by
:class:`pinsidecar.engine.EngineProcess`, exactly as production builds and runs them, never by a private copy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from pinsidecar_hook.contract import CountsArtifact, load_counts
from pinsidecar_hook.contract.env import HookConfig

from pinsidecar.engine import EngineConfig, EngineProcess, EngineSpec, free_port, hooked_spec
from pinsidecar.testing.wait import wait_until

__all__: list[str] = []  # nothing here is another package's business

# Boot timeout for tests: a cold torch.compile on a busy 2-core box can take minutes; eager boots take ~20-60 s.
BOOT_TIMEOUT_S = 900.0
# Tests flush often so a "periodic flush" test does not wait long; production uses the hook's default.
TEST_FLUSH_INTERVAL_S = 1.0
# A model folder built beforehand (e.g. once per CI job) instead of building the demo model per session.
MODEL_DIR_ENV = "PINSIDECAR_TEST_MODEL_DIR"
# Prompts for greedy comparisons between placements of one model (a map must not change a token): code and prose,
# so that both domains' hot experts route; 12 tokens each, enough for generated text to route too.
PARITY_PROMPTS = (
    "def parse_rows(items, node):\n    total = 0\n    for x in items:\n",
    "The old lighthouse keeper walked along the shore and",
    "for node in range(391):\n    if node % 9 == 0:\n",
    "In the morning the market was already full of",
)
PARITY_MAX_TOKENS = 12


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

    def greedy(self, prompt: str, max_tokens: int = PARITY_MAX_TOKENS) -> dict[str, list[Any]]:
        """One greedy completion of exactly ``max_tokens`` tokens (EOS ignored): its token ids and their logprobs,
        what two placements of the same model must agree on."""
        lp = self.complete(prompt, max_tokens=max_tokens, logprobs=1, return_tokens_as_token_ids=True,
                           ignore_eos=True)["choices"][0]["logprobs"]
        return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]}

    def greedy_outputs(self, prompts: tuple[str, ...] = PARITY_PROMPTS,
                       max_tokens: int = PARITY_MAX_TOKENS) -> list[dict[str, list[Any]]]:
        """:meth:`greedy` of each prompt, in order."""
        return [self.greedy(p, max_tokens) for p in prompts]

    def hook_request(self, op: str, timeout_s: float = 60.0) -> CountsArtifact:
        """Send ``flush``/``reset`` to the count hook and return the counts file that answers it."""
        from pinsidecar.counts.count_boot import request_counts

        return request_counts(self.counts_path, op, self, timeout_s)

    def wait_for_counts(self, predicate: Callable[[CountsArtifact], bool], timeout_s: float = 60.0) -> CountsArtifact:
        """Poll the counts file until ``predicate`` holds (e.g. a periodic flush happened). A file not written yet,
        or mid-replace on a slow file system, is "not yet"."""
        def holds() -> CountsArtifact | None:
            counts = load_counts(self.counts_path)
            return counts if predicate(counts) else None

        return wait_until(holds, f"the counts at {self.counts_path} to satisfy the condition", timeout_s,
                          step_s=0.1, ignore=(Exception,), gone=lambda: None if self.alive() else "the engine exited")


def start_engine(model_dir: Path, mode: str = "count", tmp_path: Path | None = None, *, port: int | None = None,
                 flush_interval_s: float = TEST_FLUSH_INTERVAL_S, map_path: Path | None = None,
                 stats_path: Path | None = None, workload: str = "test", hook_env: dict[str, str] | None = None,
                 boot_timeout_s: float = BOOT_TIMEOUT_S, **engine_keys: Any) -> HookedEngine:
    """Start an engine on ``model_dir`` with the hook in ``mode`` and wait until it serves.

    Hook files go under ``tmp_path`` (a temp dir if None): ``counts.json`` in count mode, ``stats.json`` in pin
    mode (``map_path`` is required there); so does the compile cache, so tests never share one with a user.
    ``engine_keys`` are ``[engine]`` keys (:class:`~pinsidecar.engine.EngineConfig`: ``enforce_eager`` (default
    on here, for a fast boot), ``extra_args``, ``env``, ``shutdown_timeout_s``, ``log_path``...); ``hook_env``
    is applied after the hook's own variables (to try a setting the hook config does not expose). On a boot
    failure the process is stopped and the error re-raised.
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
    engine_keys.setdefault("enforce_eager", True)
    engine_keys["env"] = {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), **engine_keys.get("env", {})}
    log_path = engine_keys.pop("log_path", tmp / f"engine-{mode}.log")
    spec = hooked_spec(EngineConfig(model=Path(model_dir), **engine_keys), hook, port=port or free_port(),
                       log_path=log_path)
    spec.env.update(hook_env or {})
    engine = HookedEngine(spec, hook)
    engine.start()
    try:
        engine.boot_s = engine.wait_ready(boot_timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine
