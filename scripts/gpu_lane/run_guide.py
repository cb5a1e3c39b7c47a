#!/usr/bin/env python3
"""Run a guide's ``bash`` blocks, in order, as one shell script: so "every command in the guide ran" is literal.

``docs/gpu-operator.md`` is written for an operator; this script is how the project checks it. Every fenced block
whose info string is ``bash`` is taken, in document order, into one ``bash -euo pipefail`` script (so a variable or
function one block defines is there for the next, as in the operator's shell); before each block the script prints
a header with the block's number, its section heading and its text, and after it the seconds it took. The first
command that fails stops the run (``set -e``), and the report says which block it was in. Blocks fenced as
``text`` (the systemd steps, which the lent GPU cannot run) are not run.

What the guide leaves to its environment (``VLLM_PY``, ``MODEL``, ``PS_HOME``, ``WHEEL``, ``PIP_INSTALL_ARGS``,
``EXTRA_VLLM_FLAGS``, ``HOT_ROWS``) is set by the caller, e.g. ``scripts/gpu_lane/device_loop.sh`` on the H200.

    python3 scripts/gpu_lane/run_guide.py docs/gpu-operator.md --log OUT.log --json OUT.json
    python3 scripts/gpu_lane/run_guide.py docs/gpu-operator.md --print      # the script it would run

Exit code: the script's (0 when every block ran).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "blocks", "main", "script"]

FENCE = re.compile(r"^```(\w*)\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
MARK = "### pinsidecar-guide block"


@dataclass(frozen=True)
class Block:
    index: int
    heading: str
    text: str


def blocks(markdown: str, lang: str = "bash") -> list[Block]:
    """The fenced blocks of ``lang``, in order, each with the heading it sits under."""
    out: list[Block] = []
    heading, inside, kind, lines = "", False, "", []
    for line in markdown.splitlines():
        fence = FENCE.match(line)
        if fence and not inside:
            inside, kind, lines = True, fence.group(1), []
            continue
        if fence and inside and not fence.group(1):
            if kind == lang:
                out.append(Block(len(out) + 1, heading, "\n".join(lines)))
            inside = False
            continue
        if inside:
            lines.append(line)
        elif (h := HEADING.match(line)) is not None:
            heading = h.group(2).strip()
    return out


def script(found: list[Block]) -> str:
    """One shell script running ``found`` in order, printing a header before each block and its time after."""
    parts = ["set -euo pipefail", "_guide_t0=$(date +%s)"]
    for b in found:
        header = f"{MARK} {b.index}/{len(found)}: {b.heading}"
        parts.append(f"printf '%s\\n' {shlex.quote(header)} {shlex.quote(b.text)} '---'")
        parts.append(b.text)
        parts.append(f"echo \"{MARK} {b.index} done in $(( $(date +%s) - _guide_t0 )) s\"; _guide_t0=$(date +%s)")
    return "\n".join(parts) + "\n"


def _last_block(log: str) -> int:
    started = [int(m.group(1)) for m in re.finditer(rf"^{MARK} (\d+)/", log, re.M)]
    return started[-1] if started else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("guide", type=Path)
    ap.add_argument("--log", type=Path, help="write everything the blocks print here (also echoed)")
    ap.add_argument("--json", type=Path, help="write a summary: blocks, the one that failed, seconds, exit code")
    ap.add_argument("--print", action="store_true", help="print the script instead of running it")
    args = ap.parse_args(argv)
    found = blocks(args.guide.read_text(encoding="utf-8"))
    text = script(found)
    if args.print:
        sys.stdout.write(text)
        return 0
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", text], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    captured: list[str] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        captured.append(line)
    rc = proc.wait()
    log = "".join(captured)
    if args.log:
        args.log.write_text(log, encoding="utf-8")
    failed = _last_block(log) if rc else None
    summary = {"guide": str(args.guide), "blocks": len(found), "exit_code": rc,
               "failed_block": failed, "failed_heading": found[failed - 1].heading if failed else None,
               "seconds": round(time.monotonic() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
