"""``python -m pinsidecar.testing.paused_daemon --pause-at STATE [--pause-at STATE ...] CONFIG``: the daemon of
``pinsidecar run``, built with remap tools that stop a remap in the given states.

A test that SIGKILLs the sidecar in the middle of a remap (``tests/test_remap_sigkill.py``) needs the remap to be
in one state when the signal lands, and some states pass in milliseconds. The pipeline stops forever right after
it has entered and recorded a state in :attr:`~pinsidecar.remap.tools.RemapTools.pause_at`; this entry point is
the only way to set that in a daemon process, so the live path (``pinsidecar run``) never reads such a switch
from its environment or anywhere else. Everything else is what ``pinsidecar run`` does: the same config loading,
logging (JSON lines, at ``daemon.log_level``) and :func:`~pinsidecar.daemon.service.run_daemon`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pinsidecar import log as pslog
from pinsidecar.daemon.config import ConfigError, load_config
from pinsidecar.daemon.service import run_daemon
from pinsidecar.remap.record import STATES
from pinsidecar.remap.tools import RemapTools

__all__: list[str] = []  # run as a module (-m), by name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pinsidecar.testing.paused_daemon", description=__doc__)
    parser.add_argument("--pause-at", action="append", default=[], choices=STATES, metavar="STATE",
                        help=f"a remap state to stop in (one of {', '.join(STATES)}); repeatable")
    parser.add_argument("config", type=Path, help="the daemon's config file, as for pinsidecar run --config")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pslog.configure(cfg.daemon.log_level, json_logs=True)
    return run_daemon(cfg, remap_tools=RemapTools(pause_at=frozenset(args.pause_at)))


if __name__ == "__main__":
    sys.exit(main())
