"""Backends: what writes an agent's replies (the embedded engine, a scripted replay, ...).

A workflow's ``model.backend`` names a module of this package; each such module has
``from_spec(spec: ModelSpec) -> Backend``. Adding a backend is adding its module.
"""

from __future__ import annotations

import importlib
import importlib.util

from agentflash.backends.base import Backend, BackendKind, ModelSpec
from agentflash.errors import UserError


def is_available(kind: BackendKind) -> bool:
    """Whether this version of agentflash has the backend ``kind``."""
    return importlib.util.find_spec(f"agentflash.backends.{kind.value}") is not None


def create_backend(spec: ModelSpec) -> Backend:
    """The (not yet opened) backend a ``model:`` section describes."""
    if not is_available(spec.backend):
        raise UserError(f"model.backend {spec.backend.value!r} is not available in this version "
                        f"of agentflash")
    module = importlib.import_module(f"agentflash.backends.{spec.backend.value}")
    return module.from_spec(spec)
