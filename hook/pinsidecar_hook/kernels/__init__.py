"""Device kernels for pin mode: partition top-k ids by residency (with live counts) and finalize the k rows.

Each kernel has a torch version that runs anywhere (the CPU engine, tests) and, where Triton and a device are
available, a Triton version with the same semantics, bit for bit. Triton is imported guardedly, so engines without
Triton (the CPU build) import this package freely. Use :func:`partition` and :func:`finalize`; they pick the
implementation by device.
"""

from pinsidecar_hook.kernels.finalize import finalize, finalize_torch, finalize_triton, fma_fp32_exact
from pinsidecar_hook.kernels.partition import partition, partition_torch, partition_triton, triton_available

__all__ = [
    "finalize",
    "finalize_torch",
    "finalize_triton",
    "fma_fp32_exact",
    "partition",
    "partition_torch",
    "partition_triton",
    "triton_available",
]
