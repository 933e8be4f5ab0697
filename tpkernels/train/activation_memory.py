"""Peak bytes of the activations autograd keeps for the backward, on any device.

    with SavedActivations(model.parameters()) as saved:
        loss = model(ids, target=targets); loss.backward()
    saved.peak_bytes        # the most bytes held at once between a forward and its backward

    measure_training(cfg)   # one rank: train cfg, return its losses, step time and peak activations

On GPUs ``torch.cuda.max_memory_allocated`` sees everything (weights, optimizer states, workspaces);
CPUs have no allocator statistics, and a process's peak RSS is dominated by the libraries and
allocator caching. What parallelism changes is what autograd saves, so this counts that: every
tensor saved for backward (``torch.autograd.graph.saved_tensors_hooks``), once per storage, the
model's parameters excepted, from when it is saved until autograd frees it. Transient buffers
(a layer's workspace, a ring's block in flight) are not saved tensors and are not counted.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch


class _Held:
    """What autograd keeps in place of a saved tensor; its death is the tensor's release."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


class SavedActivations:
    """Context manager: ``live_bytes`` now, ``peak_bytes`` since entry (see the module docstring).
    Saved-tensor hooks are per thread: enter it on the thread that runs forward and backward."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._count: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or key == 0:
            return t
        held = _Held(t)
        n = self._count.get(key, 0)
        if n == 0:
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._count[key] = n + 1
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def _release(self, key: int, nbytes: int) -> None:
        n = self._count.get(key, 0) - 1
        if n <= 0:
            self._count.pop(key, None)
            self.live_bytes -= nbytes
        else:
            self._count[key] = n

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def measure_training(cfg) -> dict:
    """Train ``cfg`` (a TrainConfig) on this rank and report {"losses", "step_s" (the median after
    the first step, which pays for warm-up), "comm_ratio" (median), "peak_bytes" (the most bytes of
    saved activations held at once), "cuda_peak_bytes" (the allocator's peak on a GPU, else 0)}."""
    from tpkernels.train.trainer import Trainer  # noqa: PLC0415

    trainer = Trainer(cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with SavedActivations(trainer.model.parameters()) as saved:
        history = trainer.train()
    later = history[1:] or history
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"losses": [h["loss"] for h in history], "step_s": median([h["step_s"] for h in later]),
            "comm_ratio": median([h["comm_ratio"] for h in later]), "peak_bytes": saved.peak_bytes,
            "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}


__all__ = ["SavedActivations", "measure_training"]
