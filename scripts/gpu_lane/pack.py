#!/usr/bin/env python3
"""Pack a vLLM release (slimmed for one H100/H200) and the Python packages it needs into chunks the device tool
can carry.

The lent H200 machine has no network, and a device call carries at most 64 MiB of the working tree. This script,
run here (stdlib + pip; network to the package index), builds everything a Qwen3-MoE server boot needs on that
machine and writes it under ``--out`` (default ``.gpu_lane``, git-ignored):

- ``cNN/chunk-NN`` + ``cNN/chunk-NN.sha256``: one folder per chunk of the compressed payload, so that each device
  call names exactly one folder in ``carry``;
- ``ctl/manifest.json`` and ``ctl/device_install.sh``: the hashes, and the script the last call runs there (verify,
  reassemble, unpack, ``pip install --no-index --no-deps --target /tmp/site``, import checks);
- ``device-calls.txt`` / ``device-calls.json``: the exact device calls, in order, to paste one after another;
- ``pack-report.json``: every size measured, every wheel carried, everything left out and why.

What goes in, and why it is safe, is written down in ``docs/gpu-lane.md``. The decisions are one
:class:`lane_profiles.LaneProfile` per vLLM release (``scripts/gpu_lane/lane_profiles.py``): what the boot imports,
the declared requirements left out or satisfied by the device, the files dropped from the vLLM wheel, and the wheels
carried whole because the device's own version is the wrong one (torch, triton and NCCL for vLLM 0.34, slimmed to
SM90 device code by ``scripts/gpu_lane/fatbin.py``). The payload is deterministic for a given set of downloaded
wheels.

Usage: ``python3 scripts/gpu_lane/pack.py --vllm 0.34.0 --out .gpu_lane`` (10-40 minutes, most of it xz; vLLM 0.26.0
by default, the release that runs on the device's own torch).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fatbin  # scripts/gpu_lane is a folder of scripts, not a package: found through sys.path
from lane_profiles import LaneProfile, profile

__all__ = ["main"]

DEFAULT_VLLM = "0.26.0"  # the newest release that pins the device's own torch (2.11.0)
PYTHON_VERSION = "3.12"  # the device's python3 (3.12.3)
# manylinux tags pip may accept for the device (Ubuntu 24.04 userland, glibc 2.39). pip matches each N exactly.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35, 39)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
MIB = 1 << 20
DEFAULT_CHUNK_MIB = 60  # at most; less when the working tree leaves less of CALL_LIMIT_MIB (main)
CALL_LIMIT_MIB = 63  # the device tool's 64 MiB per call, less a margin for what travel_bytes does not see
CTL_ROOM_BYTES = 1 << 20  # ctl/ (manifest and install script, ~13 KiB) and the call's own files
DEVICE_SRC = "/tmp/gpu_lane"  # where each call drops its chunk on the device
DEVICE_SITE = "/tmp/site"  # where the last call installs (used through PYTHONPATH)

# The device's `pip freeze` (python3 there: /opt/torch/.venv/bin/python3, Python 3.12.3). Resolution treats these
# as installed and pins them, so nothing here is downloaded and every carried wheel agrees with them.
DEVICE_FREEZE = """
absl-py==2.5.0 accelerate==1.15.0 aiofiles==25.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.3 aiosignal==1.4.0
annotated-doc==0.0.5 anyio==4.15.1 attrs==26.1.0 botorch==0.18.1 build==1.6.1 certifi==2026.7.22
charset-normalizer==3.5.1 chex==0.1.92 click==8.5.0 cloudpickle==3.1.2 cmake==4.4.3 colorama==0.4.6
contourpy==1.4.0 coverage==7.16.2 cuda-bindings==13.3.1 cuda-core==1.2.0 cuda-pathfinder==1.8.1
cuda-toolkit==13.0.2 cupy-cuda13x==14.2.0 cycler==0.12.1 Cython==3.3.0 diffrax==0.7.2 e3nn==0.6.0 einops==0.8.2
equinox==0.13.8 etils==1.14.0 execnet==2.1.2 filelock==3.32.5 flatbuffers==25.12.19 flax==0.12.10
fonttools==4.66.1 formulaic==1.2.2 frozenlist==1.8.0 fsspec==2026.7.0 gpytorch==1.15.2 grpcio==1.84.0
h11==0.16.0 h5py==3.16.0 hf-xet==1.6.0 httpcore==1.0.9 httpx==0.28.1 huggingface_hub==1.33.0 humanize==4.16.0
hypothesis==6.168.3 idna==3.19 ImageIO==2.38.0 iniconfig==2.3.0 interface_meta==2.0.1 jax==0.11.2
jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2 jaxlib==0.11.2 jaxtyping==0.3.11 Jinja2==3.1.6 joblib==1.6.0
kiwisolver==1.5.1 lazy-loader==0.6 lightning==2.6.6 lightning-utilities==0.15.3 linear_operator==0.6.1
lineax==0.1.1 llvmlite==0.50.0 lxml==6.1.3 Markdown==3.11 markdown-it-py==4.2.0 MarkupSafe==3.0.3
matplotlib==3.11.2 mdurl==0.1.2 meson==1.12.1 ml_dtypes==0.6.0 mpi4py==4.1.2 mpmath==1.3.0 msgpack==1.2.3
multidict==6.9.1 multipledispatch==1.0.0 mypy_extensions==1.1.0 nanobind==3.1.0 narwhals==2.26.0
networkx==3.6.1 ninja==1.13.2 numba==0.68.0 numba-cuda==0.30.4 numpy==2.5.2 numpyro==0.21.0
nvidia-cublas==13.1.0.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.19.0.56 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66 nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.0 nvidia-ml-py==13.610.43
nvidia-nccl-cu13==2.28.9 nvidia-nvjitlink==13.0.88 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85 onnx==1.23.1
onnx-ir==1.0.0 onnxruntime==1.30.0 onnxscript==0.7.2 opencv-python-headless==5.0.0.93 opt_einsum==3.4.0
opt-einsum-fx==0.1.4 optax==0.2.8 optimistix==0.1.0 orbax-checkpoint==0.12.4 packaging==26.3 pandas==3.0.6
pathspec==1.1.1 patsy==1.0.3 peft==0.21.0 pillow==12.3.0 pip==24.0 pluggy==1.6.0 portalocker==4.4.0
prometheus_client==0.26.0 propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0 pyarrow==25.0.1
pybind11==3.1.0 Pygments==2.21.0 pyparsing==3.3.3 pyproject_hooks==1.3.3 pyre-extensions==0.0.32 pytest==9.1.1
pytest-benchmark==5.2.3 pytest-cov==7.1.0 pytest-mock==3.16.0 pytest-timeout==2.5.0 pytest-xdist==3.8.0
python-dateutil==2.9.0.post0 pytorch-lightning==2.6.6 PyYAML==6.0.3 regex==2026.9.3 requests==2.34.2
rich==15.0.0 sacrebleu==2.6.0 safetensors==0.8.0 scikit_build_core==1.1.0 scikit-image==0.26.0
scikit-learn==1.9.1 scipy==1.18.1 seaborn==0.13.2 sentence-transformers==6.0.1 sentencepiece==0.2.2
setuptools==81.0.0 shellingham==1.5.4 simplejson==4.1.2 six==1.17.0 sortedcontainers==2.4.0 statsmodels==0.15.0
sympy==1.14.0 tabulate==0.10.0 tensorboard==2.21.0 tensorboard-data-server==0.7.2 tensorstore==0.1.85
threadpoolctl==3.7.0 tifffile==2026.9.20 tiktoken==0.14.0 timm==1.0.29 tokenizers==0.23.2 toolz==1.1.0
torch==2.11.0 torch-geometric==2.8.0.post1 torchaudio==2.11.0 torchdiffeq==0.2.5 torchmetrics==1.9.0
torchvision==0.26.0 tqdm==4.70.1 transformers==5.17.0 treescope==0.1.10 triton==3.6.0 typer==0.27.2
typing_extensions==4.16.0 typing-inspect==0.9.0 urllib3==2.7.0 uvloop==0.23.0 wadler_lindig==0.1.7
Werkzeug==3.1.9 wheel==0.48.0 wrapt==2.5.0 xarray==2026.9.0 xxhash==4.0.1 yarl==1.25.1 zipp==4.1.0
"""

DEVICE_ENV = {  # PEP 508 marker environment of the device's python3
    "implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
    "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
    "platform_system": "Linux", "platform_version": "", "python_full_version": "3.12.3", "python_version": "3.12",
    "sys_platform": "linux", "extra": "",
}


def log(msg: str) -> None:
    print(f"pack: {msg}", file=sys.stderr, flush=True)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_freeze() -> dict[str, str]:
    pins = {}
    for tok in DEVICE_FREEZE.split():
        name, version = tok.split("==", 1)
        pins[canon(name)] = version
    return pins


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------- download


def pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    log("pip download " + " ".join(args))
    subprocess.run(cmd + args, check=True)


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode("utf-8")


def wheel_name_version(path: Path) -> tuple[str, str]:
    parts = path.name.split("-")
    return canon(parts[0]), parts[1]


def requires_dist(metadata: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


def _packaging():
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    return Requirement, Marker


def applicable(reqs: list[str]) -> list:
    """Requirements that apply on the device with no extras selected."""
    Requirement, _ = _packaging()
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(DEVICE_ENV):
            continue
        out.append(req)
    return out


def make_stub_wheels(pins: dict[str, str], dest: Path) -> None:
    """One empty wheel per device package, version ``X+device``, so pip's resolver sees the device as installed."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        norm = re.sub(r"[-_.]+", "_", name)
        v = f"{version}+device"
        info = f"{norm}-{v}.dist-info"
        files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n",
                 f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: pinsidecar-pack\nRoot-Is-Purelib: true\n"
                                  "Tag: py3-none-any\n"}
        record = "".join(f"{k},sha256={_b64(hashlib.sha256(c.encode()).digest())},{len(c)}\n"
                         for k, c in files.items()) + f"{info}/RECORD,,\n"
        files[f"{info}/RECORD"] = record
        with zipfile.ZipFile(dest / f"{norm}-{v}-py3-none-any.whl", "w") as z:
            for k, c in files.items():
                z.writestr(k, c)


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def lane_pins(prof: LaneProfile, vllm_reqs: list) -> tuple[dict[str, str], dict[str, str]]:
    """The device packages the resolver takes as installed (with the carried wheels' versions in place of the
    device's: torch 2.14.0 for vLLM 0.34), and those it must not (``{name: why}``): the ones whose device version a
    requirement of vLLM excludes (vLLM 0.34 asks for newer tokenizers, huggingface_hub, pillow, ...; the newer
    release is then carried and shadows the device's)."""
    pins = device_freeze()
    for req in prof.carried:  # the carried wheel stands where the device's own was (torch 2.14.0, not 2.11.0)
        name, version = req.split("==")
        pins[canon(name)] = version
    skip = {canon(n) for n in prof.not_required} | {canon(n) for n in prof.left_out}
    unpinned = {canon(n): why for n, why in prof.unpin.items()}
    for req in vllm_reqs:
        name = canon(req.name)
        if name in pins and name not in skip and not req.specifier.contains(pins[name], prereleases=True):
            unpinned[name] = f"vLLM asks {req.specifier}, the device has {pins[name]}"
    return {n: v for n, v in pins.items() if n not in unpinned}, unpinned


