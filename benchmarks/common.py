"""Shared helpers of the benchmark scripts: timing, device labels, CSV/PNG output."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def device_slug(device: torch.device) -> str:
    name = device_label(device) if device.type == "cuda" else "cpu"
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def run_metadata(device: torch.device) -> dict:
    try:
        import triton  # noqa: PLC0415

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"device": device_label(device), "torch": torch.__version__, "triton": triton_version,
            "date": datetime.date.today().isoformat()}


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA: triton's do_bench, events, median)."""
    if device.type == "cuda":
        import triton.testing  # noqa: PLC0415

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(numel: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """Measured device copy bandwidth (bytes read + bytes written per second), in GB/s."""
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps)
    return 2 * numel * src.element_size() / ms / 1e6


def write_csv(name: str, rows: list[dict]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in columns))


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no PNG")
        return None
    return plt
