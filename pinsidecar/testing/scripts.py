"""Import a script of the repository (``scripts/**/*.py``) by its path, for the tests that check it.

Those scripts are run as files, not imported as a package, so they are not on ``sys.path`` (the benchmarks are a
package, ``bench``: tests import them as ``from bench import placement``). Loading one by path
keeps the test's import explicit and leaves ``sys.path`` alone. The module is registered under its name before it
runs: a dataclass in it needs its module to be importable by name while the class is built.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__: list[str] = []  # nothing here is another package's business


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The module the script at ``path`` defines (once per name and session), named ``name`` or its file stem."""
    name = name or path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
