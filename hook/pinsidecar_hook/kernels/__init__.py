"""Device kernels for pin mode: partition top-k ids by residency (with live counts) and finalize the k rows.

Each kernel has a torch version that runs anywhere (the CPU engine, tests) and, where Triton and a device are
available, a Triton version with the same semantics. Triton is imported lazily, so engines without Triton (the
CPU build) import this package freely. See :mod:`.partition` and :mod:`.finalize`.
"""

from pinsidecar_hook.kernels.partition import partition, partition_torch

__all__ = ["partition", "partition_torch"]
