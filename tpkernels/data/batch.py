"""TokenBatch: what a data source hands the trainer for one step (the global batch, on the host).

Every tensor is (rows, seq), row r of each describing the same packed row:

* ``ids`` (long): token ids.
* ``position_ids`` (long) or None: positions restarting at 0 at each document (a packed row holds
  several; attention never crosses one, the model's varlen path); None: one document per row.
* ``loss_mask`` (bool) or None: **True at token t when token t is a supervised target**, i.e. the
  prediction of ``ids[:, t]`` made at position t - 1 is in the loss. The mask is on the label
  token and applied after the shift: ``targets[:, t] = ids[:, t + 1]`` is kept iff
  ``loss_mask[:, t + 1]`` (and t is not a document's last token). None: every token is a target
  (pre-training).
* ``pair_index`` (long) or None, preference data only: per token, the number of the pair its
  document belongs to, counted 0, 1, … over the global batch in row order; -1 on tokens of no pair
  (a row's filler). Constant within a document: the document's pair.
* ``chosen`` (bool) or None, preference data only: per token, True in the chosen sequence of its
  pair, False in the rejected one (and on filler).
* ``pair_sample`` (long) or None, preference data only: per token, its pair's stable index in the
  packed dataset (0 … pairs − 1, the same at every step, seed and layout being fixed: the key of the
  DPO reference cache); -1 on filler.

A pair's chosen and rejected sequences are two documents of one row, so slicing rows (DP) keeps
them together; under CP a row is split into zigzag shares, so the per-document sums a preference
loss needs are summed over the CP group (the per-token ``pair_index``/``chosen`` shard with the row).
"""

from __future__ import annotations

import dataclasses

import torch

from tpkernels.conventions import IGNORE_INDEX


@dataclasses.dataclass
class TokenBatch:
    ids: torch.Tensor
    position_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    pair_index: torch.Tensor | None = None
    chosen: torch.Tensor | None = None
    pair_sample: torch.Tensor | None = None

    def __iter__(self):
        raise TypeError("a TokenBatch is not an (ids, position_ids) tuple any more: use .ids and .position_ids")

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def map(self, fn) -> "TokenBatch":
        """``fn`` applied to every tensor present (e.g. a row slice, a CP share)."""
        return TokenBatch(**{k: None if v is None else fn(v) for k, v in self.fields().items()})

    def rows_of_dp_rank(self, dp_rank: int, dp: int) -> "TokenBatch":
        """This DP replica's contiguous share of the rows."""
        per = self.rows // dp
        return self.map(lambda t: t[dp_rank * per:(dp_rank + 1) * per])

    def padded(self, rows: int) -> "TokenBatch":
        """The batch with rows appended up to ``rows``, each a filler document with no target (``loss_mask``
        False, id 0, ``pair_index``/``pair_sample`` -1): a short last batch of a validation pass, which a
        token-mean loss counts nothing of."""
        extra = rows - self.rows
        if extra <= 0:
            return self
        seq = self.ids.shape[1]
        fill = {"ids": torch.zeros(extra, seq, dtype=self.ids.dtype),
                "position_ids": torch.arange(seq).expand(extra, seq),
                "loss_mask": torch.zeros(extra, seq, dtype=torch.bool),
                "pair_index": torch.full((extra, seq), -1, dtype=torch.long),
                "chosen": torch.zeros(extra, seq, dtype=torch.bool),
                "pair_sample": torch.full((extra, seq), -1, dtype=torch.long)}
        have = self.fields()
        if have["position_ids"] is None:
            have["position_ids"] = torch.arange(seq).expand(self.rows, seq)
        if have["loss_mask"] is None:
            have["loss_mask"] = torch.ones(self.rows, seq, dtype=torch.bool)
        return TokenBatch(**{k: None if v is None else torch.cat([v, fill[k].to(v.dtype)]) for k, v in have.items()})

    def targets(self, ignore_index: int = IGNORE_INDEX, *, masked: bool = True) -> torch.Tensor:
        """(rows, seq) next-token targets: ``ids[:, t + 1]`` at t, ``ignore_index`` at each row's and each
        document's last token and, with ``masked`` and a ``loss_mask``, wherever the label token
        ``t + 1`` is not supervised."""
        target = torch.full_like(self.ids, ignore_index)
        target[:, :-1] = self.ids[:, 1:]
        if self.position_ids is not None:
            target[:, :-1] = target[:, :-1].masked_fill(self.position_ids[:, 1:] == 0, ignore_index)
        if masked and self.loss_mask is not None:
            target[:, :-1] = target[:, :-1].masked_fill(~self.loss_mask[:, 1:], ignore_index)
        return target

    @staticmethod
    def cat(parts: list["TokenBatch"]) -> "TokenBatch":
        """Rows of several batches stacked (a field absent in some: positions counted per row, masks all
        True; pairs renumbered over the whole batch; a blend of pairs and other data is refused)."""
        out = {}
        for name in ("ids", "position_ids", "loss_mask", "pair_index", "chosen", "pair_sample"):
            vals = [getattr(p, name) for p in parts]
            if all(v is None for v in vals):
                out[name] = None
            elif name in ("pair_index", "chosen", "pair_sample") and any(v is None for v in vals):
                raise ValueError("data.source blends preference pairs with other data: blend sources of one kind only")
            else:
                out[name] = torch.cat([
                    v if v is not None else
                    torch.arange(p.ids.shape[1]).expand_as(p.ids).clone() if name == "position_ids" else
                    torch.ones_like(p.ids, dtype=torch.bool) for p, v in zip(parts, vals)])
        if out["pair_index"] is not None:
            out["pair_index"] = number_pairs(out["pair_index"])
        return TokenBatch(**out)


def number_pairs(pair: torch.Tensor) -> torch.Tensor:
    """(rows, seq) pair numbers renumbered 0, 1, … over the rows in row order, from any numbering whose
    pairs are consecutive integers within each row (-1: no pair, kept)."""
    big = torch.iinfo(torch.long).max
    low = torch.where(pair >= 0, pair, big).min(dim=1).values
    local = torch.where(pair >= 0, pair - low[:, None], pair)
    counts = (local.max(dim=1).values + 1).clamp(min=0)
    base = torch.cumsum(counts, 0) - counts
    return torch.where(local >= 0, local + base[:, None], local)
