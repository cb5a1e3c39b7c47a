"""bench/gpu_lane.py end to end on vLLM CPU with the tiny demo model (``--small``), so the GPU lane's script does
not rot between device sessions: count boot with exact counts, usage and positional maps, the placements booted and
measured, token identity against the hook-off engine, live stats, the report and its plot.

On the CPU every placement is host memory, so the tok/s here mean nothing; what is asserted is that every part of
the pipeline ran and that its correctness checks hold. Four engine boots: a few minutes on a 2-core box.

The rest are the pure parts of ``--quant`` and ``--reps``, without an engine: each format's vLLM arguments, bytes
per expert and positional-offload parameters (checked against a model of vLLM 0.26's UVA offloader), the
interleaved rounds' aggregation and the selfcheck's.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_lane

# The GPU lane's geometry (bench/gpu_lane.py GPU_GEOMETRY): hidden, expert intermediate, experts, layers.
HID, INTER, NE, NL = 2048, 768, 128, 16


@pytest.mark.vllm
def test_gpu_lane_small_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert gpu_lane.main(["--small", "--work", str(tmp_path / "work"), "--out", str(out),
                          "--streams", "1:12,4:12,8:6", "--prefill", "48:1,2"]) == 0
    doc = json.loads((out / "gpu_lane_vllm_cpu.json").read_text())
    engines = doc["engines"]
    assert set(engines) == {"count", "off", "p23", "u23"}
    for workload in ("code", "prose"):  # the count boot's counts are exact
        assert engines["count"]["workloads"][workload]["exact"], engines["count"]["workloads"][workload]
    live = engines["u23"]["live"]
    assert live["tokens_exact"] and live["selections_exact"] and 0 < live["cold_rate"] < 1
    assert live["backend"] == "cpu"
    assert doc["figures"]["token_identity_all_placements"] == 1.0
    for name in ("off", "p23", "u23"):
        assert engines[name]["decode"]["1"]["decode_tok_s_per_stream"] > 0
        assert engines[name]["decode"]["4"]["output_tok_s"] > 0 and engines[name]["decode"]["8"]["max_tokens"] == 6
        for c in ("1", "2"):  # the prefill's time to first token; its tokens are in the exact live count above
            prefill = engines[name]["prefill"][c]
            assert prefill["ttft_s_median"] > 0 and prefill["processed_tokens"] == 48 * int(c)
    assert doc["figures"]["prefill_ttft_usage_over_positional_23pct_x2"] > 0
    assert doc["figures"]["usage_over_positional_23pct_8stream"] > 0
    p23, u23 = doc["placements"]["p23"], doc["placements"]["u23"]
    assert p23["params"] >= 1 and p23["usage_map_host_bytes"] == u23["host_bytes"] > 0
    assert (out / "gpu_lane_vllm_cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert doc["command"].startswith("python ") and doc["date"]
    # bf16 stays the lane it was: no selfcheck asked for, the report named as before, the hook's bytes per expert.
    assert doc["quant"] == "bf16" and doc["bit_identity"] is None and "selfcheck" not in engines["u23"]
    assert doc["host_bytes_per_expert"]["value"] == doc["host_bytes_per_expert"]["computed_from_layout"]
    assert doc["host_bytes_per_expert"]["source"].startswith("count boot")
    assert doc["figures"]["live_counts_exact"] is True and doc["figures"]["count_boot_exact"] is True


# ---------------------------------------------------------------------------------------------------- pure parts


def _geo() -> Any:
    from pinsidecar.demo.model import Geometry

    return Geometry.scaled(**gpu_lane.GPU_GEOMETRY)


def _lane(tmp_path: Path, quant: str, **kw: Any) -> gpu_lane.Lane:
    return gpu_lane.Lane(small=False, work=tmp_path / quant, out=None, report_name="r", deadline=1e9, quant=quant,
                         **kw)


def test_quant_engine_args_and_report_names() -> None:
    assert gpu_lane.quant_engine_args("bf16") == []
    assert gpu_lane.quant_engine_args("fp8-online") == ["--quantization", "fp8"]
    assert gpu_lane.quant_engine_args("fp8-block") == [] == gpu_lane.quant_engine_args("gptq-int4")
    with pytest.raises(ValueError):
        gpu_lane.quant_engine_args("int3")
    assert gpu_lane.default_report_name(False, "bf16") == "gpu_lane_h200"
    assert gpu_lane.default_report_name(False, "fp8-block") == "gpu_lane_h200_fp8-block"
    assert gpu_lane.default_report_name(True, "gptq-int4") == "gpu_lane_vllm_cpu_gptq-int4"
    assert gpu_lane.CHECKPOINT_QUANT == {"bf16": None, "fp8-block": "fp8-block", "fp8-online": None,
                                         "gptq-int4": "gptq-int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4",
                                         "awq-int4": "awq-int4"}
    from pinsidecar.demo.quant import QUANT_METHODS

    # every lane's checkpoint is one the demo-model generator writes
    assert {q for q in gpu_lane.CHECKPOINT_QUANT.values() if q} <= set(QUANT_METHODS)


def test_pin_backend_per_lane_and_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane pins with its named backend or auto; GPU_LANE_PIN_BACKEND overrides per quant (the Humming lane on
    vLLM 0.34), and a malformed pair stops the run with what is wrong."""
    from pinsidecar_hook.contract.backends import PIN_BACKENDS

    monkeypatch.delenv("GPU_LANE_PIN_BACKEND", raising=False)
    assert gpu_lane.pin_backend("bf16") == "auto" and gpu_lane.pin_backend("mxfp4") == "oai_triton"
    assert set(gpu_lane.PIN_BACKEND.values()) <= set(PIN_BACKENDS)
    monkeypatch.setenv("GPU_LANE_PIN_BACKEND", "awq-int4=humming, nvfp4=humming")
    assert gpu_lane.pin_backend("awq-int4") == "humming" == gpu_lane.pin_backend("nvfp4")
    assert gpu_lane.pin_backend("gptq-int4") == "marlin_experts"
    monkeypatch.setenv("GPU_LANE_PIN_BACKEND", "humming")
    with pytest.raises(SystemExit, match="'humming' is not quant=backend"):
        gpu_lane.pin_backend("awq-int4")


