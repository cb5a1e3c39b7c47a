"""The daemon's configuration: one TOML file, validated completely on load.

Why so strict: a daemon that starts with a typo'd key silently ignores what the operator asked for, and one that
starts with a missing model folder fails 20 s later inside vLLM with a message that names neither the file nor
the key. So :func:`load_config` refuses unknown keys, wrong types, bad ports and missing files, and every error
names the key the way it is written in the file (``engine.port: expected an integer 1-65535, got 'abc'``).

The file has one table per part of the daemon (``[engine]``, ``[container]``, ``[supervisor]``, ``[gate]``,
``[control]``, ``[metrics]``, ``[maps]``, ``[daemon]``, ``[drift]``, ``[remap]``); each maps onto one frozen
dataclass, whose fields are the allowed keys, validated by the one table validator (:mod:`pinsidecar.schema`). The
engine's tables live with the engine (:class:`~pinsidecar.engine.spec.EngineConfig`,
:class:`~pinsidecar.engine.container.ContainerConfig`), so the count boot reads ``[engine]`` from this same file
with the same rules; the drift watch's table lives with the drift watch
(:class:`~pinsidecar.drift.config.DriftConfig`) and the remap pipeline's with the pipeline
(:class:`~pinsidecar.remap.config.RemapConfig`). Relative paths are taken relative to the config file's folder.
``overrides`` (dotted keys, e.g. ``{"engine.model": "/models/demo"}``) are applied before validation, so a
command-line override is checked exactly like the file.

Where keys live (``docs/configuration.md``): what an operator sets stays at the top of each table; the tuning keys
(waits, intervals, sizes, budgets) are in ``[section.advanced]`` and the engine's vLLM flags in ``[engine.vllm]``.
The dataclasses do not change with the layout (a field keeps its attribute name), so nothing that reads a
:class:`Config` knows about it. A file of the old layout still loads: each key at its old place is a
:class:`~pinsidecar.schema.Deprecation` in :attr:`Config.deprecations`, logged as a warning that names the new
place, and listed by ``pinsidecar check-config``; a key at both places is an error naming both.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar.daemon.webhook import DEFAULT_REMAP_ALERTS
from pinsidecar.drift.config import DRIFT_SECTION, DriftConfig, check_drift_config
from pinsidecar.engine.container import ContainerConfig
from pinsidecar.engine.spec import (
    ENGINE_SECTION,
    EngineConfig,
    EngineSpec,
    check_engine_config,
    hooked_spec,
    parse_engine_table,
)
from pinsidecar.remap.config import REMAP_SECTION, RemapConfig, check_remap_config, resolve_workloads
from pinsidecar.schema import (
    ADVANCED,
    CHOICES,
    MIN,
    POSITIVE,
    ConfigError,
    Deprecation,
    Problems,
    apply_override,
    build_section,
    closest,
    document_schema,
    has_field,
    key_name,
    port_field,
    read_toml,
    replace_section,
    set_field,
    usable,
    warn_deprecations,
    written_key,
)

__all__ = ["ConfigError", "laid_out", "load_config"]

DEFAULT_CONFIG_PATH = Path("/etc/pinsidecar/pinsidecar.toml")
# The committed JSON schema of the file (tests/test_schema.py keeps it current); the examples point editors at it
# with taplo's `#:schema ./pinsidecar.schema.json` line.
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "examples" / "pinsidecar.schema.json"


@dataclass(frozen=True)
class SupervisorConfig:
    """Liveness, restarts and the crash-loop limit. The limit is the operator's; probes and backoff are tuning."""

    health_interval_s: float = field(default=2.0, metadata={POSITIVE: True, **ADVANCED})
    health_timeout_s: float = field(default=5.0, metadata={POSITIVE: True, **ADVANCED})
    # A live process whose /health fails this many checks in a row is restarted (one miss is a GC pause).
    health_failures: int = field(default=3, metadata={POSITIVE: True, **ADVANCED})
    backoff_initial_s: float = field(default=1.0, metadata={POSITIVE: True, **ADVANCED})
    backoff_max_s: float = field(default=60.0, metadata={POSITIVE: True, **ADVANCED})
    # After this many failed boots / crashes in a row (without a stable run in between) stop restarting.
    crash_loop_limit: int = field(default=5, metadata={POSITIVE: True})
    # An engine that stays ready this long resets the crash count and the backoff.
    stable_after_s: float = field(default=120.0, metadata={POSITIVE: True, **ADVANCED})
    # A boot this many times slower than the last one with the same geometry is flagged as a compile-cache miss.
    cache_miss_factor: float = field(default=2.0, metadata={POSITIVE: True, **ADVANCED})
    # ...and at least this many seconds slower (a 3 s boot becoming 7 s is noise, not a recompile).
    cache_miss_min_s: float = field(default=10.0, metadata={MIN: 0, **ADVANCED})