def resolve(vllm_wheel: Path, cache: Path, prof: LaneProfile) -> tuple[dict[str, Path], dict[str, str]]:
    """Resolve vLLM's requirements (minus the profile's not-required and left-out ones) against the device's freeze
    with pip's own resolver. Returns the downloaded wheels that the device does not already have, by canonical name,
    and the device packages that had to be resolved anew (:func:`lane_pins`)."""
    vllm_reqs = applicable(requires_dist(wheel_metadata(vllm_wheel)))
    pins, unpinned = lane_pins(prof, vllm_reqs)
    stubs = cache / "device-stubs"
    if stubs.exists():
        shutil.rmtree(stubs)
    make_stub_wheels(pins, stubs)
    skip = {canon(n) for n in prof.not_required} | {canon(n) for n in prof.left_out}
    reqs = []
    for req in vllm_reqs:
        if canon(req.name) not in skip:
            reqs.append(str(req).split(";")[0].strip())  # markers already evaluated for the device
    resolved_dir = cache / "resolved"
    if resolved_dir.exists():
        shutil.rmtree(resolved_dir)
    resolved_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        con_file = Path(tmp) / "constraints.txt"
        con_file.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        pip_download(["--find-links", str(stubs), "-c", str(con_file), "-r", str(req_file)], resolved_dir)
    out = {}
    for whl in sorted(resolved_dir.glob("*.whl")):
        name, version = wheel_name_version(whl)
        if version.endswith("+device"):
            continue
        if name in out:
            raise SystemExit(f"pack: two versions of {name} resolved: {out[name].name}, {whl.name}")
        out[name] = whl
    return out, unpinned


