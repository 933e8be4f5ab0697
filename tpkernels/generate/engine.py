"""Generation with a ParallelTransformer at any TP layout: a KV cache per rank, batched prompts of
different lengths, greedy or sampled tokens, stops at EOS / end of turn / stop strings.

    gen = Generator(model)                                      # model: this rank's, pp == 1 (any TP)
    outs = gen.generate([[5, 9, 2], [7, 1]], max_new_tokens=20, stop_ids={2})
    outs[0].ids, outs[0].finish_reason                          # generated ids; "stop", "length" or "context"

One call:
1. prefill: the prompts back to back in one row, positions restarting at 0 for each (the way
   training packs documents: varlen attention over several prompts, no padding, no wasted rows),
   each layer storing its rotated keys and values in the cache (:class:`~tpkernels.models.kv_cache.KVCache`);
   the head forms the logits of each prompt's last token only.
2. decode: one token per row per step, at position = the row's length, attending to the row's
   cache; rows that stopped keep their slot (their tokens are ignored) so the others' shapes never change.

Padded batches (``input_ids`` with an ``attention_mask``, left or right padding) are unpadded first:
the mask picks each row's tokens, and positions start at 0 at each row's first real token, so a
padded row gives what the row alone gives.

Every TP rank must take the same token: the logits are all-gathered over TP, so every rank holds the
same bits, but a generator advanced differently on one rank, a nondeterministic GPU sampling kernel or a
stop string (a tokenizer decode) seen by one rank would make the ranks diverge and then hang in
mismatched collectives. So TP rank 0 chooses (tokens and which rows stopped) and broadcasts them: one
message of a few integers per step, beside the all-reduces each layer already does. The prompts are
broadcast from TP rank 0 once per call for the same reason.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tpkernels.generate.sampling import Sampling
from tpkernels.models.inputs import StageInput, document_bounds
from tpkernels.models.kv_cache import KVCache
from tpkernels.parallel import control


@dataclass
class Completion:
    """One prompt's result: ``ids`` the generated tokens (a stop token included, as transformers returns
    it); ``finish_reason``: "stop" (a stop id), "stop_string", "length" (max_new_tokens) or "context"
    (the model's context, max_position_embeddings, is full); ``text`` when the caller decodes: the reply as
    it continues the prompt's text (cut before a stop string)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    text: str | None = None


def unpad(input_ids: Tensor, attention_mask: Tensor | None) -> list[list[int]]:
    """Each row's real tokens of a (batch, seq) batch: all of them without a mask, else those where the
    mask is 1 (left or right padding alike; a hole inside a row is refused: positions would be ambiguous)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")
    out = []
    for r, (row, m) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
        on = [i for i, x in enumerate(m) if x]
        if on and on[-1] - on[0] + 1 != len(on):
            raise ValueError(f"attention_mask row {r} has a hole: padding must be on the left or the right")
        out.append([row[i] for i in on])
    return out


class Generator:
    """Generates with ``model`` (this rank's part of a ParallelTransformer without pipeline parallelism, at
    any TP size; collective over its TP group)."""

    def __init__(self, model):
        if model.num_virtual != 1:
            raise ValueError(f"generation runs one pipeline stage: the model has pp ({model.state.pp_size}) and "
                             f"virtual stages ({model.state.config.virtual_stages}); load it with pp 1 (TP layouts "
                             "only)")
        if model.ctx.sequence_parallel and model.ctx.tp_size > 1:
            raise ValueError("generation needs sequence_parallel off: a decoding step's one token per row cannot be "
                             "split along the sequence")
        if model.ctx.cp_size > 1:
            raise ValueError(f"generation needs cp 1 (cp is {model.ctx.cp_size})")
        self.model = model
        self.group = model.state.tp_group
        self.chunk = model.chunks[0]
        self.device = model._device()

    @property
    def is_chooser(self) -> bool:
        """The rank that chooses the tokens (TP rank 0)."""
        return self.model.state.tp_rank == 0

    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """Checked prompts; returns the cache capacity per row."""
        mc = self.model.config
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens!r}) must be an integer >= 1")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token (e.g. the tokenizer's BOS)")
            bad = [t for t in p if not isinstance(t, int) or not 0 <= t < mc.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token id {bad[0]!r}: ids must be in [0, vocab_size "
                                 f"({mc.vocab_size}))")
            if len(p) >= mc.max_position_embeddings:
                raise ValueError(f"prompt {i} has {len(p)} tokens: the model's context (max_position_embeddings) is "
                                 f"{mc.max_position_embeddings} tokens, so a prompt may have at most "
                                 f"{mc.max_position_embeddings - 1} to leave room for one new token; shorten it")
        return min(max(len(p) for p in prompts) + max_new_tokens, mc.max_position_embeddings)

    def _hidden(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The final normed hidden state (batch, seq, hidden) of ids (batch, seq) at positions (batch, seq),
        through the model's own stage (embedding, blocks, final norm); documents from the positions."""
        docs = document_bounds(positions) if positions.shape[0] == 1 else torch.empty(positions.shape[0], 0,
                                                                                       dtype=torch.int32)
        x = StageInput((ids.to(self.device),), positions.to(self.device), docs).astuple()
        return self.chunk(x)

    def _logits(self, y: Tensor) -> Tensor:
        """(rows, vocab) logits of hidden states (rows, hidden), gathered over TP (every rank the same bits)."""
        return self.model.head.logits(y.unsqueeze(0))[0]

    @torch.no_grad()
    def prefill(self, cache: KVCache, prompts: list[list[int]]) -> Tensor:
        """Run the prompts (an empty cache) and return each one's last-token logits (batch, vocab)."""
        cache.reset()
        lens = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        cache.begin(lens, packed=True)
        y = self._hidden(ids, pos)
        cache.advance()
        last = torch.tensor(lens).cumsum(0) - 1
        return self._logits(y[0, last.to(y.device)])

    @torch.no_grad()
    def extend(self, cache: KVCache, ids: Tensor) -> Tensor:
        """Append ids (batch, n) to every row of the cache (rows of any lengths); returns the logits of all
        n new positions (batch, n, vocab)."""
        b, n = ids.shape
        pos = torch.tensor(cache.lengths)[:, None] + torch.arange(n)[None]
        if int(pos.max()) >= self.model.config.max_position_embeddings:
            raise ValueError(f"position {int(pos.max())} is past the model's context (max_position_embeddings "
                             f"{self.model.config.max_position_embeddings})")
        cache.begin([n] * b)
        y = self._hidden(ids, pos)
        cache.advance()
        return self._logits(y.reshape(b * n, -1)).reshape(b, n, -1)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]] | Tensor, max_new_tokens: int = 32, sampling: Sampling | None = None,
                 *, attention_mask: Tensor | None = None, stop_ids=(), stop_strings=(), decode=None,
                 seed: int = 0, stream=None) -> list[Completion]:
        """Generate for each prompt (lists of ids, or a padded (batch, seq) tensor with ``attention_mask``).

        max_new_tokens: at most this many new tokens per prompt (fewer when the context fills).
        sampling: :class:`Sampling` (default greedy). stop_ids: ids that end a row (EOS, end of turn).
        stop_strings: texts that end a row once its decoded reply holds one (``decode(ids) -> str`` needed;
        the text is cut before it). seed: the chooser's generator seed. stream(row, token): called on the
        chooser as each token is taken. Collective over the TP group; every rank returns the same."""
        sampling = sampling or Sampling()
        if isinstance(prompts, Tensor):
            prompts = unpad(prompts, attention_mask)
        elif attention_mask is not None:
            raise ValueError("attention_mask goes with a (batch, seq) tensor of input_ids, not lists of ids")
        prompts = [_ids(i, p) for i, p in enumerate(prompts)]
        stop_strings = [s for s in stop_strings]
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"stop_strings ({stop_strings!r}) must be non-empty strings")
        if stop_strings and decode is None:
            raise ValueError("stop_strings need decode (ids -> text) to read the reply")
        # every rank generates for TP rank 0's prompts (a rank given others would run mismatched collectives)
        prompts = control.broadcast_object(prompts, 0, self.group)
        capacity = self._check(prompts, max_new_tokens)
        model, b = self.model, len(prompts)
        vocab = model.config.vocab_size
        outs = [Completion(p) for p in prompts]
        cache = KVCache(model, b, capacity)
        gen = torch.Generator().manual_seed(seed) if self.is_chooser else None
        seen = None
        if sampling.repetition_penalty != 1.0 and self.is_chooser:
            seen = torch.zeros(b, vocab, dtype=torch.bool)
            for r, p in enumerate(prompts):
                seen[r, p] = True
        stop_ids = {int(i) for i in stop_ids}
        limit = model.config.max_position_embeddings
        active = list(range(b))  # the rows still generating, in the cache's row order
        with cache.attached(model):
            logits = self.prefill(cache, prompts)
            while True:
                choice = None
                if self.is_chooser:
                    try:  # what fails here fails on every rank (the others wait in the broadcast)
                        choice = self._choose(logits, seen, active, outs, sampling, gen, stop_ids, stop_strings,
                                              decode, len(outs[active[0]].ids))
                        for r, t in zip(active, choice[0]) if stream is not None else ():
                            stream(r, t)  # every active row takes its token, the ones that stop included
                    except Exception as e:  # noqa: BLE001  (sent to every rank, raised there)
                        choice = e
                choice = control.broadcast_object(choice, 0, self.group)
                if isinstance(choice, BaseException):
                    raise choice
                tokens, reasons = choice
                keep = []
                for j, (r, t, why) in enumerate(zip(active, tokens, reasons)):
                    o = outs[r]
                    o.ids.append(t)
                    if seen is not None:
                        seen[r, t] = True
                    if why is not None:
                        o.finish_reason = why
                    elif len(o.ids) >= max_new_tokens:
                        o.finish_reason = "length"
                    elif len(o.prompt_ids) + len(o.ids) >= limit:  # the next token would sit past the context
                        o.finish_reason = "context"
                    else:
                        keep.append(j)
                if not keep:
                    break
                if len(keep) < len(active):  # finished rows leave the batch (and the cache)
                    cache.keep(keep)
                    active, tokens = [active[j] for j in keep], [tokens[j] for j in keep]
                logits = self.extend(cache, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0]
        if decode is not None:
            for o in outs:
                o.text = _reply_text(o, decode)
                if o.finish_reason == "stop_string":
                    o.text = _cut(o.text, stop_strings)
        return outs

    def _choose(self, logits, seen, active, outs, sampling, gen, stop_ids, stop_strings, decode, step):
        """The chooser's (tokens, stop reasons) of the active rows."""
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(f"the model's logits hold NaN or inf at new token {step}: the weights are broken "
                                     "or overflow in this dtype (try dtype float32)")
        rows = torch.tensor(active)
        tokens = sampling.next_tokens(logits.cpu() if seen is not None else logits,
                                      seen[rows] if seen is not None else None, gen).tolist()
        return tokens, [self._reason(outs[r], t, stop_ids, stop_strings, decode) for r, t in zip(active, tokens)]

    @staticmethod
    def _reason(out: Completion, token: int, stop_ids: set, stop_strings: list, decode) -> str | None:
        if token in stop_ids:
            return "stop"
        if stop_strings:
            text = decode(out.ids + [token])
            if any(s in text for s in stop_strings):
                return "stop_string"
        return None


