"""Which implementation runs an op: the one dispatch rule of the package.

Every op has one public entry (e.g. :func:`tpkernels.bias_gelu`) that asks :func:`select` which
implementation runs the call. The rule is the same for every op, kernels and GEMM-communication
algorithms alike:

1. an explicit argument of the call (``backend=`` of a kernel op, ``algo=`` of a GEMM-comm op;
   ``algo="auto"`` means no choice);
2. else the environment, ``TPKERNELS_BACKEND``: a bare name forces that implementation for every
   op of its kind (``TPKERNELS_BACKEND=reference``: every kernel op; ``=ring``: every GEMM-comm
   op), ``op=name`` entries force one op (``TPKERNELS_BACKEND=bias_gelu=cuda,flash_attn=triton``;
   ``gemm_comm=ring`` names both GEMM-comm ops), and an op's own entry beats a bare name;
3. else the op's default: the first implementation of its default order that can run the call
   (kernels: by device, then dtype; GEMM-comm: by the size of the GEMM).

The same rule sets how an implementation runs: the fused GEMM-comm path's movers, chunks and
timeouts come from the call's ``options`` (:class:`~tpkernels.functional.gemm_comm_fused.FusedOptions`),
else from their ``TPKERNELS_*`` variables, read at that call (:mod:`tpkernels.env_vars` lists them
all), else their defaults; nothing is read once at import.

A chosen implementation (1 or 2) that cannot run the call raises
:class:`BackendUnavailableError` naming the op, where the choice came from and why it cannot run;
nothing falls back silently. :func:`why_not` gives the reason for any implementation.

Kernel implementations:

============  =====================================================================
``cuda``      hand-written CUDA kernels in ``tpkernels._C`` (needs a CUDA tensor and an
              extension built with CUDA)
``triton``    Triton kernels (a CUDA tensor, or a CPU tensor with ``TRITON_INTERPRET=1``)
``cpp``       vectorised C++ CPU kernels in ``tpkernels._C`` (needs a CPU tensor)
``reference`` pure PyTorch, any device (the fallback and the test oracle)
============  =====================================================================

GEMM-communication algorithms: ``collective`` (one collective + one GEMM), ``ring`` (chunks
travel while the previous chunk is multiplied) and ``fused`` (Triton GEMMs that wait on, or raise,
per-chunk signals in torch symmetric memory: CUDA only); see :mod:`tpkernels.functional.gemm_comm`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from tpkernels import env_vars
from tpkernels._extension import build_info, extension, extension_error

KERNELS = ("cuda", "triton", "cpp", "reference")
ALGORITHMS = ("collective", "ring", "fused")
DEFAULT_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpp", "reference")}
ENV_VAR = "TPKERNELS_BACKEND"
RULE = ("explicit argument (backend=/algo=, options=) > TPKERNELS_BACKEND op=name entry > TPKERNELS_BACKEND bare "
        "name (every op of its kind) > the op's default; a chosen implementation that cannot run raises; every "
        "TPKERNELS_* knob is read when a call needs it (tpkernels.env_vars)")


class BackendUnavailableError(RuntimeError):
    """A forced or requested implementation cannot run this call; the message says why."""


@dataclass(frozen=True)
class _Op:
    name: str
    impls: tuple[str, ...]
    family: str | None  # an alias that names several ops in TPKERNELS_BACKEND (e.g. gemm_comm)
    check: Callable | None  # (impl, device, dtype) -> reason or None: the op's own limits
    default: Callable | None  # (device, dtype, **context) -> impl; None: DEFAULT_ORDER by device
    default_doc: dict


_OPS: dict[str, _Op] = {}


def register_op(op: str, impls: tuple[str, ...], *, family: str | None = None, check: Callable | None = None,
                default: Callable | None = None, default_doc: dict | None = None) -> None:
    """Declare op ``op`` and its implementations (ops register themselves when their module is imported)."""
    kinds = {_kind(i) for i in impls}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"register_op({op!r}): implementations {impls} must all be kernels {KERNELS} or all "
                         f"algorithms {ALGORITHMS}")
    _OPS[op] = _Op(op, tuple(impls), family, check, default, dict(default_doc or {}))


def triton_dtype_limits(device: torch.device, dtype: torch.dtype | None, gpu=(torch.float16, torch.bfloat16,
                                                                                   torch.float32)) -> str | None:
    """Why the Triton kernels cannot take ``dtype`` (None when they can): ``gpu`` on CUDA tensors; under
    the interpreter float16 and float32 only (it computes bfloat16 on raw bits)."""
    if dtype is None:
        return None
    if device.type == "cuda":
        return None if dtype in gpu else \
            f"the Triton kernels take {', '.join(str(d).replace('torch.', '') for d in gpu)} CUDA tensors, got {dtype}"
    if dtype in (torch.float16, torch.float32):
        return None
    return f"the Triton interpreter runs float16 and float32 (it computes bfloat16 wrongly), got {dtype}"


def _kind(impl: str) -> str | None:
    return "kernel" if impl in KERNELS else "algorithm" if impl in ALGORITHMS else None


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {name: op.impls for name, op in _OPS.items()}


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel_unavailable(backend: str, device: torch.device) -> str | None:
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
    err = _triton_import_error()
    if err:
        return err
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreter_on()):
        return None
    return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got a {device.type} tensor"


def triton_unavailable(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None when they can)."""
    return _kernel_unavailable("triton", device)


