"""The map builder, the positional baseline, evaluation, leave-one-out, diff, the heatmap and the test builders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pinsidecar_hook.contract import ArtifactError, LayerPlacement, load_map

from pinsidecar import placement
from pinsidecar.placement.heatmap import render_map_png, write_map_png
from pinsidecar.testing.artifacts import (
    counts_from,
    domain_ranking,
    make_counts,
    make_map,
    model_geometry,
    swap_experts,
    write_map,
)

# ---------------------------------------------------------------------------------------------------- build


def test_build_takes_most_selected_with_ties_to_lower_id_and_sorted_lists() -> None:
    c = counts_from([[1, 9, 3, 3, 3, 0], [5, 5, 5, 5, 5, 5]])
    m = placement.build_usage_map([c], 3, "t")
    assert m.layers[0] == LayerPlacement(0, hot=(1, 2, 3), cold=(0, 4, 5))  # 3,3,3 tie: ids 2,3 beat 4
    assert m.layers[1] == LayerPlacement(1, hot=(0, 1, 2), cold=(3, 4, 5))  # all tied: lowest ids
    assert m.hot_rows == 3 and m.cold_rows == 3 and m.policy == "usage" and m.label == "t"
    assert m.predicted_cold_rate == pytest.approx((1 + 3 + 0 + 15) / (19 + 30))
    assert m.meta["predicted_cold_rate_per_layer"] == [pytest.approx(4 / 19, abs=1e-6), 0.5]
    assert m.source_counts == (c.digest(),)


def test_engine_meta_is_carried_when_all_counts_agree() -> None:
    a = counts_from([[1, 2]], meta={"dtype": "bfloat16", "tp_size": 1, "workload_note": "x"})
    b = counts_from([[2, 1]], meta={"dtype": "bfloat16", "tp_size": 2})
    m = placement.build_usage_map([a, b], 1)
    assert m.meta["dtype"] == "bfloat16" and "tp_size" not in m.meta and "workload_note" not in m.meta


def test_built_map_is_a_valid_artifact(tmp_path: Path) -> None:
    c = make_counts(num_layers=5, num_experts=32, top_k=4, tokens=300, layer_ids=[3, 7, 11, 15, 19])
    m = placement.build_usage_map([c], 10, expert_bytes=4096)
    placement.save_map(m, tmp_path / "sub" / "m.json")
    back = load_map(tmp_path / "sub" / "m.json")
    assert back.content_hash == m.content_hash
    assert back.layer_ids == (3, 7, 11, 15, 19) and back.expert_bytes == 4096
    assert all(len(lp.hot) == 10 for lp in back.layers)


def test_same_placement_hashes_the_same_whatever_the_input_order() -> None:
    a, b = make_counts(seed=1), make_counts(seed=2)
    m1 = placement.build_usage_map([a, b], 16)
    m2 = placement.build_usage_map([b, a], 16)
    assert m1.content_hash == m2.content_hash
    # and equals a map built from the pre-summed counts
    assert placement.build_usage_map([placement.sum_counts([a, b])], 16).content_hash == m1.content_hash


def test_build_picks_the_true_hot_set_of_a_skewed_domain() -> None:
    hot = list(range(40, 56))
    c = make_counts(num_layers=3, num_experts=64, top_k=4, tokens=3000, skew=1.5, hot_set=hot)
    m = placement.build_usage_map([c], 16)
    for lp in m.layers:
        assert len(set(lp.hot) & set(hot)) >= 14


def test_counts_of_different_geometry_are_refused_naming_both() -> None:
    a = make_counts(num_experts=64)
    b = make_counts(num_experts=32)
    with pytest.raises(ArtifactError, match=r"a\.json .*64 experts.*b\.json .*32 experts"):
        placement.build_usage_map([a, b], 8, names=["a.json", "b.json"])
    c = make_counts(top_k=2)
    with pytest.raises(ArtifactError, match=r"top-8.*top-2"):
        placement.build_usage_map([a, c], 8)
    d = make_counts(layer_ids=[1, 2, 3, 4])
    with pytest.raises(ArtifactError, match="different models"):
        placement.leave_one_out([a, d], 8)


@pytest.mark.parametrize("hot_rows, expect", [(0, "at least 1"), (-3, "at least 1"), (64, "no offload is needed"),
                                              (65, "no offload is needed")])
def test_budget_out_of_range(hot_rows: int, expect: str) -> None:
    with pytest.raises(ArtifactError, match=expect):
        placement.build_usage_map([make_counts()], hot_rows)


def test_counts_without_selections_are_refused() -> None:
    empty = counts_from([[0, 0, 0, 0]])
    with pytest.raises(ArtifactError, match=r"e\.json: no selections counted"):
        placement.build_usage_map([empty], 2, names=["e.json"])


def test_budget_edges_are_allowed() -> None:
    c = make_counts()
    assert placement.build_usage_map([c], 1).hot_rows == 1
    assert placement.build_usage_map([c], 63).cold_rows == 1


def test_hbm_bytes_to_hot_rows() -> None:
    mib = 2**20
    # the reference box: 40 layers x 384 experts of 17.93 MiB; 295 hot rows
    xbytes = int(17.93 * mib)
    assert placement.hot_rows_for_budget(295 * 40 * xbytes + 40 * xbytes - 1, 40, xbytes, 384) == 295
    assert placement.hot_rows_for_budget(40 * xbytes, 40, xbytes, 384) == 1
    with pytest.raises(ArtifactError, match="smaller than one expert per layer"):
        placement.hot_rows_for_budget(40 * xbytes - 1, 40, xbytes, 384)
    with pytest.raises(ArtifactError, match="holds all 384 experts"):
        placement.hot_rows_for_budget(384 * 40 * xbytes, 40, xbytes, 384)
    with pytest.raises(ArtifactError, match="size of one expert is unknown"):
        placement.hot_rows_for_budget(10**12, 40, 0, 384)
    with pytest.raises(ArtifactError, match="must be positive"):
        placement.hot_rows_for_budget(0, 40, xbytes, 384)


# ---------------------------------------------------------------------------------------------------- positional


def test_positional_mask_reference_budget() -> None:
    # 40 x 384, 89 cold rows per layer -> 3560 cold experts: 9 whole layers and 104 experts of the tenth
    mask = placement.positional_mask(list(range(40)), 384, 6, 40 * 89)
    cold_per_layer = (~mask.hot_mask()).sum(axis=1)
    assert cold_per_layer[:9].tolist() == [384] * 9
    assert cold_per_layer[9] == 104
    assert cold_per_layer[10:].sum() == 0
    assert not mask.hot_mask()[9, :104].any() and mask.hot_mask()[9, 104:].all()
    assert mask.cold_total == 3560 and mask.meta["full_cold_layers"] == 9 and mask.meta["partial_layer_cold"] == 104


def test_positional_follows_parameter_order_not_storage_order() -> None:
    mask = placement.positional_mask([5, 1, 3], 4, 1, 6)
    cold = (~mask.hot_mask()).sum(axis=1)
    assert dict(zip(mask.layer_ids, cold.tolist(), strict=True)) == {1: 4, 3: 2, 5: 0}


def test_positional_for_uses_the_same_budget_and_cannot_be_a_map() -> None:
    m = placement.build_usage_map([make_counts(num_layers=6, num_experts=16)], 12)
    mask = placement.positional_for(m)
    assert mask.cold_total == m.cold_rows * m.num_layers == 24
    assert (~mask.hot_mask()).sum() == (~m.hot_mask()).sum()
    assert len({int(h) for h in mask.hot_mask().sum(axis=1)}) > 1  # hot count varies by layer: no fixed geometry
    with pytest.raises(ArtifactError, match="outside"):
        placement.positional_mask([0, 1], 4, 1, 9)


# ---------------------------------------------------------------------------------------------------- evaluate


def test_evaluate_by_hand_for_map_and_mask() -> None:
    c = counts_from([[6, 2, 1, 1], [0, 0, 4, 6]])
    m = placement.build_usage_map([c], 2)
    r = placement.evaluate(m, c)
    assert r["cold_rate"] == pytest.approx(2 / 20)
    assert [p["cold_rate"] for p in r["per_layer"]] == [pytest.approx(0.2), 0.0]
    assert [p["cold_experts_touched"] for p in r["per_layer"]] == [2, 0]
    assert r["map_hash"] == m.content_hash and r["policy"] == "usage"
    pos = placement.evaluate(placement.positional_for(m), c)
    assert pos["cold_rate"] == pytest.approx(10 / 20)  # layer 0 entirely cold
    assert pos["per_layer"][0]["cold_rate"] == 1.0 and pos["policy"] == "positional"
    assert "map_hash" not in pos


def test_evaluate_refuses_other_geometry_naming_both() -> None:
    m = make_map(num_layers=4, num_experts=64, top_k=8)
    with pytest.raises(ArtifactError, match=r"m\.json .*c\.json .*different models"):
        placement.evaluate(m, make_counts(num_experts=32), "m.json", "c.json")
    with pytest.raises(ArtifactError, match=r"top-8.*top-4"):
        placement.evaluate(m, make_counts(top_k=4))


def test_figures_in_domain_beats_positional_and_cross_domain_is_worse() -> None:
    """The shape of the demo's figure on synthetic traffic: held-out in-domain << positional, cross-domain worse."""
    geometry = dict(num_layers=8, num_experts=64, top_k=4, tokens=2000)
    train = make_counts(**geometry, domain=0, seed=1)
    held_out = make_counts(**geometry, domain=0, seed=2)
    other = make_counts(**geometry, domain=1, seed=3)
    m = placement.build_usage_map([train], 48)
    in_domain = placement.evaluate(m, held_out)["cold_rate"]
    positional = placement.evaluate(placement.positional_for(m), held_out)["cold_rate"]
    cross = placement.evaluate(m, other)["cold_rate"]
    assert in_domain < positional / 3
    assert in_domain < cross
    assert abs(in_domain - m.predicted_cold_rate) < 0.03


