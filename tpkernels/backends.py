"""Which kernel runs an op: the one dispatch rule of the package.

Every op has one public entry (e.g. :func:`tpkernels.bias_gelu`) that asks :func:`select` for
a backend given the op and the device of its inputs:

============  =====================================================================
``cuda``      hand-written CUDA kernels in ``tpkernels._C`` (needs a CUDA tensor and an
              extension built with CUDA)
``triton``    Triton kernels (a CUDA tensor, or a CPU tensor with ``TRITON_INTERPRET=1``)
``cpp``       vectorised C++ CPU kernels in ``tpkernels._C`` (needs a CPU tensor)
``reference`` pure PyTorch, any device (the fallback and the test oracle)
============  =====================================================================

Default order: CUDA tensors try ``cuda`` then ``triton`` then ``reference``; CPU tensors try
``cpp`` then ``reference`` (the Triton interpreter is for tests, never a default).
``TPKERNELS_BACKEND=<name>`` forces one backend for every op; if it cannot run the call, a
:class:`BackendUnavailableError` says why instead of silently falling back.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from tpkernels._extension import build_info, extension, extension_error

BACKENDS = ("cuda", "triton", "cpp", "reference")
DEFAULT_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpp", "reference")}
ENV_VAR = "TPKERNELS_BACKEND"

# Which backends implement which op. Ops register themselves when their module is imported.
_OP_BACKENDS: dict[str, tuple[str, ...]] = {}


class BackendUnavailableError(RuntimeError):
    """A forced or requested backend cannot run this call; the message says why."""


def register_op(op: str, backends: tuple[str, ...]) -> None:
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"register_op({op!r}): unknown backends {sorted(unknown)}; known: {BACKENDS}")
    _OP_BACKENDS[op] = tuple(backends)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return dict(_OP_BACKENDS)


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def why_not(backend: str, op: str, device: torch.device) -> str | None:
    """None when ``backend`` can run ``op`` on ``device``, else the reason it cannot."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
    if backend not in _OP_BACKENDS.get(op, ()):
        return f"op {op} has no {backend} kernel (it has: {', '.join(_OP_BACKENDS.get(op, ()))})"
    if backend == "reference":
        return None
    if backend == "cpp":
        if device.type != "cpu":
            return f"the C++ kernels run on CPU tensors, got a {device.type} tensor"
        return None if extension() is not None else extension_error()
    if backend == "cuda":
        if device.type != "cuda":
            return f"the CUDA kernels need CUDA tensors, got a {device.type} tensor"
        if extension() is None:
            return extension_error()
        if not build_info().get("with_cuda"):
            return "tpkernels._C was built without CUDA (CPU-only torch, no nvcc, or TPKERNELS_SKIP_CUDA_BUILD=1)"
        return None
    # triton
    err = _triton_import_error()
    if err:
        return err
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreter_on():
        return None
    return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got a {device.type} tensor"


def forced_backend() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value or None


def select(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device``: ``backend`` if given, else $TPKERNELS_BACKEND,
    else the first of the default order that can run. Raises BackendUnavailableError."""
    wanted = backend or forced_backend()
    if wanted is not None:
        reason = why_not(wanted, op, device)
        if reason is not None:
            source = "backend argument" if backend else f"{ENV_VAR}={wanted}"
            raise BackendUnavailableError(f"{source} cannot run {op} on {device}: {reason}")
        return wanted
    reasons = []
    for name in DEFAULT_ORDER.get(device.type, ("reference",)):
        reason = why_not(name, op, device)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise BackendUnavailableError(f"no backend can run {op} on {device}: " + "; ".join(reasons))


def default_backends() -> dict[str, dict[str, str]]:
    """For `tpkernels info`: per op, the backend chosen for a CPU and a CUDA tensor (or why none)."""
    table = {}
    for op in _OP_BACKENDS:
        row = {}
        for dev in ("cpu", "cuda"):
            try:
                row[dev] = select(op, torch.device(dev))
            except BackendUnavailableError as e:
                row[dev] = f"none ({e})"
        table[op] = row
    return table