def why_not(backend: str, op: str, device: torch.device, dtype: torch.dtype | None = None, **context) -> str | None:
    """None when implementation ``backend`` can run ``op`` on ``device`` (and ``dtype``, and the op's
    ``context``, e.g. a row length), else why not."""
    spec = _OPS.get(op)
    if spec is None:
        return f"unknown op {op!r}; ops: {', '.join(_OPS)}"
    if backend not in spec.impls:
        known = KERNELS + ALGORITHMS
        if backend not in known:
            return f"unknown implementation {backend!r}; choose one of {', '.join(spec.impls)}"
        return f"op {op} has no {backend} implementation (it has: {', '.join(spec.impls)})"
    if _kind(backend) == "kernel":
        reason = _kernel_unavailable(backend, device)
        if reason:
            return reason
    if spec.check is not None:
        return spec.check(backend, device, dtype, **context)
    return None


def parse_env(value: str | None = None) -> tuple[str | None, dict[str, str]]:
    """``TPKERNELS_BACKEND`` as (bare name or None, {op or family: name})."""
    value = env_vars.read(ENV_VAR) if value is None else value
    bare, per_op = None, {}
    for item in filter(None, (s.strip().lower() for s in value.split(","))):
        if "=" in item:
            key, name = (s.strip() for s in item.split("=", 1))
            per_op[key] = name
        elif bare is None:
            bare = item
        else:
            raise BackendUnavailableError(f"{ENV_VAR} ({value!r}) names two implementations for every op "
                                          f"({bare!r}, {item!r}); give one, or op=name entries")
    return bare, per_op


def forced_backend() -> str | None:
    """The bare name of ``TPKERNELS_BACKEND`` (the one forced on every op of its kind), if any."""
    return parse_env()[0]


def _env_choice(spec: _Op) -> tuple[str | None, str]:
    """(implementation forced by the environment for this op, how it was written)."""
    bare, per_op = parse_env()
    known = set(_OPS) | {o.family for o in _OPS.values() if o.family}
    unknown = sorted(set(per_op) - known)
    if unknown:
        raise BackendUnavailableError(f"{ENV_VAR} names unknown op {unknown[0]!r}; ops: {', '.join(sorted(known))}")
    for key in (spec.name, spec.family):
        if key and key in per_op:
            return per_op[key], f"{ENV_VAR}={key}={per_op[key]}"
    if bare is not None:
        kind = _kind(bare)
        if kind is None:
            raise BackendUnavailableError(f"{ENV_VAR} ({bare!r}) must name one of {', '.join(KERNELS + ALGORITHMS)}, "
                                          "or give op=name entries")
        if kind == _kind(spec.impls[0]):
            return bare, f"{ENV_VAR}={bare} (every op)"
    return None, ""


def select(op: str, device: torch.device, backend: str | None = None, *, dtype: torch.dtype | None = None,
           **context) -> str:
    """The implementation that runs ``op`` on ``device``: ``backend`` if given, else the environment's
    choice, else the op's default (``context`` feeds the default, e.g. the GEMM-comm FLOPs).
    Raises BackendUnavailableError."""
    spec = _OPS.get(op)
    if spec is None:
        raise BackendUnavailableError(f"unknown op {op!r}; ops: {', '.join(_OPS)}")
    source = "backend argument" if _kind(spec.impls[0]) == "kernel" else "algo argument"
    wanted = backend
    if wanted is None:
        wanted, source = _env_choice(spec)
    if wanted is not None:
        reason = why_not(wanted, op, device, dtype, **context)
        if reason is not None:
            hint = ""
            if source.endswith("(every op)"):
                hint = f"; to force it for one op only, set {ENV_VAR}=<op>={wanted} (e.g. {ENV_VAR}=bias_gelu={wanted})"
            raise BackendUnavailableError(f"{source} cannot run {op} on {device}"
                                          f"{'' if dtype is None else f' ({dtype})'}: {reason}{hint}")
        return wanted
    if spec.default is not None:
        return spec.default(device, dtype, **context)
    reasons = []
    for name in DEFAULT_ORDER.get(device.type, ("reference",)):
        if name not in spec.impls:
            continue
        reason = why_not(name, op, device, dtype, **context)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise BackendUnavailableError(f"no implementation can run {op} on {device}: " + "; ".join(reasons))


def default_backends() -> dict[str, dict[str, str]]:
    """For `tpkernels info`: per op, what runs on a CPU and on a CUDA tensor (or why nothing can)."""
    table = {}
    for op, spec in _OPS.items():
        row = {}
        for dev in ("cpu", "cuda"):
            try:
                forced, source = _env_choice(spec)
                if forced is not None:
                    reason = why_not(forced, op, torch.device(dev))
                    row[dev] = forced if reason is None else f"error, {source}: {reason}"
                elif spec.default is not None:
                    row[dev] = spec.default_doc.get(dev, "auto")
                else:
                    row[dev] = select(op, torch.device(dev))
            except BackendUnavailableError as e:
                row[dev] = f"error: {e}"
        table[op] = row
    return table