def test_an_overlap_engine_runs_its_maps_placement_with_the_tier_overlap(tmp_path: Path) -> None:
    """``u23x`` is u23's map with PINSIDECAR_PIN_OVERLAP; booted beside u23 it gives the overlap's figure."""
    assert gpu_lane.map_name("u23x") == "u23" and gpu_lane.is_overlap("u23x") and gpu_lane.is_overlap("u0x")
    assert gpu_lane.map_name("u23") == "u23" and not gpu_lane.is_overlap("u23") and not gpu_lane.is_overlap("off")
    hook = gpu_lane._hook_config("pin", tmp_path, tmp_path / "u23.json", False, "triton_experts", overlap=True)
    assert hook.overlap_tiers and hook.to_env()["PINSIDECAR_PIN_OVERLAP"] == "1"
    assert not gpu_lane._hook_config("pin", tmp_path, tmp_path / "u23.json", False).overlap_tiers
    assert ("overlap_over_serial_23pct_1stream", "u23x", "u23", "1") in gpu_lane.ratio_specs()


def test_regime_options_parse_and_size_the_engines(tmp_path: Path) -> None:
    """--streams and --prefill: the decode concurrencies beyond 16 and the prefill's prompt size reach the engine
    (max-num-seqs, CUDA-graph sizes, max-model-len); malformed values stop the run naming the format."""
    assert gpu_lane.parse_streams("") is None and gpu_lane.parse_prefill(" ") is None
    assert gpu_lane.parse_streams("1:64,32:32,64:16") == {1: 64, 32: 32, 64: 16}
    assert gpu_lane.parse_prefill("2048:1,4") == (2048, (1, 4))
    for bad in ("1", "0:8", "4:1", "a:b"):
        with pytest.raises(SystemExit, match="STREAMS:TOKENS"):
            gpu_lane.parse_streams(bad)
    for bad in ("2048", "2048:", "x:1", "2048:0"):
        with pytest.raises(SystemExit, match="TOKENS:CONCURRENCY"):
            gpu_lane.parse_prefill(bad)
    lane = _lane(tmp_path, "bf16", streams={1: 64, 64: 32}, prefill=(2048, (1, 4)))
    args = gpu_lane.engine_for(lane, "off", {"offload_params": ["w13_weight"]}).spec.argv()
    assert args[args.index("--max-num-seqs") + 1] == "64"
    rest = args[args.index("--cudagraph-capture-sizes") + 1:]
    sizes = rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]
    assert sizes == ["1", "2", "4", "8", "16", "32", "64"]
    assert args[args.index("--max-model-len") + 1] == "2112"
    plain = gpu_lane.engine_for(_lane(tmp_path, "fp8-block"), "off", {"offload_params": ["w13_weight"]})
    assert plain.spec.extra_args[plain.spec.extra_args.index("--max-num-seqs") + 1] == "16"


