"""The remap pipeline's settings: the ``[remap]`` table of the daemon's TOML file, as one frozen dataclass.

The thresholds that decide *whether* to remap live in ``[drift]`` (:class:`~pinsidecar.drift.config.DriftConfig`:
trip levels, margin, cooldown, daily cap); this table says *how* a remap runs: where its traffic comes from, how
much is enough, where the count engine listens, and how a reboot is verified before it is committed. The choices
an operator makes (the traffic source, fixtures, the count engine's port and environment, parity prompts, in place
or not, whether verification needs traffic) are in ``[remap]`` itself; the amounts, waits and timeouts are tuning,
in ``[remap.advanced]`` (:data:`~pinsidecar.schema.ADVANCED`). The field metadata is the one table validator's
(:mod:`pinsidecar.schema`), so the daemon takes :class:`RemapConfig` as a section as it is;
:func:`check_remap_config` adds the checks across keys.

Where the defaults come from: the CPU demo (the demo MoE model, requests of 50-90 routed tokens, a 15-25 s eager
boot). 64 captured requests are ~4,000 routed tokens, about four drift windows, which is what the demo's count
boots of one fixture measure; 512 routed tokens is the smallest count the map builder was seen to place the demo's
hot set from without noise dominating (``tests/test_drift_recorded.py``: a one-window map at 256 tokens is 5
points noisy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import APPLY_ORDERINGS

from pinsidecar.schema import ADVANCED, CHOICES, MIN, POSITIVE, Problems, usable, written_key

__all__ = ["REMAP_SECTION", "RemapConfig", "check_remap_config", "resolve_workloads"]

REMAP_SECTION = "remap"
# "capture": count-boot the traffic the gate captured (plus fixtures) on a second engine; "live": build the
# candidate from the drift watch's live windows (pin mode counts the full histogram online; no count boot).
SOURCES = ("capture", "live")
# Default count-boot port: the serving engine's port plus this, when remap.count_boot_port is 0.
COUNT_BOOT_PORT_OFFSET = 100


def default_parity_prompts() -> Path:
    """The shipped parity prompts: a few short completions, model-agnostic text (``remap/fixtures/parity.jsonl``)."""
    return Path(__file__).parent / "fixtures" / "parity.jsonl"


@dataclass(frozen=True)
class RemapConfig:
    """How a remap runs (see the module docstring); ``[drift]`` decides whether one starts."""

    # Where the candidate's traffic comes from (see SOURCES). A host with one GPU cannot run a second engine
    # beside the serving one: use "live" there.
    source: str = field(default="capture", metadata={CHOICES: SOURCES})
    # capture: the newest this many captured requests (needs gate.capture_dir), newest first.
    capture_requests: int = field(default=64, metadata={POSITIVE: True, **ADVANCED})
    # capture: JSONL workload files replayed with the captured requests (fixtures of the traffic you expect);
    # relative paths are relative to the config file's folder.
    workloads: list[str] = field(default_factory=list)
    # Fewer requests than this (captured plus fixtures) is too little traffic to count: the remap is aborted.
    min_requests: int = field(default=8, metadata={POSITIVE: True, **ADVANCED})
    # A count boot (or, live, the windows a candidate is built from) with fewer routed tokens is aborted.
    min_count_tokens: int = field(default=512, metadata={POSITIVE: True, **ADVANCED})
    # The count engine's port; 0: engine.port + 100. It runs beside the serving engine.
    count_boot_port: int = field(default=0, metadata={MIN: 0})
    count_boot_concurrency: int = field(default=4, metadata={POSITIVE: True, **ADVANCED})
    # More environment for the count engine, over engine.env. On the CPU lane give it its own cores, e.g.
    # {VLLM_CPU_OMP_THREADS_BIND = "1"}: vLLM CPU binds every engine's OpenMP threads to the same first cores by
    # default, and two engines' compute threads would share core 0.
    count_boot_env: dict[str, str] = field(default_factory=dict)
    # live: at most this many windows of the current drift streak build the candidate (never older traffic:
    # a map of a blend of traffic classes serves each class worse than its own map).
    live_windows: int = field(default=2, metadata={POSITIVE: True, **ADVANCED})
    # capture: how long evaluation waits for a drift window that began after the capture was cut (one that does
    # not overlap the counted traffic); after that the newest window is used and the decision says so.
    held_out_wait_s: float = field(default=60.0, metadata={MIN: 0, **ADVANCED})
    # Greedy prompts whose outputs must match token for token across the reboot; absent: the shipped fixture.
    parity_prompts: Path | None = None
    # After the reboot, the live cold rate over this many routed tokens must be at most the candidate's predicted
    # rate on the held-out window plus verify_tolerance (absolute fraction of selections).
    verify_tokens: int = field(default=512, metadata={POSITIVE: True, **ADVANCED})
    verify_tolerance: float = field(default=0.05, metadata={MIN: 0, **ADVANCED})
    verify_timeout_s: float = field(default=300.0, metadata={POSITIVE: True, **ADVANCED})
    # Too little traffic to verify within verify_timeout_s: roll back (true) or commit as "unverified" (false;
    # parity has passed and the decision was out of sample).
    verify_requires_traffic: bool = False
    # How often the daemon reads the live stats into the drift watch (seconds). The hook writes every 5 s.
    watch_interval_s: float = field(default=2.0, metadata={POSITIVE: True, **ADVANCED})
    # Deploy by applying the candidate in place first (the hook swaps the rows that change between the two maps
    # while the engine keeps serving: no drain, no boot); the drain-reboot is the fallback when the hook refuses,
    # fails, does not answer, or the candidate has another geometry. false: always drain and reboot.
    in_place: bool = True
    # How long the daemon waits for the hook's answer to one apply request. The hook holds the engine's step for
    # the whole apply, so this also bounds how long serving may stand still before the remap falls back to a
    # reboot. A demo-model apply takes milliseconds; a large model's host <-> HBM copies take seconds.
    apply_timeout_s: float = field(default=60.0, metadata={POSITIVE: True, **ADVANCED})
    # How the hook orders an in-place apply's batches against the engine's steps: "host" syncs the GPU under the
    # step lock around each batch (a step may wait for the last one's kernels, ~60 ms at 16 streams on the H200);
    # "stream" queues each batch on the engine's CUDA stream and lets the next step wait for it there (holds of
    # a few ms; not yet the default: docs/remap-in-place.md, "Ordering"). The CPU always runs "host".
    apply_ordering: str = field(default="host", metadata={CHOICES: APPLY_ORDERINGS, **ADVANCED})
    # How long one batch of an in-place apply may take, in ms: held under the step lock with "host" (after the
    # wait for the last step's kernels), of copies on the device with "stream". A stream waits for at most about
    # one step plus one batch, so a lower figure shortens the longest gap between tokens and lengthens the apply.
    # 0 means the hook's own default (20 ms).
    apply_hold_ms: float = field(default=0.0, metadata={MIN: 0, **ADVANCED})

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def count_port(self, engine_port: int) -> int:
        return self.count_boot_port or engine_port + COUNT_BOOT_PORT_OFFSET

    @property
    def parity_prompts_path(self) -> Path:
        return self.parity_prompts or default_parity_prompts()


def resolve_workloads(cfg: RemapConfig, base: Path | None) -> list[Path]:
    """``workloads`` as paths, relative ones taken relative to ``base`` (the config file's folder)."""
    out = []
    for w in cfg.workloads:
        p = Path(w).expanduser()
        out.append(p if p.is_absolute() or base is None else base / p)
    return out


def check_remap_config(cfg: RemapConfig, *, base: Path | None, engine_port: int, check_paths: bool = True,
                       section: str = REMAP_SECTION, problems: Problems | None = None) -> None:
    """Cross-field checks, each naming the key where the file has it. Every problem goes to ``problems``;
    without it, a :class:`ConfigError` holding them all is raised."""
    own = Problems() if problems is None else problems

    def key(name: str) -> str:
        return written_key(cfg, name, section)

    port_key = key("count_boot_port")
    if usable(cfg, "count_boot_port"):
        if cfg.count_boot_port and not 1 <= cfg.count_boot_port <= 65535:
            own.add(f"{port_key}: expected an integer 1-65535 (or 0: engine.port + {COUNT_BOOT_PORT_OFFSET}), got "
                    f"{cfg.count_boot_port} (a TCP port, e.g. count_boot_port = 8100)")
        elif not 1 <= cfg.count_port(engine_port) <= 65535:
            own.add(f"{port_key}: engine.port + {COUNT_BOOT_PORT_OFFSET} = {cfg.count_port(engine_port)} is not a "
                    f"port (set {port_key})")
    if cfg.verify_tolerance > 1 and usable(cfg, "verify_tolerance"):
        own.add(f"{key('verify_tolerance')}: a fraction of selections between 0 and 1, got {cfg.verify_tolerance} "
                "(write 5 points as 0.05)")
    if check_paths:
        for w in resolve_workloads(cfg, base) if usable(cfg, "workloads") else ():
            if not w.is_file():
                own.add(f"{key('workloads')}: {w} is not a file (list JSONL workload files of requests)")
        if cfg.parity_prompts is not None and not cfg.parity_prompts.is_file():
            own.add(f"{key('parity_prompts')}: {cfg.parity_prompts} is not a file (point it at a JSONL file of "
                    "completions, or remove the key for the shipped one)")
    if problems is None:
        own.raise_any()
