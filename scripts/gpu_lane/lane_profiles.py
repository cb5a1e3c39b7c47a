"""What the GPU lane carries for each vLLM version: the decisions behind ``scripts/gpu_lane/pack.py``.

One :class:`LaneProfile` per vLLM release the lane runs. A profile says which of vLLM's declared requirements the
device satisfies in its own way (``not_required``), which are left out because a server boot never imports them
(``left_out``), which packages a boot imports (``roots``: they and what they require are carried), which files of
the vLLM wheel are dropped (``slim_drop``), and which wheels are carried whole because the device's own version is
the wrong one (``carried``: torch, triton, NCCL for vLLM 0.34), each slimmed the same way (files dropped, device code
of other GPU generations zeroed: ``scripts/gpu_lane/fatbin.py``). ``docs/gpu-lane.md`` says why for each.

The lent machine has torch 2.11.0+cu130 and triton 3.6.0. vLLM 0.26.0 is the newest release that pins that torch,
so its profile carries no torch. vLLM 0.34.0 (the current release, 2026-12-07) pins torch 2.14.0 and triton 3.8, so
its profile carries both, and the NCCL that torch 2.14 links against.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PROFILES", "LaneProfile", "profile"]


@dataclasses.dataclass(frozen=True)
class LaneProfile:
    """Everything version-specific that ``pack.py`` needs (module docstring)."""

    vllm: str
    not_required: dict[str, str]
    left_out: dict[str, str]
    roots: tuple[str, ...]
    slim_drop: tuple[tuple[str, str], ...]  # (regex on the path inside the vLLM wheel, why it is safe)
    # Wheels carried whole instead of the device's own: requirement -> why. Downloaded without their dependencies
    # (the device has those, or they are resolved with vLLM's), slimmed by ``carried_drop`` and the fatbin rule.
    carried: dict[str, str] = dataclasses.field(default_factory=dict)
    carried_drop: tuple[tuple[str, str], ...] = ()  # (regex on the path inside any carried wheel, why)
    # Device packages resolved anew although no requirement of vLLM names them: their device version requires one
    # that vLLM needs newer (the resolver sees the device's packages as stubs without requirements, so it cannot).
    unpin: dict[str, str] = dataclasses.field(default_factory=dict)
    fatbin_arch: int | None = None  # keep only this SM architecture's device code in carried shared libraries
    boot_imports: tuple[str, ...] = (  # what device_install.sh imports to prove the install (model runner etc.)
        "vllm.entrypoints.openai.api_server", "vllm.v1.worker.gpu_worker", "vllm.model_executor.models.qwen3_moe",
        "vllm.model_executor.layers.fused_moe.experts.triton_moe", "vllm.v1.attention.backends.triton_attn")


# vLLM's own requirements that the device satisfies differently, or that we never want from PyPI: the CUDA stack
# and torch are the device's (torch 2.11.0+cu130, triton 3.6.0, nvidia-*); numba (vLLM pins 0.65.0, the device
# has 0.68.0; only n-gram speculative decoding and two multimodal processors use it); setuptools (<81 pinned,
# device has 81.0.0; only pkg_resources-style lookups use it); opencv (device has 5.0, vLLM asks >=4.13).
_NOT_REQUIRED_026 = {
    "torch": "the device's torch 2.11.0+cu130 (the version vLLM 0.26.0 pins)",
    "torchaudio": "the device's 2.11.0 (audio models only)",
    "torchvision": "the device's 0.26.0 (vision models only)",
    "triton": "the device's 3.6.0",
    "numba": "vLLM pins 0.65.0; the device's 0.68.0 is used (n-gram speculative decoding only)",
    "setuptools": "vLLM asks <81; the device's 81.0.0 is used (no boot path needs the difference)",
    "opencv-python-headless": "the device's 5.0.0.93 satisfies >=4.13",
    "torchcodec": "video decoding for multimodal models; imported lazily and guarded",
    "pynvvideocodec": "GPU video decoding; imported lazily",
    "flashinfer-python": "FlashInfer attention/MoE kernels; SM90 runs FLASH_ATTN (FA3) or TRITON_ATTN and Triton "
    "fused MoE; every vLLM import of flashinfer is guarded (has_flashinfer())",
    "apache-tvm-ffi": "pinned ==0.1.10 for flashinfer, which is not carried; xgrammar's own requirement "
    "(>=0.1.11) decides the version instead",
    "tilelang": "TileLang kernels (DeepSeek sparse attention); lazy",
    "nvidia-cudnn-frontend": "cuDNN frontend for FlashInfer/ViT paths; lazy",
    "nvtx": "only with VLLM_NVTX / profiling; imported inside a function",
    "fastsafetensors": "only with --load-format fastsafetensors",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4, SM100 paths, the optional bf16 router GEMM); every use checks "
    "`import cutlass` and falls back",
    "quack-kernels": "CuTe DSL helpers for the same optional kernels",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style models)",
    "humming-kernels": "quantized MoE kernels (humming); lazy",
}

# Requirements vLLM declares that a text-only, bf16, OpenAI-server boot does not import (checked by importing the
# boot modules with these packages absent; see docs/gpu-lane.md). Left out to keep the payload and the risk small.
_LEFT_OUT_026 = {
    "mistral-common": "Mistral tokenizers/models only; its wheels need numpy<2.4 on Python 3.12, the device has "
    "numpy 2.5.2, so it cannot be installed consistently anyway",
    "anthropic": "the Anthropic /v1/messages endpoint imports it on demand; not imported at boot",
    "mcp": "MCP tool server for the Responses API; lazy (brings pyjwt[crypto], cryptography, jsonschema)",
    "opentelemetry-sdk": "tracing (--otlp-traces-endpoint); vllm/tracing/otel.py guards the import",
    "opentelemetry-api": "tracing; guarded",
    "opentelemetry-exporter-otlp": "tracing; guarded",
    "opentelemetry-semantic-conventions-ai": "tracing; guarded",
    "lm-format-enforcer": "structured-output backend 'lm-format-enforcer'; only imported when a request selects it",
    "outlines-core": "structured-output backend 'outlines'; only imported when a request selects it",
    "lark": "used by the outlines/lm-format-enforcer backends only",
    "jsonschema": "not imported by vLLM 0.26 itself (grep finds no import)",
    "python-json-logger": "only with a JSON logging config (VLLM_LOGGING_CONFIG_PATH)",
    "ijson": "Mistral tool parser only",
    # What fastapi[standard] adds beyond the ROOTS: the `fastapi` command-line tools and uvicorn's optional extras
    # (uvicorn falls back to h11 and the stdlib event loop policy; the device has uvloop and h11).
    "fastapi-cli": "the `fastapi` command; vLLM starts uvicorn itself",
    "fastapi-cloud-cli": "the `fastapi cloud` command (brings sentry-sdk, rignore, fastar, ...)",
    "rich-toolkit": "fastapi-cli only",
    "httptools": "optional uvicorn HTTP parser; uvicorn uses h11 (on the device) without it",
    "websockets": "optional uvicorn websocket support; only vLLM's realtime speech endpoint uses websockets",
    "python-dotenv": "uvicorn --env-file only",
    "pydantic-settings": "fastapi-cli / cloud-cli only",
    "sentry-sdk": "fastapi-cloud-cli only",
    "rignore": "fastapi-cloud-cli only",
    "fastar": "fastapi-cloud-cli only",
    "agent-detector": "fastapi-cloud-cli only",
    "detect-installer": "fastapi-cloud-cli only",
}

# The packages a boot imports (module level, or lazily on the boot path), found by importing vLLM's server,
# engine-core, worker, model-runner, Qwen3-MoE, fused-MoE and attention modules with CUDA forced, then parsing the
# `serve` arguments and building the FastAPI app. Their own requirements (minus the device's) are carried too.
_ROOTS_026 = (
    "fastapi",  # the server (fastapi[standard] extras are not needed: uvicorn etc. are listed here)
    "starlette",
    "uvicorn",
    "python-multipart",  # fastapi form parsing, imported by vllm.entrypoints
    "email-validator",  # pydantic networks, imported at boot
    "pydantic",
    "pydantic-extra-types",
    "prometheus-fastapi-instrumentator",  # /metrics (build_app)
    "openai",  # request/response types of the OpenAI server
    "openai-harmony",  # imported at module level by the chat serving code
    "msgspec",  # engine core <-> front end messages
    "pyzmq",  # engine core <-> front end transport
    "cbor2",  # prefix-cache block hashing
    "cachetools",
    "partial-json-parser",  # tool parsers, imported by the serving code
    "pybase64",
    "xgrammar",  # imported at module level (vllm/v1/structured_output/backend_xgrammar.py)
    "llguidance",  # imported at module level by the structured-output package
    "model-hosting-container-standards",  # imported by the api server (SageMaker routes)
    "watchfiles",  # imported by vllm/entrypoints/serve/utils/ssl.py
    "setproctitle",  # process titles (guarded, but tiny)
    "blake3",  # multimodal hashing (lazy; tiny)
    "depyf",  # torch.compile debug dumps and one error path (lazy; tiny)
    "compressed-tensors",  # compressed-tensors checkpoints (lazy; tiny; lets fp8/int checkpoints load)
)

# Files removed from the vLLM wheel: (regex on the path inside the wheel, reason). Everything else is kept.
_SLIM_DROP_026 = (
    (r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$",
     "FlashAttention-2 (SM80/SM89). On SM90 vLLM picks FA3 (fa_utils.get_flash_attn_version); FA2 would only "
     "serve ALiBi models. FA3 is kept: vllm_flash_attn/__init__.py raises ImportError when neither is present, "
     "and every model imports it through model_executor/layers/attention"),
    (r"^vllm/vllm-rs$", "Rust front end binary; used only with VLLM_USE_RUST_FRONTEND=1"),
    (r"^vllm/third_party/deep_gemm/",
     "DeepGEMM (FP8 block-scaled GEMMs); without it has_deep_gemm() is False and FP8 falls back; bf16 never uses it"),
    (r"^vllm/third_party/fmha_sm100/", "SM100-only sparse attention (MiniMax-M3); imported lazily"),
    (r"^vllm/_flashmla_C\.abi3\.so$", "FlashMLA (MLA models); import guarded in v1/attention/ops/flashmla.py"),
    (r"^vllm/_flashmla_extension_C\.abi3\.so$", "FlashMLA FP8 extension; import guarded"),
    (r"^vllm/_qutlass_C\.abi3\.so$", "QuTLASS MXFP4/NVFP4 (Blackwell); import suppressed in platforms/cuda.py"),
    (r"^vllm/_rust_tool_parser\.abi3\.so$", "Rust tool-call parsers; imported only when such a parser is chosen"),
)


PROFILE_026 = LaneProfile(vllm="0.26.0", not_required=_NOT_REQUIRED_026, left_out=_LEFT_OUT_026, roots=_ROOTS_026,
                          slim_drop=_SLIM_DROP_026)

# vLLM 0.34.0. Read from its wheel's METADATA and measured by importing the boot modules (server, engine core, GPU
# worker, the V2 model runner, Qwen3-MoE, TritonExperts, FP8, the Triton and FA3 attention backends) in a full
# install of its requirements and listing what they import (2026-12-07).
_NOT_REQUIRED_034 = {
    **{k: v for k, v in _NOT_REQUIRED_026.items() if k not in ("torch", "triton", "apache-tvm-ffi")},
    "torch": "carried: vLLM 0.34.0 pins torch 2.14.0, the device has 2.11.0 (see carried)",
    "triton": "carried: torch 2.14.0 requires triton~=3.8.0, the device has 3.6.0 (see carried)",
    "flashinfer-python": "a hard requirement since 0.34, but every use goes through has_flashinfer(), which looks the "
    "package up with find_spec: without it vLLM takes its other kernels. On SM90 with tensor parallel a bf16 or "
    "FP8-block MoE gets TritonExperts either way (oracle/unquantized.py, oracle/fp8.py); FlashInfer would add its "
    "sampler (top-p/top-k only) and JIT-compile its kernels with the device's nvcc at first use. 855 MB unpacked",
    "nvidia-cutlass-dsl": "CuTe DSL (486 MB unpacked): vLLM imports it inside the kernels that use it (SM100 paths, "
    "DeepSeek sparse attention, the optional bf16 router GEMM); torch 2.14's optional CuTe override of "
    "aten._fused_rms_norm checks for it with find_spec and stays off without it",
    "apache-tvm-ffi": "only with the CuTe DSL or FlashInfer (torch/_native/cutedsl_utils.py checks for both)",
    "tilelang": "TileLang kernels (DeepSeek sparse attention); imported lazily; 210 MB unpacked",
    "quack-kernels": "CuTe DSL helpers for the same optional kernels",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style models); brings a 291 MB Triton fork",
    "humming-kernels": "HummingIndexedExperts (NVFP4 and GPTQ/AWQ int4 MoE on SM90); imported when such a layer is "
    "built; the bf16 and FP8-block lanes never build one",
    "instanttensor": "an optional weight loader (--load-format instanttensor); imported lazily",
    "fastsafetensors": "only with --load-format fastsafetensors; its import is guarded",
}
_LEFT_OUT_034 = {
    **_LEFT_OUT_026,
    "opentelemetry-sdk": "tracing (--otlp-traces-endpoint); vllm/tracing/otel.py guards the import (try/except)",
    "python-json-logger": "only with a JSON logging config (VLLM_LOGGING_CONFIG_PATH)",
}
_ROOTS_034 = (
    *(r for r in _ROOTS_026 if r != "openai-harmony"),
    "oss-harmony",  # provides the openai_harmony module (vllm/renderers/chat_utils/types.py imports it at boot)
    "orjson",  # fastapi's responses import it at boot (FastAPI 0.13x)
)
_SLIM_DROP_034 = (
    (r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$",
     "FlashAttention-2 (SM80/SM89). On SM90 vLLM picks FA3; FA3 is kept (vllm_flash_attn/__init__.py raises "
     "ImportError when neither loads, and every model imports it)"),
    (r"^vllm/vllm-rs$", "Rust front end binary; used only with VLLM_USE_RUST_FRONTEND=1"),
    (r"^vllm/third_party/deep_gemm/",
     "DeepGEMM (FP8 block-scaled GEMMs; 0.34 turns it on when it finds nvcc >= 12.9, which the device has). Without it "
     "has_deep_gemm() is False: FP8 block layers use vLLM's CUTLASS/Triton kernels, and TritonExperts' sorted-A down "
     "projection (which needs DeepGEMM's E8M0 scales) stays off; the split's self-check runs whichever path is on"),
    (r"^vllm/third_party/fmha_sm100/", "SM100-only sparse attention; imported lazily"),
    (r"^vllm/_flashmla_C\.abi3\.so$", "FlashMLA (MLA models); import guarded"),
    (r"^vllm/_flashmla_extension_C\.abi3\.so$", "FlashMLA FP8 extension; import guarded"),
    (r"^vllm/_qutlass_C\.abi3\.so$", "QuTLASS MXFP4/NVFP4 (Blackwell); import suppressed in platforms/cuda.py"),
    (r"^vllm/_rust_tool_parser\.abi3\.so$", "Rust tool-call parsers; imported only when such a parser is chosen"),
    (r"^vllm/_flashkda_C\.abi3\.so$", "Kimi delta attention kernels (linear-attention models); imported lazily"),
    (r"^vllm/_deepselect_C\.abi3\.so$", "DeepSeek sparse-attention top-k selection; imported lazily"),
)
_CARRIED_034 = {
    "torch==2.14.0": "vLLM 0.34.0 pins it; its CUDA 13.0 build runs on the device's driver and CUDA 13 libraries "
    "(cuBLAS 13.1, cuDNN 9.19, cuSPARSELt 0.8.0: every symbol torch 2.14 imports from them is exported there, "
    "checked with nm against those wheels)",
    "triton==3.8.0": "torch 2.14.0 requires triton~=3.8.0 (Inductor's generated kernels, vLLM's own Triton kernels)",
    "torchvision==0.29.0": "torch 2.14.0's match. The device's 0.26.0 cannot stay: transformers imports torchvision "
    "when it is installed (image_utils.py, on vllm.config's import path), and 0.26.0's C++ ops, built for torch "
    "2.11, do not load into 2.14 (\"operator torchvision::nms does not exist\", the H100, 2026-12-07). 7.1 MiB",
    "nvidia-nccl-cu13==2.32.6": "torch 2.14.0 links 16 NCCL symbols that the device's 2.28.9 lacks (ncclCommGrow, "
    "ncclAlltoAll, ...: a library missing them does not load). torch pins 2.30.7, which the package index here does "
    "not have; 2.32.6 is the nearest later release and exports all of them (same soname, libnccl.so.2)",
}
_CARRIED_DROP_034 = (
    (r"^torch/bin/protoc", "protoc, a build tool (torch/bin/torch_shm_manager stays: importing torch needs it)"),
    (r"^triton/backends/nvidia/lib/cupti-blackwell/", "CUPTI for SM100+ profiling (proton); not loaded on SM90"),
    (r"^triton/backends/nvidia/lib/cupti/.*_static\.a$", "static CUPTI archives: for building, never loaded"),
    (r"^triton/backends/nvidia/lib/cupti/libnvperf_host.*", "the profiler's host library (proton only)"),
    (r"^triton/backends/nvidia/bin/ptxas-blackwell$", "ptxas for SM100+ targets; SM90 uses bin/ptxas"),
    (r"^triton/instrumentation/", "test instrumentation library"),
    (r"^nvidia/nccl/lib/libnccl_device\.(bc|ltoir)$", "NCCL's device library for user kernels (LTO); torch does not "
     "link it at run time"),
)
PROFILE_034 = LaneProfile(
    vllm="0.34.0", not_required=_NOT_REQUIRED_034, left_out=_LEFT_OUT_034, roots=_ROOTS_034,
    slim_drop=_SLIM_DROP_034, carried=_CARRIED_034, carried_drop=_CARRIED_DROP_034,
    unpin={"transformers": "the device's 5.17.0 requires huggingface-hub<2.0, and vLLM 0.34 requires >=2.0.0"},
    fatbin_arch=90,
    boot_imports=("vllm.entrypoints.openai.api_server", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu.model_runner",
                  "vllm.model_executor.models.qwen3_moe", "vllm.model_executor.layers.fused_moe.experts.triton_moe",
                  "vllm.v1.attention.backends.triton_attn"))

PROFILES = {p.vllm: p for p in (PROFILE_026, PROFILE_034)}


def profile(vllm: str) -> LaneProfile:
    """The profile of vLLM ``vllm`` (``0.34.0``, or ``0.34`` for the newest profiled patch release of it)."""
    if vllm in PROFILES:
        return PROFILES[vllm]
    matches = sorted((v for v in PROFILES if v.startswith(vllm.rstrip(".") + ".")), reverse=True)
    if not matches:
        raise SystemExit(f"pack: no lane profile for vLLM {vllm} (profiled: {', '.join(PROFILES)}; "
                         "add one in scripts/gpu_lane/lane_profiles.py)")
    return PROFILES[matches[0]]
