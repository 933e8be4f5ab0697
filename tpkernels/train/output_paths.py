"""Where a run writes (checkpoints, metrics, the trace, an exported model), checked before it starts:
a path that is a file where a folder is wanted, a folder where a file is wanted, or that lies under
a file, fails at the first save with an ``OSError`` from deep inside; here it is named at once."""

from __future__ import annotations

import os
from pathlib import Path


def path_problem(key: str, value: str | os.PathLike | None, kind: str) -> str | None:
    """Why ``value`` (config key ``key``) cannot be written as a ``kind`` ("folder" or "file"), or None."""
    if value is None or value == "":
        return None
    p = Path(value)
    if p.exists():
        if kind == "folder" and not p.is_dir():
            return f"{key} ({str(value)!r}) is a file; it must be a folder (or not exist yet)"
        if kind == "file" and p.is_dir():
            return f"{key} ({str(value)!r}) is a folder; it must be a file (or not exist yet)"
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{key} ({str(value)!r}) lies under {str(parent)!r}, which is a file, not a folder"
            if not os.access(parent, os.W_OK | os.X_OK) and not p.exists():
                return f"{key} ({str(value)!r}): cannot create it, {str(parent)!r} is not writable"
            break
    return None


def check_output_paths(cfg) -> None:
    """Raise ValueError naming every output path of TrainConfig ``cfg`` that cannot be written."""
    errs = [e for e in (path_problem("checkpoint.save_dir", cfg.checkpoint.save_dir, "folder"),
                        path_problem("logging.metrics_file", cfg.logging.metrics_file, "file"),
                        path_problem("logging.tensorboard_dir", cfg.logging.tensorboard_dir, "folder"),
                        path_problem("logging.trace", cfg.logging.trace, "file")) if e]
    if errs:
        raise ValueError("; ".join(errs))


__all__ = ["check_output_paths", "path_problem"]
