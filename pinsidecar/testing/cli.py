"""Running the CLI in-process for tests, and what every refusal must look like.

A refusal (:class:`~pinsidecar.errors.UserError`) exits 2 and prints ``error: <what> (<how to fix>)`` on stderr,
never a traceback; a ``--json`` run prints one JSON document on stdout and nothing else there.
"""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner, Result

from pinsidecar.cli import main

__all__: list[str] = []  # used by the tests only, which are not a package


def run(*args: str) -> Result:
    """``pinsidecar ARGS`` in this process; an unexpected exception propagates (it is a bug, not a refusal)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_json(*args: str) -> dict[str, Any]:
    """``pinsidecar ARGS --json``, which must succeed; its stdout as JSON."""
    result = run(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def assert_user_error(result: Result, *fragments: str) -> None:
    """``result`` is a refusal (exit 2, ``error: ...`` on stderr, no traceback) whose message has ``fragments``."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for frag in fragments:
        assert frag in result.stderr, (frag, result.stderr)
