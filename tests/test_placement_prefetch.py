"""``pinsidecar placement prefetch``: the last-step predictor of each step's cold experts, replayed on a trace.

Hand-made traces whose recall and precision are worked out by hand, a brute-force reference on random traces, and
the command's refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pinsidecar_hook.contract import ArtifactError, RoutingTrace, save_trace

from pinsidecar.placement import HotRanking, evaluate_prefetch
from pinsidecar.placement.prefetch import last_step_prediction
from pinsidecar.testing.cli import assert_user_error, run, run_json

# 6 experts, expert 0 hot (rank 0 1 2 3 4 5), one layer
RANK = HotRanking.from_counts(np.array([[10, 0, 0, 0, 0, 0]]), "counts")


def one_layer(tokens: list[list[int]]) -> RoutingTrace:
    return RoutingTrace(np.asarray(tokens)[:, None, :], 6)


def test_the_last_step_predicts_what_repeats() -> None:
    # steps (batch 1): cold sets {1,2}, {1,3}, {1,3}, {4,5}
    trace = one_layer([[0, 1, 2], [1, 3, 0], [3, 1, 0], [4, 5, 0]])
    r = evaluate_prefetch(trace, RANK, hot_rows=1, window=1)
    # predictions: {}, {1,2}, {1,3}, {1,3}; hits 0 + 1 + 2 + 0
    assert (r.cold, r.prefetched, r.hits) == (8, 6, 3)
    assert r.recall == pytest.approx(3 / 8) and r.precision == pytest.approx(3 / 6)
    d = r.as_dict()
    assert d["cold_per_step"] == 2.0 and d["missed_per_step"] == pytest.approx(5 / 4)
    assert d["moved_per_step"] == pytest.approx((6 + 5) / 4)
    # window 2: predictions {}, {1,2}, {1,2,3}, {1,3}: hits 0 + 1 + 2 + 0, 7 prefetched
    r2 = evaluate_prefetch(trace, RANK, hot_rows=1, window=2)
    assert (r2.prefetched, r2.hits) == (7, 3)


def test_steps_of_a_batch_share_their_cold_set() -> None:
    trace = one_layer([[1, 0], [2, 0], [1, 0], [3, 0]])  # batch 2: {1,2}, {1,3}
    r = evaluate_prefetch(trace, RANK, hot_rows=1, window=1, batch=2)
    assert (r.steps, r.cold, r.prefetched, r.hits) == (2, 4, 2, 1)


def test_against_a_brute_force_reference_on_random_traces() -> None:
    rng = np.random.default_rng(3)
    experts, top_k, tokens, layers = 16, 3, 200, 2
    ids = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                    for _ in range(tokens)])
    trace = RoutingTrace(ids, experts)
    counts = np.stack([np.bincount(ids[:, layer].ravel(), minlength=experts) for layer in range(layers)])
    ranking = HotRanking.from_counts(counts, "counts")
    for window, batch in ((1, 1), (3, 1), (2, 4)):
        got = evaluate_prefetch(trace, ranking, hot_rows=5, window=window, batch=batch)
        hot = ranking.hot_mask(5)
        cold = hits = pref = 0
        for layer in range(layers):
            sets = [set() for _ in range(-(-tokens // batch))]
            for t in range(tokens):
                sets[t // batch] |= {int(e) for e in ids[t, layer] if not hot[layer][e]}
            for s, actual in enumerate(sets):
                predicted = set().union(*sets[max(0, s - window):s])
                cold += len(actual)
                pref += len(predicted)
                hits += len(actual & predicted)
        assert (got.cold, got.prefetched, got.hits) == (cold, pref, hits), (window, batch)


def test_the_prediction_window_is_exactly_the_last_w_steps() -> None:
    cold = np.eye(5, dtype=bool)  # expert s is cold at step s only
    for w in (1, 2, 4):
        predicted = last_step_prediction(cold, w)
        for s in range(5):
            assert sorted(np.nonzero(predicted[s])[0].tolist()) == list(range(max(0, s - w), s)), (w, s)


def test_bad_arguments_are_refused() -> None:
    trace = one_layer([[0, 1, 2]])
    with pytest.raises(ArtifactError, match="window must be at least 1"):
        evaluate_prefetch(trace, RANK, 1, window=0)
    with pytest.raises(ArtifactError, match=r"hot-rows must be in 0\.\.5"):
        evaluate_prefetch(trace, RANK, 6)
    with pytest.raises(ArtifactError, match="predictor 'oracle'"):
        evaluate_prefetch(trace, RANK, 1, predictor="oracle")


def test_the_command_reports_each_window(tmp_path: Path) -> None:
    trace = tmp_path / "trace.npz"
    save_trace(trace, one_layer([[0, 1, 2], [1, 3, 0], [3, 1, 0], [4, 5, 0]]))
    counts = tmp_path / "train.npz"  # expert 0 the most selected, then by id
    save_trace(counts, one_layer([[0, 1, 2], [0, 3, 4], [0, 5, 1]]))
    r = run_json("placement", "prefetch", str(trace), "--train", str(counts), "--hot-rows", "1", "--window", "1,2")
    assert [x["window"] for x in r["results"]] == [1, 2]
    assert r["results"][0]["recall"] == pytest.approx(3 / 8) and r["hot_rows"] == 1
    human = run("placement", "prefetch", str(trace), "--train", str(counts), "--hot-rows", "1")
    assert human.exit_code == 0 and "recall" in human.stdout and "37.5%" in human.stdout
    assert_user_error(run("placement", "prefetch", str(trace), "--train", str(counts)), "--hot-rows is needed")
    assert_user_error(run("placement", "prefetch", str(trace), "--train", str(counts), "--hot-rows", "1",
                          "--window", "x"), "--window 'x'")


def test_the_bench_writes_one_row_per_profile_stream_count_and_window(tmp_path: Path) -> None:
    from bench import prefetch_predictor

    out = tmp_path / "prefetch.json"
    assert prefetch_predictor.main(["--out", str(out), "--steps", "20", "--profiles", "stationary,short_reuse"]) == 0
    import json

    r = json.loads(out.read_text())
    assert len(r["results"]) == 2 * 3 * 3 and r["geometry"]["hot_rows"] == 99
    assert all(0.0 <= x["recall"] <= 1.0 and 0.0 <= x["precision"] <= 1.0 for x in r["results"])
    # the same steps, a longer memory: recall never drops with the window
    by = {(x["profile"], x["streams"], x["window"]): x["recall"] for x in r["results"]}
    assert all(by[(p, s, 1)] <= by[(p, s, 2)] <= by[(p, s, 4)] for p, s, _w in by)


def test_the_residual_predictor_bench_scores_every_predictor_on_the_same_cold_reads(demo_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """bench/prefetch_residual.py on the demo model in transformers (CPU): every predictor is scored against the
    same cold selections, and the union of two predictors hits at least what each hits."""
    import json

    from bench import prefetch_residual
    from pinsidecar.testing.artifacts import write_counts

    counts = write_counts(tmp_path / "counts.json", num_layers=4, num_experts=64, top_k=8)
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "def f(x):\\n    return x"}\n{"prompt": "The river ran"}\n')
    out = tmp_path / "residual.json"
    assert prefetch_residual.main(["--model", str(demo_model_dir), "--counts", str(counts), "--workload",
                                   str(workload), "--hot-rows", "49", "--max-new-tokens", "4", "--out", str(out)]) == 0
    r = {x["predictor"]: x for x in json.loads(out.read_text())["results"]}
    assert set(r) == {"same-layer", "next-layer", "last-step", "same-layer+last-step"}
    assert len({x["cold"] for x in r.values()}) == 1 and r["last-step"]["cold"] > 0
    assert r["same-layer+last-step"]["hits"] >= max(r["same-layer"]["hits"], r["last-step"]["hits"])
    assert all(0.0 <= x["recall"] <= 1.0 and 0.0 <= x["precision"] <= 1.0 for x in r.values())