@dataclass(frozen=True)
class GateConfig:
    """The reverse proxy in front of the engine; clients talk to it, never to the engine directly."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = port_field(8080)
    max_queue: int = field(default=256, metadata={POSITIVE: True, **ADVANCED})  # requests held during a reboot
    max_hold_s: float = field(default=300.0, metadata={POSITIVE: True, **ADVANCED})  # longest a held request waits
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata={POSITIVE: True, **ADVANCED})
    # an engine that sends nothing (no header, no chunk) for this long is hung: the request gets 504
    upstream_idle_timeout_s: float = field(default=600.0, metadata={POSITIVE: True, **ADVANCED})
    capture_dir: Path | None = None  # opt-in request capture store; absent = off
    capture_max_bytes: int = field(default=256 * 1024 * 1024, metadata={MIN: 8192, **ADVANCED})  # total, over all files
    capture_max_files: int = field(default=8, metadata={POSITIVE: True, **ADVANCED})
    capture_sample_rate: float = field(default=1.0, metadata={MIN: 0})


@dataclass(frozen=True)
class ControlConfig:
    """The control API (status, drain-reboot, remap). Loopback TCP by default, or a unix socket."""

    host: str = "127.0.0.1"
    port: int = port_field(8090)
    unix_socket: Path | None = None  # when set, listen here instead of host:port
    token_file: Path | None = None  # bearer token for mutating calls; the file must have mode 0600
    create_token: bool = False  # create token_file (random, 0600) when it does not exist
    max_body_bytes: int = field(default=64 * 1024, metadata={POSITIVE: True, **ADVANCED})
    drain_timeout_s: float = field(default=120.0, metadata={POSITIVE: True, **ADVANCED})  # default for drain-reboot
    # Alertmanager alerts that may start a remap through POST /remap (the rules labelled action="remap" in
    # grafana/alerts.yml); a delivery naming any other alert is refused with 422 and does nothing.
    remap_alerts: list[str] = field(default_factory=lambda: list(DEFAULT_REMAP_ALERTS))


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus exporter."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = port_field(9108)
    cgroup_root: Path = field(default=Path("/sys/fs/cgroup"), metadata=ADVANCED)  # where cgroup v2 is mounted
    nvml: bool = True


@dataclass(frozen=True)
class MapsConfig:
    """The maps library folder, watched for new maps (activation only by command or remap policy)."""

    dir: Path | None = None  # default <daemon.state_dir>/maps
    watch: bool = True


@dataclass(frozen=True)
class DaemonConfig:
    """The daemon itself: where it keeps its state (hook files, remap records, the engine log), and how it logs."""

    state_dir: Path = Path("/var/lib/pinsidecar")
    log_level: str = field(default="info", metadata={CHOICES: ("debug", "info", "warning", "error")})
    json_logs: str = field(default="auto", metadata={CHOICES: ("auto", "yes", "no")})


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
    drift: DriftConfig = field(default_factory=DriftConfig)
    remap: RemapConfig = field(default_factory=RemapConfig)
    path: Path | None = None  # the file it came from
    # Keys the file sets at their old place: they work, and `pinsidecar check-config` lists where they belong.
    deprecations: tuple[Deprecation, ...] = ()

    @property
    def maps_dir(self) -> Path:
        return self.maps.dir or self.daemon.state_dir / "maps"

    def engine_spec(self, map_path: Path | None = None) -> EngineSpec:
        """The serving engine, with the hook of ``[engine]`` booted with ``map_path`` (default: ``engine.map``);
        hook files and the engine log under ``daemon.state_dir`` unless the table names them."""
        state = self.daemon.state_dir
        return hooked_spec(self.engine, self.engine.hook_config(state, map_path),
                           log_path=self.engine.log_path or state / "engine.log")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("path", "deprecations"):
                continue
            out[f.name] = {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
        return out


_SECTION_TYPES: dict[str, type] = {
    ENGINE_SECTION: EngineConfig, "container": ContainerConfig, "supervisor": SupervisorConfig, "gate": GateConfig,
    "control": ControlConfig, "metrics": MetricsConfig, "maps": MapsConfig, "daemon": DaemonConfig,
    DRIFT_SECTION: DriftConfig, REMAP_SECTION: RemapConfig,
}


def laid_out(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (tables keyed by field name, as code builds them) with every key moved to its place in the current
    layout (``drift.window_tokens`` to ``[drift.advanced]``, ``engine.enforce_eager`` to ``[engine.vllm]`` as
    ``enforce-eager``). A config the package writes for an operator (the demo's, the tests' daemons) must load
    without a deprecation warning: otherwise the first thing the demo shows is thirteen warnings about its own
    file. ``doc`` itself is not changed; unknown sections and keys are left for the loader to refuse; a key set
    both ways is refused here, as the loader would."""
    out: dict[str, Any] = {}
    for name, table in doc.items():
        cls = _SECTION_TYPES.get(name)
        if cls is None or not isinstance(table, dict):
            out[name] = table
            continue
        placed = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in [k for k in table if k in fields]:
            value = placed.pop(key)
            if has_field(placed, cls, key):  # tables merged from two layouts: which one meant it is not ours to say
                raise ConfigError(f"{name}.{key} and {key_name(name, cls, key)}: the same key set in two places "
                                  "(keep one)")
            set_field(placed, cls, key, value)
        out[name] = placed
    return out