def test_leave_one_out_matches_building_from_the_others() -> None:
    cs = [make_counts(seed=s, domain=s % 2) for s in range(3)]
    loo = placement.leave_one_out(cs, 16, names=["a", "b", "c"])
    assert [r["held_out"] for r in loo] == ["a", "b", "c"]
    for i, row in enumerate(loo):
        others = [c for j, c in enumerate(cs) if j != i]
        expect = placement.evaluate(placement.build_usage_map(others, 16), cs[i])["cold_rate"]
        assert row["cold_rate"] == pytest.approx(expect)
    assert placement.leave_one_out(cs[:1], 16) == []


# ---------------------------------------------------------------------------------------------------- diff, summary


def test_diff_identical_and_moved() -> None:
    a = make_map(num_layers=3, num_experts=8, hot_rows=3, seed=0, expert_bytes=100)
    same = placement.diff_maps(a, a)
    assert same["identical"] and same["compile_cache_hit"] and same["hot_to_cold"] == 0
    lp = a.layers[1]
    b = swap_experts(a, lp.layer_id)  # its lowest hot expert goes cold, its lowest cold expert goes hot
    d = placement.diff_maps(a, b)
    assert not d["identical"] and d["compile_cache_hit"]
    assert d["per_layer"][1] == {"layer_id": lp.layer_id, "hot_to_cold": [lp.hot[0]], "cold_to_hot": [lp.cold[0]]}
    assert d["layers_changed"] == 1 and d["moved_bytes"] == 200
    assert "compile-cache hit" in d["verdict"]


