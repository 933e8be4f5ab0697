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


# Per-SM limits of the targets we compile for (CUDA programming guide, "Technical specifications per
# compute capability", and the occupancy calculator's allocation rules). Registers are allocated per
# warp in units of 256 and each of the 4 sub-partitions has a quarter of the file; shared memory in
# units of 128 bytes plus 1 KB that the system reserves per block.
SM_LIMITS = {
    90: {"regs": 64 * 1024, "shared": 228 * 1024, "threads": 2048, "blocks": 32},  # H100 / H200
    80: {"regs": 64 * 1024, "shared": 164 * 1024, "threads": 2048, "blocks": 32},  # A100
}
_REG_UNIT, _SUB_PARTITIONS, _SHARED_UNIT, _SHARED_RESERVED = 256, 4, 128, 1024


def blocks_per_sm(arch: int, num_warps: int, regs: int | None, shared: int) -> tuple[int, str]:
    """(resident blocks per SM, the resource that limits it: "regs", "shared", "threads" or "blocks") of
    a kernel using ``regs`` registers per thread (None: unknown, not a limit) and ``shared`` bytes of
    shared memory per block with ``num_warps`` warps, on sm_``arch`` (80 or 90; others use sm_80's)."""
    lim = SM_LIMITS.get(arch, SM_LIMITS[80])
    limits = {"blocks": lim["blocks"], "threads": lim["threads"] // (32 * num_warps)}
    if regs:
        per_warp = -(-regs * 32 // _REG_UNIT) * _REG_UNIT
        warps = _SUB_PARTITIONS * ((lim["regs"] // _SUB_PARTITIONS) // per_warp)
        limits["regs"] = warps // num_warps
    per_block = -(-shared // _SHARED_UNIT) * _SHARED_UNIT + _SHARED_RESERVED
    limits["shared"] = lim["shared"] // per_block
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter
