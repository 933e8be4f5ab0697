"""What the run reports per step: model FLOP utilisation and a JSON line for machines.

MFU = model FLOPs of the step (the planner's count: forward + backward of every GEMM and of the
attention core, no recompute) / (step time × ranks × peak FLOP/s of one rank). The peak is the
GPU's dense bf16 peak from the planner's hardware table (matched by device name); on a CPU it is
the fp32 GEMM rate this rank measures at start-up (a 1024³ matmul), so CPU MFU is labelled
"vs measured GEMM": it says how much of the machine's matmul speed the step achieves.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s of one rank, what it is)."""
    if device.type == "cuda":
        from tpkernels.planner.measure import preset_for_device  # noqa: PLC0415

        name = torch.cuda.get_device_name(device)
        spec = preset_for_device(name)
        if spec is not None:
            return spec.peak_tflops_bf16 * 1e12, f"{spec.name} bf16 peak"
        return float("nan"), f"{name}: no peak in the planner's table"
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    rate = 3 * 2 * 1024 ** 3 / (time.perf_counter() - t0)
    return rate, "measured CPU fp32 GEMM"


class MetricsFile:
    """One JSON object per line, appended as steps finish (rank 0)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
