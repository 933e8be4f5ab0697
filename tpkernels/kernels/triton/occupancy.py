"""How many programs fill a device: the grid-sizing rule the memory-bound Triton kernels share."""

from __future__ import annotations

import torch

# Under the interpreter (CPU) programs run one after another, so a handful is enough.
INTERPRETER_PROGRAMS = 4


def program_target(device: torch.device, per_sm: int = 4) -> int:
    """Programs for a grid on ``device``: ``per_sm`` resident programs per SM keep the memory
    system busy on a GPU (torch caches the device properties, so this is cheap per launch);
    elsewhere ``INTERPRETER_PROGRAMS``."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS
