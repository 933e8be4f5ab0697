"""Send activations and gradients between pipeline stages with torch.distributed P2P (NCCL, gloo).

Every transfer starts with a fixed 4-int header (kind, micro-batch, chunk, metadata length). The
metadata (the nesting of tuples/dicts, and each tensor's shape, dtype and requires_grad) travels
only the first time and whenever it changes (a new sequence length, say), and is cached per
(peer, kind) on both sides. The data then goes as one message per tensor.

Ownership: every received tensor gets storage of its own. Autograd saves received activations
for backward, and a zero-bubble W keeps the received output gradient until it runs, after later
receives from the same peer; a buffer reused per peer would be overwritten under it (on CUDA the
caching allocator makes a fresh buffer as cheap as a reused one).

Failures: a stage that fails sends an ABORT header to its neighbours (``abort``); a peer waiting
for data from it raises ``PipelineAbortError`` naming the failed rank and its error, and passes the
abort on, so every rank fails fast instead of hanging. A peer that dies (its connection closes)
raises ``PipelinePeerLostError`` naming it; a wait that exceeds ``timeout_s`` raises
``PipelineTimeoutError``.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tpkernels.parallel.groups import global_rank, group_rank_size

KIND_ACT, KIND_GRAD, KIND_STATUS, KIND_ABORT = 1, 2, 3, 99
_KIND_NAMES = {KIND_ACT: "activation", KIND_GRAD: "gradient", KIND_STATUS: "end-of-step status"}


class PipelineAbortError(RuntimeError):
    """Another stage failed; raised on the ranks that were waiting for it. ``source``: the rank the
    news came from."""

    source: int = -1


class PipelinePeerLostError(RuntimeError):
    """A peer stopped responding: its connection closed (the process died) or broke. ``peer``: its rank."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class PipelineTimeoutError(TimeoutError):
    pass


def _is_timeout(err: Exception) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensors of a tensor / tuple / list / dict (nested), and a picklable structure to rebuild it."""
    if isinstance(obj, torch.Tensor):
        return [obj], "T"
    if isinstance(obj, (tuple, list)):
        tensors, specs = [], []
        for x in obj:
            t, s = flatten(x)
            tensors += t
            specs.append(s)
        return tensors, (type(obj).__name__, specs)
    if isinstance(obj, dict):
        tensors, specs = [], []
        for k, x in obj.items():
            t, s = flatten(x)
            tensors += t
            specs.append((k, s))
        return tensors, ("dict", specs)
    raise TypeError(f"pipeline stages exchange tensors, tuples, lists or dicts of tensors, not {type(obj).__name__}")


def unflatten(tensors: list[torch.Tensor], spec: Any) -> Any:
    it = iter(tensors)

    def build(s):
        if s == "T":
            return next(it)
        kind, items = s
        if kind == "dict":
            return {k: build(v) for k, v in items}
        seq = [build(v) for v in items]
        return tuple(seq) if kind == "tuple" else seq

    return build(spec)


@dataclass(frozen=True)
class _Meta:
    spec: Any
    tensors: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


def _encode_meta(meta: _Meta) -> bytes:
    """JSON, not pickle: a peer's bytes are data, never code."""
    return json.dumps({"spec": meta.spec, "tensors": [[list(shape), str(dtype).removeprefix("torch."), grad]
                                                      for shape, dtype, grad in meta.tensors]}).encode()


def _decode_meta(raw: bytes) -> _Meta:
    d = json.loads(raw.decode())
    dtypes = []
    for _, name, _ in d["tensors"]:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise RuntimeError(f"a pipeline peer sent a tensor of unknown dtype {name!r}")
        dtypes.append(dt)
    return _Meta(d["spec"], tuple((tuple(shape), dt, bool(grad)) for (shape, _, grad), dt in zip(d["tensors"], dtypes)))


