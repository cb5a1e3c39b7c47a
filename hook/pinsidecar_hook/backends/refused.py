"""The experts classes vLLM picks that no split backend takes, and what an operator can do about each.

A refusal at attach names the class vLLM chose, the formats it serves, and the vLLM flag that makes vLLM pick a
class pinsidecar *does* split (with the guarantee it gets there), or says that none does yet and count mode is
what works. Read in vLLM 0.34.0's oracles (``model_executor/layers/fused_moe/oracle/``) for one SM90 GPU with a
default install; the flag is ``--moe-backend`` (``config/kernel.py:122``, ``MoEBackend``), which every oracle maps
to its own backend list (e.g. ``oracle/mxfp4.py:385``, ``"triton_unfused": [TRITON_UNFUSED]``), or, for Humming, the
environment variable ``VLLM_BATCH_INVARIANT=1``, which keeps the class and turns off the one thing in it a split cannot
reproduce (stream-K, :mod:`pinsidecar_hook.vllm_seam.humming`).

Torch-free data: the hook's refusal message and ``docs/backends.md``'s table read the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KNOWN_UNSPLIT", "UnsplitClass", "advice"]


@dataclass(frozen=True)
class UnsplitClass:
    """One experts class no backend splits: what it serves, the flag to use instead (None: none gives a split
    class yet) and what that flag gives."""

    formats: str
    flag: str | None
    gives: str


KNOWN_UNSPLIT: dict[str, UnsplitClass] = {
    "HummingIndexedExperts": UnsplitClass(
        "GPTQ/AWQ int4 and NVFP4 on SM90 (prioritize_humming)", "VLLM_BATCH_INVARIANT=1",
        "the same class with stream-K off in every tuning range, which the humming backend splits bit for bit by "
        "design (PINSIDECAR_PIN_BACKEND=humming; not yet run on a GPU, so auto does not pick it; vLLM's batch-"
        "invariant mode slows its other kernels too); or boot with --moe-backend marlin for MarlinExperts (int4: "
        "split by marlin_experts, not bit-identical). Count mode counts it as it is"),
    "FlashInferExperts": UnsplitClass(
        "FP8 block with expert parallel; compressed-tensors static FP8", "--moe-backend triton",
        "TritonExperts, split bit-identical by triton_experts"),
    "TritonOrCutlassExperts": UnsplitClass(
        "compressed-tensors FP8 per-channel, dynamic per-token", "--moe-backend triton",
        "TritonExperts, split bit-identical by triton_experts"),
    "TritonOrDeepGemmExperts": UnsplitClass(
        "FP8 block with DeepGEMM installed", "--moe-backend triton",
        "TritonExperts, split bit-identical by triton_experts"),
    "TritonWNA16Experts": UnsplitClass(
        "int4/int8 weight-only through Triton", "--moe-backend marlin",
        "MarlinExperts (split by marlin_experts, not bit-identical)"),
}


def advice(class_name: str) -> str:
    """What to tell the operator about a refused layer of ``class_name`` ('' for a class not in the table)."""
    known = KNOWN_UNSPLIT.get(class_name)
    if known is None:
        return ""
    if known.flag is None:
        return f"vLLM picked {class_name} for {known.formats}: no vLLM flag gives a class pinsidecar splits yet; " \
               f"{known.gives}"
    return f"vLLM picked {class_name} for {known.formats}: boot vLLM with {known.flag} to get {known.gives}"
