"""Per-thread settings that a ``with`` block turns on and restores (deferred weight gradients, the
cross-rank check, ...)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any


@contextlib.contextmanager
def setting(state: threading.local, name: str, value: Any):
    """``state.<name> = value`` inside the block (this thread only); the previous value after it."""
    prev = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield value
    finally:
        setattr(state, name, prev)