class P2P:
    """This rank's transfers. ``send`` returns at once (the data is in flight); ``recv`` blocks for the
    data. ``wait_sends`` waits for everything still in flight. Ranks are ranks of ``group``."""

    def __init__(self, group=None, device: torch.device | None = None, timeout_s: float = 300.0):
        self.group = group
        self.rank = group_rank_size(group)[0]  # 0 in a single process without torch.distributed
        self.device = device or torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._sent_meta: dict[tuple[int, int], _Meta] = {}
        self._recv_meta: dict[tuple[int, int], _Meta] = {}
        self._inflight: list[tuple[dist.Work, Any, int]] = []  # (work, buffer kept alive, peer)
        self._next_header: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # posted ahead, by source

    def _post(self, op, t: torch.Tensor, peer: int, what: str):
        try:
            return op(t, global_rank(self.group, peer), group=self.group)
        except RuntimeError as e:  # the connection is already gone (gloo closes it after a failure)
            raise self._lost(peer, what, e) from None

    def _lost(self, peer: int, what: str, err: Exception) -> "PipelinePeerLostError":
        return PipelinePeerLostError(f"{self._name(peer)} stopped responding (connection lost) while "
                                     f"{self._name(self.rank)} waited for {what}: {err}", peer)

    def _name(self, r: int) -> str:
        """``rank r`` of the pipeline group, with its global rank when the two differ (TP × PP)."""
        g = global_rank(self.group, r) if dist.is_initialized() else r
        return f"rank {r}" if g == r else f"pipeline rank {r} (global rank {g})"

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        self._inflight.append((self._post(dist.isend, t, dst, "a send to post"), t, dst))

    def _recv(self, t: torch.Tensor, src: int, what: str) -> None:
        self._wait(self._post(dist.irecv, t, src, what), src, what)

    def send(self, obj: Any, dst: int, kind: int, mb: int, chunk: int) -> None:
        tensors, spec = flatten(obj)
        meta = _Meta(spec, tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors))
        payload = b""
        if self._sent_meta.get((dst, kind)) != meta:
            payload = _encode_meta(meta)
            self._sent_meta[(dst, kind)] = meta
        self._isend(torch.tensor([kind, mb, chunk, len(payload)], dtype=torch.int64, device=self.device), dst)
        if payload:
            self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), dst)
        for t in tensors:
            self._isend(t.detach().contiguous(), dst)

    def _wait(self, work, peer: int, what: str, timeout: datetime.timedelta | None = None) -> None:
        """Wait for one transfer with ``peer``; a timeout and a lost peer are told apart."""
        timeout = timeout or self.timeout
        try:
            work.wait(timeout)
        except RuntimeError as e:
            if _is_timeout(e):
                raise PipelineTimeoutError(f"rank {self.rank} waited more than {timeout.total_seconds():.0f} s for "
                                           f"{what} from rank {peer}: {e}") from None
            raise self._lost(peer, what, e) from None

    def recv(self, src: int, kind: int, mb: int, chunk: int, expect_more: bool = False) -> Any:
        """Receive what ``src`` sent for (kind, micro-batch, chunk). ``expect_more``: another message
        from ``src`` follows in this step, so its header is posted now and arrives while this rank
        computes (one round trip fewer on the critical path)."""
        what = f"the {_KIND_NAMES.get(kind, kind)} of micro-batch {mb} (chunk {chunk})" if kind != KIND_STATUS else \
            "the end-of-step status"
        pending = self._next_header.pop(src, None)
        if pending is None:
            header = torch.empty(4, dtype=torch.int64, device=self.device)
            self._recv(header, src, what)
        else:
            work, header = pending
            self._wait(work, src, what)
        h_kind, h_mb, h_chunk, n_meta = (int(x) for x in header.tolist())
        if h_kind == KIND_ABORT:
            msg = torch.empty(n_meta, dtype=torch.uint8, device=self.device)
            self._recv(msg, src, "the abort message")
            err = PipelineAbortError(bytes(msg.cpu().tolist()).decode(errors="replace"))
            err.source = src
            raise err
        if (h_kind, h_mb, h_chunk) != (kind, mb, chunk):
            raise RuntimeError(f"rank {self.rank} expected {what} from rank {src} but got kind {h_kind}, "
                               f"micro-batch {h_mb}, chunk {h_chunk}: the schedules of the two ranks disagree")
        if n_meta:
            raw = torch.empty(n_meta, dtype=torch.uint8, device=self.device)
            self._recv(raw, src, what)
            self._recv_meta[(src, kind)] = _decode_meta(bytes(raw.cpu().tolist()))
        meta = self._recv_meta[(src, kind)]
        bufs = [torch.empty(s, dtype=d, device=self.device) for s, d, _ in meta.tensors]  # owned by the receiver
        for b in bufs:
            self._recv(b, src, what)
        if expect_more:
            nxt = torch.empty(4, dtype=torch.int64, device=self.device)
            self._next_header[src] = (self._post(dist.irecv, nxt, src, what), nxt)
        if kind == KIND_ACT:
            for b, (_, _, rg) in zip(bufs, meta.tensors):
                b.requires_grad_(rg and b.is_floating_point())
        return unflatten(bufs, meta.spec)

    def wait_sends(self) -> None:
        for work, _, peer in self._inflight:
            self._wait(work, peer, "a send to complete")
        self._inflight.clear()

    def abort(self, peers: list[int], message: str, wait_s: float = 3.0) -> None:
        """Tell ``peers`` this stage failed. Best effort: waits up to ``wait_s`` in all for the peers to
        take the message (a peer that failed too, or is blocked on another rank, hears it from that
        rank instead)."""
        data = message.encode()[:4000]
        works = []
        for p in peers:
            try:
                for t in (torch.tensor([KIND_ABORT, -1, -1, len(data)], dtype=torch.int64, device=self.device),
                          torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)):
                    works.append((dist.isend(t, global_rank(self.group, p), group=self.group), t))
            except RuntimeError:
                pass  # the peer may be gone already
        deadline = time.monotonic() + wait_s
        for work, _ in works:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError:
                pass