def parse_config(doc: dict[str, Any], base: Path, path: Path | None = None, check_paths: bool = True) -> Config:
    """Validate an already-parsed TOML document (``base``: the folder relative paths are taken from).
    ``check_paths=False`` skips "does this file exist" checks (for clients of a daemon that runs elsewhere).
    Keys at their old place load and are listed in :attr:`Config.deprecations` (not logged here). Raises one
    :class:`ConfigError` holding every problem of the document, in the order of the file."""
    problems = Problems()
    found: list[Deprecation] = []
    sections: dict[str, Any] = {}
    for name in [*doc, *(n for n in _SECTION_TYPES if n not in doc)]:  # the file's order, for the messages
        cls = _SECTION_TYPES.get(name)
        raw = doc.get(name, {})
        if cls is None:
            near = closest(str(name), _SECTION_TYPES)
            hint = f"did you mean [{near}]? " if near else ""
            problems.add(f"{name}: unknown section ({hint}allowed: {', '.join(_SECTION_TYPES)})")
        elif name == ENGINE_SECTION:  # [engine.vllm] is the engine's command line: its own reader
            sections[name] = parse_engine_table(raw, base, check_paths, found, problems=problems)
        else:
            sections[name] = build_section(name, cls, raw, base, check_paths, deprecations=found, problems=problems)
    remap = sections[REMAP_SECTION]  # its workload list is relative to the file's folder, like the paths
    sections[REMAP_SECTION] = replace_section(remap, workloads=[str(w) for w in resolve_workloads(remap, base)])
    cfg = Config(**sections, path=path, deprecations=tuple(found))
    _cross_check(cfg, problems, check_paths)
    problems.raise_any()
    return cfg


