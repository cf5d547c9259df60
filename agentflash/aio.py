"""``anyio.run`` for the command line and ``Runner.run_sync``: Ctrl-C the same on every Python."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(fn, *args)``, where Ctrl-C ends as ``KeyboardInterrupt``. On Python 3.10
    anyio's copy of asyncio's runner cancels the main task on SIGINT, and without 3.11's
    ``Task.uncancel`` it cannot turn that back into the interrupt: a ``CancelledError``
    traceback and exit 1 came out, where the commands say "interrupted" and exit 130."""
    import anyio

    try:
        return anyio.run(fn, *args)
    except asyncio.CancelledError:
        if sys.version_info < (3, 11):  # (nothing else cancels the main task from outside)
            raise KeyboardInterrupt from None
        raise
