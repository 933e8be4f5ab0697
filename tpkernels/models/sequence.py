"""Where the tokens of a batch sit: positions and, for packed rows, document boundaries.

Documents packed into one row are marked the Hugging Face way: their ``position_ids`` restart at
0. Every row starts a document. A model's stages carry the boundaries per row
(``tpkernels.models.inputs.StageInput.documents``); ``SequenceInfo.from_documents`` turns them
into the ``cu_seqlens`` of varlen attention (no attention crosses a document; rotary positions
restart with each document) or, under context parallelism, into the global boundaries on the host
that the CP attention plans its kernel calls from. ``SequenceInfo.of(position_ids)`` finds them
from positions directly. Rows without restarts keep the dense (batch, seq) attention.

Host reads: none for a batch with default positions. For packed batches the first stage finds
the boundaries on the host, from the step's host copy of the positions (no device sync); each
later pipeline stage reads the boundaries it receives with the activations once per micro-batch
(beside the P2P header it reads anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.functional.attention import trust_cu_seqlens


@dataclass
class SequenceInfo:
    """position_ids: (batch, seq) int64; cu_seqlens: (documents + 1,) int32 over the flattened batch, on
    the device, or None (one document per row, or context parallelism); max_seqlen: the longest
    document; cp_cu_seqlens: under context parallelism, the global documents' boundaries over the
    flattened batch of whole sequences, a host tensor (None: one document per row); documents: the
    per-row boundaries to hand the next pipeline stage (StageInput.documents), on the device."""

    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    cp_cu_seqlens: torch.Tensor | None = None
    documents: torch.Tensor | None = None

    @classmethod
    def dense(cls, position_ids: torch.Tensor) -> "SequenceInfo":
        """One document per row (no host read)."""
        return cls(position_ids, None, position_ids.shape[1])

    @classmethod
    def from_documents(cls, position_ids: torch.Tensor, documents: torch.Tensor, cp: int = 1) -> "SequenceInfo":
        """From per-row boundaries (batch, n) of sequences of seq·cp tokens (StageInput.documents): free
        for a host tensor (the first stage's), one read of a device one (a later stage's)."""
        b, s = position_ids.shape
        send = documents.to(position_ids.device, non_blocking=True)
        if documents.shape[1] == 0:
            return cls(position_ids, None, s, None, send)
        T = s * cp
        cu = [0]
        for r, row in enumerate(documents.tolist()):  # ascending from 0, padded with T
            cu += [r * T + x for x in sorted(set(row) | {T}) if x > 0]
        longest = max(y - x for x, y in zip(cu, cu[1:]))
        if cp > 1:
            return cls(position_ids, None, longest, torch.tensor(cu, dtype=torch.int32), send)
        dev = trust_cu_seqlens(torch.tensor(cu, dtype=torch.int32).to(position_ids.device, non_blocking=True),
                               b * s, longest)  # made from host values: varlen attention reads nothing back
        return cls(position_ids, dev, longest, None, send)

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> "SequenceInfo":
        b, s = position_ids.shape
        starts = position_ids == 0
        starts[:, 0] = True
        flat = starts.reshape(-1)
        idx = torch.nonzero(flat).reshape(-1)
        if idx.numel() == b:  # no document boundary inside a row
            return cls(position_ids, None, s)
        cu = torch.cat([idx, torch.tensor([b * s], device=idx.device)]).to(torch.int32)
        return cls(position_ids, cu, int((cu[1:] - cu[:-1]).max()))


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """position_ids (batch, seq) restarting at each document of ``cu_seqlens`` (over the flattened
    batch; every row boundary must be a document boundary)."""
    cu = cu_seqlens.to(torch.int64)
    total = batch * seq
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at batch × seq ({batch} × {seq} = {total}), "
                         f"got {cu.tolist()[:8]}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
    row_starts = torch.arange(0, total, seq, device=cu.device)
    if not bool(torch.isin(row_starts, cu).all()):
        raise ValueError(f"cu_seqlens must contain every row start (multiples of seq = {seq}): a document may not "
                         "span two rows")
    tok = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu, tok, right=True) - 1
    return (tok - cu[doc]).reshape(batch, seq)


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).expand(b, s)


def next_token_targets(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """target[:, t] = input_ids[:, t + 1], ``ignore_index`` at each row's end and, for packed rows,
    at each document's last token (a document does not predict the next one's first token)."""
    target = torch.full_like(input_ids, ignore_index)
    target[:, :-1] = input_ids[:, 1:]
    if position_ids is not None:
        ends = position_ids[:, 1:] == 0
        target[:, :-1] = target[:, :-1].masked_fill(ends, ignore_index)
    return target