def closure(resolved: dict[str, Path], prof: LaneProfile, unpinned: dict[str, str]) -> tuple[dict[str, Path],
                                                                                              list[str]]:
    """The profile's roots, the device packages resolved anew, and their requirements (markers for the device, no
    extras) that the device lacks. Returns the carried wheels and a list of requirements that neither the device nor
    the payload satisfies (warnings)."""
    pins, _ = lane_pins(prof, [])
    pins = {n: v for n, v in pins.items() if n not in unpinned}
    carry: dict[str, Path] = {}
    problems: list[str] = []
    todo = [canon(r) for r in prof.roots] + [n for n in unpinned if n in resolved]
    while todo:
        name = todo.pop()
        if name in carry or name in pins:
            continue
        if name not in resolved:
            problems.append(f"{name}: needed but not resolved")
            continue
        carry[name] = resolved[name]
        for req in applicable(requires_dist(wheel_metadata(resolved[name]))):
            dep = canon(req.name)
            if dep in pins:
                if not req.specifier.contains(pins[dep], prereleases=True):
                    problems.append(f"{name} wants {req}; the device has {dep}=={pins[dep]}")
                continue
            todo.append(dep)
    # Versions among carried wheels agree by construction: they come from one pip resolution.
    return carry, problems


# ------------------------------------------------------------------------------------------------- slim + repack


