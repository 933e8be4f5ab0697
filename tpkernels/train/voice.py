"""Python warnings in a training run said as the package says things: one line, ``warning: <message>``,
without Python's ``file.py:90: UserWarning:`` prefix and source line, once per process, by the
logging rank only (every rank reads the same config and data, so they would all say the same).

    install_warning_voice(rank)      # tpkernels train calls it in each process it runs
"""

from __future__ import annotations

import sys
import warnings


def install_warning_voice(rank: int) -> None:
    """Route ``warnings.warn`` through one-line messages on rank 0 (other ranks stay silent)."""
    seen: set[tuple[type, str]] = set()

    def show(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        if rank != 0:
            return
        text = " ".join(str(message).split()) if "\n" not in str(message).strip() else str(message).strip()
        if (category, text) in seen:
            return
        seen.add((category, text))
        print(f"warning: {text}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


__all__ = ["install_warning_voice"]