def _cross_check(cfg: Config, problems: Problems, check_paths: bool = True) -> None:
    """The checks across tables (and the engine's, drift's and remap's own), each skipped where a value it
    involves was already refused."""
    e = cfg.engine
    check_engine_config(e, problems=problems)
    check_drift_config(cfg.drift, problems=problems)
    check_remap_config(cfg.remap, base=None, engine_port=e.port, check_paths=check_paths, problems=problems)
    if e.launcher == "container" and not cfg.container.image and usable(e, "launcher"):
        problems.add('container.image: required when engine.launcher = "container" (name the vLLM image, e.g. '
                     'image = "vllm/vllm-openai:v0.33.0")')
    c = cfg.control
    if c.token_file is None:
        if usable(c, "token_file"):
            problems.add("control.token_file: required (mutating control calls need a bearer token: set "
                         "token_file to a mode 0600 file holding one, and create_token = true to have it made)")
    elif check_paths and not c.create_token and not c.token_file.exists():
        problems.add(f"control.token_file: {c.token_file} does not exist (create it with mode 0600, "
                     f"e.g. `umask 077; openssl rand -hex 32 > {c.token_file}`, or set control.create_token)")
    s = cfg.supervisor
    if s.backoff_max_s < s.backoff_initial_s and usable(s, "backoff_max_s", "backoff_initial_s"):
        initial = written_key(s, "backoff_initial_s", "supervisor")
        problems.add(f"{written_key(s, 'backoff_max_s', 'supervisor')}: must be >= {initial} "
                     f"({s.backoff_initial_s}), got {s.backoff_max_s} (raise it, or lower {initial})")
    g = cfg.gate
    if g.capture_sample_rate > 1:
        problems.add(f"gate.capture_sample_rate: must be between 0 and 1, got {g.capture_sample_rate} (the fraction "
                     "of requests kept: 0.05 keeps 5 %)")
    ports: dict[int, str] = {}
    listeners = [("engine.port", e.port, True, usable(e, "port")),
                 ("gate.port", g.port, g.enabled, usable(g, "port", "enabled")),
                 ("control.port", c.port, c.unix_socket is None, usable(c, "port", "unix_socket")),
                 ("metrics.port", cfg.metrics.port, cfg.metrics.enabled, usable(cfg.metrics, "port", "enabled")),
                 (written_key(cfg.remap, "count_boot_port", REMAP_SECTION), cfg.remap.count_port(e.port),
                  e.hook_mode == "pin" and cfg.remap.source == "capture",
                  usable(e, "port", "hook_mode") and usable(cfg.remap, "count_boot_port", "source"))]
    for key, port, used, known in listeners:
        if not used or not known:
            continue
        if port in ports:
            problems.add(f"{key}: port {port} is also used by {ports[port]} (give each listener its own port)")
            continue
        ports[port] = key


def json_schema() -> dict[str, Any]:
    """The JSON schema of the config file (``pinsidecar check-config --schema``; committed as
    :data:`SCHEMA_PATH`), for editors: every table and key, its type, range and default; keys at their old place
    are marked deprecated."""
    return document_schema(_SECTION_TYPES, "pinsidecar configuration",
                           "The pinsidecar daemon's TOML config file (docs/configuration.md). Generated by "
                           "`pinsidecar check-config --schema`.")


def load_config(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None,
                check_paths: bool = True, *, warn: bool = True) -> Config:
    """Read and validate the config file (default :data:`DEFAULT_CONFIG_PATH`). Raises :class:`ConfigError`.

    ``check_paths=False``: everything but file existence (what ``status`` / ``drain-reboot`` use: they only need
    the control section, and the engine's files belong to the daemon). ``overrides`` name a key by its field
    (``engine.enforce_eager``) and replace the file's value wherever the file keeps it. A key at its old place is
    logged as a deprecation warning naming its new place (``warn=False``: only listed in
    :attr:`Config.deprecations`, for a command that reports them itself)."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    doc = read_toml(p)
    try:
        for dotted, value in (overrides or {}).items():
            apply_override(doc, dotted, value, _SECTION_TYPES)
        cfg = parse_config(doc, p.resolve().parent, p, check_paths)
    except ConfigError as exc:
        raise exc.within(p) from None
    if warn:
        warn_deprecations(cfg.deprecations, p)
    return cfg
