"""pinsidecar: keep the MoE experts that traffic uses in GPU memory and the rest in pinned host memory.

The loop, in module order: counts (``profile``) -> maps (``maps``) -> hook (count, pin; the ``pinsidecar_hook``
package) -> engine (``engine``) -> metrics (``metrics``) -> drift (``drift``) -> remap (``remap``). The daemon
(``daemon``) and the CLI (``cli``) drive it.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
