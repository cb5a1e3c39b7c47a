"""``pinsidecar drift replay`` and the ``[drift]`` config: the documented JSON, and clear exits on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pinsidecar.cli import main
from pinsidecar.drift import load_drift_config
from pinsidecar.drift.config import DriftConfig
from pinsidecar.schema import ConfigError
from pinsidecar.testing.artifacts import make_counts, write_counts

EXAMPLES = Path(__file__).resolve().parents[1] / "pinsidecar" / "examples"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def recording(tmp_path: Path) -> dict[str, object]:
    """A code map, its source counts, and 8 windows: 3 of code, then 5 of prose."""
    from pinsidecar.placement import build_usage_map, save_map

    src = make_counts(tokens=4000, domain=0, seed=1)
    src.save(tmp_path / "src.json")
    save_map(build_usage_map([src], 48, label="code"), tmp_path / "map.json")
    windows = [write_counts(tmp_path / f"w{i}.json", tokens=1000, domain=0 if i < 3 else 1, seed=10 + i)
               for i in range(8)]
    return {"map": str(tmp_path / "map.json"), "src": str(tmp_path / "src.json"),
            "windows": [str(w) for w in windows], "dir": tmp_path}


def test_replay_json_has_the_documented_keys(recording: dict) -> None:
    r = run("drift", "replay", "--map", recording["map"], *recording["windows"], "--source-counts", recording["src"],
            "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {"windows", "trips", "decisions"} <= set(doc)
    assert len(doc["windows"]) == 8 and [w["index"] for w in doc["windows"]] == list(range(8))
    w = doc["windows"][4]
    assert {"signals", "state", "trip", "why_not", "judged", "window"} <= set(w)
    assert {"cold_rate", "predicted_cold_rate", "divergence_per_layer", "divergence_max", "projected_gain",
            "exploitable_skew", "skew_gap"} <= set(w["signals"])
    assert doc["trips"] and all(doc["windows"][t]["trip"] for t in doc["trips"])
    assert len(doc["decisions"]) == len(doc["trips"])
    d = doc["decisions"][0]
    assert {"deploy", "reason", "candidate_cold_rate", "active_cold_rate"} <= set(d)
    assert d["deploy"] is True and d["held_out_window"] == d["trip"] + 1
    assert doc["reference"] == "source counts" and doc["warnings"] == []


def test_replay_prints_a_table_for_a_person(recording: dict) -> None:
    r = run("drift", "replay", "--map", recording["map"], *recording["windows"])
    assert r.exit_code == 0, r.output
    assert "gain pts" in r.stdout and "TRIP" in r.stdout and "DEPLOY" in r.stdout
    assert "first judged window" in r.stdout


def test_replay_takes_thresholds_from_the_drift_table(recording: dict) -> None:
    cfg = Path(recording["dir"]) / "drift.toml"
    cfg.write_text("[engine]\nmodel = 'ignored here'\n\n[drift]\ntrip_gain = 0.9\nclear_gain = 0.5\n")
    r = run("drift", "replay", "--map", recording["map"], *recording["windows"], "--config", str(cfg), "--json")
    doc = json.loads(r.stdout)
    assert doc["config"]["trip_gain"] == 0.9 and doc["trips"] == []


@pytest.mark.parametrize(("case", "message"), [
    ("missing_window", "w99.json"),
    ("missing_map", "nomap.json"),
    ("geometry", "different models"),
    ("config_unknown_key", "drift.trip_gian: unknown key"),
    ("config_type", "drift.window_tokens: expected an integer"),
    ("config_hysteresis", "drift.clear_gain: must be <= drift.trip_gain"),
    ("config_missing", "config file not found"),
])
def test_bad_input_exits_2_with_a_clear_message(recording: dict, case: str, message: str) -> None:
    tmp = Path(recording["dir"])
    args = ["drift", "replay", "--map", recording["map"], *recording["windows"]]
    if case == "missing_window":
        args.append(str(tmp / "w99.json"))
    elif case == "missing_map":
        args[3] = str(tmp / "nomap.json")
    elif case == "geometry":
        args.append(str(write_counts(tmp / "other.json", num_experts=32, top_k=4, tokens=300)))
    elif case == "config_missing":
        args += ["--config", str(tmp / "nope.toml")]
    else:
        body = {"config_unknown_key": "trip_gian = 0.1", "config_type": "window_tokens = 'many'",
                "config_hysteresis": "trip_gain = 0.05\nclear_gain = 0.06"}[case]
        (tmp / "bad.toml").write_text(f"[drift]\n{body}\n")
        args += ["--config", str(tmp / "bad.toml")]
    r = run(*args)
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_config_defaults_and_validation() -> None:
    assert load_drift_config(None) == DriftConfig()
    assert load_drift_config(EXAMPLES / "cpu-demo.toml") == DriftConfig()  # no [drift] table: the defaults
    cfg = DriftConfig()
    assert cfg.clear_gain < cfg.trip_gain and cfg.margin <= cfg.trip_level and cfg.min_tokens <= cfg.window_tokens


@pytest.mark.parametrize(("body", "message"), [
    ("min_tokens = 0", "drift.min_tokens: must be > 0"),
    ("margin = -0.1", "drift.margin: must be >= 0"),
    ("trip_gain = 8", "write 8 points as 0.08"),
    ("min_tokens = 5000", "drift.min_tokens: must be <= drift.window_tokens"),
    ("enabled = 'yes'", "drift.enabled: expected true or false"),
])
def test_config_errors_name_the_file_and_the_key(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "pinsidecar.toml"
    path.write_text(f"[drift]\n{body}\n")
    with pytest.raises(ConfigError, match=r"pinsidecar\.toml") as exc:
        load_drift_config(path)
    assert message in str(exc.value)
