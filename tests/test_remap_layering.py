"""No import arrow from the remap pipeline into the daemon: ``pinsidecar/remap/`` never imports
``pinsidecar.daemon``, not even under ``TYPE_CHECKING`` or inside a function.

The daemon starts remaps; a remap does not reach back into the daemon. What the pipeline needs of the process that
runs it is :class:`~pinsidecar.remap.host.RemapHost` (the daemon implements it), so a test or another host can run
a remap, and a change in the daemon's config or internals cannot silently become the pipeline's. ``test_layering``
only reads top-level imports (it looks for cycles); this reads every import statement in the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REMAP = ROOT / "pinsidecar" / "remap"
FORBIDDEN = "pinsidecar.daemon"


def _imports(tree: ast.AST, module: str) -> list[str]:
    """Every module an import statement anywhere in ``tree`` names (``from x import y`` counts ``x`` and
    ``x.y``; relative imports are resolved against ``module``'s package)."""
    package = module.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found += [source, *(f"{source}.{a.name}" for a in node.names)]
    return found


def _bad(tree: ast.AST, module: str) -> list[str]:
    return sorted({t for t in _imports(tree, module) if t == FORBIDDEN or t.startswith(FORBIDDEN + ".")})


def test_no_module_under_remap_imports_the_daemon() -> None:
    offenders = []
    paths = sorted(REMAP.rglob("*.py"))
    assert len(paths) > 10, paths  # the folder is really there
    for path in paths:
        module = "pinsidecar." + ".".join(path.relative_to(ROOT / "pinsidecar").with_suffix("").parts)
        offenders += [f"{path.relative_to(ROOT)}: {t}" for t in _bad(ast.parse(path.read_text()), module)]
    assert not offenders, ("pinsidecar/remap imports pinsidecar.daemon (pass what the pipeline needs through "
                           "pinsidecar.remap.host.RemapHost instead):\n  " + "\n  ".join(offenders))


def test_the_check_sees_every_kind_of_import() -> None:
    """The detector itself: a TYPE_CHECKING import, a lazy one, a relative one and ``from pinsidecar import daemon``
    are all caught; a look-alike name is not."""
    source = '''
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from pinsidecar.daemon.config import Config
def f():
    import pinsidecar.daemon.service
    from ..daemon import supervisor
    from pinsidecar import daemon
from pinsidecar.daemonish import x
'''
    assert _bad(ast.parse(source), "pinsidecar.remap.pipeline") == [
        "pinsidecar.daemon", "pinsidecar.daemon.config", "pinsidecar.daemon.config.Config",
        "pinsidecar.daemon.service", "pinsidecar.daemon.supervisor"]
