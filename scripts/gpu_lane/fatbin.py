#!/usr/bin/env python3
"""Keep one GPU architecture's device code in a shared library: zero every other architecture's cubins.

Why. A CUDA wheel carries device code for every GPU generation it supports: torch 2.14's ``libtorch_cuda.so`` is
503 MB, and 332 MB of it is the ``.nv_fatbin`` section, with one cubin per kernel for each of SM75, 80, 86, 90,
100, 103 and 120. The lent machine is SM90 (H100/H200), and every byte travels through 64-MiB device calls. The
fatbin entries are compressed already, so xz cannot shrink them; zeroed bytes it shrinks to nothing.

How. A fatbin section is a run of containers (magic ``0xBA55ED50``), one per translation unit, each a list of
entries (``kind`` 1 = PTX, 2 = ELF cubin) with a header that names the SM architecture and the payload size. This
script keeps every entry of the target architecture and zeroes the payload of every other entry, in place: the
section's size, every header and every offset stay as they are, so the ELF file is unchanged but for those bytes.
The CUDA driver picks the entry that matches the device from the headers and never reads another one's payload.
A container with no entry for the target (device code that would reach SM90 only by PTX JIT from an older
architecture, say) is left whole, so nothing that could run on the target is removed.

The layout is NVIDIA's fatbinary format as read by open tools (e.g. ``cuda-fatbin-decompression``); the script
checks every header it walks (magic, sizes inside the section) and refuses the file otherwise, so a format it does
not know is reported, never half-rewritten. ``tests/test_gpu_lane_fatbin.py`` checks it on a synthetic fatbin.

Usage: ``python3 scripts/gpu_lane/fatbin.py --arch 90 LIB.so [LIB.so ...]`` (rewrites in place, prints a report).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import struct
import sys
from pathlib import Path

__all__ = ["FatbinError", "SlimReport", "fatbin_sections", "slim_buffer", "slim_file", "slim_section"]

CONTAINER_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, payload size
_ENTRY_ARCH_OFFSET = 28  # uint32 SM architecture (90 for sm_90/sm_90a), after size fields and the PTX/ELF version
SECTIONS = (".nv_fatbin", "__nv_relfatbin")  # device code, and relocatable device code (NCCL)


class FatbinError(ValueError):
    """The file holds a fatbin section this script does not understand; nothing was written."""


@dataclasses.dataclass
class SlimReport:
    """What :func:`slim_file` did to one library."""

    path: str
    sections: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> section bytes
    containers: int = 0
    containers_kept_whole: int = 0  # no entry for the target architecture
    entries: int = 0
    entries_zeroed: int = 0
    bytes_zeroed: int = 0
    archs: dict[int, int] = dataclasses.field(default_factory=dict)  # arch -> payload bytes before


def fatbin_sections(data: bytes | mmap.mmap) -> dict[str, tuple[int, int]]:
    """``{name: (file offset, size)}`` of the fatbin sections of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        return {}

    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    found = {}
    for i in range(shnum):
        name_off, offset, size = header(i)
        end = data.find(b"\0", str_off + name_off)
        name = bytes(data[str_off + name_off:end]).decode("ascii", "replace")
        if name in SECTIONS and size:
            found[name] = (offset, size)
    return found


def _walk(data: bytearray | mmap.mmap, start: int, size: int) -> list[tuple[int, list[tuple[int, int, int, int]]]]:
    """Every container of a section: ``(offset, [(entry offset, header size, payload size, arch), ...])``.
    Containers are 8-byte aligned and may be separated by zero padding."""
    out = []
    pos, end = start, start + size
    while pos + _CONTAINER.size <= end:
        magic, _version, header_size, body = _CONTAINER.unpack_from(data, pos)
        if magic != CONTAINER_MAGIC:
            if bytes(data[pos:pos + 8]) != b"\0" * 8:
                raise FatbinError(f"unexpected bytes at section offset {pos - start:#x} (no fatbin container)")
            pos += 8
            continue
        entry, stop = pos + header_size, pos + header_size + body
        if stop > end:
            raise FatbinError(f"container at {pos - start:#x} runs past the section end")
        entries = []
        while entry < stop:
            kind, _v, ehead, payload = _ENTRY.unpack_from(data, entry)
            arch, = struct.unpack_from("<I", data, entry + _ENTRY_ARCH_OFFSET)
            if kind not in (1, 2) or ehead < _ENTRY_ARCH_OFFSET + 4 or entry + ehead + payload > stop:
                raise FatbinError(f"entry at {entry - start:#x}: kind {kind}, header {ehead}, payload {payload}")
            entries.append((entry, ehead, payload, arch))
            entry += ehead + payload
        out.append((pos, entries))
        pos = stop
    return out


def slim_section(data: bytearray | mmap.mmap, start: int, size: int, arch: int, report: SlimReport) -> None:
    """Zero, in ``data``, the payload of every entry of the section whose architecture is not ``arch`` (containers
    without an ``arch`` entry are left whole). Walks the whole section first, so a format error writes nothing."""
    containers = _walk(data, start, size)
    for _pos, entries in containers:
        report.containers += 1
        report.entries += len(entries)
        for _e, _h, payload, a in entries:
            report.archs[a] = report.archs.get(a, 0) + payload
        if not any(a == arch for *_rest, a in entries):
            report.containers_kept_whole += 1
            continue
        for e, ehead, payload, a in entries:
            if a != arch:
                data[e + ehead:e + ehead + payload] = b"\0" * payload
                report.entries_zeroed += 1
                report.bytes_zeroed += payload


def slim_buffer(data: bytearray | mmap.mmap, arch: int, name: str = "") -> SlimReport:
    """Slim every fatbin section of the ELF image ``data`` in place (module docstring). Every section is checked
    before any byte changes, so a :class:`FatbinError` leaves ``data`` as it was. No fatbin: nothing changes."""
    report = SlimReport(path=name)
    sections = fatbin_sections(data)
    for offset, size in sections.values():
        _walk(data, offset, size)
    for section, (offset, size) in sections.items():
        report.sections[section] = size
        slim_section(data, offset, size, arch, report)
    return report


def slim_file(path: Path, arch: int) -> SlimReport:
    """:func:`slim_buffer` on a file, in place."""
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        report = slim_buffer(data, arch, str(path))
        data.flush()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="SM architecture to keep (90: H100/H200)")
    ap.add_argument("libs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for lib in args.libs:
        try:
            rep = slim_file(lib, args.arch)
        except FatbinError as exc:
            print(f"error: {lib}: {exc} (the file was not changed)", file=sys.stderr)
            return 2
        print(json.dumps(dataclasses.asdict(rep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
