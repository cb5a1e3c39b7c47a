"""The one table validator (:mod:`pinsidecar.schema`) on tables of its own: unions accept any member type and refuse
naming every allowed type; keys live at their place (the section, ``[section.advanced]``, a named sub-table), work
at their old place with a deprecation naming the new one, and are an error at both; overrides land at the place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog

from pinsidecar.schema import (
    ADVANCED,
    MIN,
    POSITIVE,
    TABLE,
    TOML_KEY,
    ConfigError,
    Deprecation,
    apply_override,
    build_section,
    drop_field,
    has_field,
    replace_section,
    set_field,
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
    ("count_or_name", True, "t.count_or_name: expected an integer or a string, got True"),
    ("count_or_name", 1.5, "t.count_or_name: expected an integer or a string, got 1.5"),
    ("count_or_name", {"x": 1}, "t.count_or_name: expected an integer or a string, got a table"),
    ("ratio_or_flag", "half", "t.ratio_or_flag: expected a number or true or false, got 'half'"),
    ("where_or_port", 1.5, "t.where_or_port: expected a path or an integer, got 1.5"),
    ("names_or_one", 3, "t.names_or_one: expected a list of strings or a string, got 3"),
    ("where", 3, "t.where: expected a path (a non-empty string without NUL), got 3"),  # one member: its message
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

    with pytest.raises(ConfigError, match=r'^x\.p: expected a path or an integer \(or "" for not set\), got 1\.5$'):
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
    with pytest.raises(ConfigError, match=r"^w\.window and w\.advanced\.window: the same key set in two places; "
                                          r"keep w\.advanced\.window and remove w\.window$"):
        _watch({"advanced": {"window": 7}, "window": 8})
    with pytest.raises(ConfigError, match=r"^w\.depth and w\.cli\.max-depth: "):
        _watch({"depth": 1, "cli": {"max-depth": 2}})


@pytest.mark.parametrize(("raw", "message"), [
    ({"advanced": {"trip": 1}}, "w.advanced.trip: not a key of [w.advanced]: it belongs in [w]"),
    ({"advanced": {"depth": 1}}, "w.advanced.depth: not a key of [w.advanced]: it belongs in [w.cli] as max-depth"),
    ({"advanced": {"windw": 1}}, "w.advanced.windw: unknown key (allowed in [w.advanced]: wait_s, window)"),
    ({"advanced": 3}, "w.advanced: expected a table ([w.advanced]), got 3"),
    ({"max-depth": 3}, "w.max-depth: unknown key (allowed in [w]: enabled, trip; in [w.advanced]: wait_s, window; "
                       "in [w.cli]: max-depth); it belongs in [w.cli]"),
    ({"advanced": {"window": 0}}, "w.advanced.window: must be > 0, got 0"),  # named at the place it was read
    ({"window": 0}, "w.window: must be > 0, got 0"),
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
