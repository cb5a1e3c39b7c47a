"""pytest fixtures that boot engines: a pytest plugin, loaded once per session by ``conftest.py``::

    pytest_plugins = ["pinsidecar.testing.fixtures"]

Load them this way, never by importing the fixture functions into test modules: pytest registers an imported
fixture once per module that imports it, so a session fixture imported into five modules is built five times
(five demo models, five sets of engines). As a plugin each fixture exists once, and a session fixture is built
once per session.

- ``demo_model_dir`` (session): the demo model (:mod:`pinsidecar.demo.model`), built once;
  ``$PINSIDECAR_TEST_MODEL_DIR`` points the tests at a model folder built beforehand instead. Every test that
  serves "the model" uses this one (a module's own copy would build, or boot, another);
- ``demo_model_factory`` (session): ``demo_model_factory(geometry=None, quant=None, router="zipf", seed=0)`` builds
  a demo model of another kind (a geometry as :meth:`~pinsidecar.demo.model.Geometry.scaled`'s keywords, a
  quantized twin, the calibrated router) once per session per kind, so modules that need the same twin share
  it; with no arguments it is the demo model exactly as the generator writes it (``demo_model_dir`` unless
  ``$PINSIDECAR_TEST_MODEL_DIR`` is set: for the tests of the generator itself). Treat the folders as read-only;
- ``fresh_logging`` (autouse): every test starts with structlog's defaults and without the handler
  :func:`pinsidecar.log.configure` installs, so a CLI test that set the level to ``warning`` cannot hide the
  ``info`` events a later test captures with ``structlog.testing.capture_logs``.
- ``engine_factory`` (module): ``engine_factory(model_dir, mode="count", **kw)`` starts a ready
  :class:`~pinsidecar.testing.engine.HookedEngine` (arguments of :func:`~pinsidecar.testing.engine.start_engine`)
  and stops every engine it started when the module's tests are done, so a module can keep one boot for all its
  tests and no module's engine outlives it (an idle engine holds 2 GiB and its threads while the next module's
  engines boot);
- ``pin_engine`` (session): a :class:`ServedPin`, the demo model served in pin mode on a random map with 40 of 64
  experts hot per layer (the live histogram and the attach-time self-check on), with its greedy outputs at boot.
  One boot for every module that needs a pin engine to read, count on or apply maps to, not a fresh one of its own:
  a boot costs 40-60 s on a 2-core box. A test that applies another map in place puts this one back before it
  ends, so every test finds the engine serving :attr:`ServedPin.map_path`; a test that counts resets first.
  Stopped at the end of the session;
- ``tmpfs``: a 64 KiB tmpfs mounted for the test under its ``tmp_path`` (a disk that really fills: ENOSPC from the
  kernel, not from a mock); skips with the mount's reason where mounting is not permitted (CI runs as root);
- ``podman_lane`` (session): a :class:`~pinsidecar.testing.container.PodmanLane`, podman with its own storage and
  the engine image built (about a second); skips with podman's reason only where podman cannot run a container.

A test that uses ``engine_factory`` or ``pin_engine`` (directly or through another fixture) boots an engine, so
it is marked ``vllm`` here whether or not it says so: ``-m "not vllm"``, the run that boots nothing and runs in
parallel, must never boot one.

Failed tests get the tail of the log of every :class:`~pinsidecar.testing.daemon.DaemonUnderTest` that ran during
them in their report (a section per daemon), so a daemon's failure reads from the report, not from a temp folder.

This is the one module of :mod:`pinsidecar.testing` that imports pytest.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pinsidecar.testing.artifacts import model_geometry, write_map
from pinsidecar.testing.container import PodmanLane, PodmanUnavailable
from pinsidecar.testing.container import podman_lane as build_podman_lane
from pinsidecar.testing.daemon import daemon_logs_for_report
from pinsidecar.testing.engine import MODEL_DIR_ENV, HookedEngine, start_engine

__all__ = ["demo_model_dir", "demo_model_factory", "engine_factory", "fresh_logging", "pin_engine",
           "podman_lane"]

_TEST_STARTED = pytest.StashKey[float]()
# The fixtures below that boot a real engine (see the module docstring: their users are ``vllm`` tests).
ENGINE_FIXTURES = frozenset({"engine_factory", "pin_engine"})


@pytest.fixture(autouse=True)
def fresh_logging() -> Iterator[None]:
    """Global logging state back to defaults around each test (see the module docstring)."""
    import logging

    import structlog

    from pinsidecar.log import reset

    structlog.reset_defaults()
    yield
    reset()
    logging.getLogger().setLevel(logging.WARNING)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that boots an engine through these fixtures ``vllm`` (module docstring)."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and "vllm" not in item.keywords:
            item.add_marker(pytest.mark.vllm)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """When the test began (its setup): the daemons that ran since then are the ones its report shows."""
    item.stash[_TEST_STARTED] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """A failed test's report carries the log tail of each daemon under test that ran during it."""
    report = yield
    if report.failed:
        for title, text in daemon_logs_for_report(item.stash.get(_TEST_STARTED, call.start)):
            report.sections.append((title, text))
    return report


