"""pinsidecar: keep the MoE experts that traffic uses in GPU memory and the rest in pinned host memory.

The loop, in folder order: counts (``counts``: the count boot) -> placement (``placement``: a row map from counts)
-> hook (the ``pinsidecar_hook`` package: count and pin mode inside vLLM) -> engine (``engine``) -> metrics
(``metrics``) -> drift (``drift``) -> remap (``remap``). The daemon (``daemon``) and the CLI (``cli``) drive it;
``demo`` builds the tiny local model and runs the loop on it, and ``testing`` holds what the tests build with.
Each package's ``__init__`` (or, where it re-exports nothing, its modules' ``__all__``) is what other packages
use; ``tests/test_public_face.py`` keeps that face narrow.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
