"""The engine's cgroup memory: ``memory.current``, ``memory.max`` and ``anon``/``file``/``shmem`` of
``memory.stat``, and how to find the engine's cgroup from its pid or its container id.

Read the engine's cgroup, not ``/proc/meminfo``, which inside a container shows the whole host. Pinned host memory
(the cold experts) is charged to the cgroup as ``shmem``, which cgroup v2 also counts inside ``file``; ``anon`` is
ordinary process memory. cgroup v2 is the target; on a hybrid or v1 host whose memory controller is mounted v1
the same metrics come from ``memory.usage_in_bytes``, ``memory.limit_in_bytes`` and
``total_rss``/``total_cache``/``total_shmem``.

Which cgroup was read is exported as ``pinsidecar_engine_cgroup_info{version, path, container_id}`` (1), so the
memory series can be joined to the container (``container_id`` is empty for a process engine). A container engine
is found through its init pid (the container's cgroup: ``/libpod_parent/libpod-<id>`` under podman's cgroupfs
manager on v1, ``machine.slice/libpod-<id>.scope`` under systemd on v2), or through its id when no pid is known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from pinsidecar.metrics.source import SourceStatus

__all__: list[str] = []  # nothing here is another package's business

# memory.stat keys exported: shmem is where pinned host memory (cold experts) is charged; v2 counts it in file too.
MEMORY_STAT_KEYS = ("anon", "file", "shmem")
# cgroup v1 has no "max": an unlimited memory.limit_in_bytes is PAGE_COUNTER_MAX rounded to pages (~2**63).
_V1_UNLIMITED = 2**62
# cgroup v1 file names for the same quantities (hierarchical totals, like v2's memory.current).
_V1_FILES = {"current": "memory.usage_in_bytes", "max": "memory.limit_in_bytes"}
_V1_STAT_KEYS = {"anon": "total_rss", "file": "total_cache", "shmem": "total_shmem"}
# Where docker and podman put a container's cgroup (systemd and cgroupfs drivers, rootful and rootless).
_CONTAINER_CGROUP_GLOBS = ("system.slice/docker-{id}*.scope", "docker/{id}*", "machine.slice/libpod-{id}*.scope",
                           "machine.slice/libpod-{id}*.scope/container", "user.slice/*/*/*/libpod-{id}*.scope",
                           "user.slice/*/*/*/*/libpod-{id}*.scope", "libpod_parent/libpod-{id}*")


def cgroup_path_for_pid(pid: int, *, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
                        ) -> Path:
    """The cgroup v2 directory of ``pid``: the ``0::<path>`` line of ``/proc/<pid>/cgroup`` under the cgroup root.

    Raises ``FileNotFoundError`` when the process is gone, ``ValueError`` when it has no cgroup v2 entry (a
    cgroup v1 host: use :func:`cgroup_v1_memory_path_for_pid`).
    """
    text = (proc_root / str(pid) / "cgroup").read_text()
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            return cgroup_root / path.lstrip("/")
    raise ValueError(f"{proc_root / str(pid) / 'cgroup'}: no cgroup v2 ('0::') entry; is this a cgroup v1 host?")


def cgroup_v1_memory_path_for_pid(pid: int, *, proc_root: Path = Path("/proc"),
                                  cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The cgroup v1 *memory* controller directory of ``pid`` (``<root>/memory/<path>``), or None without one."""
    for line in (proc_root / str(pid) / "cgroup").read_text().splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return cgroup_root / "memory" / path.lstrip("/")
    return None


