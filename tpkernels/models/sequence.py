"""Where the tokens of a batch sit: positions and, for packed rows, document boundaries.

Documents packed into one row are marked the Hugging Face way: their ``position_ids`` restart at
0. Every row starts a document. ``SequenceInfo.of(position_ids)`` turns that into the
``cu_seqlens`` of varlen attention, so no attention crosses a document, and rotary positions
restart with each document. Rows without restarts keep the dense (batch, seq) attention.

Host reads: none for a batch with default positions. For packed batches the first stage finds
the boundaries on the host, from the step's host copy of the positions (no device sync); each
later pipeline stage reads the longest document from the boundaries it receives with the
activations (one read per micro-batch, beside the P2P header it reads anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpkernels.functional.attention import trust_cu_seqlens


@dataclass
class SequenceInfo:
    """position_ids: (batch, seq) int64; cu_seqlens: (documents + 1,) int32 over the flattened
    batch, or None (one document per row); max_seqlen: the longest document."""

    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int

    @classmethod
    def dense(cls, position_ids: torch.Tensor) -> "SequenceInfo":
        """One document per row (no host read)."""
        return cls(position_ids, None, position_ids.shape[1])

    @classmethod
    def from_cu_seqlens(cls, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> "SequenceInfo":
        """From the boundaries an earlier pipeline stage found (empty: dense rows; no host read then)."""
        if cu_seqlens.numel() == 0:
            return cls.dense(position_ids)
        return cls(position_ids, cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))

    def on(self, position_ids: torch.Tensor) -> "SequenceInfo":
        """This info (found on the host) for ``position_ids`` on their device: the boundaries follow
        them there (an asynchronous copy, no sync), trusted by varlen attention (they were made from
        checked values), so it reads nothing back."""
        cu = None
        if self.cu_seqlens is not None:
            cu = trust_cu_seqlens(self.cu_seqlens.to(position_ids.device, non_blocking=True),
                                  position_ids.numel(), self.max_seqlen)
        return SequenceInfo(position_ids, cu, self.max_seqlen)

    def boundaries(self) -> torch.Tensor:
        """cu_seqlens, or an empty int32 tensor for dense rows: what the next pipeline stage receives."""
        if self.cu_seqlens is not None:
            return self.cu_seqlens
        return torch.empty(0, dtype=torch.int32, device=self.position_ids.device)

    @classmethod
    def rows(cls, position_ids: torch.Tensor) -> "SequenceInfo":
        """Each row one document, stated as boundaries (cu_seqlens at the row starts): what a CP rank
        whose share holds no document start uses when its group's sequences are packed."""
        b, s = position_ids.shape
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=position_ids.device)
        return cls(position_ids, cu, s)

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
                       ignore_index: int = -100) -> torch.Tensor:
    """target[:, t] = input_ids[:, t + 1], ``ignore_index`` at each row's end and, for packed rows,
    at each document's last token (a document does not predict the next one's first token)."""
    target = torch.full_like(input_ids, ignore_index)
    target[:, :-1] = input_ids[:, 1:]
    if position_ids is not None:
        ends = position_ids[:, 1:] == 0
        target[:, :-1] = target[:, :-1].masked_fill(ends, ignore_index)
    return target