def test_engine_args_per_quant(tmp_path: Path) -> None:
    """What each engine of a quantized lane is started with, read from its spec (nothing is started)."""
    lane = _lane(tmp_path, "fp8-online", selfcheck=True, vllm_args=["--moe-backend", "triton"])
    layout = gpu_lane.expert_layout(lane)
    off = gpu_lane.engine_for(lane, "off", layout)
    assert off.spec.extra_args[-4:] == ["--quantization", "fp8", "--moe-backend", "triton"]
    assert gpu_lane.SELFCHECK_ENV not in off.spec.env
    pin = gpu_lane.engine_for(lane, "u23", layout, mode="pin", map_path=tmp_path / "u23.json")
    assert pin.spec.env[gpu_lane.SELFCHECK_ENV] == "1" and "--quantization" in pin.spec.extra_args
    block = _lane(tmp_path, "fp8-block")
    layout = gpu_lane.expert_layout(block)
    placement = gpu_lane.positional_offload(layout, int(0.23 * layout["total_bytes"]))
    p23 = gpu_lane.engine_for(block, "p23", layout, placement=placement)
    args = p23.spec.extra_args
    assert "--quantization" not in args
    i = args.index("--cpu-offload-params")
    assert args[i + 1:] == ["w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"]
    assert float(args[args.index("--cpu-offload-gb") + 1]) == pytest.approx(placement["cpu_offload_gb"], abs=1e-9)
    bf16 = _lane(tmp_path, "bf16")
    u23 = gpu_lane.engine_for(bf16, "u23", gpu_lane.expert_layout(bf16), mode="pin", map_path=tmp_path / "m.json")
    assert gpu_lane.SELFCHECK_ENV not in u23.spec.env and "--quantization" not in u23.spec.extra_args