def cgroup_path_for_container(container_id: str, *, cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path:
    """Find a docker or podman container's cgroup by its id (full or a prefix of at least 12 hex digits): the v2
    directory, or on a v1 host the memory controller's (``<root>/memory/...``)."""
    for base in (cgroup_root, cgroup_root / "memory"):
        for pattern in _CONTAINER_CGROUP_GLOBS:
            hits = sorted(p for p in base.glob(pattern.format(id=container_id)) if p.is_dir())
            if hits:
                return hits[0]
    raise FileNotFoundError(f"no cgroup for container {container_id} under {cgroup_root}; pass the engine pid "
                            "(the container's init pid) instead")


def _parse_memory_stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key and value:
            out[key] = int(value)
    return out


def _nothing() -> None:
    return None


class CgroupMemoryCollector:
    """Exports the engine's cgroup memory (see the module docstring).

    ``pid()`` and ``container_id()`` are asked at every scrape, so a restarted engine (a new pid, a new container)
    is followed; the pid wins when both are known, and neither turns the source off. An unlimited max (``max`` in
    v2, ~2**63 in v1) is left out rather than exported as +Inf, so ratios against it give no result instead of 0.
    """

    source = "cgroup"

    def __init__(self, *, pid: Callable[[], int | None] = _nothing, container_id: Callable[[], str | None] = _nothing,
                 cgroup_root: Path = Path("/sys/fs/cgroup"), proc_root: Path = Path("/proc")) -> None:
        self.pid = pid
        self.container_id = container_id
        self.cgroup_root = Path(cgroup_root)
        self.proc_root = Path(proc_root)
        self.status = SourceStatus(self.source)
        self._file_status = SourceStatus("cgroup files")

    def find(self) -> tuple[int, Path] | None:
        """(cgroup version, directory) of the engine now, or None when no engine is known."""
        pid = self.pid()
        if pid is not None:
            try:
                v2: Path | None = cgroup_path_for_pid(pid, proc_root=self.proc_root, cgroup_root=self.cgroup_root)
            except ValueError:
                v2 = None
            if v2 is not None and (v2 / "memory.current").exists():
                return 2, v2
            v1 = cgroup_v1_memory_path_for_pid(pid, proc_root=self.proc_root, cgroup_root=self.cgroup_root)
            if v1 is not None and (v1 / _V1_FILES["current"]).exists():
                return 1, v1
            if v2 is None:
                raise ValueError(f"{self.proc_root / str(pid) / 'cgroup'}: no cgroup v2 entry and no v1 memory "
                                 "controller")
            return 2, v2  # reading memory.current fails in collect(), with the path in the message
        container_id = self.container_id()
        if container_id:
            path = cgroup_path_for_container(container_id, cgroup_root=self.cgroup_root)
            return (1 if (path / _V1_FILES["current"]).exists() else 2), path
        return None

    def _info(self, version: int, cg: Path) -> Metric:
        root = self.cgroup_root / "memory" if version == 1 else self.cgroup_root
        try:
            rel = "/" + str(cg.relative_to(root))
        except ValueError:
            rel = str(cg)
        container_id = self.container_id() or ""
        fam = GaugeMetricFamily("pinsidecar_engine_cgroup_info",
                                "The cgroup the engine's memory is read from (1): cgroup version, path under the "
                                "cgroup root, and the container id (empty for a process engine).",
                                labels=["version", "path", "container_id"])
        fam.add_metric([str(version), rel, container_id], 1)
        return fam

    def collect(self) -> Iterator[Metric]:
        try:
            found = self.find()
        except (OSError, ValueError) as exc:
            self.status.fail(f"engine cgroup not found: {exc}")
            return
        if found is None:
            self.status.off()
            return
        version, cg = found
        current_file = "memory.current" if version == 2 else _V1_FILES["current"]
        try:
            current = int((cg / current_file).read_text())
        except (OSError, ValueError) as exc:
            self.status.fail(f"{cg / current_file}: {exc} (is the memory controller enabled for this cgroup?)")
            return
        self.status.ok()
        yield self._info(version, cg)
        yield GaugeMetricFamily("pinsidecar_engine_cgroup_memory_current_bytes",
                                "Memory charged to the engine's cgroup (memory.current).", value=current)
        missing: list[str] = []
        max_file = "memory.max" if version == 2 else _V1_FILES["max"]
        try:
            raw = (cg / max_file).read_text().strip()
            if raw != "max" and int(raw) < _V1_UNLIMITED:
                yield GaugeMetricFamily("pinsidecar_engine_cgroup_memory_max_bytes",
                                        "The engine cgroup's memory limit (memory.max); absent when unlimited.",
                                        value=int(raw))
        except (OSError, ValueError) as exc:
            missing.append(f"{max_file}: {exc}")
        try:
            stat = _parse_memory_stat((cg / "memory.stat").read_text())
            fam = GaugeMetricFamily("pinsidecar_engine_cgroup_memory_stat_bytes",
                                    "The engine cgroup's memory.stat by type (shmem, where pinned host memory is "
                                    "charged, is also counted in file).", labels=["type"])
            for key in MEMORY_STAT_KEYS:
                src = key if version == 2 else _V1_STAT_KEYS[key]
                if src in stat:
                    fam.add_metric([key], stat[src])
            yield fam
        except (OSError, ValueError) as exc:
            missing.append(f"memory.stat: {exc}")
        if missing:
            self._file_status.fail(f"{cg}: " + "; ".join(missing))
        else:
            self._file_status.ok()