def _record_line(name: str, data: bytes) -> list[str]:
    return [name, f"sha256={_b64(hashlib.sha256(data).digest())}", str(len(data))]


_SHARED_LIB = re.compile(r"\.so(\.\d+)*$")


def slim_wheel(src: Path, dest: Path, drop: tuple[tuple[str, str], ...], arch: int | None = None) -> dict:
    """Copy a wheel without the files ``drop`` names (regex, why), stored (uncompressed) so xz sees the raw bytes;
    with ``arch``, every shared library keeps only that SM architecture's device code (``fatbin.py``: the other
    generations' cubins are zeroed, so they compress to nothing). RECORD is rewritten to list exactly what is left,
    with the new hashes."""
    drops = [(re.compile(p), why) for p, why in drop]
    dropped: dict[str, dict] = {}
    zeroed = {"libraries": 0, "bytes": 0}
    kept_bytes = 0
    total_bytes = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in sorted(zin.infolist(), key=lambda i: i.filename):
            total_bytes += info.file_size
            if info.filename == record_name:
                continue
            hit = next((why for rx, why in drops if rx.search(info.filename)), None)
            if hit is not None:
                entry = dropped.setdefault(hit, {"files": 0, "bytes": 0})
                entry["files"] += 1
                entry["bytes"] += info.file_size
                continue
            data = zin.read(info)
            if arch is not None and _SHARED_LIB.search(info.filename):
                buf = bytearray(data)
                try:
                    rep = fatbin.slim_buffer(buf, arch, info.filename)
                except fatbin.FatbinError as exc:  # a format we do not know: carried as it is
                    log(f"WARNING {src.name}:{info.filename}: {exc}; kept whole")
                else:
                    if rep.bytes_zeroed:
                        zeroed["libraries"] += 1
                        zeroed["bytes"] += rep.bytes_zeroed
                        data = bytes(buf)
            zi = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_STORED
            zout.writestr(zi, data)
            rows.append(_record_line(info.filename, data))
            kept_bytes += info.file_size
        rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zi = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        zout.writestr(zi, buf.getvalue())
    return {"wheel": src.name, "wheel_bytes": src.stat().st_size, "unpacked_bytes": total_bytes,
            "slim_unpacked_bytes": kept_bytes, "dropped": [{"reason": why, **v} for why, v in dropped.items()],
            "fatbin_arch": arch, "fatbin_zeroed": zeroed}


def download_carried(prof: LaneProfile, cache: Path) -> list[Path]:
    """The wheels the profile carries whole (torch, triton, NCCL for vLLM 0.34), without their dependencies (the
    device has them, or vLLM's resolution brings them), downloaded once into the cache."""
    out = []
    for req in prof.carried:
        name, version = req.split("==")
        folder = cache / "carried"
        pattern = f"{re.sub(r'[-_.]+', '_', name)}-{version}-*.whl"
        found = sorted(folder.glob(pattern)) if folder.exists() else []
        if not found:
            pip_download(["--no-deps", req], folder)
            found = sorted(folder.glob(pattern))
        if not found:
            raise SystemExit(f"pack: {req} was not downloaded")
        out.append(found[0])
    return out