@pytest.fixture(scope="session")
def demo_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Builds demo models by kind, each once per session (see the module docstring)."""
    built: dict[tuple[Any, ...], Path] = {}

    def factory(*, geometry: dict[str, int] | None = None, quant: str | None = None, router: str = "zipf",
                seed: int = 0) -> Path:
        key = (tuple(sorted((geometry or {}).items())), quant, router, seed)
        if key not in built:
            from pinsidecar.demo.model import DEFAULT_GEOMETRY, Geometry, build_demo_model

            geo = Geometry.scaled(**geometry) if geometry else DEFAULT_GEOMETRY
            name = "-".join(str(x) for x in ("demo-model", quant, None if router == "zipf" else router,
                                              seed or None) if x)
            built[key] = Path(build_demo_model(tmp_path_factory.mktemp(name) / "model", seed=seed, geometry=geo,
                                               quant=quant, router=router))
        return built[key]

    return factory


@pytest.fixture(scope="session")
def demo_model_dir(demo_model_factory: Callable[..., Path]) -> Path:
    """The demo model, built once per session (or ``$PINSIDECAR_TEST_MODEL_DIR``, built beforehand)."""
    prebuilt = os.environ.get(MODEL_DIR_ENV, "").strip()
    if prebuilt:
        if not (Path(prebuilt) / "config.json").is_file():
            raise pytest.UsageError(f"{MODEL_DIR_ENV}={prebuilt} has no config.json (build it with `pinsidecar "
                                    "demo-model DIR` or unset the variable)")
        return Path(prebuilt)
    return demo_model_factory()


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., HookedEngine]]:
    """Starts ready engines; every one of them is stopped at the end of the module (or earlier by the test,
    with ``.stop()``)."""
    started: list[HookedEngine] = []

    def factory(model_dir: Path, mode: str = "count", **kwargs: Any) -> HookedEngine:
        kwargs.setdefault("tmp_path", tmp_path_factory.mktemp(f"engine-{mode}"))
        eng = start_engine(model_dir, mode, **kwargs)
        started.append(eng)
        return eng

    yield factory
    for eng in started:
        eng.stop()


@dataclass(frozen=True)
class ServedPin:
    """The session's shared pin engine (``pin_engine``): the engine, the map it serves, and its greedy outputs on
    :data:`~pinsidecar.testing.engine.PARITY_PROMPTS` at boot (placement must never change them)."""

    engine: HookedEngine
    map_path: Path
    label: str
    hot_rows: int
    reference: list[dict[str, list[Any]]]

    @property
    def stats_path(self) -> Path:
        assert self.engine.hook.stats_path is not None
        return Path(self.engine.hook.stats_path)


@pytest.fixture(scope="session")
def pin_engine(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedPin]:
    """The shared pin engine (module docstring); stopped at the end of the session."""
    geo = model_geometry(demo_model_dir)
    n, label = geo["num_experts"], "skew"
    hot_rows = n * 5 // 8
    tmp = tmp_path_factory.mktemp("pin-engine")
    map_path = write_map(tmp / "skew.json", num_layers=geo["num_layers"], num_experts=n, hot_rows=hot_rows, seed=11,
                         top_k=geo["top_k"], label=label)
    engine = start_engine(demo_model_dir, "pin", tmp / "engine", map_path=map_path,
                          hook_env={"PINSIDECAR_STATS_HISTOGRAM": "1", "PINSIDECAR_PIN_SELFCHECK": "1"})
    try:
        yield ServedPin(engine, map_path.absolute(), label, hot_rows, engine.greedy_outputs())
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def podman_lane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanLane]:
    """podman with the engine image, its own storage, removed (with every container in it) after the session.
    Its ``CONTAINERS_*`` variables are set in this process for the session, so a launcher the tests run here
    (which calls the podman CLI with this process's environment) uses the lane's storage too."""
    try:
        lane = build_podman_lane(tmp_path_factory.mktemp("podman"))
    except PodmanUnavailable as exc:
        pytest.skip(f"podman cannot run a container on this machine: {exc}")
    env = pytest.MonkeyPatch()
    for key, value in lane.env.items():
        env.setenv(key, value)
    yield lane
    env.undo()
    lane.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    from pinsidecar.testing.fs import MountNotPermitted, small_tmpfs

    try:
        with small_tmpfs(tmp_path / "fs", "64k") as path:
            yield path
    except MountNotPermitted as exc:
        pytest.skip(str(exc))