def test_expert_bytes_per_quant(tmp_path: Path) -> None:
    """Bytes per expert as vLLM 0.26 holds them after loading (the brief's arithmetic, hidden 2048, I 768)."""
    geo = _geo()

    def total(quant: str) -> int:
        return sum(b for _, b in gpu_lane.expert_tensors(quant, geo))

    assert total("bf16") == 3 * INTER * HID * 2 == 9437184  # bench/results/gpu_lane_h200.json's expert_bytes
    blocks = (2 * (INTER // 128) * (HID // 128) + (HID // 128) * (INTER // 128)) * 4  # float32 128x128 block scales
    assert total("fp8-block") == 3 * INTER * HID + blocks
    assert total("fp8-online") == 3 * INTER * HID + 8  # one float32 scale per expert for w13 and for w2
    scales = (HID // 128 * 2 * INTER + INTER // 128 * HID) * 2  # model dtype (bf16), [H/128, 2I] and [I/128, H]
    zeros = (HID // 128 * 2 * INTER // 8 + INTER // 128 * HID // 8) * 2
    assert total("gptq-int4") == 3 * INTER * HID // 2 + scales + zeros  # g_idx: empty [E, 0] after the Marlin repack
    # the same figures as the project's own derivation (pinsidecar.placement.expert_bytes, used by map build)
    from pinsidecar.placement.expert_bytes import (
        fp8_block_expert_bytes,
        fp8_per_tensor_expert_bytes,
        gptq_expert_bytes,
        unquantized_expert_bytes,
    )

    assert total("bf16") == unquantized_expert_bytes(HID, INTER)
    assert total("fp8-block") == fp8_block_expert_bytes(HID, INTER)
    assert total("fp8-online") == fp8_per_tensor_expert_bytes(HID, INTER) == 4718600  # measured on the H200
    assert total("gptq-int4") == gptq_expert_bytes(HID, INTER)
    with pytest.raises(ValueError):
        gpu_lane.expert_tensors("int3", geo)
    for quant in gpu_lane.QUANTS:
        layout = gpu_lane.expert_layout(_lane(tmp_path, quant))
        assert layout["expert_bytes"] == layout["expert_bytes_computed"] == total(quant)
        assert layout["total_bytes"] == total(quant) * NE * NL and layout["quant"] == quant


def test_expert_layout_takes_the_hooks_bytes(tmp_path: Path) -> None:
    """The count boot's figure (counts meta, what pin mode checks a map against) wins over the arithmetic; pin
    mode's own figure from a refusal wins over both."""
    lane = _lane(tmp_path, "gptq-int4")
    (lane.work / "counts_code.json").write_text(json.dumps({"meta": {"expert_bytes": 2453504}}))
    layout = gpu_lane.expert_layout(lane)
    assert layout["expert_bytes"] == 2453504 and layout["expert_bytes_source"].startswith("count boot")
    assert layout["expert_bytes_computed"] != 2453504 and layout["total_bytes"] == 2453504 * NE * NL
    (lane.work / "expert_bytes_pin.json").write_text(json.dumps({"expert_bytes": 2453760}))
    assert gpu_lane.expert_layout(lane)["expert_bytes"] == 2453760


def _vllm_uva_offload(layout: dict[str, Any], args: list[str]) -> list[str]:
    """vLLM 0.26's UVAOffloader over the lane's MoE layers: per layer, each parameter in registration order, offload
    while offloaded < int(cpu_offload_gb * 2**30), matching --cpu-offload-params by whole name segments."""
    budget = int(float(args[args.index("--cpu-offload-gb") + 1]) * 1024**3)
    params = args[args.index("--cpu-offload-params") + 1:]
    registered = list(layout["expert_tensors"])  # every per-expert tensor of the layer, offloadable or not
    sizes = dict(layout["offload_order"])
    offloaded, done = 0, []
    for layer in range(layout["layers"]):
        if offloaded >= budget:
            break
        for name in registered:
            if offloaded >= budget:
                break
            if not any(f".{p}." in f".mlp.experts.{name}." for p in params):
                continue
            offloaded += sizes[name]
            done.append(f"layer {layer} {name}")
    return done


@pytest.mark.parametrize("quant", ["bf16", "fp8-block", "gptq-int4"])
def test_positional_offload_moves_weights_and_scales(tmp_path: Path, quant: str) -> None:
    layout = gpu_lane.expert_layout(_lane(tmp_path, quant))
    params = gpu_lane.positional_params(quant)
    assert params and layout["offload_params"] == params
    weights = [n for n in params if n.endswith(("_weight", "_qweight"))]
    assert (len(weights) == 2 and len(params) > 2) or quant == "bf16"  # the scales go with their weights
    offloaded = sum(size for _, size in layout["offload_order"]) / NE
    assert offloaded == layout["expert_bytes"]  # every byte of an expert is offloadable (g_idx hold none)
    for frac in gpu_lane.HOST_FRACTIONS.values():
        target = int(frac * layout["total_bytes"])
        plan = gpu_lane.positional_offload(layout, target)
        args = gpu_lane.offload_args(plan, layout["offload_params"])
        assert _vllm_uva_offload(layout, args) == plan["tensors"], (quant, frac)  # stops exactly after the plan
        assert abs(plan["bytes"] - target) <= max(size for _, size in layout["offload_order"]) / 2
    assert gpu_lane.offload_args({"cpu_offload_gb": 0.0}, params) == []


def test_positional_offload_budget_survives_rounding() -> None:
    """The budget the lane used to pass (previous total + 1 byte, six decimals) is rounded back to the previous
    total, and vLLM stops one tensor early: 3.375 GiB instead of 4.125 at 23 % in bf16. The midpoint does not."""
    w13, w2 = 2 * INTER * HID * 2 * NE, INTER * HID * 2 * NE
    layout = {"layers": NL, "offload_order": [["w13_weight", w13], ["w2_weight", w2]],
              "expert_tensors": {"w13_weight": 0, "w2_weight": 0}}
    plan = gpu_lane.positional_offload(layout, int(0.23 * 3 * INTER * HID * 2 * NE * NL))
    assert plan["params"] == 7 and plan["bytes"] == int(4.125 * 2**30)
    old = ["--cpu-offload-gb", f"{(plan['bytes'] - w13 + 1) / 2**30:.6f}",
           "--cpu-offload-params", "w13_weight", "w2_weight"]
    assert len(_vllm_uva_offload(layout, old)) == 6
    assert len(_vllm_uva_offload(layout, gpu_lane.offload_args(plan, ["w13_weight", "w2_weight"]))) == 7


def test_positional_not_available_for_fp8_online(tmp_path: Path) -> None:
    assert gpu_lane.positional_params("fp8-online") is None
    status = gpu_lane.positional_status("fp8-online")
    assert status.startswith("positional: not available for fp8-online: ") and "meta device" in status
    assert gpu_lane.positional_status("fp8-block") == "available"
    assert gpu_lane.expert_layout(_lane(tmp_path, "fp8-online"))["offload_order"] == []
    tried = gpu_lane.expert_layout(_lane(tmp_path, "fp8-online", try_positional=True))  # to watch it fail
    assert [n for n, _ in tried["offload_order"]] == ["w13_weight", "w2_weight", "w13_weight_scale",
                                                      "w2_weight_scale"]
    # a positional engine that fails to boot makes a quantized lane's positional "not available", with the reason
    results = {"off": {"gpu_memory_mib": 12000.0},
               "p23": {"placement": {"bytes": 2 * 2**30}, "error": "EngineBootError('engine exited')",
                       "log": gpu_lane.parse_log_text("(Worker pid=1) ERROR [core.py:1] RuntimeError: cannot map an "
                                                      "empty tensor\nRuntimeError: Engine core initialization failed. "
                                                      "See root cause above.")}}
    status, checks = gpu_lane.positional_checks(results, "gptq-int4")
    assert status == "positional: not available for gptq-int4: boot failed: RuntimeError: cannot map an empty tensor"
    assert checks["p23"]["error"] == "RuntimeError: cannot map an empty tensor"
    del results["p23"]["log"]  # no log: the error's own first line
    assert gpu_lane.positional_checks(results, "gptq-int4")[1]["p23"]["error"] == "EngineBootError('engine exited')"
    results["p23"] = {"placement": {"bytes": 2 * 2**30}, "gpu_memory_mib": 9900.0, "log": {"cpu_offloaded_gib": 2.0}}
    status, checks = gpu_lane.positional_checks(results, "fp8-block")
    assert status == "available" and checks["p23"]["log_matches_plan"] and checks["p23"]["effective"]
    results["p23"]["gpu_memory_mib"] = 11900.0  # offloaded on paper, still on the GPU
    assert gpu_lane.positional_checks(results, "fp8-block")[1]["p23"]["effective"] is False


def _round(tok: float, out: float) -> dict[str, Any]:
    return {s: {"streams": int(s), "decode_tok_s_per_stream": tok / int(s), "output_tok_s": out, "wall_s": 1.0,
                "ttft_s_median": 0.01, "processed_tokens": 100, "runs_per_stream_tok_s": [tok / int(s)]}
            for s in ("1", "4", "16")}


def test_rep_aggregation() -> None:
    one = _round(500.0, 400.0)
    assert gpu_lane.aggregate_rounds([one]) is one  # one round: exactly the single sweep, as before --reps
    rounds = [_round(500.0, 400.0), _round(350.0, 300.0), _round(420.0, 390.0)]
    agg = gpu_lane.aggregate_rounds(rounds)
    assert agg["1"]["decode_tok_s_per_stream"] == 420.0 and agg["1"]["processed_tokens"] == 300
    spread = agg["1"]["reps"]["decode_tok_s_per_stream"]
    assert (spread["median"], spread["min"], spread["max"], spread["n"]) == (420.0, 350.0, 500.0, 3)
    assert agg["4"]["output_tok_s"] == 390.0 and agg["1"]["runs_per_stream_tok_s"] == [500.0, 350.0, 420.0]
    # ratios are taken within each round, then the median: not the ratio of the medians
    off = [_round(500.0, 0), _round(300.0, 0), _round(400.0, 0)]
    u23 = [_round(400.0, 0), _round(270.0, 0), _round(200.0, 0)]  # ratios 0.8, 0.9, 0.5
    results = {"off": {"decode": gpu_lane.aggregate_rounds(off), "decode_reps": off, "booted_with": ["u23"]},
               "u23": {"decode": gpu_lane.aggregate_rounds(u23), "decode_reps": u23, "booted_with": ["off"]}}
    figures, reps = gpu_lane.ratio_figures(results)
    assert figures["usage_23pct_over_all_hbm_1stream"] == 0.8 == statistics.median([0.8, 0.9, 0.5])
    per_round = reps["usage_23pct_over_all_hbm_1stream"]
    assert per_round["min"] == 0.5 and per_round["max"] == 0.9
    assert figures["usage_over_positional_23pct_1stream"] is None and "split_0pct_over_off_step_time" in figures
    results["u23"]["booted_with"] = []  # rounds of two different boots are not paired
    figures, reps = gpu_lane.ratio_figures(results)
    assert not reps and figures["usage_23pct_over_all_hbm_1stream"] == round(270.0 / 400.0, 3)


def test_group_need_counts_rounds() -> None:
    lane = gpu_lane.Lane(small=False, work=Path("/tmp/gpu-lane-test-unused"), out=None, report_name="r",
                         deadline=1e9, sweep={"off", "p23"}, reps=3)
    assert lane.wants_sweep("off") and not lane.wants_sweep("u23")
    need = gpu_lane.group_need_s(lane, ["off", "p23", "u23"])
    assert need == gpu_lane.GROUP_BOOT_S[True] + 2 * gpu_lane.ENGINE_MEASURE_S + gpu_lane.PARITY_MEASURE_S \
        + 2 * 2 * gpu_lane.REP_MEASURE_S
    assert gpu_lane._parse_set("all") is None and gpu_lane._parse_set("none") == set()
    assert gpu_lane._parse_set("off,u23") == {"off", "u23"}


def test_selfcheck_aggregation() -> None:
    # the hook's meta["selfcheck"] (pinsidecar_hook.selfcheck.SelfCheck.summary) and its log line
    meta = {"layers": 16, "cases": 32, "equal": 31, "mismatches": [{"layer": 3, "case": "skewed"}],
            "mismatch_count": 1, "errors": [], "expected_equal": True}
    line = "31/32 cases bitwise equal to vLLM's unsplit call over 16 layers; mismatches: [...]"
    sc = gpu_lane.selfcheck_from(meta, line)
    assert (sc["source"], sc["layers"], sc["cases"], sc["equal"], sc["mismatches"]) == ("stats", 16, 32, 31, 1)
    assert sc["first_mismatches"] == [{"layer": 3, "case": "skewed"}] and sc["expected_equal"] is True
    assert sc["errors"] == 0 and sc["log"] == line
    assert gpu_lane.selfcheck_from({**meta, "mismatch_count": 60}, None)["mismatches"] == 60  # the list is capped
    from_log = gpu_lane.selfcheck_from(None, "32/32 cases bitwise equal to vLLM's unsplit call over 16 layers")
    assert (from_log["source"], from_log["equal"], from_log["cases"], from_log["layers"]) == ("log", 32, 32, 16)
    assert gpu_lane.selfcheck_from(None, None) == {"source": "missing"}
    ok = {"layers": 16, "cases": 32, "equal": 32, "mismatches": 0, "source": "stats"}
    results = {
        "off": {"mode": "off"},
        "u23": {"mode": "pin", "selfcheck": ok, "earlier_boot": {"mode": "pin", "selfcheck": sc}},
        "u0": {"mode": "pin", "error": "EngineBootError(...)", "selfcheck": {"source": "log"}},
    }
    results["u10"] = {"mode": "pin"}  # booted without the selfcheck (a bf16 lane): not counted, not missing
    summary = gpu_lane.selfcheck_summary(results)
    assert summary["pin_engines"] == 3 and summary["missing"] == ["u0"]
    assert (summary["cases"], summary["equal"], summary["mismatches"], summary["layers"]) == (64, 63, 1, 32)
    assert summary["bit_identity"] == round(63 / 64, 6) and summary["not_expected_equal"] == []
    assert gpu_lane.selfcheck_summary({"off": {"mode": "off"}})["bit_identity"] is None


def test_log_lines_the_lane_reads() -> None:
    text = "\n".join([
        "(Worker pid=1) INFO 12-01 [uva.py:58] Total CPU offloaded parameters: 4.12",
        "(Worker pid=1) INFO 12-01 [pin.py:371] pinsidecar pin: map /tmp/m.json (usage 23%, hash ab) on rank 0/1",
        "(Worker pid=1) INFO 12-01 [pin.py:400] pinsidecar pin selfcheck: 16 layers, 32/32 equal",
        "(Worker pid=1) INFO 12-01 [fp8.py:297] Using TRITON Fp8 MoE backend out of potential backends: [...]",
        "(Worker pid=1) ERROR pin mode refuses map m (label 'x', hash ab) for this model: bytes per expert: map says "
        "4719744, model has 4719872 per rank (x1 ranks = 4719872)",
        "(APIServer pid=2) INFO 12-01 [api_server.py:1] Starting vLLM server",
    ])
    log = gpu_lane.parse_log_text(text)
    assert log["cpu_offloaded_gib"] == 4.12 and log["moe_backend"] == "TRITON"
    assert log["pin_summary"].startswith("map /tmp/m.json") and log["pin_selfcheck"] == "16 layers, 32/32 equal"
    assert log["pin_expert_bytes_mismatch"] == {"map": 4719744, "model": 4719872}
    line = gpu_lane.engine_line("fp8-block", {"name": "u23", "boot_s": 61.0, "identity_ids": [[1, 2], [3]],
                                              "selfcheck": {"cases": 32, "equal": 32, "layers": 16},
                                              "live": {"tokens_exact": True, "selections_exact": True,
                                                       "cold_rate": 0.066, "backend": "triton_experts"}},
                                [[1, 2], [3]])
    assert line.startswith("== ENGINE fp8-block u23: boot 61.0 s") and "greedy parity vs off 2/2" in line
    assert "selfcheck 32/32 equal, 16 layers" in line and "live exact True" in line


def test_build_model_passes_the_checkpoint_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pinsidecar.demo.model as demo

    calls: list[dict[str, Any]] = []

    def fake_build(out_dir: Path, **kw: Any) -> Path:
        calls.append(kw)
        out_dir.mkdir(parents=True, exist_ok=True)
        quant = kw.get("quant")
        (out_dir / "pinsidecar_demo.json").write_text(json.dumps({"quant": {"method": quant}} if quant else {}))
        return out_dir

    monkeypatch.setattr(demo, "build_demo_model", fake_build)
    for quant in gpu_lane.QUANTS:
        lane = _lane(tmp_path, quant)
        assert gpu_lane.build_model(lane)["reused"] is False
        assert gpu_lane.build_model(lane)["reused"] is True  # the marker says the same format: kept
    assert [c.get("quant") for c in calls] == [None, "fp8-block", None, "gptq-int4", "mxfp4", "nvfp4", "awq-int4"]
    assert all(c["force"] and c["geometry"].hidden == HID for c in calls)
    lane = _lane(tmp_path, "gptq-int4")
    (lane.model / "pinsidecar_demo.json").write_text("{}")  # a bf16 model where a GPTQ one belongs: rebuilt
    assert gpu_lane.build_model(lane)["reused"] is False and calls[-1]["quant"] == "gptq-int4"


def test_summarize_report() -> None:
    doc = {"quant": "fp8-block", "bit_identity": 1.0, "selfcheck": {"cases": 64, "equal": 64, "layers": 32,
                                                                    "missing": []},
           "figures": {"token_identity_hook_engines": 1.0, "live_counts_exact": True, "count_boot_exact": True,
                       "usage_over_positional_23pct_1stream": 1.9, "usage_23pct_over_all_hbm_4stream": None},
           "host_bytes_per_expert": {"value": 4719744}, "positional": "available",
           "engines": {"u23": {"name": "u23", "boot_s": 60.0, "token_identity_vs_off": {"identical": 8,
                                                                                       "prompts": 8}}}}
    s = gpu_lane.summarize_report(doc)
    assert s["bit_identity"] == 1.0 and s["host_bytes_per_expert"] == 4719744
    assert s["figures"] == {"usage_over_positional_23pct_1stream": 1.9}
    assert "greedy parity vs off 8/8" in s["engines"]["u23"]
