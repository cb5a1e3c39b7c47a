"""The README's first command, end to end: `pinsidecar demo` on the real vLLM CPU engine.

Four engine boots (three count boots and one pin boot), so it is marked slow too; it is what keeps the demo
command true at every commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pinsidecar.cli import main
from pinsidecar.testing.engine import free_port


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_loop_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--workdir", str(work), "--port", str(free_port()), "--json"])
    assert result.exit_code == 0, result.output
    # The operator's terminal: --json puts one JSON document on stdout (json.loads refuses anything after it),
    # and hundreds of replayed requests leave no httpx line in either stream.
    summary = json.loads(result.stdout)
    assert "HTTP Request:" not in result.stdout + result.stderr
    assert "==>" not in result.stdout
    assert summary == json.loads((work / "demo-summary.json").read_text())

    in_domain, cross = summary["in_domain"], summary["cross_domain"]
    # Usage-aware placement beats positional offload on held-out traffic of the domain it was built from ...
    assert in_domain["usage"] < in_domain["positional"] / 2
    # ... and is a per-workload artifact: on another domain's traffic it does much worse than in-domain.
    assert cross["usage"] > 2 * in_domain["usage"]
    # Every count boot was exact (layers x tokens x top_k) ...
    assert all(p["exact"] for p in summary["profiles"].values()), summary["profiles"]
    # ... and pin mode routed exactly as the count boot did: the live cold rate equals the offline evaluation.
    pin = summary["pin"]
    assert pin["matches_offline_eval"], pin
    assert pin["selections"] > 0 and pin["tier_bytes"]["host"] > 0 and pin["tier_bytes"]["hbm"] > 0
