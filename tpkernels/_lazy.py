"""A package's names imported from their modules on first use (PEP 562), so that importing the package
(for its pure-Python parts: the command line, the planner, the prompt reader) does not import torch.

    __getattr__ = lazy_names(__name__, {"Trainer": "trainer", "train": "trainer"})
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` in ``where`` is ``package.<where[name]>.name``,
    imported when first asked for; any other name is an AttributeError, as Python says it."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["lazy_names"]