def test_diff_other_geometry_is_not_a_cache_hit() -> None:
    a = make_map(num_layers=3, num_experts=8, hot_rows=3)
    b = make_map(num_layers=3, num_experts=8, hot_rows=4)
    d = placement.diff_maps(a, b)
    assert not d["compile_cache_hit"] and d["geometry_differences"] == ["cold_rows", "hot_rows"]
    assert "NOT a compile-cache hit" in d["verdict"]
    c = make_map(num_layers=3, num_experts=16, hot_rows=3)
    d2 = placement.diff_maps(a, c)
    assert not d2["compile_cache_hit"] and d2["comparable_layers"] == 0 and d2["per_layer"] == []
    e = make_map(layer_ids=[0, 1, 5], num_experts=8, hot_rows=3)
    d3 = placement.diff_maps(a, e)
    assert "layer_ids" in d3["geometry_differences"] and d3["comparable_layers"] == 2


def test_summary() -> None:
    m = placement.build_usage_map([make_counts()], 16, "code", expert_bytes=1000)
    s = placement.summary(m)
    assert s["hash"] == m.content_hash and s["label"] == "code"
    assert s["hot_bytes"] == 16 * 4 * 1000 and s["cold_bytes"] == 48 * 4 * 1000
    assert len(s["predicted_cold_rate_per_layer"]) == 4


# ---------------------------------------------------------------------------------------------------- counts helpers


def test_sum_counts_and_top_share() -> None:
    a = counts_from([[4, 0, 0, 0]], meta={"expert_bytes": 5, "x": 1})
    b = counts_from([[0, 2, 1, 1]], meta={"expert_bytes": 5, "x": 2})
    s = placement.sum_counts([a, b])
    assert s.counts.tolist() == [[4, 2, 1, 1]] and s.tokens == 8
    assert s.meta["expert_bytes"] == 5 and "x" not in s.meta
    assert placement.top_share(s.counts).tolist() == [0.5]  # top 25 % of 4 experts = 1 expert: 4/8
    assert placement.top_share(np.zeros((1, 4))).tolist() == [0.0]


