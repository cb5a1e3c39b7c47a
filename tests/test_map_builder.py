"""One map builder: ``pinsidecar map build`` and a remap's candidate, built from the same counts with the same
geometry, are the same map and carry the same meta.

Both go through :func:`pinsidecar.placement.build_map` (the CLI from its flags, a remap through
:func:`~pinsidecar.remap.candidates.build_candidate` with the active map's geometry). What must differ, and nothing
else: the label and the creation time (map fields, not meta), and the meta's ``source_files`` (the names of the
inputs: the files ``map build`` read, the count boot's workload for a remap). Both files are read back from disk,
as the engine and the drift watch read them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pinsidecar_hook.contract import load_map

from pinsidecar.placement import build_usage_map
from pinsidecar.remap.candidates import build_candidate, save_candidate
from pinsidecar.testing.artifacts import make_counts
from pinsidecar.testing.cli import run_json

XBYTES = 4096
# The one meta field whose value names the inputs rather than describes the map.
DIFFERS = {"source_files"}


def _counted(domain: int, seed: int, tokens: int = 3000):
    """Counts as a count boot writes them: the engine's bytes per expert and format keys in the meta."""
    counts = make_counts(tokens=tokens, domain=domain, seed=seed, workload="prose")
    counts.meta.update(expert_bytes=XBYTES, dtype="bfloat16", expert_tensors=["w13_weight", "w2_weight"])
    return counts


@pytest.mark.parametrize(("slots", "policy"), [(0, "lru"), (4, "lfu")], ids=["no-cache", "lfu-cache"])
def test_map_build_and_a_remap_write_the_same_map_and_meta(tmp_path: Path, slots: int, policy: str) -> None:
    hbm_rows = 48
    # the active map a remap rebuilds: its geometry is what the candidate keeps
    active = build_usage_map([_counted(0, 1)], hbm_rows - slots, label="code", expert_bytes=XBYTES,
                             cache_slots=slots, cache_policy=policy)
    counts = _counted(1, 2)
    counts_path = tmp_path / "prose.counts.json"
    counts.save(counts_path)

    cli_out = tmp_path / "cli.map.json"
    run_json("map", "build", str(counts_path), "--hot-rows", str(hbm_rows), "--expert-bytes", str(XBYTES),
             "--cache-slots", str(slots), "--cache-policy", policy, "--label", "prose-cli", "--out", str(cli_out))
    by_cli = load_map(cli_out)
    candidate = build_candidate([counts], active, label="prose-remap")
    by_remap = load_map(save_candidate(tmp_path / "maps", candidate, counts))

    assert by_remap.content_hash == by_cli.content_hash  # the same placement
    assert by_remap.geometry() == by_cli.geometry() == active.geometry()
    assert by_remap.predicted_cold_rate == by_cli.predicted_cold_rate
    assert by_remap.source_counts == by_cli.source_counts and by_remap.model == by_cli.model
    assert (by_cli.label, by_remap.label) == ("prose-cli", "prose-remap")
    assert set(by_remap.meta) == set(by_cli.meta)
    assert {k: v for k, v in by_remap.meta.items() if k not in DIFFERS} == \
        {k: v for k, v in by_cli.meta.items() if k not in DIFFERS}
    assert by_cli.meta["source_files"] == ["prose.counts.json"] and by_remap.meta["source_files"] == ["prose"]
    # what the meta says, so the comparison is not of two empty records
    assert by_remap.meta["expert_bytes_from"] == {"expert_bytes": XBYTES}
    assert by_remap.meta["expert_tensors"] == ["w13_weight", "w2_weight"]  # the counted engine's format: same
    if slots:
        assert by_remap.meta["cache"] == {"slots": slots, "policy": policy, "hbm_rows": hbm_rows,
                                          "hot_rows": hbm_rows - slots, "chosen": "given"}
        assert by_remap.meta["cache_model"] == "independent"
    else:
        assert "cache" not in by_remap.meta and "cache_model" not in by_remap.meta


def test_a_remap_of_a_quantized_twins_map_drops_the_counted_format(tmp_path: Path) -> None:
    """The rule ``map build`` applies to a figure other than the counted engine's applies to a remap too: a map
    whose bytes per expert are not the counts' is for another checkpoint format, so it does not carry the counted
    engine's ``dtype`` and ``expert_tensors`` (pin mode would refuse it for tensors it was never meant to have)."""
    active = build_usage_map([_counted(0, 1)], 48, label="fp8", expert_bytes=XBYTES // 2)
    candidate = build_candidate([_counted(1, 2)], active, label="prose")
    assert candidate.expert_bytes == XBYTES // 2
    assert "expert_tensors" not in candidate.meta and "dtype" not in candidate.meta
    same_format = build_candidate([_counted(1, 2)], build_usage_map([_counted(0, 1)], 48, expert_bytes=XBYTES))
    assert same_format.meta["expert_tensors"] == ["w13_weight", "w2_weight"]  # the control: same figure, kept
