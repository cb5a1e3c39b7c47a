"""pytest fixtures that boot engines: a pytest plugin, loaded once per session by ``conftest.py``::

    pytest_plugins = ["pinsidecar.testing.fixtures"]

Load them this way, never by importing the fixture functions into test modules: pytest registers an imported
fixture once per module that imports it, so a session fixture imported into five modules is built five times
(five demo models, five sets of engines). As a plugin each fixture exists once, and a session fixture is built
once per session.

- ``demo_model_dir`` (session): the demo model (:mod:`pinsidecar.demo.model`), built once;
  ``$PINSIDECAR_TEST_MODEL_DIR`` points the tests at a model folder built beforehand instead.
- ``fresh_logging`` (autouse): every test starts with structlog's defaults and without the handler
  :func:`pinsidecar.log.configure` installs, so a CLI test that set the level to ``warning`` cannot hide the
  ``info`` events a later test captures with ``structlog.testing.capture_logs``.
- ``engine_factory`` (session): ``engine_factory(model_dir, mode="count", **kw)`` starts a ready
  :class:`~pinsidecar.testing.engine.HookedEngine` (arguments of :func:`~pinsidecar.testing.engine.start_engine`)
  and stops every engine it started at the end of the session, so a module can keep one boot for all its tests.
- ``podman_lane`` (session): a :class:`~pinsidecar.testing.container.PodmanLane`, podman with its own storage and
  the engine image built (about a second); skips with podman's reason only where podman cannot run a container.

This is the one module of :mod:`pinsidecar.testing` that imports pytest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pinsidecar.testing.container import PodmanLane, PodmanUnavailable
from pinsidecar.testing.container import podman_lane as build_podman_lane
from pinsidecar.testing.engine import MODEL_DIR_ENV, HookedEngine, start_engine

__all__ = ["demo_model_dir", "engine_factory", "fresh_logging", "podman_lane"]


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


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, built once per session (or ``$PINSIDECAR_TEST_MODEL_DIR``, built beforehand)."""
    prebuilt = os.environ.get(MODEL_DIR_ENV, "").strip()
    if prebuilt:
        if not (Path(prebuilt) / "config.json").is_file():
            raise pytest.UsageError(f"{MODEL_DIR_ENV}={prebuilt} has no config.json (build it with `pinsidecar "
                                    "demo-model DIR` or unset the variable)")
        return Path(prebuilt)
    from pinsidecar.demo.model import build_demo_model

    return Path(build_demo_model(tmp_path_factory.mktemp("demo-model") / "model"))


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., HookedEngine]]:
    """Starts ready engines; every one of them is stopped at the end of the session (or earlier by the test,
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
