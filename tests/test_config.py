"""Config validation: the shipped examples load, every kind of bad input is refused naming its key, and the
``[engine]`` table read alone (:func:`~pinsidecar.engine.load_engine_config`, what the count boot uses) is the
daemon's table with the daemon's messages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pinsidecar.daemon.config import ConfigError, load_config
from pinsidecar.engine import load_engine_config
from pinsidecar.testing.artifacts import write_map

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "pinsidecar" / "examples"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text("x" * 32)
    os.chmod(p, 0o600)
    return p


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pinsidecar.toml"
    p.write_text(text)
    return p


def _minimal(model_dir: Path, token_file: Path, extra: str = "", engine_extra: str = "") -> str:
    port = "" if engine_extra.startswith("port") else "port = 8251\n"
    return (f'[engine]\nmodel = "{model_dir}"\n{port}{engine_extra}\n'
            f'[control]\ntoken_file = "{token_file}"\nport = 8252\n[gate]\nport = 8250\n[metrics]\nport = 8253\n'
            f"{extra}")


def test_cpu_example_loads_with_model_override(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "cpu-demo.toml", {"engine.model": str(model_dir)})
    assert cfg.engine.model == model_dir
    assert cfg.engine.launcher == "process"
    assert cfg.control.create_token
    spec = cfg.engine_spec()
    argv = spec.argv()
    assert "--kv-cache-memory-bytes" in argv and "--enforce-eager" in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert spec.log_path == cfg.daemon.state_dir / "engine.log"
    assert "PINSIDECAR_HOOK_MODE" not in spec.env  # hook off: nothing set


def test_the_examples_are_in_the_current_layout(model_dir: Path, token_file: Path) -> None:
    # operator keys at the top, tuning in [section.advanced], vLLM flags in [engine.vllm]: nothing deprecated
    for example in ("cpu-demo.toml", "gpu-container.toml"):
        cfg = load_config(EXAMPLES / example, check_paths=False, warn=False)
        assert cfg.deprecations == (), [str(d) for d in cfg.deprecations]
    gpu = load_config(EXAMPLES / "gpu-container.toml", check_paths=False, warn=False)
    assert (gpu.engine.ready_timeout_s, gpu.engine.max_model_len, gpu.engine.enable_prefix_caching) == (1800, 32768,
                                                                                                         True)
    assert gpu.supervisor.crash_loop_limit == 4 and gpu.supervisor.stable_after_s == 600
    assert gpu.gate.capture_sample_rate == 0.05 and gpu.gate.max_hold_s == 900


def test_the_cpu_example_serves_the_model_the_demo_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    # `pinsidecar demo` run in the repository root builds its model in <workdir>/model, workdir "demo" by default;
    # the example's relative path is taken from its own folder, so it names that model from wherever it is used
    from pinsidecar.cli.demo import demo_cmd
    from pinsidecar.demo.loop import DemoOptions
    from pinsidecar.demo.stages import DemoRun

    monkeypatch.chdir(REPO)
    workdir = next(p.default for p in demo_cmd.params if p.name == "workdir")
    demo_model = DemoRun(DemoOptions(workdir=workdir), None).model_dir  # type: ignore[arg-type]
    cfg = load_config(EXAMPLES / "cpu-demo.toml", check_paths=False)
    assert cfg.engine.model is not None and cfg.engine.model.resolve() == demo_model == REPO / "demo" / "model"
    assert cfg.daemon.state_dir.resolve() == REPO / "demo" / "daemon" / "state"  # the daemon's files beside it


def test_check_config_passes_on_the_cpu_example_once_the_demo_model_exists(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from pinsidecar.cli import main

    checkout = tmp_path / "checkout"  # the example where it lives in a checkout, and the demo's folder beside it
    (checkout / "pinsidecar" / "examples").mkdir(parents=True)
    example = checkout / "pinsidecar" / "examples" / "cpu-demo.toml"
    example.write_text((EXAMPLES / "cpu-demo.toml").read_text())
    monkeypatch.chdir(tmp_path)  # not the checkout: the paths are the file's, not the working directory's
    before = CliRunner().invoke(main, ["check-config", "--config", str(example)])
    assert before.exit_code == 2
    assert before.stderr == (f"error: {example}: engine.model: {example.parent}/../../demo/model does not exist "
                             "(fix the path or create it)\n")
    (checkout / "demo" / "model").mkdir(parents=True)  # what `pinsidecar demo` builds
    (checkout / "demo" / "model" / "config.json").write_text("{}")
    after = CliRunner().invoke(main, ["check-config", "--config", str(example), "--strict"])
    assert after.exit_code == 0, after.output
    assert after.stdout == f"ok: {example} loads\n"


def test_gpu_example_loads_with_local_paths(model_dir: Path, token_file: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "maps").mkdir(parents=True)
    mp = write_map(state / "maps" / "agent.json", label="agent")
    cfg = load_config(EXAMPLES / "gpu-container.toml", {
        "engine.model": str(model_dir), "engine.map": str(mp), "control.token_file": str(token_file),
        "daemon.state_dir": str(state)})
    assert cfg.engine.launcher == "container"
    assert cfg.container.image.startswith("vllm/")
    spec = cfg.engine_spec()
    assert spec.env["PINSIDECAR_HOOK_MODE"] == "pin"
    assert spec.env["PINSIDECAR_MAP_PATH"] == str(mp)
    assert spec.env["PINSIDECAR_STATS_PATH"] == str(state / "stats.json")
    assert spec.dtype == ""  # follows the engine: a GPU image's vLLM, "auto" (tests/test_engine.py)
    assert spec.env["PINSIDECAR_PIN_BACKEND"] == "auto"


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path, token_file: Path) -> None:
    (tmp_path / "m").mkdir()
    p = _write(tmp_path, f'[engine]\nmodel = "m"\n[control]\ntoken_file = "{token_file}"\n')
    assert load_config(p).engine.model == tmp_path / "m"


@pytest.mark.parametrize(("engine_extra", "pattern"), [
    ('port = "abc"', r"engine\.port: expected an integer 1-65535, got 'abc'"),
    ("port = 70000", r"engine\.port: expected an integer 1-65535, got 70000"),
    ("port = 0", r"engine\.port: expected an integer 1-65535, got 0"),
    ("kv_cache_bytes = -1", r"engine\.kv_cache_bytes: must be >= 0"),
    ('enforce_eager = "yes"', r"engine\.enforce_eager: expected true or false, got 'yes'"),
    ("extra_args = [1, 2]", r"engine\.extra_args: expected a list of strings"),
    ('launcher = "k8s"', r"engine\.launcher: expected one of process, container, got 'k8s'"),
    ("colour = 1", r"engine\.colour: unknown key"),
    ('map = "/nonexistent/map.json"', r"engine\.map: /nonexistent/map\.json does not exist"),
    ('hook_mode = "pin"', r"engine\.map: required when engine\.hook_mode = \"pin\""),
    ("ready_timeout_s = 0", r"engine\.ready_timeout_s: must be > 0"),
    ('pin_backend = "fast"', r"engine\.pin_backend: PINSIDECAR_PIN_BACKEND='fast' is not a pin backend; use auto"),
    ('launcher = "container"', r"container\.image: required"),
])
def test_bad_engine_values_name_the_key(tmp_path: Path, model_dir: Path, token_file: Path, engine_extra: str,
                                        pattern: str) -> None:
    p = _write(tmp_path, _minimal(model_dir, token_file, engine_extra=engine_extra))
    with pytest.raises(ConfigError, match=pattern) as exc:
        load_config(p)
    assert str(p) in str(exc.value)


@pytest.mark.parametrize(("extra", "pattern"), [
    ("[bogus]\nx = 1\n", r"bogus: unknown section"),
    ('[supervisor]\nbackoff_initial_s = "fast"\n', r"supervisor\.backoff_initial_s: expected a number"),
    ("[supervisor]\nbackoff_initial_s = 10\nbackoff_max_s = 1\n", r"supervisor\.backoff_max_s: must be >= "),
    ("[daemon]\nlog_level = \"loud\"\n", r"daemon\.log_level: expected one of"),
    ("[gate]\ncapture_sample_rate = 2.0\n", r"gate\.capture_sample_rate: must be between 0 and 1"),
])
def test_bad_other_sections(tmp_path: Path, model_dir: Path, token_file: Path, extra: str, pattern: str) -> None:
    # _minimal already has [gate]; append keys to it by writing a custom document for that case
    text = _minimal(model_dir, token_file)
    if extra.startswith("[gate]"):
        text = text.replace("[gate]\nport = 8250\n", "[gate]\nport = 8250\n" + extra.split("\n", 1)[1])
        extra = ""
    p = _write(tmp_path, text + extra)
    with pytest.raises(ConfigError, match=pattern):
        load_config(p)


def test_remap_in_place_defaults_and_its_keys_are_validated(tmp_path: Path, model_dir: Path,
                                                            token_file: Path) -> None:
    cfg = load_config(_write(tmp_path, _minimal(model_dir, token_file)))
    assert cfg.remap.in_place is True and cfg.remap.apply_timeout_s == 60.0 and cfg.remap.apply_ordering == "host"
    assert cfg.remap.apply_hold_ms == 0.0  # the hook's own budget
    cfg = load_config(_write(tmp_path, _minimal(model_dir, token_file,
                                                '[remap.advanced]\napply_ordering = "stream"\napply_hold_ms = 8\n')))
    assert cfg.remap.apply_ordering == "stream" and cfg.remap.apply_hold_ms == 8.0
    cfg = load_config(_write(tmp_path, _minimal(model_dir, token_file,
                                                "[remap]\nin_place = false\napply_timeout_s = 5\n")))
    assert cfg.remap.in_place is False and cfg.remap.apply_timeout_s == 5.0
    for extra, pattern in (
            ('[remap]\nin_place = "yes"\n', r"remap\.in_place: expected true or false, got 'yes'"),
            ("[remap]\napply_timeout_s = 0\n", r"remap\.apply_timeout_s: must be > 0, got 0"),
            ("[remap]\napply_timeout_s = -1.5\n", r"remap\.apply_timeout_s: must be > 0"),
            ("[remap]\napply_tmeout_s = 5\n", r"remap\.apply_tmeout_s: unknown key"),
            ("[remap.advanced]\napply_hold_ms = -1\n", r"remap\.advanced\.apply_hold_ms: must be >= 0, got -1"),
            ('[remap.advanced]\napply_ordering = "device"\n',
             r"remap\.advanced\.apply_ordering: expected one of host, stream, got 'device'")):
        with pytest.raises(ConfigError, match=pattern):
            load_config(_write(tmp_path, _minimal(model_dir, token_file, extra)))
    # apply_timeout_s is how long the daemon waits for the hook's answer, not how long serving stands still (the
    # step lock is held only while rows move), so it is not tied to the gate's idle timeout
    cfg = load_config(_write(tmp_path, _minimal(model_dir, token_file,
                                                "[remap]\nin_place = false\napply_timeout_s = 900\n")))
    assert cfg.remap.apply_timeout_s == 900.0


def test_the_examples_deploy_in_place_with_their_timeout(model_dir: Path, token_file: Path, tmp_path: Path) -> None:
    cpu = load_config(EXAMPLES / "cpu-demo.toml", {"engine.model": str(model_dir)})
    assert cpu.remap.in_place is True and cpu.remap.apply_timeout_s == 30.0
    state = tmp_path / "state"
    (state / "maps").mkdir(parents=True)
    mp = write_map(state / "maps" / "agent.json", label="agent")
    gpu = load_config(EXAMPLES / "gpu-container.toml", {
        "engine.model": str(model_dir), "engine.map": str(mp), "control.token_file": str(token_file),
        "daemon.state_dir": str(state)})
    assert gpu.remap.in_place is True and gpu.remap.apply_timeout_s == 120.0


def test_duplicate_ports_are_refused(tmp_path: Path, model_dir: Path, token_file: Path) -> None:
    text = _minimal(model_dir, token_file).replace("[gate]\nport = 8250", "[gate]\nport = 8251")
    with pytest.raises(ConfigError, match=r"gate\.port: port 8251 is also used by engine\.port"):
        load_config(_write(tmp_path, text))


def test_missing_token_file_and_missing_model(tmp_path: Path, model_dir: Path) -> None:
    p = _write(tmp_path, f'[engine]\nmodel = "{model_dir}"\n[control]\ntoken_file = "{tmp_path}/nope"\n')
    with pytest.raises(ConfigError, match=r"control\.token_file: .*nope does not exist"):
        load_config(p)
    p = _write(tmp_path, '[engine]\nport = 8251\n')
    with pytest.raises(ConfigError, match=r"engine\.model: required"):
        load_config(p)


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[engine\nmodel = 1"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml")


def test_override_is_validated_like_the_file(tmp_path: Path, model_dir: Path, token_file: Path) -> None:
    p = _write(tmp_path, _minimal(model_dir, token_file))
    with pytest.raises(ConfigError, match=r"engine\.model: /nowhere does not exist"):
        load_config(p, {"engine.model": "/nowhere"})


def test_cli_run_refuses_bad_config_naming_the_key(tmp_path: Path, model_dir: Path, token_file: Path) -> None:
    from click.testing import CliRunner

    from pinsidecar.cli import main

    p = _write(tmp_path, _minimal(model_dir, token_file, engine_extra='port = "abc"'))
    res = CliRunner().invoke(main, ["run", "--config", str(p)])
    assert res.exit_code == 2
    assert "engine.port: expected an integer 1-65535, got 'abc'" in res.output


def test_clients_skip_file_checks_but_not_the_rest(tmp_path: Path) -> None:
    # `pinsidecar status` on a host without the model folder still finds the control API
    cfg = load_config(EXAMPLES / "cpu-demo.toml", check_paths=False)
    assert cfg.control.port == 8090
    p = _write(tmp_path, '[engine]\nmodel = "/nowhere"\nport = "abc"\n[control]\ntoken_file = "/nope"\n')
    with pytest.raises(ConfigError, match=r"engine\.port: expected an integer 1-65535"):
        load_config(p, check_paths=False)


def test_engine_table_alone_from_both_examples(model_dir: Path, tmp_path: Path) -> None:
    cpu = load_engine_config(EXAMPLES / "cpu-demo.toml", {"model": model_dir})
    assert cpu == load_config(EXAMPLES / "cpu-demo.toml", {"engine.model": str(model_dir)}).engine  # one schema
    assert cpu.served_model_name == "demo" and cpu.enforce_eager and cpu.dtype == ""  # the engine's default
    gpu = load_engine_config(EXAMPLES / "gpu-container.toml", check_paths=False)  # paths of the GPU host
    assert gpu.launcher == "container" and gpu.hook_mode == "pin" and gpu.dtype == "" and gpu.kv_cache_bytes == 0
    assert gpu.extra_args == ["--gpu-memory-utilization", "0.92", "--trust-remote-code"]
    mp = write_map(tmp_path / "agent.json", label="agent")
    gpu = load_engine_config(EXAMPLES / "gpu-container.toml", {"engine.model": str(model_dir), "engine.map": str(mp)})
    assert gpu.model == model_dir and gpu.map == mp
    with pytest.raises(ConfigError, match=r"gpu-container\.toml: engine\.model: /srv/models/.* does not exist"):
        load_engine_config(EXAMPLES / "gpu-container.toml")


def test_engine_table_defaults_lose_to_the_file_and_overrides_win(model_dir: Path, tmp_path: Path) -> None:
    p = _write(tmp_path, f'[engine]\nmodel = "{model_dir}"\nmax_model_len = 512\n')
    cfg = load_engine_config(p, {"port": 9001}, defaults={"max_model_len": 64, "enforce_eager": True})
    assert (cfg.max_model_len, cfg.enforce_eager, cfg.port) == (512, True, 9001)
    with pytest.raises(ConfigError, match=r"engine\.port: expected an integer 1-65535, got 'x'"):
        load_engine_config(p, {"port": "x"})  # an override is checked like the file
    assert load_engine_config(None, {"model": model_dir}).model == model_dir  # no file at all
    with pytest.raises(ConfigError, match=r"^engine\.model: required"):
        load_engine_config(None)


@pytest.mark.parametrize("engine_extra", [
    'port = "abc"', "kv_cache_bytes = -1", 'enforce_eager = "yes"', "extra_args = [1, 2]", 'launcher = "k8s"',
    "colour = 1", 'map = "/nonexistent/map.json"', 'hook_mode = "pin"', 'pin_backend = "fast"',
])
def test_engine_table_alone_gives_the_daemons_messages(tmp_path: Path, model_dir: Path, token_file: Path,
                                                       engine_extra: str) -> None:
    p = _write(tmp_path, _minimal(model_dir, token_file, engine_extra=engine_extra))
    with pytest.raises(ConfigError) as daemon:
        load_config(p)
    with pytest.raises(ConfigError) as alone:
        load_engine_config(p)
    assert str(alone.value) == str(daemon.value)


def test_every_problem_of_a_file_comes_in_one_pass(tmp_path: Path, model_dir: Path) -> None:
    p = _write(tmp_path, f'[engine]\nmodel = "{model_dir}"\nport = "8251"\ncolour = 1\n'
                         "[gate]\nport = 8000\n"  # engine.port's default: no clash reported for a refused port
                         "[supervisor.advanced]\nbackoff_initial_s = 10\nbackoff_max_s = 1\n"
                         "[drift]\ntrip_gain = 2\nclear_gain = 3\n"
                         "[bogus]\nx = 1\n"
                         '[daemon]\nlog_level = "loud"\n')
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert [line.removeprefix(f"{p}: ") for line in err.value.problems] == [
        "engine.port: expected an integer 1-65535, got '8251' (write it without quotes: port = 8251)",
        "engine.colour: unknown key (allowed in [engine]: counts_path, env, extra_args, "
        "hook_mode, host, launcher, log_path, map, model, port, python, served_model_name, workload; in "
        "[engine.advanced]: pin_backend, pin_overlap, ready_timeout_s, stats_path, stop_timeout_s; in [engine.vllm]: "
        "dtype, "
        "enable-prefix-caching, enforce-eager, kv-cache-memory-bytes, max-model-len, shutdown-timeout, and any "
        "other vLLM flag)",
        "bogus: unknown section (allowed: engine, container, supervisor, gate, control, metrics, maps, daemon, "
        "drift, remap)",
        'daemon.log_level: expected one of debug, info, warning, error, got \'loud\' (write one of them, e.g. '
        'log_level = "info")',
        "drift.trip_gain: a fraction of selections between 0 and 1, got 2.0 (write 8 points as 0.08)",
        "drift.clear_gain: a fraction of selections between 0 and 1, got 3.0 (write 8 points as 0.08)",
        "drift.clear_gain: must be <= drift.trip_gain (2.0) for hysteresis, got 3.0 (lower it, or raise "
        "drift.trip_gain)",
        "control.token_file: required (mutating control calls need a bearer token: set token_file to a mode 0600 "
        "file holding one, and create_token = true to have it made)",
        "supervisor.advanced.backoff_max_s: must be >= supervisor.advanced.backoff_initial_s (10.0), got 1.0 (raise "
        "it, or lower supervisor.advanced.backoff_initial_s)"]
    assert all(line.startswith(f"{p}: ") for line in err.value.problems)
