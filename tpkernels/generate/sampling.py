"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k and top-p, after
a repetition penalty; the order and the semantics of Hugging Face ``generate``'s logits processors
(``RepetitionPenaltyLogitsProcessor``, then ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``), so a setting means what it means there.

    params = Sampling(temperature=0.7, top_p=0.9)       # temperature 0: greedy (the default)
    ids = params.next_tokens(logits, seen, generator)   # logits (batch, vocab), seen (batch, vocab) bool
                                                        # -> (batch,) int64
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _number(name: str, value, rule: str, ok) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} ({value!r}) must be {rule}")


@dataclass(frozen=True)
class Sampling:
    """temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0: all). top_p: keep the smallest set of most likely tokens
    whose probabilities sum to at least top_p (1: all). repetition_penalty: > 1 makes tokens already in
    the row (prompt and generated) less likely: a positive logit is divided by it, a negative one
    multiplied (CTRL's rule, as Hugging Face applies it); 1: off. top_k and top_p act only when sampling."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        _number("temperature", self.temperature, "a finite number >= 0 (0: greedy)", lambda x: x >= 0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k!r}) must be an integer >= 0 (0: no limit)")
        _number("top_p", self.top_p, "in (0, 1] (1: no limit)", lambda x: 0 < x <= 1)
        _number("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1: off)", lambda x: x > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def scores(self, logits: Tensor, seen: Tensor | None) -> Tensor:
        """The processed scores (batch, vocab) in fp32 (fp64 for fp64 logits): the penalty, the temperature
        and the top-k / top-p cuts (−inf) applied. ``seen`` (batch, vocab) bool: the tokens each row holds
        (prompt and generated)."""
        s = logits.float() if logits.dtype != torch.float64 else logits.clone()
        if self.repetition_penalty != 1.0 and seen is not None:
            p = self.repetition_penalty
            s = torch.where(seen, torch.where(s > 0, s / p, s * p), s)
        if self.greedy:
            return s
        s = s / self.temperature
        if self.top_k and self.top_k < s.shape[-1]:
            kth = torch.topk(s, self.top_k, dim=-1).values[..., -1:]
            s = s.masked_fill(s < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(s, dim=-1, descending=False)
            cum = ordered.softmax(-1).cumsum(-1)
            drop = cum <= 1 - self.top_p
            drop[..., -1] = False  # the most likely token always stays
            s = s.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return s

    def next_tokens(self, logits: Tensor, seen: Tensor | None = None,
                    generator: torch.Generator | None = None) -> Tensor:
        """(batch,) int64: the next token of each row from its logits (batch, vocab)."""
        s = self.scores(logits, seen)
        if self.greedy:
            return s.argmax(-1)
        probs = s.softmax(-1)
        return torch.multinomial(probs.cpu() if generator is not None and generator.device.type == "cpu" else probs,
                                 1, generator=generator).reshape(-1).to(logits.device)


__all__ = ["Sampling"]
