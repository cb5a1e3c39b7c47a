"""A real podman container lane for tests and benchmarks, with no registry and nothing changed outside the repo.

CI has no registry to pull a vLLM image from, so the lane runs a *local* image: :func:`podman_lane` imports a tiny
root filesystem (the directories an OCI runtime expects, ``bin``/``sbin``/``lib``/``lib64`` as links into ``usr``,
a copy of ``/etc``) as :data:`IMAGE`, and the engine inside it runs this checkout's own vLLM: ``/usr``, the
interpreter root the virtual environment points at (pyenv's, on the CI boxes) and the virtual environment are
bind-mounted read-only at the same paths, so ``<venv>/bin/python`` works unchanged inside. The hook goes in
exactly as in production, through :func:`pinsidecar.engine.container.hook_overlay`.

Isolation: podman reads :data:`CONTAINERS_CONF` (in the repo; why each setting is there is written in it), with
the lane's own runtime folder (``tmp_dir``) added, through ``$CONTAINERS_CONF``, and a storage configuration
written under the lane's own folder through ``$CONTAINERS_STORAGE_CONF`` (``vfs`` driver: works on any filesystem,
and the image is 3 MB), so the host's podman images, containers and runtime state are never seen or touched.
Every podman call of the tests, and the daemon under test, runs with :attr:`PodmanLane.env`.

Building the lane takes about a second; it raises :class:`PodmanUnavailable` (the pytest fixture turns it into a
skip with the reason) only when podman cannot run a container here at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinsidecar.engine.container import ENGINE_LABEL as _ENGINE_LABEL
from pinsidecar.engine.container import ContainerConfig

__all__: list[str] = []  # nothing here is another package's business

CONTAINERS_CONF = Path(__file__).with_name("containers.conf")
IMAGE = "localhost/pinsidecar-engine-test:1"
# The label every engine container carries (pinsidecar.engine.container adds it to `run`).
ENGINE_LABEL = f"{_ENGINE_LABEL}=1"
_ROOTFS_DIRS = ("usr", "proc", "sys", "dev", "tmp", "run", "root", "var/tmp", "var/lib", "opt")
_USR_LINKS = ("bin", "sbin", "lib", "lib64")


class PodmanUnavailable(RuntimeError):
    """podman cannot run a container on this machine; the message says why (and what would fix it)."""


@dataclass
class PodmanLane:
    """podman with its own storage under ``root``, the engine image imported, and what the engine needs mounted."""

    root: Path
    env: dict[str, str]
    image: str = IMAGE
    python: str = str(Path(sys.prefix) / "bin" / "python")
    mounts: list[str] = field(default_factory=list)

    def podman(self, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``podman ARGS`` against the lane's storage; raise with podman's stderr when ``check`` and it fails."""
        res = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise PodmanUnavailable(f"`podman {' '.join(args[:3])}` failed ({res.returncode}): "
                                    f"{(res.stderr or res.stdout).strip()[-800:]}")
        return res

    def config_table(self, name: str, **overrides: Any) -> dict[str, Any]:
        """The ``[container]`` table of a daemon config for this lane: podman, the local image, host network, no
        GPU, this venv's interpreter, and the read-only mounts that make it work inside."""
        keys: dict[str, Any] = {"runtime": "podman", "image": self.image, "name": name, "gpus": "",
                                "python": self.python, "network": "host", "ipc_host": True,
                                "mounts": list(self.mounts)}
        keys.update(overrides)
        return keys

    def container_config(self, name: str, **overrides: Any) -> ContainerConfig:
        """The same table as the launcher's :class:`ContainerConfig` (an engine started without the daemon)."""
        return ContainerConfig(**self.config_table(name, **overrides))

    def containers(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every engine container in the lane's storage (running or not), as ``podman ps --all`` reports it."""
        args = ["ps", "--all", "--format", "json", "--filter", f"label={ENGINE_LABEL}"]
        if name:
            args += ["--filter", f"name=^{name}$"]
        out = self.podman(*args).stdout.strip()
        return json.loads(out) if out else []

    def close(self) -> None:
        """Remove every container and image of the lane, then its storage folder (``vfs`` keeps plain folders,
        nothing stays mounted). Not ``podman system reset``: that also clears podman's shared runtime folder."""
        with contextlib.suppress(Exception):
            self.podman("rm", "--all", "--force", "--time", "0", check=False, timeout=120)
        with contextlib.suppress(Exception):
            self.podman("rmi", "--all", "--force", check=False, timeout=120)
        shutil.rmtree(self.root, ignore_errors=True)


def _engine_mounts() -> list[str]:
    """``/usr``, the interpreter root the venv was made from (``sys.base_prefix``) and the venv itself, read-only
    at the same paths, so the venv's interpreter and every library it loads resolve inside the container."""
    mounts = ["/usr:/usr:ro"]
    for root in (Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()):
        if not str(root).startswith("/usr/") and f"{root}:{root}:ro" not in mounts:
            mounts.append(f"{root}:{root}:ro")
    return mounts


def _rootfs_tarball(dest: Path) -> Path:
    """The image's root filesystem as a tarball: empty directories, the ``usr`` links, and a copy of ``/etc``
    (users, resolver, ld.so.conf: what libc and Python read at start). Sockets and unreadable files are left out."""
    tar_path = dest / "rootfs.tar"
    with tarfile.open(tar_path, "w") as tar:
        for d in _ROOTFS_DIRS:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d.endswith("tmp") else 0o755
            tar.addfile(info)
        for link in _USR_LINKS:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{link}"
            tar.addfile(info)

        def readable(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
            return ti if ti.isdir() or ti.isfile() or ti.issym() else None

        for entry in sorted(Path("/etc").iterdir()):
            with contextlib.suppress(OSError):
                tar.add(entry, arcname=f"etc/{entry.name}", filter=readable)
    return tar_path


def podman_lane(root: Path) -> PodmanLane:
    """Build the lane under ``root`` (the image imported, a container run once to prove it works); about a
    second. Raises :class:`PodmanUnavailable` when podman or runc is missing, or cannot run a container here."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            raise PodmanUnavailable(f"{tool} is not installed (scripts/setup.sh installs podman, runc and "
                                    "catatonit with apt)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    storage = root / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n')
    # The repo's settings plus the lane's own runtime folder: podman's default, /run/libpod, is shared by every
    # podman on the host, and a refresh there (after another user's `system reset`) resets our containers' states.
    text = CONTAINERS_CONF.read_text()
    if text.rfind("[engine]") < text.rfind("["):
        raise PodmanUnavailable(f"{CONTAINERS_CONF}: [engine] must be its last table (tmp_dir is appended to it)")
    conf = root / "containers.conf"
    conf.write_text(text + f'\n# this lane\'s own runtime folder\ntmp_dir = "{root / "tmp"}"\n')
    lane = PodmanLane(root=root, env={"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)},
                      mounts=_engine_mounts())
    if lane.podman("image", "exists", lane.image, check=False).returncode != 0:
        lane.podman("import", str(_rootfs_tarball(root)), lane.image)
    volumes = [arg for m in lane.mounts for arg in ("--volume", m)]
    probe = lane.podman("run", "--rm", "--init", "--network", "host", *volumes, lane.image,
                        lane.python, "-c", "import sys; print(sys.prefix)", check=False)
    if probe.returncode != 0 or probe.stdout.strip() != sys.prefix:
        raise PodmanUnavailable(f"podman cannot run a container here ({probe.returncode}): "
                                f"{(probe.stderr or probe.stdout).strip()[-800:]}")
    return lane
