"""Faults injected into the hook's in-place apply from outside the hook, so that the hook reads no test variables.

``pinsidecar_hook.swap.batches.swap_layers`` takes ``stall_s`` (hold the step lock that long after the first
layer's swaps: a test can SIGKILL the engine mid-apply) and ``fail_after_layers`` (raise after that many layers,
``0`` before the first: the swap-back is proven) as arguments, and the live path (``swap.apply_map``) never passes
them. A test that wants either wraps ``pinsidecar_hook.swap.apply.swap_layers`` (where the apply reads it) with them:

- in its own process, :func:`inject` (through pytest's ``monkeypatch``, undone after the test);
- in a real engine, :func:`engine_env`: the environment for ``[engine] env``, a folder put first on
  ``PYTHONPATH`` whose ``sitecustomize.py`` wraps the function when the engine process imports the hook, with the
  faults in a JSON file beside it. The engine's processes (the API server, the engine core) all get it; nothing of
  it is in the hook or the daemon;
- in a real tensor-parallel engine, per rank and changed while it runs: :func:`live_engine_env` installs wrappers
  that read the faults file at each call, and :func:`set_live_faults` rewrites it: ``ranks`` (the
  ``torch.distributed`` ranks it applies to), ``refuse`` (the reason a rank's checks refuse the apply with, as a
  rank that cannot read the candidate would), ``fail_after_layers``, ``stall_s``. With no faults set, nothing
  changes.
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

_MODULE = "pinsidecar_hook.swap.apply"
_PATH = os.path.join(os.path.dirname(__file__), {faults_file!r})
_FAULTS = json.loads(open(_PATH).read())


def _now():
    """The live faults for this process: {{}} unless the file names this rank (or no ranks)."""
    try:
        faults = json.loads(open(_PATH).read())
    except (OSError, ValueError):
        return {{}}
    ranks = faults.pop("ranks", None)
    faults.pop("live", None)
    if ranks is not None:
        try:
            import torch.distributed as dist
            if not (dist.is_initialized() and dist.get_rank() in ranks):
                return {{}}
        except Exception:
            return {{}}
    return faults


def _wrap_live(module):
    swap_layers, prepare = module.swap_layers, module._prepare

    def live_swap_layers(*args, **kw):
        kw.update({{k: v for k, v in _now().items() if k in ("stall_s", "fail_after_layers")}})
        return swap_layers(*args, **kw)

    def live_prepare(*args, **kw):
        reason = _now().get("refuse")
        if reason:
            raise module.ApplyRefused(reason)
        return prepare(*args, **kw)

    module.swap_layers, module._prepare = live_swap_layers, live_prepare


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
            if _FAULTS.get("live"):
                _wrap_live(module)
                print(f"pinsidecar hook faults: live faults from {{_PATH}}", file=sys.stderr, flush=True)
                return
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
    import pinsidecar_hook.swap.apply as swap_apply

    monkeypatch.setattr(swap_apply, "swap_layers", functools.partial(swap_apply.swap_layers,
                                                                      **_faults(stall_s, fail_after_layers)))


def engine_env(folder: Path, *, stall_s: float | None = None, fail_after_layers: int | None = None
               ) -> dict[str, str]:
    """Write the fault injector into ``folder`` and return the engine environment that loads it."""
    return _install(folder, _faults(stall_s, fail_after_layers))


def live_engine_env(folder: Path) -> dict[str, str]:
    """The engine environment whose faults :func:`set_live_faults` changes while the engine runs (none at first)."""
    return _install(folder, {"live": True})


def set_live_faults(folder: Path, *, ranks: list[int] | None = None, refuse: str | None = None,
                    fail_after_layers: int | None = None, stall_s: float | None = None) -> None:
    """The faults the next applies of a :func:`live_engine_env` engine meet (no argument: none)."""
    faults: dict[str, Any] = {"live": True, **({"ranks": list(ranks)} if ranks is not None else {})}
    faults.update({k: v for k, v in (("refuse", refuse), ("fail_after_layers", fail_after_layers),
                                     ("stall_s", stall_s)) if v is not None})
    from pinsidecar_hook.contract.io import atomic_write_json

    atomic_write_json(folder / FAULTS_FILE, faults)


def _install(folder: Path, faults: dict[str, Any]) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAULTS_FILE).write_text(json.dumps(faults))
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(faults_file=FAULTS_FILE))
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path)}
