"""Cross-GPU buffers for the fused GEMM + communication kernels: *arenas*.

An arena is one byte buffer of the same size on every rank of a group, plus the base address of
every rank's copy (so a kernel can read a peer's buffer directly over NVLink), an epoch counter
for the signals that live in it, and an error word that the kernels' bounded waits write to.

- :class:`SymmetricArena`: torch's symmetric memory (``torch.distributed._symmetric_memory``:
  ``empty`` + ``rendezvous``), the peers' buffers mapped into this process by torch. One
  rendezvous per (group, use), cached and grown by powers of two, so steady-state calls allocate
  nothing and make no collective calls. We use torch's and write no IPC of our own.
- :class:`VirtualArena`: the same interface over plain buffers of one device, one per emulated
  rank (:mod:`tpkernels.functional.virtual_tp`): the "peer" addresses are the other emulated
  ranks' buffers, so the very same kernels run, on one GPU or on the CPU under the interpreter.

Signals are int32 words in an arena, zeroed once at creation; call e of the arena raises them to
e (``next_epoch``), so they are never reset between calls.
"""

from __future__ import annotations

from typing import Callable

import torch

from tpkernels import env_vars

ALIGN = 256  # bytes: every region of an arena starts on a 256-byte boundary (vector and TMA loads)


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SignalTimeoutError(RuntimeError):
    """A fused kernel gave up waiting for a peer's signal; the message names the rank and chunk."""


class ErrorWord:
    """One int32 that kernels raise (atomic max) when a wait times out. On CUDA it lives in pinned host
    memory, mapped into the device address space, so the host reads it without synchronizing."""

    def __init__(self, device: torch.device):
        pinned = device.type == "cuda"
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self.describe: Callable[[int], str] = lambda code: f"signal wait timed out (code {code})"

    def check(self) -> None:
        """Raise SignalTimeoutError if a kernel finished with a timed-out wait (and clear the word)."""
        code = int(self.tensor[0])
        if code:
            self.tensor.zero_()
            raise SignalTimeoutError(self.describe(code))


def max_spins(device: torch.device) -> int:
    """Reads a wait makes before it gives up: TPKERNELS_SIGNAL_SPINS, else ~30 s of polling on a GPU
    and 1000 reads under the interpreter (whose producers finished before the consumer started)."""
    spins = env_vars.read("TPKERNELS_SIGNAL_SPINS")
    if spins is not None:
        return spins
    return (1 << 26) if device.type == "cuda" else 1000


class _Arena:
    rank: int
    world: int
    nbytes: int
    device: torch.device

    def __init__(self):
        self.epoch = 0
        self.err = ErrorWord(self.device)
        self._tables: dict[int, torch.Tensor] = {}

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def _check_region(self, offset: int, shape, dtype) -> int:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset % ALIGN or offset + size > self.nbytes:
            raise ValueError(f"arena region at byte {offset} of {size} bytes does not fit its {self.nbytes}-byte "
                             f"arena or is not {ALIGN}-aligned")
        return size

    def table(self, offset: int = 0) -> torch.Tensor:
        """(world,) int64 on the device: the address of byte ``offset`` of every rank's buffer."""
        t = self._tables.get(offset)
        if t is None:
            t = torch.tensor([p + offset for p in self.base_ptrs()], dtype=torch.int64, device=self.device)
            self._tables[offset] = t
        return t

    def local(self, offset: int, shape, dtype) -> torch.Tensor:
        return self.peer(self.rank, offset, shape, dtype)


class VirtualArena(_Arena):
    """Rank ``rank``'s view of ``buffers`` (one uint8 tensor per emulated rank, same size, one device)."""

    def __init__(self, rank: int, buffers: list[torch.Tensor]):
        self.rank, self.world, self.buffers = rank, len(buffers), buffers
        self.nbytes, self.device = buffers[0].numel(), buffers[0].device
        super().__init__()

    def base_ptrs(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers]

    def peer(self, r: int, offset: int, shape, dtype) -> torch.Tensor:
        size = self._check_region(offset, shape, dtype)
        return self.buffers[r][offset:offset + size].view(dtype).view(shape)

    def barrier(self) -> None:
        """Nothing: the harness that drives the emulated ranks orders their phases itself."""


class SymmetricArena(_Arena):
    """This rank's view of one torch symmetric-memory allocation of ``nbytes`` over ``group``. Creating one
    is collective (every rank of the group, same size, same order)."""

    def __init__(self, group, nbytes: int, device: torch.device):
        import torch.distributed as dist  # noqa: PLC0415
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        self.device, self.nbytes = device, nbytes
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.buf.zero_()  # the signals start below every epoch
        group = group if group is not None else dist.group.WORLD
        self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        super().__init__()
        self.handle.barrier(channel=0)  # no peer reads this buffer before it is zeroed

    def base_ptrs(self) -> list[int]:
        return list(self.handle.buffer_ptrs)

    def peer(self, r: int, offset: int, shape, dtype) -> torch.Tensor:
        self._check_region(offset, shape, dtype)
        return self.handle.get_buffer(r, tuple(shape), dtype, offset // torch.empty((), dtype=dtype).element_size())

    def barrier(self, timeout_s: float | None = None) -> None:
        """Stream-ordered barrier of the group (on the current stream), with torch's timeout: ``timeout_s``,
        else TPKERNELS_BARRIER_TIMEOUT_S."""
        timeout_s = timeout_s if timeout_s is not None else env_vars.read("TPKERNELS_BARRIER_TIMEOUT_S")
        self.handle.barrier(channel=0, timeout_ms=int(timeout_s * 1000))


_ARENAS: dict[tuple, SymmetricArena] = {}
# arenas outgrown by a larger call: kept, not freed, because kernels of the previous call may still
# read them on a peer (symmetric memory is unmapped at once, not in stream order); growth by powers
# of two bounds what this keeps to the size of the live arena
_RETIRED: list[SymmetricArena] = []


def symmetric_arena(group, use: str, nbytes: int, device: torch.device) -> SymmetricArena:
    """The cached arena of (group, use) with at least ``nbytes``, grown to the next power of two when a call
    needs more (collective: every rank asks for the same size at the same call, which the ops guarantee)."""
    key = (id(group), use, device)
    arena = _ARENAS.get(key)
    if arena is None or arena.nbytes < nbytes:
        if arena is not None:
            _RETIRED.append(_ARENAS.pop(key))
        arena = SymmetricArena(group, 1 << max(nbytes - 1, ALIGN).bit_length(), device)
        _ARENAS[key] = arena
    return arena


def symmetric_memory_unavailable(group=None) -> str | None:
    """Why torch symmetric memory cannot serve ``group`` (None when it can)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415
        import torch.distributed._symmetric_memory  # noqa: F401, PLC0415
    except ImportError as e:
        return f"this torch has no symmetric memory ({e})"
    if not torch.cuda.is_available():
        return "symmetric memory needs CUDA devices"
    if not dist.is_initialized():
        return "torch.distributed is not initialized"
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        return f"symmetric memory needs an NCCL process group, this group's backend is {backend!r}"
    return None


__all__ = ["ALIGN", "ErrorWord", "SignalTimeoutError", "SymmetricArena", "VirtualArena", "align", "max_spins",
           "symmetric_arena", "symmetric_memory_unavailable"]