def restore_wheel(src: Path, dest: Path) -> None:
    """Rewrite a wheel with stored entries (same files, same bytes, same RECORD): xz then compresses the contents
    instead of deflate streams, and pip installs it exactly as before."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in sorted(zin.infolist(), key=lambda i: i.filename):
            zi = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = info.external_attr
            zout.writestr(zi, zin.read(info))


def build_tar(files: list[Path], payload_json: dict, dest: Path) -> None:
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            ti = tar.gettarinfo(str(f), arcname=f"wheels/{f.name}")
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode = 0, 0, 0, "", "", 0o644
            with f.open("rb") as fh:
                tar.addfile(ti, fh)
        data = json.dumps(payload_json, indent=1, sort_keys=True).encode()
        ti = tarfile.TarInfo("PAYLOAD.json")
        ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
        tar.addfile(ti, io.BytesIO(data))


def compress_xz(src: Path, dest: Path, preset: str) -> str:
    """xz with the CLI when present (multi-threaded), else Python's lzma. Both are read by Python's lzma."""
    xz = shutil.which("xz")
    if xz:
        with dest.open("wb") as out:
            subprocess.run([xz, f"-{preset}", "-T0", "--check=crc64", "-c", str(src)], stdout=out, check=True)
        return f"xz -{preset} -T0"
    import lzma

    level = int(preset.rstrip("e")) | (lzma.PRESET_EXTREME if preset.endswith("e") else 0)
    with src.open("rb") as fin, lzma.open(dest, "wb", preset=level) as fout:
        shutil.copyfileobj(fin, fout, 16 * MIB)
    return f"python lzma preset {preset}"


# ------------------------------------------------------------------------------------------------- device side


DEVICE_INSTALL = r"""#!/usr/bin/env bash
# Runs on the device machine (no network). Verifies the chunks, reassembles and unpacks the payload, installs the
# wheels into __SITE__ and checks that vLLM imports against the device's torch. Written by scripts/gpu_lane/pack.py.
# Chunks are looked for in __SRC__ (where each call copies its chunk) and, failing that, in the carried folders
# .gpu_lane/cNN/ of the repository copy (ignored carried folders stay there while the machine is warm).
set -euo pipefail
SRC="${GPU_LANE_SRC:-__SRC__}"
SITE="${GPU_LANE_SITE:-__SITE__}"
REPO_LANE="${GPU_LANE_REPO:-$PWD/__OUTNAME__}"
HERE="$(cd "$(dirname "$0")" && pwd)"
MANIFEST="${GPU_LANE_MANIFEST:-$HERE/manifest.json}"
[ -f "$MANIFEST" ] || MANIFEST="$SRC/manifest.json"
t0=$(date +%s)
python3 - "$SRC" "$REPO_LANE" "$MANIFEST" <<'PY'
import hashlib, io, json, lzma, os, sys, tarfile, time
src, repo_lane, manifest_path = sys.argv[1:4]
m = json.load(open(manifest_path))
parts, missing, bad = [], [], []
for i, c in enumerate(m["chunks"]):
    cands = [os.path.join(src, c["name"]), os.path.join(repo_lane, c["folder"], c["name"])]
    path = next((p for p in cands if os.path.isfile(p)), None)
    if path is None:
        missing.append(f'{c["name"]} (device call {i + 1})')
        continue
    data = open(path, "rb").read()
    if hashlib.sha256(data).hexdigest() != c["sha256"]:
        bad.append(f'{c["name"]} at {path} (device call {i + 1})')
        continue
    parts.append(data)
if missing or bad:
    print("gpu_lane: MISSING " + ", ".join(missing) if missing else "", file=sys.stderr)
    print("gpu_lane: BAD HASH " + ", ".join(bad) if bad else "", file=sys.stderr)
    print("gpu_lane: resend those calls (all of them if the machine went cold: /tmp does not survive)", file=sys.stderr)
    sys.exit(3)
blob = b"".join(parts)
if hashlib.sha256(blob).hexdigest() != m["payload"]["sha256"]:
    sys.exit("gpu_lane: reassembled payload hash differs from the manifest")
t = time.time()
raw = lzma.decompress(blob)
dest = os.path.join(src, "payload")
with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
    tar.extractall(dest, filter="data")
print(f"gpu_lane: {len(m['chunks'])} chunks ok, payload {len(blob)} B -> {len(raw)} B, unpacked in "
      f"{time.time() - t:.1f} s", flush=True)
