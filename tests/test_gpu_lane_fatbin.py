"""scripts/gpu_lane/fatbin.py: one GPU generation's device code kept in a shared library, the rest zeroed in place.

The GPU lane carries torch 2.14, triton 3.8 and NCCL to the lent SM90 machine in 64-MiB calls, and zeroing the other
generations' cubins (compressed already, so xz cannot shrink them) is what makes that fit. These tests build a
minimal 64-bit ELF file holding a fatbin section in the layout the script reads, and check what it keeps, what it
zeroes, and that a section it does not understand leaves the file untouched.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_lane_fatbin", Path(__file__).resolve().parents[1] / "scripts" / "gpu_lane" / "fatbin.py")
fatbin = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = fatbin  # its dataclasses look their module up there
_SPEC.loader.exec_module(fatbin)  # type: ignore[union-attr]


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fatbin entry: a 64-byte header (kind, version, header size, payload size, ..., arch at 28) and payload."""
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.CONTAINER_MAGIC, 1, 16, len(body)) + body


def _elf(section: bytes, name: bytes = b".nv_fatbin") -> bytes:
    """A 64-bit little-endian ELF image with sections: null, .shstrtab, and ``section`` under ``name``."""
    shstrtab = b"\0.shstrtab\0" + name + b"\0"
    data_off = 64
    strtab_off = data_off + len(section)
    shoff = (strtab_off + len(shstrtab) + 7) // 8 * 8
    ehdr = bytearray(64)
    ehdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", ehdr, 0x28, shoff)
    struct.pack_into("<HHH", ehdr, 0x3A, 64, 3, 1)  # shentsize, shnum, shstrndx

    def shdr(name_off: int, offset: int, size: int) -> bytes:
        h = bytearray(64)
        struct.pack_into("<I", h, 0, name_off)
        struct.pack_into("<QQ", h, 0x18, offset, size)
        return bytes(h)

    image = bytes(ehdr) + section + shstrtab
    image += b"\0" * (shoff - len(image))
    return image + shdr(0, 0, 0) + shdr(1, strtab_off, len(shstrtab)) + shdr(11, data_off, len(section))


def _payload(tag: int, size: int = 256) -> bytes:
    return bytes((tag + i) % 251 + 1 for i in range(size))  # no zero byte: a zeroed payload is unmistakable


def test_keeps_the_target_architecture_and_zeroes_the_others(tmp_path: Path) -> None:
    sm80, sm90, sm90ptx, sm100 = _payload(1), _payload(2), _payload(3), _payload(4)
    both = _container(_entry(2, 80, sm80), _entry(2, 90, sm90), _entry(1, 90, sm90ptx), _entry(2, 100, sm100))
    only_other = _container(_entry(2, 86, _payload(5)), _entry(1, 120, _payload(6)))  # no SM90 entry: kept whole
    section = both + b"\0" * 8 + only_other  # containers may be separated by zero padding
    lib = tmp_path / "lib.so"
    lib.write_bytes(_elf(section))
    before = lib.read_bytes()

    report = fatbin.slim_file(lib, 90)

    after = lib.read_bytes()
    assert len(after) == len(before)
    assert after.count(sm90) == 1 and after.count(sm90ptx) == 1
    assert sm80 not in after and sm100 not in after
    assert _payload(5) in after and _payload(6) in after
    assert report.containers == 2 and report.containers_kept_whole == 1
    assert report.entries == 6 and report.entries_zeroed == 2 and report.bytes_zeroed == 2 * 256
    assert report.archs == {80: 256, 90: 512, 100: 256, 86: 256, 120: 256}
    # Only payload bytes changed: every header and everything outside the section is as it was.
    changed = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert changed and all(y == 0 for y in (after[i] for i in changed))
    assert len(changed) <= 2 * 256


def test_the_relocatable_section_is_slimmed_too(tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(_elf(_container(_entry(2, 90, _payload(7)), _entry(2, 75, _payload(8))), b"__nv_relfatbin"))
    report = fatbin.slim_file(lib, 90)
    assert report.sections == {"__nv_relfatbin": len(_container(_entry(2, 90, _payload(7)),
                                                                 _entry(2, 75, _payload(8))))}
    assert _payload(8) not in lib.read_bytes() and _payload(7) in lib.read_bytes()


def test_a_library_without_device_code_is_left_alone(tmp_path: Path) -> None:
    lib = tmp_path / "plain.so"
    image = _elf(b"just host code", b".text")
    lib.write_bytes(image)
    report = fatbin.slim_file(lib, 90)
    assert lib.read_bytes() == image and report.sections == {} and report.bytes_zeroed == 0


@pytest.mark.parametrize("damage", ["magic", "overrun"])
def test_a_section_it_does_not_understand_changes_nothing(tmp_path: Path, damage: str) -> None:
    good = _container(_entry(2, 80, _payload(9)), _entry(2, 90, _payload(10)))
    bad = bytearray(_container(_entry(2, 86, _payload(11))))
    if damage == "magic":
        bad[:4] = b"\x12\x34\x56\x78"
    else:  # an entry whose payload runs past its container
        struct.pack_into("<Q", bad, 16 + 8, 1 << 20)
    lib = tmp_path / "lib.so"
    lib.write_bytes(_elf(good + bytes(bad)))
    before = lib.read_bytes()
    with pytest.raises(fatbin.FatbinError):
        fatbin.slim_file(lib, 90)
    assert lib.read_bytes() == before  # the good container before the bad one was not zeroed either


def test_not_an_elf_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(fatbin.FatbinError, match="ELF"):
        fatbin.slim_buffer(bytearray(b"MZ" + bytes(100)), 90)
