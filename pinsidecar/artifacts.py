"""The daemon's view of the hook's file formats: a re-export, so there is exactly one definition.

See :mod:`pinsidecar_hook.artifacts` for the formats themselves.
"""

from pinsidecar_hook.artifacts import *  # noqa: F403
from pinsidecar_hook.artifacts import __all__  # noqa: F401
