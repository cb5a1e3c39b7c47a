"""Faults injected into the hook's in-place apply from outside the hook, so that the hook reads no test variables.

``pinsidecar_hook.swap_batches.swap_layers`` takes ``stall_s`` (hold the step lock that long after the first
layer's swaps: a test can SIGKILL the engine mid-apply) and ``fail_after_layers`` (raise after that many layers,
``0`` before the first: the swap-back is proven) as arguments, and the live path (``swap.apply_map``) never passes
them. A test that wants either wraps ``pinsidecar_hook.swap.swap_layers`` with them:

- in its own process, :func:`inject` (through pytest's ``monkeypatch``, undone after the test);
- in a real engine, :func:`engine_env`: the environment for ``[engine] env``, a folder put first on
  ``PYTHONPATH`` whose ``sitecustomize.py`` wraps the function when the engine process imports the hook, with the
  faults in a JSON file beside it. The engine's processes (the API server, the engine core) all get it; nothing of
  it is in the hook or the daemon.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

__all__: list[str] = []  # nothing here is another package's business

FAULTS_FILE = "pinsidecar-hook-faults.json"

# Written as the engine's sitecustomize.py: standalone (the engine's environment may lack the daemon's package),
# and lazy (it must not import torch before vLLM has set its environment up): it wraps swap_layers once the hook's
# swap module has been imported, by wrapping that module's loader.
_SITECUSTOMIZE = '''"""Written by pinsidecar.testing.hook_faults: faults in the hook's in-place apply (tests only)."""
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys

_MODULE = "pinsidecar_hook.swap"
_FAULTS = json.loads(open(os.path.join(os.path.dirname(__file__), {faults_file!r})).read())


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            module.swap_layers = functools.partial(module.swap_layers, **_FAULTS)
            print(f"pinsidecar hook faults: swap_layers wrapped with {{_FAULTS}}", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_and_wrap
        return spec


sys.meta_path.insert(0, _WrapOnImport())
'''


def _faults(stall_s: float | None, fail_after_layers: int | None) -> dict[str, Any]:
    faults = {k: v for k, v in (("stall_s", stall_s), ("fail_after_layers", fail_after_layers)) if v is not None}
    if not faults:
        raise ValueError("no fault given: pass stall_s and/or fail_after_layers")
    return faults


def inject(monkeypatch: Any, *, stall_s: float | None = None, fail_after_layers: int | None = None) -> None:
    """Make this process's in-place applies stall or fail (``monkeypatch``: pytest's, which undoes it)."""
    from pinsidecar_hook import swap

    monkeypatch.setattr(swap, "swap_layers", functools.partial(swap.swap_layers,
                                                                **_faults(stall_s, fail_after_layers)))


def engine_env(folder: Path, *, stall_s: float | None = None, fail_after_layers: int | None = None
               ) -> dict[str, str]:
    """Write the fault injector into ``folder`` and return the engine environment that loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAULTS_FILE).write_text(json.dumps(_faults(stall_s, fail_after_layers)))
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(faults_file=FAULTS_FILE))
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path)}