def _ids(i: int, prompt) -> list[int]:
    """Prompt ``i`` as a list of Python ints (integers of any kind, or a 1-D integer tensor; anything else is
    named)."""
    if isinstance(prompt, Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise ValueError(f"prompt {i} is a {prompt.dtype} tensor of shape {tuple(prompt.shape)}: a prompt tensor "
                             "holds 1-D integer token ids")
        prompt = prompt.tolist()
    bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
    if bad is not None:
        raise ValueError(f"prompt {i} holds {bad!r}: a prompt is a list of token ids (integers)")
    return [int(t) for t in prompt]


def _reply_text(out: Completion, decode) -> str:
    """The reply as it continues the prompt's text: decode(prompt + reply) past decode(prompt), as transformers'
    text-generation pipeline cuts it (a word-level or SentencePiece tokenizer puts the space between prompt and
    reply there), or the reply decoded alone when the prompt's text is no prefix of the whole."""
    before, whole = decode(out.prompt_ids), decode(out.prompt_ids + out.ids)
    return whole[len(before):] if whole.startswith(before) else decode(out.ids)


def _cut(text: str, stop_strings: list[str]) -> str:
    """The text before the first stop string."""
    at = min((text.find(s) for s in stop_strings if s in text), default=len(text))
    return text[:at]


__all__ = ["Completion", "Generator", "unpad"]
