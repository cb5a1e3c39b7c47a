"""The one table reader (:mod:`pinsidecar.schema`, pydantic underneath) on tables of its own: unions accept any member
type and refuse naming every allowed type; every refusal names the key, says what is expected and how to fix it,
and comes with all the others of the table in one pass; keys live at their place (the section,
``[section.advanced]``, a named sub-table), work at their old place with a deprecation naming the new one, and are
an error at both; overrides land at the place; the JSON schema says the same, and the committed one is current."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog

from pinsidecar.schema import (
    ADVANCED,
    CHOICES,
    EXISTS,
    MIN,
    POSITIVE,
    TABLE,
    TOML_KEY,
    ConfigError,
    Deprecation,
    Problems,
    apply_override,
    build_section,
    document_schema,
    drop_field,
    has_field,
    port_field,
    replace_section,
    set_field,
    usable,
    written_key,
)


@dataclass(frozen=True)
class Unions:
    count_or_name: int | str = 0
    ratio_or_flag: float | bool = 1.0
    where: Path | None = None
    where_or_port: Path | int = 1
    names_or_one: list[str] | str = field(default_factory=list)
    positive_or_auto: int | str = field(default=1, metadata={POSITIVE: True})


def _unions(**raw: object) -> Unions:
    return build_section("t", Unions, raw, Path("/base"))


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("count_or_name", 5, 5),
    ("count_or_name", "five", "five"),
    ("ratio_or_flag", 0.5, 0.5),
    ("ratio_or_flag", 2, 2.0),  # an integer is a number
    ("ratio_or_flag", True, True),  # ... but a boolean is not
    ("where", "rel", Path("/base/rel")),
    ("where", "", None),  # "" is "not set" for an optional path
    ("where_or_port", "/abs", Path("/abs")),
    ("where_or_port", 9000, 9000),
    ("names_or_one", ["a", "b"], ["a", "b"]),
    ("names_or_one", "a", "a"),
    ("positive_or_auto", "auto", "auto"),  # the number rule does not apply to the string member
])
def test_a_union_accepts_a_value_of_any_member_type(key: str, value: object, expected: object) -> None:
    got = getattr(_unions(**{key: value}), key)
    assert got == expected and type(got) is type(expected)


def test_a_union_keeps_the_declared_order() -> None:
    @dataclass(frozen=True)
    class Order:
        a: int | float = 0
        b: float | int = 0

    cfg = build_section("o", Order, {"a": 3, "b": 3}, Path("."))
    assert type(cfg.a) is int and type(cfg.b) is float  # the first member that takes the value wins


@pytest.mark.parametrize(("key", "value", "message"), [
    ("count_or_name", True, "t.count_or_name: expected an integer or a string, got True (write it like "
                            "count_or_name = 0)"),
    ("count_or_name", 1.5, "t.count_or_name: expected an integer or a string, got 1.5 (write it like "
                           "count_or_name = 0)"),
    ("count_or_name", {"x": 1}, "t.count_or_name: expected an integer or a string, got a table (write it like "
                                "count_or_name = 0)"),
    ("ratio_or_flag", "half", "t.ratio_or_flag: expected a number or true or false, got 'half' (write it like "
                              "ratio_or_flag = 1.0)"),
    ("where_or_port", 1.5, "t.where_or_port: expected a path or an integer, got 1.5 (write it like "
                           "where_or_port = 1)"),
    ("names_or_one", 3, 't.names_or_one: expected a list of strings or a string, got 3 (write it like '
                        'names_or_one = ["..."])'),
    ("where", 3, 't.where: expected a path (a non-empty string without NUL), got 3 (write it like '
                 'where = "/path/to/it")'),  # one member: its message
])
def test_a_union_refuses_naming_every_allowed_type(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _unions(**{key: value})
    assert str(err.value) == message


@pytest.mark.parametrize(("key", "value", "message"), [
    # the value has the shape of one member, which refuses it: that member's message says more than the type list
    ("ratio_or_flag", float("nan"), "t.ratio_or_flag: expected a finite number, got nan"),
    ("where_or_port", "a\x00b", "t.where_or_port: expected a path (a non-empty string without NUL)"),
    ("names_or_one", ["a", 1], "t.names_or_one: expected a list of strings, got ['a', 1]"),
    ("positive_or_auto", 0, "t.positive_or_auto: must be > 0, got 0"),
])
def test_a_union_gives_the_refusing_members_own_message(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _unions(**{key: value})
    assert str(err.value).startswith(message)


def test_optional_path_message_says_empty_is_unset() -> None:
    @dataclass(frozen=True)
    class Two:
        p: Path | int | None = None

    with pytest.raises(ConfigError, match=r'^x\.p: expected a path or an integer \(or "" for not set\), got 1\.5 '
                                          r'\(write it like p = "/path/to/it"\)$'):
        build_section("x", Two, {"p": 1.5}, Path("."))
    assert build_section("x", Two, {"p": ""}, Path(".")).p is None


# ------------------------------------------------------------------------------------------- where keys live


@dataclass(frozen=True)
class Watch:
    enabled: bool = True
    trip: float = field(default=0.1, metadata={MIN: 0})
    window: int = field(default=100, metadata={POSITIVE: True, **ADVANCED})
    wait_s: float = field(default=5.0, metadata={POSITIVE: True, **ADVANCED})
    depth: int = field(default=2, metadata={TABLE: "cli", TOML_KEY: "max-depth"})


def _watch(raw: dict[str, object]) -> tuple[Watch, list[Deprecation]]:
    found: list[Deprecation] = []
    return build_section("w", Watch, raw, Path("."), deprecations=found), found


def test_keys_load_from_their_place_without_a_word() -> None:
    cfg, found = _watch({"trip": 0.2, "advanced": {"window": 7, "wait_s": 1}, "cli": {"max-depth": 4}})
    assert (cfg.trip, cfg.window, cfg.wait_s, cfg.depth) == (0.2, 7, 1.0, 4) and found == []


def test_a_key_at_its_old_place_works_and_names_its_new_place() -> None:
    cfg, found = _watch({"window": 7, "depth": 4})
    assert (cfg.window, cfg.depth) == (7, 4)
    assert [d.message for d in found] == ["w.window is deprecated here: move it to [w.advanced]",
                                          "w.depth is deprecated here: move it to [w.cli] as max-depth"]
    assert [(d.key, d.new_key) for d in found] == [("w.window", "w.advanced.window"), ("w.depth", "w.cli.max-depth")]


def test_without_a_list_the_deprecation_is_logged() -> None:
    with structlog.testing.capture_logs() as logs:
        build_section("w", Watch, {"window": 7}, Path("."))
    assert [(e["log_level"], e["event"], e["move_to"]) for e in logs] == [
        ("warning", "config_key_deprecated", "w.advanced.window")]
    assert logs[0]["detail"] == "w.window is deprecated here: move it to [w.advanced]"


def test_a_key_at_both_places_is_an_error_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"^w\.window and w\.advanced\.window: the same key set in two places "
                                          r"\(keep w\.advanced\.window and remove w\.window\)$"):
        _watch({"advanced": {"window": 7}, "window": 8})
    with pytest.raises(ConfigError, match=r"^w\.depth and w\.cli\.max-depth: "):
        _watch({"depth": 1, "cli": {"max-depth": 2}})


@pytest.mark.parametrize(("raw", "message"), [
    ({"advanced": {"trip": 1}}, "w.advanced.trip: not a key of [w.advanced] (move it to [w])"),
    ({"advanced": {"depth": 1}}, "w.advanced.depth: not a key of [w.advanced] (move it to [w.cli] as max-depth)"),
    ({"advanced": {"windw": 1}}, "w.advanced.windw: unknown key (did you mean window? allowed in [w.advanced]: "
                                 "wait_s, window)"),
    ({"advanced": {"zzz": 1}}, "w.advanced.zzz: unknown key (allowed in [w.advanced]: wait_s, window)"),
    ({"advanced": 3}, "w.advanced: expected a table ([w.advanced]), got 3 (write it as a [w.advanced] table)"),
    ({"max-depth": 3}, "w.max-depth: unknown key here (move it to [w.cli])"),
    ({"enabld": 3}, "w.enabld: unknown key (did you mean enabled? allowed in [w]: enabled, trip; in [w.advanced]: "
                    "wait_s, window; in [w.cli]: max-depth)"),
    ({"advanced": {"window": 0}}, "w.advanced.window: must be > 0, got 0 (a number above 0, e.g. window = 100)"),
    ({"window": 0}, "w.window: must be > 0, got 0 (a number above 0, e.g. window = 100)"),  # where it was read
])
def test_misplaced_unknown_and_bad_keys_name_where_they_were_written(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _watch(raw)
    assert str(err.value) == message


def test_written_key_names_a_key_where_the_file_has_it_or_in_the_files_layout() -> None:
    new, _ = _watch({"advanced": {"window": 7}})
    old, _ = _watch({"window": 7})
    assert written_key(new, "window", "w") == "w.advanced.window" and written_key(old, "window", "w") == "w.window"
    # a key the file does not set: at its place in the layout the file uses
    assert written_key(new, "wait_s", "w") == "w.advanced.wait_s" and written_key(old, "wait_s", "w") == "w.wait_s"
    assert written_key(Watch(), "depth", "w") == "w.cli.max-depth"  # built in code: the new layout
    assert written_key(replace_section(old, trip=0.3), "window", "w") == "w.window"  # survives a replace


def test_set_has_and_drop_find_a_key_at_either_place() -> None:
    table: dict[str, object] = {"window": 1, "cli": {"max_depth": 3}}
    assert has_field(table, Watch, "window") and has_field(table, Watch, "depth")  # either spelling of a flag
    assert not has_field(table, Watch, "wait_s")
    set_field(table, Watch, "window", 9)
    set_field(table, Watch, "depth", 4)
    assert table == {"cli": {"max-depth": 4}, "advanced": {"window": 9}}
    drop_field(table, Watch, "window")
    assert table == {"cli": {"max-depth": 4}, "advanced": {}}


def test_an_override_replaces_the_files_value_wherever_it_is() -> None:
    doc: dict[str, object] = {"w": {"window": 1}}
    apply_override(doc, "w.window", 5, {"w": Watch})
    apply_override(doc, "w.advanced.wait_s", 2.5)  # a dotted place is taken as written
    cfg, found = _watch(doc["w"])  # type: ignore[arg-type]
    assert (cfg.window, cfg.wait_s, found) == (5, 2.5, [])
    plain: dict[str, object] = {}
    apply_override(plain, "w.window", 5)  # without the schema: set where it says
    assert plain == {"w": {"window": 5}}
    with pytest.raises(ConfigError, match="an override needs a dotted key"):
        apply_override(plain, "window", 5)
    with pytest.raises(ConfigError, match=r"^w\.advanced: expected a table"):
        apply_override({"w": {"advanced": 1}}, "w.advanced.window", 5)


# ------------------------------------------------------------------------------------ every problem in one pass


@dataclass(frozen=True)
class Engine:
    port: int = port_field(8000)
    mode: str = field(default="off", metadata={CHOICES: ("off", "count", "pin")})
    ratio: float = field(default=0.5, metadata={MIN: 0})
    eager: bool = False
    model: Path | None = field(default=None, metadata={EXISTS: "any"})
    names: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    window: int = field(default=100, metadata={POSITIVE: True, **ADVANCED})


def test_every_problem_of_a_table_comes_in_one_pass_in_the_files_order_each_with_a_fix() -> None:
    raw = {"port": "8000", "mode": "pn", "colour": 1, "eager": 1, "ratio": float("nan"), "model": "/nowhere",
           "advanced": {"window": 0, "windw": 3}, "names": ["a", 1], "env": {"A": True}, "cli": 2}
    with pytest.raises(ConfigError) as err:
        build_section("e", Engine, raw, Path("/base"))
    assert err.value.problems == (
        "e.port: expected an integer 1-65535, got '8000' (write it without quotes: port = 8000)",
        'e.mode: expected one of off, count, pin, got \'pn\' (did you mean mode = "pin"?)',
        "e.colour: unknown key (allowed in [e]: eager, env, mode, model, names, port, ratio; in [e.advanced]: "
        "window)",
        "e.eager: expected true or false, got 1 (write it like eager = false)",
        "e.ratio: expected a finite number, got nan (nan and inf are not numbers here, e.g. ratio = 0.5)",
        "e.model: /nowhere does not exist (fix the path or create it)",
        "e.advanced.window: must be > 0, got 0 (a number above 0, e.g. window = 100)",
        "e.advanced.windw: unknown key (did you mean window? allowed in [e.advanced]: window)",
        "e.names: expected a list of strings, got ['a', 1] (write it like names = [\"...\"])",
        'e.env: expected a table of string values, got a table (write it like env = { "NAME" = "value" })',
        "e.cli: unknown key (allowed in [e]: eager, env, mode, model, names, port, ratio; in [e.advanced]: window)")
    assert str(err.value) == "\n".join(err.value.problems)


def test_a_collecting_reader_leaves_a_refused_value_at_its_default_and_says_so() -> None:
    problems = Problems()
    cfg = build_section("e", Engine, {"port": "x", "ratio": 2, "eager": "true", "advanced": {"window": 7}},
                        Path("/b"), problems=problems)
    assert problems.messages == ["e.port: expected an integer 1-65535, got 'x' (a TCP port, e.g. port = 8000)",
                                 "e.eager: expected true or false, got 'true' (write it without quotes: eager = true)"]
    assert (cfg.port, cfg.eager, cfg.ratio, cfg.window) == (8000, False, 2.0, 7)  # refused: the default
    assert not usable(cfg, "port") and not usable(cfg, "ratio", "eager") and usable(cfg, "ratio", "window")
    assert written_key(cfg, "port", "e") == "e.port"  # still named where the file wrote it
    with pytest.raises(ConfigError) as err:
        problems.raise_any()
    assert err.value.problems == tuple(problems.messages)
    assert str(err.value.within("/etc/x.toml")).splitlines()[0].startswith("/etc/x.toml: e.port: ")


@pytest.mark.parametrize(("raw", "message"), [
    ({"port": 8000.0}, "e.port: expected an integer 1-65535, got 8000.0 (a TCP port, e.g. port = 8000)"),
    ({"port": True}, "e.port: expected an integer 1-65535, got True (a TCP port, e.g. port = 8000)"),
    ({"ratio": "0.5"}, "e.ratio: expected a number, got '0.5' (write it without quotes: ratio = 0.5)"),
    ({"ratio": -1}, "e.ratio: must be >= 0, got -1 (0 or more, e.g. ratio = 0.5)"),
    ({"ratio": 10 ** 400}, "e.ratio: expected a finite number, got 1" + "0" * 400),
    ({"model": ""}, None),  # "" is "not set" for an optional path
    ({"model": "a\x00b"}, "e.model: expected a path (a non-empty string without NUL), got 'a\\x00b'"),
    ({"mode": 1}, "e.mode: expected one of off, count, pin, got 1 (write one of them, e.g. mode = \"off\")"),
])
def test_toml_types_are_strict(raw: dict[str, object], message: str | None) -> None:
    if message is None:
        assert build_section("e", Engine, raw, Path("/b")).model is None
        return
    with pytest.raises(ConfigError) as err:
        build_section("e", Engine, raw, Path("/b"))
    assert str(err.value).startswith(message), err.value


# --------------------------------------------------------------------------------------------- the JSON schema


def test_the_json_schema_says_what_the_reader_takes() -> None:
    schema = document_schema({"w": Watch}, "t", "d")
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    w = schema["$defs"]["Watch"]
    assert w["additionalProperties"] is False and schema["additionalProperties"] is False
    assert w["properties"]["enabled"] == {"default": True, "title": "enabled", "type": "boolean"}
    assert w["properties"]["trip"]["minimum"] == 0 and w["properties"]["trip"]["type"] == "number"
    old = w["properties"]["window"]  # the old place: taken, and marked for an editor to strike through
    assert old["deprecated"] is True and old["description"] == "Deprecated here: move it to [w.advanced]."
    advanced = schema["$defs"]["Watch_advanced"]["properties"]
    assert advanced["window"]["exclusiveMinimum"] == 0 and advanced["window"]["default"] == 100
    assert "max-depth" in schema["$defs"]["Watch_cli"]["properties"]
    engine = document_schema({"e": Engine}, "t", "d")["$defs"]["Engine"]["properties"]
    assert (engine["port"]["minimum"], engine["port"]["maximum"]) == (1, 65535)
    assert engine["mode"]["enum"] == ["off", "count", "pin"]


def test_the_committed_json_schema_is_current_and_checks_what_the_reader_checks() -> None:
    """`pinsidecar check-config --schema > pinsidecar/examples/pinsidecar.schema.json` writes it; the examples
    point editors at it (taplo's `#:schema` line)."""
    import jsonschema

    from pinsidecar.daemon.config import SCHEMA_PATH, json_schema
    from pinsidecar.testing.cli import run

    assert json.loads(SCHEMA_PATH.read_text()) == json.loads(json.dumps(json_schema())), (
        "the schema is out of date: pinsidecar check-config --schema > pinsidecar/examples/pinsidecar.schema.json")
    printed = run("check-config", "--schema")
    assert printed.exit_code == 0 and printed.stdout == SCHEMA_PATH.read_text()
    assert run("check-config", "--schema", "--json").stdout == printed.stdout
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for example in sorted(SCHEMA_PATH.parent.glob("*.toml")):
        text = example.read_text()
        assert text.startswith("#:schema ./pinsidecar.schema.json\n"), example
        assert list(validator.iter_errors(tomllib.loads(text))) == [], example
    old_layout = {"drift": {"window_tokens": 512}, "engine": {"max_model_len": 512, "vllm": {"max-num-seqs": 4}}}
    assert list(validator.iter_errors(old_layout)) == []  # deprecated, not wrong
    for bad in ({"engine": {"prot": 8000}}, {"engine": {"port": "8000"}}, {"gate": {"port": 70000}},
                {"drift": {"advanced": {"window_tokens": 0}}}, {"engine": {"launcher": "k8s"}}, {"bogus": {}}):
        assert list(validator.iter_errors(bad)), bad
