"""The daemon's public face stays narrow: a name in an ``__all__`` is one that another package imports.

Each package of ``pinsidecar`` (``pinsidecar.remap``, ``pinsidecar.drift``, ...) is a room; what other rooms use
from it is its face, and the rest is private to it (tests may still import it by its module path: they test the inside).
A name another package uses is listed once, in the package ``__init__`` when that re-exports it, else in its
module. This test fails on a new ``__all__`` entry that nothing outside its package imports, and on an entry
listed both in a module and in its package ``__init__``, so the face cannot grow back by habit. ``__all__`` is
what ``from x import *``, the docs and a reader take as the contract; keeping it true keeps refactors cheap.

The hook (``pinsidecar_hook``) is left as it is: it changes only where it must (its rooms have their own test,
``test_hook_rooms.py``), and its imports still count as uses of the daemon's names. So do the benchmarks'
(``bench/``, not part of the distribution, with no ``__all__`` of the daemon's): they import what they measure,
and the scenario harness they share with their tests, by its public names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"pinsidecar": ROOT / "pinsidecar", "pinsidecar_hook": ROOT / "hook" / "pinsidecar_hook"}
CONSUMERS = {"bench": ROOT / "bench"}  # their imports are uses; their own names are not the daemon's face
# Used by name, not by an import: the console script, vLLM's plugin entry point, pytest's fixture plugin.
USED_BY_NAME = {("pinsidecar.cli", "main"), ("pinsidecar", "__version__")}
PLUGIN_MODULES = {"pinsidecar.testing.fixtures"}  # pytest finds its fixtures by name; tests/test_engine.py reads it
# A ceiling, not a target: a third of the daemon's 602 public names before the second renovation (2026-12-02).
MOST_PUBLIC_NAMES = 200


def _modules(sources: dict[str, Path] = SOURCES) -> Iterator[tuple[str, Path]]:
    for top, base in sources.items():
        for path in sorted(base.rglob("*.py")):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _room(module: str) -> str:
    """The package a module belongs to: ``pinsidecar.remap.pipeline`` -> ``pinsidecar.remap``."""
    return ".".join(module.split(".")[:2])


def _exports() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for module, path in _modules():
        if not module.startswith("pinsidecar.") and module != "pinsidecar":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", None) == "__all__" for t in targets) and node.value is not None:
                    out[module] = [e.value for e in node.value.elts]  # type: ignore[attr-defined]
    return out


def _uses() -> set[tuple[str, str, str]]:
    """(importing room, module imported from, name) for every import and ``alias.attr`` in the library."""
    uses: set[tuple[str, str, str]] = set()
    for module, path in [*_modules(), *_modules(CONSUMERS)]:
        tree = ast.parse(path.read_text())
        room = _room(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join([*base, node.module] if node.module else base)
                for a in node.names:
                    uses.add((room, source, a.name))
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, cur = [], node
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id in aliases:
                    chain.reverse()
                    for i, attr in enumerate(chain):
                        uses.add((room, ".".join([aliases[cur.id], *chain[:i]]), attr))
    return uses


def _used_outside(module: str, name: str, uses: set[tuple[str, str, str]]) -> bool:
    if (module, name) in USED_BY_NAME or module in PLUGIN_MODULES:
        return True
    room = _room(module)
    return any(n == name and r != room and source in (module, room) for r, source, n in uses)


def test_every_public_name_is_used_by_another_package() -> None:
    uses = _uses()
    unused = [f"{m}.{n}" for m, names in _exports().items() for n in names if not _used_outside(m, n, uses)]
    assert not unused, ("these __all__ entries are imported by no other package: drop them from __all__ (the name "
                        "stays importable for tests) or import them where they are meant to be used:\n  "
                        + "\n  ".join(unused))


def test_a_name_the_package_re_exports_is_not_listed_again_in_its_module() -> None:
    exports = _exports()
    twice = [f"{m}.{n}" for m, names in exports.items() if _room(m) != m
             for n in names if n in exports.get(_room(m), [])]
    assert not twice, "listed in the package __init__ and again in its module:\n  " + "\n  ".join(twice)


def test_the_public_face_stays_under_its_ceiling() -> None:
    total = sum(len(names) for names in _exports().values())
    assert total <= MOST_PUBLIC_NAMES, f"{total} public names (ceiling {MOST_PUBLIC_NAMES})"
