"""Live tensor bytes on any device, for memory tests and benchmarks on CPUs (which keep no allocator
statistics).

    with LiveTensorBytes() as mem:
        o = op(q, k, v); o.sum().backward()
    mem.peak_bytes, mem.largest_elements, mem.largest_bytes

A ``TorchDispatchMode`` that sees every tensor a PyTorch op returns, inside our registered custom
ops too (it re-enters them below the Python dispatch key), and counts each storage from the first
tensor that holds it until the last one dies: ``peak_bytes`` is the most bytes live at once among
the tensors made under the mode (inputs made before it are not counted), ``largest_elements`` and
``largest_bytes`` the largest storage's element count and size. Custom ops without a tensor argument
(the profiler's ``record_function`` markers that ``optimizer.step`` makes) run untouched. A kernel's internal workspace (memory it frees before returning)
is not a returned tensor and is not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """See the module docstring. Single-threaded use: enter it on the thread that runs the ops."""

    def __init__(self):
        super().__init__()
        self._held: dict[int, list[int]] = {}  # storage pointer -> [live tensors, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_elements = 0
        self.largest_bytes = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key == 0:
            return
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.largest_elements = max(self.largest_elements, nbytes // max(1, t.element_size()))
            self.largest_bytes = max(self.largest_bytes, nbytes)
        else:
            entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._held[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("aten", "prims"):
            out = func(*args, **kwargs)
        else:  # a custom op: its device kernel, with the mode on, so the ops inside it are seen
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if not tensors:  # e.g. a profiler marker: nothing to count
                return func(*args, **kwargs)
            device = tensors[0].device
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C._dispatch_key_for_device(device.type)),
                                      *args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


__all__ = ["LiveTensorBytes"]
