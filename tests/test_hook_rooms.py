"""The hook's rooms: imports point one way, only the seam touches vLLM, and the backend registry states its contract.

Read from the source (every ``import`` statement, module level or inside a function, since the hook imports vLLM
and the mode modules lazily) and checked by importing the hook in fresh interpreters.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pinsidecar_hook
import pytest
from pinsidecar_hook.contract.env import PIN_BACKENDS

HOOK = Path(pinsidecar_hook.__file__).parent

# Which hook modules each room may import (besides the standard library, numpy, torch, triton, flashinfer).
ALLOWED = {
    "contract": {"contract"},
    "kernels": {"kernels"},
    "vllm_seam": {"contract"},
    "selfcheck": {"vllm_seam"},
    "flusher": {"contract"},
    "rehome": {"vllm_seam"},
    "cache": {"kernels"},  # the cache tier's step: state in torch, its CUDA launch and copy in kernels
    "backends": {"vllm_seam", "contract", "kernels", "cache"},
    "trace_record": {"contract"},  # count mode's routing trace: a device buffer, written as a contract trace
    "count": {"vllm_seam", "contract", "flusher", "kernels", "trace_record"},  # kernels: the GPU count's launch
    "swap": {"contract"},  # the in-place apply works on pin mode's layers through a protocol, not pin itself
    "pin": {"vllm_seam", "contract", "flusher", "rehome", "backends", "cache", "swap", "selfcheck"},
    "modes": {"vllm_seam", "contract", "count", "pin"},
    "plugin": {"contract", "modes"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(HOOK.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            arg = node.args[0]
            found.add(arg.value if isinstance(arg, ast.Constant) else "<dynamic>")
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in HOOK.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_rooms_import_only_what_their_layer_allows() -> None:
    wrong = []
    for module, deps in _graph().items():
        room = _room(module)
        for dep in deps:
            if _room(dep) != room and _room(dep) not in ALLOWED.get(room, set()) and _room(dep) != "__init__":
                wrong.append(f"{module} imports {dep}")
    assert not wrong, wrong
    assert set(ALLOWED) | {"__init__"} == {_room(m) for m in _graph()}, "a new room needs a line in ALLOWED"


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node):], node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])
    seam = {m for m in graph if _room(m) == "vllm_seam"}
    assert not ({"pinsidecar_hook.count", "pinsidecar_hook.pin", "pinsidecar_hook.modes"}
                & set().union(*(graph[m] for m in seam)))
    assert {m for m, deps in graph.items() if "pinsidecar_hook.modes" in deps} == {"pinsidecar_hook.plugin"}


def test_only_the_seam_imports_vllm() -> None:
    """Every import of vLLM is in the seam package: its common module and one module per kernel family."""
    importers = sorted(_module_name(p) for p in HOOK.rglob("*.py")
                       if any(m == "vllm" or m.startswith("vllm.") for m in _imports(p)))
    seam = "pinsidecar_hook.vllm_seam"
    assert importers == [f"{seam}._common", f"{seam}.cpu", f"{seam}.flashinfer", f"{seam}.humming", f"{seam}.marlin",
                         f"{seam}.monolithic", f"{seam}.triton"]
    assert "<dynamic>" not in set().union(*(_imports(p) for p in HOOK.rglob("*.py")))


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=HOOK.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_hook_module_imports_without_vllm() -> None:
    """In a fresh interpreter where importing vLLM fails, every module of the hook still imports: vLLM is touched
    only when a seam function runs."""
    modules = sorted(_graph())
    _run("import importlib, sys\nsys.modules['vllm'] = None\n"
         f"for name in {modules!r}:\n    importlib.import_module(name)\n")


def test_contract_imports_with_only_the_standard_library_and_numpy() -> None:
    _run("import sys\nsys.modules['torch'] = None\nimport pinsidecar_hook.contract\n")


def test_backend_registry_is_one_list_and_each_entry_is_a_backend_class() -> None:
    """The contract's names come from the one registry (contract/backends.py); each entry is a SplitBackend
    subclass of that name, in a module of its own, and says what it splits and whether auto may pick it."""
    from pinsidecar_hook.backends import SplitBackend, load_backend
    from pinsidecar_hook.contract.backends import BACKENDS, PIN_BACKEND_ALIASES

    assert tuple(entry.name for entry in BACKENDS) == PIN_BACKENDS
    assert set(PIN_BACKEND_ALIASES.values()) <= set(PIN_BACKENDS)
    for entry in BACKENDS:
        backend = load_backend(entry.name)
        assert isinstance(backend, type) and issubclass(backend, SplitBackend) and entry.name == backend.NAME
        assert set(backend.REQUIRED_TENSORS) <= set(backend.SPLIT_TENSORS)
        assert backend.__module__ == entry.module
        assert Path(sys.modules[backend.__module__].__file__).stem == entry.name  # one file per backend
        assert not (backend.AUTO and not backend.VERIFIED), f"auto must never pick the unverified {entry.name}"


def test_auto_selection_refuses_what_no_rule_covers() -> None:
    import torch
    from pinsidecar_hook.backends import BackendUnavailable, select_backend

    assert select_backend("torch_ref", torch.device("cpu"), object()).NAME == "torch_ref"  # explicit wins
    with pytest.raises(BackendUnavailable, match=r"no split backend for experts object .quant: none. on cpu") as info:
        select_backend("auto", torch.device("cpu"), object())
    message = str(info.value)  # names every backend and why it does not fit
    for name in PIN_BACKENDS:
        assert f"{name}:" in message
    assert "never picked by auto (set PINSIDECAR_PIN_BACKEND=flashinfer_trtllm)" in message
    with pytest.raises(BackendUnavailable, match="pin backend 'triton_experts' cannot split object"):
        select_backend("triton_experts", torch.device("cpu"), object())  # explicit, but it does not fit
