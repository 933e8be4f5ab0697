"""Every ``TPKERNELS_*`` environment variable, in one table: what it does, its default, its rule.

Run-time variables are read when a call needs them (never cached at import), through :func:`read`,
which checks the value and names the variable in its error; an explicit argument of the call beats
them (the dispatch rule of :mod:`tpkernels.backends`). ``tpkernels info`` prints this table, and the
README's copy is checked against it by the tests. Build-time variables are read by ``setup.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str
    kind: str = "int"  # "int", "float", "choice", "text", "flag" (0 or 1)
    choices: tuple[str, ...] = ()
    when: str = "run"  # "run" (read at call time) or "build" (setup.py)


TABLE: tuple[EnvVar, ...] = (
    EnvVar("TPKERNELS_BACKEND", "", "force an implementation: a bare name for every op of its kind (reference, "
           "triton, cuda, cpp; collective, ring, fused), op=name entries for one op (tpkernels.backends)", "text"),
    EnvVar("TPKERNELS_CHECK_RANKS", "0", "1: every collective op first checks that all ranks pass the same shapes "
           "and dtypes, and names the rank that differs", "flag"),
    EnvVar("TPKERNELS_FLASH_AUTOTUNE", "1", "0: the Triton attention kernels use their first config, no autotuning",
           "flag"),
    EnvVar("TPKERNELS_FUSED_AG_CHUNKS", "4", "fused all-gather + GEMM: chunks per source shard (finer: the GEMM "
           "starts sooner, each costs a copy launch and a signal)"),
    EnvVar("TPKERNELS_FUSED_AG_COPY", "engine", "who moves the fused all-gather's chunks: the copy engine, or the "
           "csrc/comm peer-copy kernel", "choice", ("engine", "kernel")),
    EnvVar("TPKERNELS_FUSED_REDUCER", "triton", "who reduces the fused reduce-scatter / all-reduce partials",
           "choice", ("triton", "cuda")),
    EnvVar("TPKERNELS_FUSED_REDUCER_PROGRAMS", "16", "SMs left to the fused reducers (the GEMM takes the rest)"),
    EnvVar("TPKERNELS_FUSED_RS", "pull", "fused reduce-scatter: partials kept local and pulled, or pushed by the "
           "GEMM epilogue into the destination's buffer", "choice", ("pull", "push")),
    EnvVar("TPKERNELS_SIGNAL_SPINS", "", "reads a fused kernel's signal wait makes before it gives up with a named "
           "timeout (default: ~30 s of polling on a GPU, 1000 under the interpreter)"),
    EnvVar("TPKERNELS_BARRIER_TIMEOUT_S", "600", "seconds a symmetric-memory barrier waits for its peers", "float"),
    EnvVar("TPKERNELS_CACHE_DIR", "", "folder of the planner's per-machine corrections that autotune fits "
           "(default: $XDG_CACHE_HOME/tpkernels, else ~/.cache/tpkernels)", "text"),
    EnvVar("TPKERNELS_CUDA_ARCHS", "80;90", "SM architectures the CUDA kernels are built for ('90+PTX' also embeds "
           "PTX)", "text", when="build"),
    EnvVar("TPKERNELS_SKIP_CUDA_BUILD", "0", "1: build the C++ CPU kernels only", "flag", when="build"),
)
BY_NAME = {v.name: v for v in TABLE}


def read(name: str):
    """The value of run-time variable ``name`` now (its default when unset or empty), typed and checked:
    a bad value raises ValueError naming the variable, its value and the rule."""
    var = BY_NAME[name]
    text = os.environ.get(name, "").strip()
    if not text:
        text = var.default
    if var.kind == "text":
        return text
    if not text:
        return None
    if var.kind == "flag":
        if text not in ("0", "1"):
            raise ValueError(f"{name} ({text!r}) must be 0 or 1")
        return text == "1"
    if var.kind == "choice":
        if text not in var.choices:
            raise ValueError(f"{name} ({text!r}) must be one of {', '.join(var.choices)}")
        return text
    try:
        value = int(text) if var.kind == "int" else float(text)
    except ValueError:
        raise ValueError(f"{name} ({text!r}) must be a{'n integer' if var.kind == 'int' else ' number'}") from None
    if not value > 0:
        raise ValueError(f"{name} ({text!r}) must be > 0")
    return value


def table_rows() -> list[tuple[str, str, str, str]]:
    """(name, default, when read, meaning) of every variable (``tpkernels info``, the README)."""
    return [(v.name, v.default or "(none)", "build" if v.when == "build" else "each call", v.meaning) for v in TABLE]


def markdown_table() -> str:
    lines = ["| variable | default | read | what it does |", "|---|---|---|---|"]
    lines += [f"| `{n}` | `{d}` | {w} | {m} |" for n, d, w, m in table_rows()]
    return "\n".join(lines)


__all__ = ["BY_NAME", "TABLE", "EnvVar", "markdown_table", "read", "table_rows"]
