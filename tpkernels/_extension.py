"""Loads the compiled extension ``tpkernels._C`` if it is there.

``import tpkernels`` must work without it (a pure-Python install, a failed build, a torch
upgraded under it); callers ask :func:`extension` and get ``None`` plus a reason instead.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str | None]:
    try:
        from tpkernels import _C  # noqa: PLC0415  (import on first use, not at package import)
    except ImportError as e:  # missing .so, or built against another torch (undefined symbols)
        return None, f"tpkernels._C could not be imported ({e}); reinstall with `pip install .`"
    return _C, None


def extension() -> ModuleType | None:
    """The ``tpkernels._C`` module, or None when it is not importable."""
    return _load()[0]


def extension_error() -> str | None:
    """Why :func:`extension` is None (None when it loaded)."""
    return _load()[1]


def build_info() -> dict:
    """What ``_C`` was built with: ``with_cuda``, ``cuda_archs`` ("80;90"), ``cpu_capability``..."""
    ext = extension()
    return dict(ext.build_info()) if ext is not None else {"with_cuda": False, "cuda_archs": "", "error": extension_error()}
