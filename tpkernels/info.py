"""`tpkernels info`: versions, what the extension was built with, the GPU, and per-op backends."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from tpkernels import backends, env_vars
from tpkernels._extension import build_info, extension_error
from tpkernels._version import __version__


def _version_of(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    """Everything `tpkernels info` prints, as a dict (also used to label benchmark CSVs)."""
    import tpkernels.functional  # noqa: F401,PLC0415  (registers the ops)

    bi = build_info()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "tpkernels": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU-only build)",
        "triton": _version_of("triton"),
        "extension": ("not importable: " + (extension_error() or "")) if "error" in bi else (
            f"CUDA {bi['cuda_runtime_version'] // 1000}.{bi['cuda_runtime_version'] % 1000 // 10} "
            f"for sm_{', sm_'.join(bi['cuda_archs'].split(';'))} + C++ CPU"
            if bi["with_cuda"] else "C++ CPU only"),
        "cpu_kernel_isa": bi.get("cpu_capability", "n/a"),
        "cpu_threads": torch.get_num_threads(),
        "gpus": gpus or ["none visible"],
        "dispatch_rule": backends.RULE,
        "TPKERNELS_BACKEND": os.environ.get(backends.ENV_VAR, "") or "unset",
        "backends": backends.default_backends(),
        "environment": [{"name": n, "default": d, "read": w, "now": os.environ.get(n, "") or "unset", "meaning": m}
                        for n, d, w, m in env_vars.table_rows()],
    }


def format_report(info: dict) -> str:
    lines = [f"tpkernels {info['tpkernels']}"]
    for key in ("python", "torch", "torch_cuda", "triton", "extension", "cpu_kernel_isa", "cpu_threads"):
        lines.append(f"  {key:15} {info[key]}")
    lines.append(f"  {'gpus':15} {', '.join(info['gpus'])}")
    lines.append(f"  dispatch rule   {info['dispatch_rule']}")
    lines.append(f"  TPKERNELS_BACKEND {info['TPKERNELS_BACKEND']}")
    lines.append("  implementation per op (CPU tensor | CUDA tensor):")
    width = max(len(op) for op in info["backends"])
    cpu_width = max(len(row["cpu"]) for row in info["backends"].values())
    for op, row in info["backends"].items():
        lines.append(f"    {op:{width}} {row['cpu']:{cpu_width}} | {row['cuda']}")
    lines.append("  environment variables (tpkernels.env_vars; an explicit argument beats them):")
    nw = max(len(v["name"]) for v in info["environment"])
    for v in info["environment"]:
        lines.append(f"    {v['name']:{nw}} now {v['now']!s:8} default {v['default']!s:8} read {v['read']:9} {v['meaning']}")
    return "\n".join(lines)
