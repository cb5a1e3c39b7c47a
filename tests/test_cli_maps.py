"""``pinsidecar map`` and ``pinsidecar counts`` end to end: outputs, figures, and every bad input.

Bad input must exit 2 with ``error: ...`` naming the file or value on stderr, no traceback, and no output file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pinsidecar_hook.contract import ModelInfo, load_counts, load_map

from pinsidecar.testing.artifacts import write_counts, write_map
from pinsidecar.testing.cli import assert_user_error, run, run_json

GEOM = dict(num_layers=6, num_experts=32, top_k=4, tokens=400)


@pytest.fixture()
def counts3(tmp_path: Path) -> list[str]:
    return [
        str(write_counts(tmp_path / "a.counts.json", **GEOM, domain=0, seed=1, expert_bytes=1000)),
        str(write_counts(tmp_path / "b.counts.json", **GEOM, domain=0, seed=2, expert_bytes=1000)),
        str(write_counts(tmp_path / "c.counts.json", **GEOM, domain=1, seed=3, expert_bytes=1000)),
    ]


# ---------------------------------------------------------------------------------------------------- build


def test_build_writes_a_map_and_reports_positional_and_leave_one_out(tmp_path: Path, counts3: list[str]) -> None:
    out = tmp_path / "maps" / "new" / "code.map.json"  # missing directories are created
    r = run_json("map", "build", *counts3[:2], "--hot-rows", "16", "--label", "code", "--out", str(out))
    emap = load_map(out)
    assert emap.hot_rows == 16 and emap.label == "code" and emap.expert_bytes == 1000
    assert r["map"]["hash"] == emap.content_hash and r["out"] == str(out)
    assert r["predicted_cold_rate"] == pytest.approx(emap.predicted_cold_rate)
    assert r["positional_cold_rate"] > 2 * r["predicted_cold_rate"]
    assert [x["held_out"] for x in r["leave_one_out"]] == counts3[:2]
    assert all(x["cold_rate"] < r["positional_cold_rate"] for x in r["leave_one_out"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["code.map.json"]


def test_build_human_output(tmp_path: Path, counts3: list[str]) -> None:
    result = run("map", "build", *counts3, "--hot-rows", "16", "--out", str(tmp_path / "m.json"))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "wrote" in out and "positional (--cpu-offload-gb, same budget)" in out
    assert "leave-one-out" in out and counts3[2] in out
    assert "3 whole layer(s) (0..2)" in out  # 6 layers x 16 cold = 96 = 3 whole layers of 32


def test_build_from_hbm_bytes(tmp_path: Path, counts3: list[str]) -> None:
    # 6 layers x 1000 bytes per expert: 100_000 bytes buys 16 rows per layer
    r = run_json("map", "build", counts3[0], "--hbm-bytes", "100000", "--out", str(tmp_path / "m.json"))
    assert r["hot_rows"] == 16 and r["budget_from"] == "hbm-bytes"
    r2 = run_json("map", "build", counts3[0], "--hbm-bytes", "90000", "--expert-bytes", "500",
                  "--out", str(tmp_path / "m2.json"))
    assert r2["hot_rows"] == 30 and load_map(tmp_path / "m2.json").expert_bytes == 500


def test_build_hbm_bytes_without_expert_size(tmp_path: Path) -> None:
    c = write_counts(tmp_path / "c.json", **GEOM)
    out = tmp_path / "m.json"
    assert_user_error(run("map", "build", str(c), "--hbm-bytes", "100000", "--out", str(out)),
                      "--expert-bytes", "--hot-rows")
    assert not out.exists()


@pytest.mark.parametrize("budget, fragments", [
    (["--hot-rows", "0"], ["at least 1", "budget of zero"]),
    (["--hot-rows", "32"], ["no offload is needed"]),
    (["--hot-rows", "500"], ["no offload is needed"]),
    (["--hbm-bytes", "0"], ["must be positive"]),
    (["--hbm-bytes", "5999"], ["smaller than one expert per layer"]),
    (["--hbm-bytes", "192000"], ["holds all 32 experts", "no offload is needed"]),
    ([], ["exactly one budget"]),
    (["--hot-rows", "4", "--hbm-bytes", "100000"], ["exactly one budget"]),
    (["--hot-rows", "4", "--expert-bytes", "0"], ["--expert-bytes must be positive"]),
])
def test_build_bad_budget(tmp_path: Path, counts3: list[str], budget: list[str], fragments: list[str]) -> None:
    out = tmp_path / "m.json"
    assert_user_error(run("map", "build", counts3[0], *budget, "--out", str(out)), *fragments)
    assert not out.exists()


def _bad_counts(tmp_path: Path, case: str) -> Path:
    good = write_counts(tmp_path / "src.json", **GEOM)
    doc = json.loads(good.read_text())
    path = tmp_path / f"{case}.counts.json"
    if case == "corrupt":
        path.write_text("{ this is not json")
        return path
    if case == "truncated":
        path.write_text(good.read_text()[: len(good.read_text()) // 2])
        return path
    if case == "version":
        doc["version"] = 7
    elif case == "geometry":
        doc["counts"][2] = doc["counts"][2][:-3]
    elif case == "empty":
        doc = ""
    path.write_text(json.dumps(doc) if doc != "" else "")
    return path


@pytest.mark.parametrize("case, fragment", [("corrupt", "not valid JSON"), ("truncated", "corrupt or truncated"),
                                            ("version", "version 7 is not supported"),
                                            ("geometry", "counts row 2 has 29 entries, expected 32"),
                                            ("empty", "file is empty")])
def test_build_bad_counts_file(tmp_path: Path, case: str, fragment: str) -> None:
    bad = _bad_counts(tmp_path, case)
    out = tmp_path / "out" / "m.json"
    assert_user_error(run("map", "build", str(bad), "--hot-rows", "8", "--out", str(out)), str(bad), fragment)
    assert not out.exists() and not out.parent.exists()


def test_build_mismatched_counts_names_both_files(tmp_path: Path, counts3: list[str]) -> None:
    other = write_counts(tmp_path / "other.json", num_layers=6, num_experts=64, top_k=4, tokens=100)
    out = tmp_path / "m.json"
    assert_user_error(run("map", "build", counts3[0], str(other), "--hot-rows", "8", "--out", str(out)),
                      counts3[0], str(other), "32 experts", "64 experts")
    assert not out.exists()


def test_build_missing_counts_file(tmp_path: Path) -> None:
    assert_user_error(run("map", "build", str(tmp_path / "nope.json"), "--hot-rows", "8", "--out",
                          str(tmp_path / "m.json")), "nope.json", "file not found")


def test_build_bad_out_paths(tmp_path: Path, counts3: list[str]) -> None:
    assert_user_error(run("map", "build", counts3[0], "--hot-rows", "8", "--out", str(tmp_path)), "is a directory")
    assert_user_error(run("map", "build", counts3[0], "--hot-rows", "8", "--out", counts3[0]), "also an input")
    load_counts(counts3[0])  # untouched
    assert_user_error(run("map", "build", counts3[0], "--hot-rows", "8"), "missing --out")


def test_build_out_unwritable(tmp_path: Path, counts3: list[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_user_error(run("map", "build", counts3[0], "--hot-rows", "8", "--out", str(blocker / "m.json")),
                      "cannot write")


def test_build_positional(tmp_path: Path, counts3: list[str]) -> None:
    r = run_json("map", "build", counts3[0], "--hot-rows", "16", "--positional")
    assert r["mode"] == "positional" and "out" not in r
    per_layer = r["positional"]["per_layer"]
    assert [p["cold_experts"] for p in per_layer] == [32, 32, 32, 0, 0, 0]
    assert [p["cold_rate"] for p in per_layer] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert r["positional_cold_rate"] == pytest.approx(0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(c).name for c in counts3)
    human = run("map", "build", counts3[0], "--hot-rows", "16", "--positional")
    assert "no map file written" in human.stdout
    out = tmp_path / "pos.json"
    assert_user_error(run("map", "build", counts3[0], "--hot-rows", "16", "--positional", "--out", str(out)),
                      "--positional cannot be written", "map eval")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- eval


def test_eval(tmp_path: Path, counts3: list[str]) -> None:
    m = tmp_path / "m.json"
    run_json("map", "build", counts3[0], "--hot-rows", "16", "--out", str(m))
    held_out = run_json("map", "eval", str(m), counts3[1])
    cross = run_json("map", "eval", str(m), counts3[2])
    assert held_out["cold_rate"] < cross["cold_rate"]
    assert held_out["cold_rate"] < held_out["positional_cold_rate"] / 2
    assert len(held_out["per_layer"]) == 6
    assert {"layer_id", "cold_rate", "positional_cold_rate", "cold_experts_touched"} <= set(held_out["per_layer"][0])
    assert held_out["map_hash"] == load_map(m).content_hash
    human = run("map", "eval", str(m), counts3[1]).stdout
    assert "cold-selection rate" in human and "positional, same budget" in human


def test_eval_mismatch_and_bad_files(tmp_path: Path, counts3: list[str]) -> None:
    m = write_map(tmp_path / "m.json", num_layers=6, num_experts=64, hot_rows=16, top_k=4)
    assert_user_error(run("map", "eval", str(m), counts3[0]), str(m), counts3[0], "different models")
    assert_user_error(run("map", "eval", counts3[0], counts3[0]), counts3[0], "expected 'pinsidecar.map'")
    doc = json.loads(m.read_text())
    doc["meta"] = "hand-edited"
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    assert_user_error(run("map", "eval", str(tmp_path / "edited.json"), counts3[0]), "edited.json", "malformed")
    doc = json.loads(m.read_text())
    doc["layers"][0]["hot"][0] = doc["layers"][0]["hot"][1]
    (tmp_path / "dup.json").write_text(json.dumps(doc))
    assert_user_error(run("map", "eval", str(tmp_path / "dup.json"), counts3[0]), "dup.json", "more than once")


# ---------------------------------------------------------------------------------------------------- show


def test_show_and_png(tmp_path: Path, counts3: list[str]) -> None:
    m = tmp_path / "m.json"
    run_json("map", "build", counts3[0], "--hot-rows", "16", "--label", "code", "--out", str(m))
    s = run_json("map", "show", str(m))
    assert s["label"] == "code" and s["geometry"]["hot_rows"] == 16 and s["hot_bytes"] == 16 * 6 * 1000
    png = tmp_path / "pics" / "m.png"
    s2 = run_json("map", "show", str(m), "--counts", counts3[1], "--png", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG" and s2["png"] == str(png)
    assert 0 < s2["evaluation"]["cold_rate"] < 1
    human = run("map", "show", str(m)).stdout
    assert "geometry: 6 layers x 32 experts" in human and "predicted cold rate" in human
    assert_user_error(run("map", "show", str(m), "--png", str(tmp_path)), "is a directory")
    bad = tmp_path / "bad.json"
    bad.write_text(m.read_text()[:100])
    png2 = tmp_path / "bad.png"
    assert_user_error(run("map", "show", str(bad), "--png", str(png2)), str(bad))
    assert not png2.exists()


def test_show_names_the_model_once(tmp_path: Path) -> None:
    # a model served without a name is named by its path: name and path are the same string
    served = ModelInfo(path="/srv/models/demo", name="/srv/models/demo")
    counts = write_counts(tmp_path / "c.json", **GEOM, model=served)
    m = tmp_path / "m.json"
    run_json("map", "build", str(counts), "--hot-rows", "16", "--out", str(m))
    assert "model: /srv/models/demo\n" in run("map", "show", str(m)).stdout
    named = write_counts(tmp_path / "n.json", **GEOM, model=ModelInfo(path="/srv/m", name="demo", revision="r1"))
    run_json("map", "build", str(named), "--hot-rows", "16", "--out", str(m))
    assert "model: demo /srv/m r1\n" in run("map", "show", str(m)).stdout


def test_a_file_of_another_kind_is_named_for_what_it_is(tmp_path: Path, counts3: list[str]) -> None:
    assert_user_error(run("map", "show", counts3[0]), f"error: {counts3[0]}: a pinsidecar counts file: format is "
                      "'pinsidecar.counts', expected 'pinsidecar.map' (pass a map file, as `pinsidecar map build` "
                      "writes)")
    for name, doc in (("plain.json", {"layers": []}), ("null.json", {"format": None})):
        (tmp_path / name).write_text(json.dumps(doc))
        result = run("map", "show", str(tmp_path / name))
        assert_user_error(result, f"{name}: not a pinsidecar map file: it has", '"format" field (expected '
                          "'pinsidecar.map') (pass a map file")
        assert "None" not in result.stderr
    assert_user_error(run("map", "show", str(tmp_path)), f"error: MAP: file '{tmp_path}' is a directory (pass a "
                      "file, see '", " map show --help')")  # in-process, click names the program "main"


# ---------------------------------------------------------------------------------------------------- diff


def test_diff(tmp_path: Path, counts3: list[str]) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    run_json("map", "build", counts3[0], "--hot-rows", "16", "--out", str(a))
    run_json("map", "build", counts3[2], "--hot-rows", "16", "--out", str(b))
    run_json("map", "build", counts3[2], "--hot-rows", "20", "--out", str(c))
    same = run_json("map", "diff", str(a), str(b))
    assert same["compile_cache_hit"] and not same["identical"] and same["hot_to_cold"] == same["cold_to_hot"] > 0
    other = run_json("map", "diff", str(a), str(c))
    assert not other["compile_cache_hit"]
    human = run("map", "diff", str(a), str(c)).stdout
    assert "NOT a compile-cache hit" in human and "compile-cache hit: NO" in human
    assert "identical placement" in run("map", "diff", str(a), str(a)).stdout


# ---------------------------------------------------------------------------------------------------- counts


def test_counts_show(counts3: list[str]) -> None:
    r = run_json("counts", "show", counts3[0])
    assert (r["num_layers"], r["num_experts"], r["top_k"], r["tokens"], r["selections"]) == (6, 32, 4, 400, 9600)
    assert r["consistent"] and len(r["per_layer"]) == 6 and 0.25 < r["skew"]["mean"] < 1
    human = run("counts", "show", counts3[0]).stdout
    assert "num_layers 6" in human and "selections 9600" in human and "top-25% share" in human


def test_counts_show_bad(tmp_path: Path) -> None:
    bad = _bad_counts(tmp_path, "version")
    assert_user_error(run("counts", "show", str(bad)), str(bad), "version 7")


def test_counts_merge(tmp_path: Path, counts3: list[str]) -> None:
    out = tmp_path / "merged.json"
    r = run_json("counts", "merge", *counts3, "--out", str(out))
    merged = load_counts(out)
    assert merged.tokens == 1200 and r["selections"] == merged.selections == 3 * 9600
    assert merged.meta["expert_bytes"] == 1000
    assert merged.meta["merged_from"] == [load_counts(c).digest() for c in counts3]
    other = write_counts(tmp_path / "o.json", num_layers=5, num_experts=32, top_k=4, tokens=10)
    out2 = tmp_path / "m2.json"
    assert_user_error(run("counts", "merge", counts3[0], str(other), "--out", str(out2)), str(other))
    assert not out2.exists()
    assert_user_error(run("counts", "merge", counts3[0], "--out", str(out2)), "at least two")


def test_console_script_runs_map_build(tmp_path: Path, counts3: list[str]) -> None:
    """The installed entry point (a real process) finds the map group and exits 2 on bad input."""
    exe = Path(sys.executable).with_name("pinsidecar")
    ok = subprocess.run([str(exe), "map", "build", counts3[0], "--hot-rows", "8", "--out", str(tmp_path / "m.json"),
                         "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["hot_rows"] == 8
    bad = subprocess.run([str(exe), "map", "build", counts3[0], "--hot-rows", "0", "--out",
                          str(tmp_path / "z.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and not (tmp_path / "z.json").exists()


def test_build_warns_about_inconsistent_counts(tmp_path: Path) -> None:
    from pinsidecar.testing.artifacts import make_counts

    c = make_counts(**GEOM)
    c.tokens += 5  # as if a flush landed between two layers of one forward
    c.save(tmp_path / "c.json")
    r = run_json("map", "build", str(tmp_path / "c.json"), "--hot-rows", "8", "--out", str(tmp_path / "m.json"))
    assert r["inconsistent_counts"] == [str(tmp_path / "c.json")]
    human = run("map", "build", str(tmp_path / "c.json"), "--hot-rows", "8", "--out", str(tmp_path / "m2.json"))
    assert "warning:" in human.stdout and "counts show" in human.stdout


def test_png_without_the_plot_extra_names_it(tmp_path: Path, counts3: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    m = tmp_path / "m.json"
    run_json("map", "build", counts3[0], "--hot-rows", "16", "--out", str(m))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra looks like
    png = tmp_path / "m.png"
    assert_user_error(run("map", "show", str(m), "--png", str(png)), "matplotlib", "pip install 'pinsidecar[plot]'")
    assert not png.exists()
    assert run_json("map", "show", str(m))["hash"] == load_map(m).content_hash  # everything else still works


def test_the_daemon_and_the_cli_do_not_import_matplotlib() -> None:
    code = ("import sys; import pinsidecar.cli, pinsidecar.daemon.service, pinsidecar.placement, "
            "pinsidecar.placement.heatmap; print('matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
