"""Python warnings in a training run said as the package says things: one line, ``warning: <message>``,
without Python's ``file.py:90: UserWarning:`` prefix and source line, once per process, by the
logging rank only (every rank reads the same config and data, so they would all say the same).
What ``tpkernels train --nproc`` said before launching (the config's warnings) is not said again by
rank 0: the said messages travel to the ranks in the environment (``TPK_TRAIN_SAID_WARNINGS``, internal:
not a setting).

    install_warning_voice(rank)      # tpkernels train calls it in each process it runs
"""

from __future__ import annotations

import os
import sys
import warnings

SAID_ENV = "TPK_TRAIN_SAID_WARNINGS"
_SEP = "\x1e"  # the ASCII record separator: never in a message


def install_warning_voice(rank: int) -> None:
    """Route ``warnings.warn`` through one-line messages on rank 0 (other ranks stay silent)."""
    seen = set(filter(None, os.environ.get(SAID_ENV, "").split(_SEP)))

    def show(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        if rank != 0:
            return
        text = str(message).strip()
        if text in seen:
            return
        seen.add(text)
        os.environ[SAID_ENV] = _SEP.join(sorted(seen))  # inherited by the ranks a launcher starts next
        print(f"warning: {text}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


__all__ = ["install_warning_voice"]