PY
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --upgrade --target "$SITE" "$SRC"/payload/wheels/*.whl
# A carried torch finds its CUDA libraries through its RPATH, $ORIGIN/../../nvidia/<lib>/lib, i.e. under $SITE:
# link the device's own (cuBLAS, cuDNN, cuSPARSELt, NVSHMEM, the CUDA runtime) beside the carried NCCL there.
python3 - "$SITE" "$MANIFEST" <<'PY'
import json, os, sys, sysconfig
site, manifest = sys.argv[1:3]
if not any(w.startswith("torch-") for w in json.load(open(manifest)).get("carried", [])):
    sys.exit(0)
device_nvidia = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
os.makedirs(os.path.join(site, "nvidia"), exist_ok=True)
for name in sorted(os.listdir(device_nvidia)):
    dest = os.path.join(site, "nvidia", name)
    if not os.path.exists(dest):
        os.symlink(os.path.join(device_nvidia, name), dest)
        print(f"gpu_lane: {dest} -> the device's {name}")
PY
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_lane: installed into $SITE in $(( $(date +%s) - t0 )) s"
python3 -c "import vllm, sys; print(vllm.__version__)"
# FlashAttention-3 is the one attention extension carried. If it does not load here, every model import fails
# (vllm/vllm_flash_attn/__init__.py raises when no FA extension loads). Fall back, loudly, to Triton attention.
if ! python3 -c "import vllm.vllm_flash_attn" 2>"$SRC/fa_import.err"; then
  echo "gpu_lane: WARNING FlashAttention-3 did not load: $(tail -n 1 "$SRC/fa_import.err")"
  python3 - "$SITE/vllm/vllm_flash_attn/__init__.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
old = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
assert old in src, "unexpected vllm_flash_attn/__init__.py"
open(path, "w").write(src.replace(old, "if False:  # gpu_lane fallback: no FA extension; use TRITON_ATTN", 1))
PY
  echo "gpu_lane: FALLBACK applied: serve with --attention-backend TRITON_ATTN"
fi
python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # noqa: E401  the CUDA extensions load
from vllm.platforms import current_platform
print("platform", type(current_platform).__name__, "capability", current_platform.get_device_capability())
from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE, FA3_AVAILABLE, is_fa_version_supported
print("FA2", FA2_AVAILABLE, "FA3", FA3_AVAILABLE, "FA3 supported", is_fa_version_supported(3))
import triton
print("triton", triton.__version__, "nccl", torch.cuda.nccl.version())
for mod in __BOOT_IMPORTS__:
    importlib.import_module(mod)
print("gpu_lane: imports ok")
# Two facts the hook depends on, checked on the real kernels (cheap; failures are reported, not fatal):
try:  # moe_sum's arithmetic (0.26's TritonExperts reduces with ops.moe_sum(input, output), no ids)
    from vllm import _custom_ops as ops
    g = torch.Generator(device="cuda").manual_seed(0)
    for k in (2, 4, 6, 8):
        x = torch.randn(33, k, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty(33, 256, device="cuda", dtype=torch.bfloat16)
        ops.moe_sum(x, out)
        acc = torch.zeros(33, 256, device="cuda", dtype=torch.float32)
        for j in range(k):
            acc = acc + x[:, j].float()
        bf = x[:, 0].clone()
        for j in range(1, k):
            bf = bf + x[:, j]
        print(f"moe_sum k={k}: equals fp32-in-order-one-cast={torch.equal(out, acc.bfloat16())} "
              f"equals bf16-running-sum={torch.equal(out, bf)}")
except Exception as e:
    print("moe_sum check failed:", repr(e))
try:  # the UVA view pin mode and --cpu-offload-gb use
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    view = get_accelerator_view_from_cpu_tensor(host)
    print("uva view:", view.device, bool((view * 2).sum().item() == (host * 2).sum().item()))
except Exception as e:
    print("uva view check failed:", repr(e))
PY
echo "gpu_lane: ready; use: export PYTHONPATH=$SITE"
"""


def device_calls(n_chunks: int, outname: str) -> list[dict]:
    calls = []
    for i in range(n_chunks):
        folder = f"{outname}/c{i:02d}"
        last = i == n_chunks - 1
        carry = [folder] + ([f"{outname}/ctl"] if last else [])
        cmd = (f"mkdir -p {DEVICE_SRC} && cp {folder}/* {DEVICE_SRC}/ && cd {DEVICE_SRC} && "
               f"sha256sum -c chunk-{i:02d}.sha256 && df -h /tmp | tail -1")
        if last:
            cmd = (f"mkdir -p {DEVICE_SRC} && cp {folder}/* {outname}/ctl/* {DEVICE_SRC}/ && "
                   f"PYTHONUNBUFFERED=1 bash {DEVICE_SRC}/device_install.sh")
        assert len(cmd) <= 2000
        calls.append({"call": i + 1, "kind": "nvidia-h200", "timeout_s": 600 if last else 300, "carry": carry,
                      "command": cmd})
    return calls


def travel_bytes(repo: Path) -> int:
    """Bytes of the working tree that every device call sends (tracked + untracked-not-ignored files)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return -1
    total = 0
    for name in out.split(b"\0"):
        if name:
            p = repo / name.decode()
            if p.is_file():
                total += p.stat().st_size
    return total


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default=DEFAULT_VLLM,
                    help="vLLM release to pack (a profile in scripts/gpu_lane/lane_profiles.py): 0.26.0 or 0.34.0")
    ap.add_argument("--out", default=".gpu_lane", help="output folder, relative to the repository root")
    ap.add_argument("--cache", default=os.environ.get("GPU_LANE_CACHE", "/tmp/pinsidecar-gpu-lane-cache"),
                    help="download cache (kept between runs)")
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_MIB)
    ap.add_argument("--xz-preset", default="9e")
    args = ap.parse_args(argv)
    prof = profile(args.vllm)
    version = prof.vllm

    repo = Path(__file__).resolve().parents[2]
    out = (repo / args.out).resolve()
    outname = os.path.relpath(out, repo)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    vdir = cache / "vllm"
    vllm_wheels = sorted(vdir.glob(f"vllm-{version}-*.whl")) if vdir.exists() else []
    if not vllm_wheels:
        pip_download(["--no-deps", f"vllm=={version}"], vdir)
        vllm_wheels = sorted(vdir.glob(f"vllm-{version}-*.whl"))
    vllm_wheel = vllm_wheels[0]
    carried_wheels = download_carried(prof, cache)

    resolved, unpinned = resolve(vllm_wheel, cache, prof)
    for n, why in sorted(unpinned.items()):
        log(f"not the device's {n}: {why}")
    carry, problems = closure(resolved, prof, unpinned)
    not_carried = {n: next((why for k, why in prof.left_out.items() if canon(k) == n), None)
                   for n in resolved if n not in carry}
    for n, why in sorted(not_carried.items()):
        log(f"left out {resolved[n].name}: {why or 'only reached through a left-out or optional requirement'}")
    for p in problems:
        log(f"WARNING {p}")

    work = cache / "work"
    if work.exists():
        shutil.rmtree(work)
    (work / "wheels").mkdir(parents=True)
    slim_path = work / "wheels" / vllm_wheel.name
    log("slimming the vLLM wheel")
    slim = slim_wheel(vllm_wheel, slim_path, prof.slim_drop, prof.fatbin_arch)
    wheels = [slim_path]
    carried_rows = []
    for src in carried_wheels:
        log(f"slimming {src.name}")
        dest = work / "wheels" / src.name
        carried_rows.append(slim_wheel(src, dest, prof.carried_drop, prof.fatbin_arch))
        wheels.append(dest)
    dep_rows = []
    for name in sorted(carry):
        src = carry[name]
        dest = work / "wheels" / src.name
        restore_wheel(src, dest)
        wheels.append(dest)
        dep_rows.append({"name": name, "wheel": src.name, "bytes": src.stat().st_size})
    payload_json = {"vllm": version, "wheels": [w.name for w in wheels],
                    "carried": [w.name for w in carried_wheels]}
    tar_path = work / "payload.tar"
    build_tar(wheels, payload_json, tar_path)
    xz_path = work / "payload.tar.xz"
    log(f"compressing {tar_path.stat().st_size / MIB:.1f} MiB with xz -{args.xz_preset} (minutes)")
    method = compress_xz(tar_path, xz_path, args.xz_preset)

    # --- output folder: chunks, control files, call list
    if out.exists():
        for child in out.iterdir():
            if re.fullmatch(r"c\d\d|ctl", child.name) and child.is_dir():
                shutil.rmtree(child)
            elif child.name in ("device-calls.txt", "device-calls.json", "pack-report.json"):
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    # As many chunks as the limit needs, of equal size: the margin under 64 MiB is then as large as it can be. The
    # working tree travels with every call, so a chunk gets what the tree leaves of CALL_LIMIT_MIB (the tree has
    # grown past 6 MiB of benchmark results, which a 58 MiB chunk no longer fits beside).
    payload_size = xz_path.stat().st_size
    tree = travel_bytes(repo)
    room = CALL_LIMIT_MIB * MIB - max(tree, 0) - CTL_ROOM_BYTES
    n_chunks = -(-payload_size // int(min(args.chunk_mib * MIB, room)))
    chunk_bytes = -(-payload_size // n_chunks)
    chunks = []
    with xz_path.open("rb") as f:
        i = 0
        while True:
            data = f.read(chunk_bytes)
            if not data:
                break
            folder = out / f"c{i:02d}"
            folder.mkdir()
            name = f"chunk-{i:02d}"
            (folder / name).write_bytes(data)
            digest = hashlib.sha256(data).hexdigest()
            (folder / f"{name}.sha256").write_text(f"{digest}  {name}\n")
            chunks.append({"name": name, "folder": f"c{i:02d}", "bytes": len(data), "sha256": digest})
            i += 1
    manifest = {"vllm": version, "carried": payload_json["carried"], "created_by": "scripts/gpu_lane/pack.py",
                "compression": method,
                "payload": {"bytes": xz_path.stat().st_size, "sha256": sha256_file(xz_path),
                            "tar_bytes": tar_path.stat().st_size},
                "chunks": chunks, "wheels": payload_json["wheels"], "device_src": DEVICE_SRC,
                "device_site": DEVICE_SITE}
    ctl = out / "ctl"
    ctl.mkdir()
    (ctl / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    script = (DEVICE_INSTALL.replace("__SRC__", DEVICE_SRC).replace("__SITE__", DEVICE_SITE)
              .replace("__OUTNAME__", outname).replace("__BOOT_IMPORTS__", repr(list(prof.boot_imports))))
    (ctl / "device_install.sh").write_text(script)
    (ctl / "device_install.sh").chmod(0o755)

    calls = device_calls(len(chunks), outname)
    (out / "device-calls.json").write_text(json.dumps(calls, indent=1) + "\n")
    ctl_bytes = sum(p.stat().st_size for p in ctl.iterdir())
    lines = [f"# Device calls for vLLM {version} ({len(chunks)} calls). Send them back to back: the machine",
             "# stays warm ~30 s after each call and /tmp is lost when it goes cold (then start again at call 1).",
             "# Each call carries one chunk folder; the last one also carries ctl/ and installs into "
             f"{DEVICE_SITE}.",
             f"# Working tree sent with every call: {tree / MIB:.2f} MiB; largest call "
             f"{(tree + max(c['bytes'] for c in chunks) + ctl_bytes + 200) / MIB:.2f} MiB of 64 MiB.", ""]
    for c in calls:
        lines += [f"## call {c['call']} of {len(calls)}", f"kind: {c['kind']}", f"timeout_s: {c['timeout_s']}",
                  f"carry: {json.dumps(c['carry'])}", "command:", c["command"], ""]
    lines += ["## afterwards, in the same warm window", f"export PYTHONPATH={DEVICE_SITE} before any use of vLLM.", ""]
    (out / "device-calls.txt").write_text("\n".join(lines))

    report = {
        "vllm_wheel": vllm_wheel.name, "slim": slim, "slim_wheel_bytes": slim_path.stat().st_size,
        "dependency_wheels": dep_rows,
        "dependency_wheel_bytes": sum(r["bytes"] for r in dep_rows),
        "left_out": {n: (resolved[n].name, why) for n, why in sorted(not_carried.items())},
        "carried": carried_rows, "not_the_device_s": unpinned,
        "left_out_requirements": prof.left_out, "not_required": prof.not_required, "problems": problems,
        "tar_bytes": tar_path.stat().st_size,
        "payload_bytes": xz_path.stat().st_size, "compression": method, "chunks": chunks,
        "working_tree_bytes": tree, "seconds": round(time.time() - t0, 1),
    }
    (out / "pack-report.json").write_text(json.dumps(report, indent=1) + "\n")
    worst = tree + max(c["bytes"] for c in chunks) + ctl_bytes
    if tree < 0 or worst > 63 * MIB:
        log(f"WARNING the largest call would send {worst / MIB:.2f} MiB (limit 64 MiB): lower --chunk-mib")
    log(f"vLLM wheel {slim['wheel_bytes'] / MIB:.1f} MiB ({slim['unpacked_bytes'] / MIB:.1f} MiB unpacked) -> slim "
        f"{slim['slim_unpacked_bytes'] / MIB:.1f} MiB unpacked; {len(dep_rows)} dependency wheels "
        f"{report['dependency_wheel_bytes'] / MIB:.1f} MiB; tar {report['tar_bytes'] / MIB:.1f} MiB -> "
        f"{report['payload_bytes'] / MIB:.1f} MiB ({method}); {len(chunks)} chunks; {report['seconds']} s")
    log(f"wrote {outname}/ (device-calls.txt lists the calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