def test_counts_summary() -> None:
    c = make_counts(num_layers=2, num_experts=16, top_k=2, tokens=100)
    s = placement.counts_summary(c)
    assert (s["num_layers"], s["num_experts"], s["top_k"], s["tokens"], s["selections"]) == (2, 16, 2, 100, 400)
    assert s["consistent"] and 0.25 < s["skew"]["mean"] <= 1


# ---------------------------------------------------------------------------------------------------- builders


def test_make_counts_obeys_routing_invariants_and_is_deterministic() -> None:
    c = make_counts(num_layers=3, num_experts=16, top_k=4, tokens=500, skew=2.0)
    assert c.consistent
    assert c.counts.max() <= c.tokens  # an expert is picked at most once per token
    np.testing.assert_array_equal(c.counts, make_counts(num_layers=3, num_experts=16, top_k=4, tokens=500,
                                                        skew=2.0).counts)
    flat = make_counts(num_layers=3, num_experts=16, top_k=4, tokens=500, skew=0.0)
    assert placement.top_share(c.counts).mean() > placement.top_share(flat.counts).mean() + 0.2


def test_make_counts_hot_set_and_domains() -> None:
    r = domain_ranking(2, 10, domain=3, hot_set=[7, 2])
    assert r[:, :2].tolist() == [[7, 2], [7, 2]] and sorted(r[0].tolist()) == list(range(10))
    a = placement.build_usage_map([make_counts(domain=0)], 16)
    b = placement.build_usage_map([make_counts(domain=1)], 16)
    overlap = np.mean([len(set(x.hot) & set(y.hot)) / 16 for x, y in zip(a.layers, b.layers, strict=True)])
    assert overlap < 0.6
    with pytest.raises(ValueError, match="distinct expert ids"):
        make_counts(hot_set=[1, 1])


def test_make_map_random_is_valid(tmp_path: Path) -> None:
    m = make_map(num_layers=3, num_experts=10, hot_rows=4, seed=9)
    assert load_map(write_map(tmp_path / "m.json", num_layers=3, num_experts=10, hot_rows=4, seed=9)) == m


def test_counts_from_holds_exactly_the_rows() -> None:
    c = counts_from([[3, 1, 0], [0, 2, 2]], top_k=2, layer_ids=[5, 9])
    assert c.counts.tolist() == [[3, 1, 0], [0, 2, 2]] and c.tokens == 2 and c.consistent
    assert c.layer_ids == [5, 9] and (c.num_experts, c.top_k) == (3, 2)
    assert not counts_from([[3, 1, 0]], tokens=7).consistent
    with pytest.raises(ValueError, match="layers"):
        counts_from([1, 2, 3])


def test_swap_experts_keeps_the_geometry(tmp_path: Path) -> None:
    a = make_map(num_layers=2, num_experts=6, hot_rows=2, seed=4)
    lp = a.layer(1)
    b = swap_experts(a, 1, lp.hot[1], lp.cold[2])
    assert b.layer(1) == LayerPlacement(1, tuple(sorted({lp.hot[0], lp.cold[2]})),
                                        tuple(sorted({*lp.cold} - {lp.cold[2]} | {lp.hot[1]})))
    assert b.layer(0) == a.layer(0) and b.same_geometry(a) and b.content_hash != a.content_hash
    b.save(tmp_path / "b.json")
    assert load_map(tmp_path / "b.json") == b
    with pytest.raises(ValueError, match="must be hot"):
        swap_experts(a, 1, lp.cold[0], lp.cold[1])


def test_model_geometry_reads_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "num_local_experts": 64, "num_experts_per_tok": 8}')
    assert model_geometry(tmp_path) == {"num_layers": 4, "num_experts": 64, "top_k": 8}


# ---------------------------------------------------------------------------------------------------- heatmap


def test_heatmap_png(tmp_path: Path) -> None:
    c = make_counts(num_layers=6, num_experts=32, top_k=4, tokens=200)
    m = placement.build_usage_map([c], 8)
    for counts in (None, c):
        png = render_map_png(m, counts)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    write_map_png(tmp_path / "x" / "m.png", m)
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["m.png"]
    with pytest.raises(ArtifactError, match="different models"):
        render_map_png(m, make_counts(num_layers=6, num_experts=16, top_k=4))
