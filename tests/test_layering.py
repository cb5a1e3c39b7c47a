"""The rooms import downwards only: no import cycle between modules, nor between the daemon's packages, and none
of the arrows the rooms' order forbids.

A cycle is how two rooms start to share one idea without anyone noticing (the hook's old ``patches`` <-> ``count``
/ ``pin`` cycle was one). The cycle checks read every module's imports at import time: the top level, and those
under a top-level ``if`` or ``try`` (an ``if TYPE_CHECKING:`` import is a dependency too: the demo's ``loop`` <->
``stages`` cycle hid there); imports inside functions are deliberate lazy imports and are not counted. They fail
naming the cycle. A cycle check alone lets a new arrow point upwards until something points back, so the order
itself is written down too (:data:`FORBIDDEN`, checked against every import statement, lazy ones included):
placement below everything that builds or judges maps, the drift watch below the remap that decides on it, the
daemon's roles wired by ``service`` and never reaching back into it or sideways into each other, and nothing that
ships importing the test helpers or the benchmarks. The remap -> daemon rule has its own test
(``test_remap_layering.py``); the hook's finer rules (every vLLM import in ``vllm_seam``, modules importable without
vLLM) are in ``test_hook_rooms.py``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"pinsidecar": ROOT / "pinsidecar", "pinsidecar_hook": ROOT / "hook" / "pinsidecar_hook"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _targets(node: ast.AST) -> list[str]:
    """What an import statement names: the module, and for ``from m import a`` also ``m.a`` (a submodule or not)."""
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def _module_level_imports(tree: ast.Module) -> Iterator[str]:
    """What a module imports when it is imported, or when a type checker reads it: the top level, and the blocks of
    a top-level ``if`` (``TYPE_CHECKING``) or ``try``; not function bodies."""
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, ast.If | ast.Try):
            nodes[:0] = [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                         *(n for h in getattr(node, "handlers", []) for n in h.body)]
        else:
            yield from _targets(node)


def _import_graph(*, every: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports: the package's own modules imported at import time
    (:func:`_module_level_imports`), or (``every``) every import statement anywhere in the file, of anything
    (``bench``, third-party names included)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        if every:
            targets = [t for node in ast.walk(tree) for t in _targets(node)]
        else:
            targets = [t for t in _module_level_imports(tree) if t in modules]
        graph[name].update(t for t in targets if t != name)
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if nxt not in state:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


_DAEMON_ROLES = ("pinsidecar.daemon.drift_loop", "pinsidecar.daemon.remap_host", "pinsidecar.daemon.status_view")
# importer (a room or a module, with everything under it) -> what it must never import (idem).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # pure functions over artifacts: the CLI, the drift watch, the remap and the daemon build and judge maps with it
    "pinsidecar.placement": ("pinsidecar.drift", "pinsidecar.remap", "pinsidecar.daemon", "pinsidecar.cli"),
    # the watch says that traffic moved; whether a candidate deploys is the remap's (which may import the watch)
    "pinsidecar.drift": ("pinsidecar.remap", "pinsidecar.daemon", "pinsidecar.cli"),
    "pinsidecar.remap": ("pinsidecar.cli",),
    # the daemon's parts: service wires them; none reaches back into the wiring or sideways into another role
    "pinsidecar.daemon.supervisor": ("pinsidecar.daemon.service", "pinsidecar.daemon.drain", *_DAEMON_ROLES),
    "pinsidecar.daemon.drain": ("pinsidecar.daemon.service", *_DAEMON_ROLES),
    "pinsidecar.daemon.drift_loop": ("pinsidecar.daemon.service", "pinsidecar.daemon.remap_host",
                                     "pinsidecar.daemon.status_view"),
    "pinsidecar.daemon.remap_host": ("pinsidecar.daemon.service", "pinsidecar.daemon.status_view"),
    "pinsidecar.daemon.status_view": ("pinsidecar.daemon.service", "pinsidecar.daemon.remap_host"),
    # what ships never needs the benchmarks (not in the wheel) nor the scenario harness they keep
    "pinsidecar": ("bench",),
    "pinsidecar_hook": ("bench",),
}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  for importer, banned in FORBIDDEN.items() if _under(m, importer)
                  for b in banned if _under(t, b))


def _room(module: str) -> str:
    """``pinsidecar.remap.pipeline`` -> ``pinsidecar.remap``; top-level modules are rooms of their own."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules() -> None:
    cycle = _a_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_rooms() -> None:
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in _import_graph().items():
        rooms[_room(module)].update(_room(t) for t in targets if _room(t) != _room(module))
    cycle = _a_cycle(rooms)
    assert cycle is None, "import cycle between rooms: " + " -> ".join(cycle or [])


def test_no_import_the_rooms_order_forbids() -> None:
    bad = _forbidden_arrows(_import_graph(every=True))
    assert not bad, "imports against the rooms' order (tests/test_layering.py FORBIDDEN):\n  " + "\n  ".join(bad)


def test_the_order_check_sees_a_forbidden_arrow() -> None:
    """The detector itself: an arrow upwards (also from a module deep in the room) is caught, one downwards and a
    look-alike name are not."""
    assert _forbidden_arrows({"pinsidecar.placement.builder": {"pinsidecar.remap.decision"},
                              "pinsidecar.remap.pipeline": {"pinsidecar.placement"},
                              "pinsidecar.daemon.drift_loop": {"pinsidecar.daemon.service_ish"},
                              "pinsidecar.daemon.status_view": {"pinsidecar.daemon.service"}}) == [
        "pinsidecar.daemon.status_view -> pinsidecar.daemon.service",
        "pinsidecar.placement.builder -> pinsidecar.remap.decision"]


def test_the_check_sees_a_cycle() -> None:
    """The detector itself: a graph with a cycle is caught, one without is not (so a pass above means something)."""
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_an_import_only_for_the_type_checker_counts() -> None:
    """``if TYPE_CHECKING:`` imports are edges of the graph; imports inside functions are not."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.loop import Options\n"
                     "try:\n    import p.fast\nexcept ImportError:\n    import p.slow\n"
                     "def f():\n    from p.lazy import x\n")
    found = set(_module_level_imports(tree))
    assert {"p.loop", "p.loop.Options", "p.fast", "p.slow"} <= found and not any("lazy" in t for t in found)


def test_the_daemon_side_never_imports_hook_internals() -> None:
    """The daemon shares only the contract with the hook (files in, files out); the testing helpers and benchmarks
    may drive the hook's kernels directly."""
    graph = _import_graph()
    allowed = ("pinsidecar_hook.contract",)
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("pinsidecar.")
                 and not m.startswith("pinsidecar.testing") for t in ts
                 if t.startswith("pinsidecar_hook") and not t.startswith(allowed))
    assert not bad, bad
