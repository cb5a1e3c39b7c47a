"""pinsidecar's engine-side hook: a vLLM general plugin that counts router selections (``count`` mode) or
re-homes each MoE layer by a row map and splits every experts call by residency (``pin`` mode).

It is loaded by vLLM through the ``vllm.general_plugins`` entry point in every engine process, or from a
bind-mounted ``hook/`` folder on ``PYTHONPATH`` (the ``pinsidecar_hook-*.dist-info`` folder beside this package
makes the entry point visible without installing anything). It talks to the daemon only through the files
defined in :mod:`pinsidecar_hook.contract`.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
