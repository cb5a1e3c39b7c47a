"""The count boot (``pinsidecar count-boot``) end to end against the real vLLM CPU server, driven by the daemon's own
example config; its engine table (the one ``[engine]`` schema, the count boot's defaults and the command line on
top); and its bad-input paths: nothing is ever written to --out unless the whole count boot succeeded."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from pinsidecar_hook.contract import load_counts, load_map
from pinsidecar_hook.contract.trace import load_trace

from pinsidecar.cli import main
from pinsidecar.counts.count_boot import _mismatch_hint, count_boot_config
from pinsidecar.engine import hooked_spec
from pinsidecar.engine.ports import free_port
from pinsidecar.schema import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "pinsidecar" / "examples"


def run_cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def workload(tmp_path: Path, n: int = 6) -> Path:
    from pinsidecar.demo.model import load_prompts

    lines = [json.dumps({"prompt": p["prompt"], "max_tokens": 5 + i % 3})
             for i, p in enumerate(load_prompts("code")[:n])]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.vllm
def test_profile_counts_exactly_and_writes_only_the_artifact(tmp_path: Path, demo_model_dir: Path) -> None:
    # The daemon's CPU example config as is: its [engine] table describes the engine, --model and --port go over it.
    out_dir = tmp_path / "out"
    out, trace_out = out_dir / "code.counts.json", out_dir / "code.trace.npz"
    wl = workload(tmp_path)
    code, stdout, stderr = run_cli("count-boot", "--config", str(EXAMPLES / "cpu-demo.toml"), "--model",
                                   str(demo_model_dir), "--workload", str(wl), "--out", str(out), "--concurrency", "3",
                                   "--port", str(free_port()), "--label", "code", "--trace", str(trace_out), "--json")
    assert code == 0, stderr
    summary = json.loads(stdout)
    counts = load_counts(out)
    meta = counts.meta
    assert meta["requests"] == 6 and summary["requests"] == 6
    # Every prompt token and every sampled token but the last of each request went through every MoE layer.
    assert counts.tokens == meta["tokens_processed"] == summary["tokens_processed"]
    assert meta["tokens_processed"] == meta["prompt_tokens"] + meta["completion_tokens"] - meta["requests"]
    assert counts.selections == counts.num_layers * counts.tokens * counts.top_k
    assert counts.consistent and summary["exact"] is True
    assert counts.workload == "code" and counts.flush_token == ""
    assert counts.model.path == str(demo_model_dir)
    # no temp or request files left behind
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([out.name, trace_out.name])
    # The routing trace: every routed token in engine order, whose counts are the counts to the last selection.
    trace = load_trace(trace_out)
    assert trace.tokens == counts.tokens and np.array_equal(trace.counts(), counts.counts)
    assert trace.layer_ids == tuple(counts.layer_ids) and trace.num_experts == counts.num_experts
    assert trace.meta["workload"] == "code" and trace.meta["full"] is False
    assert summary["trace"] == {"out": str(trace_out), "tokens": counts.tokens, "layers": counts.num_layers,
                                "full": False, "capacity_tokens": 65536, "matches_counts": True}
    # ... and the simulator replays it: with the counts' hot set and no slots, its misses are the counts' cold
    # selections at that geometry, exactly (the static map's cold rate, in sample)
    hot = counts.num_experts * 3 // 4
    code, stdout, stderr = run_cli("placement", "simulate", str(trace_out), "--counts", str(out), "--hbm-rows",
                                   str(hot), "--json")
    assert code == 0, stderr
    (result,) = json.loads(stdout)["results"]
    cold_rate = 1 - np.sort(counts.counts, axis=1)[:, ::-1][:, :hot].sum() / counts.selections
    assert result["cache_slots"] == 0 and result["miss_rate"] == pytest.approx(cold_rate, abs=1e-9)
    # ... and the operator's next step: a map whose split of the same rows into hot rows and cache slots is chosen
    # on the trace, its predicted cold rate the simulator's miss rate of that split on it
    cached_map = out_dir.parent / "cached.json"
    code, stdout, stderr = run_cli("map", "build", str(out), "--hot-rows", str(hot), "--cache-slots", "auto",
                                   "--trace", str(trace_out), "--out", str(cached_map), "--json")
    assert code == 0, stderr
    emap = load_map(cached_map)
    assert emap.hot_rows + emap.cache_slots == hot and emap.meta["cache_model"] == "trace"
    code, stdout, stderr = run_cli("placement", "simulate", str(trace_out), "--counts", str(out), "--hbm-rows",
                                   str(hot), "--cache-slots", str(emap.cache_slots), "--json")
    (chosen,) = json.loads(stdout)["results"]
    assert emap.predicted_cold_rate == pytest.approx(chosen["miss_rate"], abs=1e-12)
    assert chosen["miss_rate"] <= result["miss_rate"]  # auto may keep no slots, never choose a worse split
    argv = " ".join(meta["engine_argv"])  # the example's engine table reached the engine
    assert "--served-model-name demo" in argv and "--shutdown-timeout 10" in argv and "--enforce-eager" in argv


def test_a_bad_trace_option_is_refused_before_anything_starts(tmp_path: Path) -> None:
    wl, out = workload(tmp_path), tmp_path / "c.json"
    for extra, says in ((["--trace", str(out)], "a file path of its own"),
                        (["--trace", str(tmp_path)], "a file path of its own"),
                        (["--trace", str(tmp_path / "t.npz"), "--trace-tokens", "0"], "--trace-tokens must be")):
        code, _stdout, stderr = run_cli("count-boot", "--model", str(tmp_path), "--workload", str(wl), "--out",
                                        str(out), *extra)
        assert code == 2 and says in stderr, stderr
        assert not out.exists()


def test_port_in_use_fails_before_starting_anything(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "model").mkdir()
    out = tmp_path / "c.json"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        code, _, stderr = run_cli("count-boot", "--model", str(tmp_path / "model"), "--workload",
                                  str(workload(tmp_path, 2)), "--out", str(out), "--port", str(port))
    assert code == 2
    assert f"port {port}" in stderr and "already in use" in stderr
    assert not out.exists()


def test_bad_workload_line_is_named_and_nothing_starts(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "ok"}\n{"prompt": "ok"}\n\n{"prompt": "ok"}\n')
    out = tmp_path / "c.json"
    code, _, stderr = run_cli("count-boot", "--model", str(tmp_path / "model"), "--workload", str(wl), "--out",
                              str(out), "--port", str(free_port()))
    assert code == 2
    assert f"{wl}:3: empty line" in stderr
    assert not out.exists()


def test_the_old_name_profile_says_so_and_runs_count_boot(tmp_path: Path) -> None:
    """Scripts written for ``pinsidecar profile`` keep working: the same options reach ``count-boot``."""
    (tmp_path / "model").mkdir()
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "ok"}\n\n')
    code, _, stderr = run_cli("profile", "--model", str(tmp_path / "model"), "--workload", str(wl), "--out",
                              str(tmp_path / "c.json"), "--port", str(free_port()))
    assert code == 2 and f"{wl}:2: empty line" in stderr
    assert "pinsidecar profile is now `pinsidecar count-boot`" in stderr


@pytest.mark.vllm
def test_engine_boot_failure_shows_its_last_log_lines(tmp_path: Path) -> None:
    model = tmp_path / "bogus-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no_such_architecture", "architectures": ["Nope"]}')
    out = tmp_path / "c.json"
    code, _, stderr = run_cli("count-boot", "--model", str(model), "--workload", str(workload(tmp_path, 2)),
                              "--out", str(out), "--port", str(free_port()))
    assert code == 1
    assert "engine exited with code" in stderr and "last engine log lines:" in stderr
    assert "no_such_architecture" in stderr or "Nope" in stderr  # vLLM's own complaint, from its log
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".c.json")] == []


def test_engine_table_is_the_daemons_schema_with_count_boot_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path}"\nextra_args = ["--seed", "7"]\nenv = {{OMP_NUM_THREADS = "1"}}\n'
                   'kv_cache_bytes = 1024\nhook_mode = "off"\nport = 8123\n[daemon]\nwhatever = 1\n')
    engine = count_boot_config(cfg)
    assert engine.extra_args == ["--seed", "7"] and engine.env == {"OMP_NUM_THREADS": "1"}
    assert engine.kv_cache_bytes == 1024 and engine.port == 8123
    assert engine.enforce_eager is True  # the count boot's default, where the file says nothing
    spec = hooked_spec(engine)
    assert spec.argv()[-2:] == ["--seed", "7"] and "--enforce-eager" in spec.argv()
    assert spec.full_env()["OMP_NUM_THREADS"] == "1"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path}"\nenforce_eager = false\n')
    assert count_boot_config(cfg).enforce_eager is False  # the file wins over the count boot's default
    (tmp_path / "other").mkdir()
    assert count_boot_config(cfg, model=tmp_path / "other", port=9).model == tmp_path / "other"
    assert count_boot_config(cfg, port=9).port == 9
    # The daemon's own messages, naming the file and the key.
    cfg.write_text("[engine]\nkv_cache_byte = 1\n")
    with pytest.raises(ConfigError, match=r"p\.toml: engine\.kv_cache_byte: unknown key \(did you mean "
                                          r"kv-cache-memory-bytes in \[engine\.vllm\]\? allowed in \[engine\]"):
        count_boot_config(cfg, model=tmp_path)
    cfg.write_text("[engine]\nenforce_eager = 'yes'\n")
    with pytest.raises(ConfigError, match=r"engine\.enforce_eager: expected true or false, got 'yes'"):
        count_boot_config(cfg, model=tmp_path)
    cfg.write_text("[engine]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"p\.toml: engine\.model: required .*pass --model"):
        count_boot_config(cfg)


def test_the_serving_engines_map_need_not_exist_for_the_count_boot_that_makes_it(tmp_path: Path) -> None:
    # An operator writes the daemon's config first (pin mode, the map it will serve), then counts: the count boot
    # runs its own hook, so the serving map's path is not checked (docs/gpu-operator.md runs exactly this order).
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[engine]\nmodel = "{tmp_path}"\nhook_mode = "pin"\nmap = "{tmp_path}/maps/code.json"\n'
                   f'log_path = "{tmp_path}/nowhere/engine.log"\n')
    engine = count_boot_config(cfg)
    assert engine.hook_mode == "off" and engine.map is None and engine.log_path is None
    cfg.write_text(f'[engine]\nmodel = "{tmp_path}"\nhook_mode = "pin"\nmap = 3\nnot_a_key = 1\n')
    with pytest.raises(ConfigError, match=r"engine\.not_a_key: unknown key"):  # the rest is still validated
        count_boot_config(cfg)


def test_cli_without_any_model_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("[engine]\nport = 8123\n")
    out = tmp_path / "c.json"
    code, _, stderr = run_cli("count-boot", "--config", str(cfg), "--workload", str(workload(tmp_path, 2)),
                              "--out", str(out))
    assert code == 2
    assert "engine.model: required" in stderr and "--model" in stderr
    assert not out.exists()


def test_container_launcher_config_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[engine]\nlauncher = "container"\nmodel = "{tmp_path}"\n[container]\nimage = "img"\n')
    code, _, stderr = run_cli("count-boot", "--config", str(cfg), "--workload", str(workload(tmp_path, 2)),
                              "--out", str(tmp_path / "c.json"), "--port", str(free_port()))
    assert code == 2 and "engine.launcher = 'container'" in stderr


def test_a_count_off_the_replay_says_what_its_sign_points_at() -> None:
    """Prefix caching can only count fewer tokens than the replay ran; more is other traffic or an extra step."""
    assert "prefix caching" in _mismatch_hint(2490, 2497) and "stop string" not in _mismatch_hint(2490, 2497)
    more = _mismatch_hint(2498, 2497)
    assert "other traffic" in more and "stop string" in more and "prefix caching" not in more
