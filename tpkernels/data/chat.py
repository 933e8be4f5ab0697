"""Records to token ids and loss masks, through the tokenizer's own chat template.

    enc = SampleEncoder(tokenizer, fmt="messages", loss_on="all_assistant")
    docs = enc.encode(record, where="chat.jsonl record 3")   # [Encoded(ids, mask)]; 2 for a preference pair

``Encoded.ids`` (n,) and ``Encoded.mask`` (n,), both lists: ``mask[t]`` True when token t is a
supervised target (the label-token convention of :class:`~tpkernels.data.batch.TokenBatch`).

The assistant mask of a conversation:

* a template with generation markers (``{% generation %}`` … ``{% endgeneration %}``): the tokens
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks;
* otherwise by prefix rendering: assistant turn i covers the characters that rendering
  ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt (the assistant
  header stays a prompt; the end-of-turn / EOS the template closes the turn with is supervised), and
  a token is supervised when it starts inside such a span. A template whose renderings are not
  prefixes of one another cannot mark assistant tokens this way: a named error, never a loss on
  the whole sequence.

``loss_on``: ``all_assistant`` (every assistant turn) or ``last_assistant`` (the final one only).
Prompt/completion records supervise the completion only (conversational: its assistant turns);
plain ones are ``prompt + completion + EOS``, the completion and EOS supervised.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tpkernels.data.formats import check_completion, check_messages, check_prompt

LOSS_ON = ("all_assistant", "last_assistant")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclasses.dataclass
class Encoded:
    ids: list[int]
    mask: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


def load_hf_tokenizer(path: str | None, why: str):
    """A Hugging Face tokenizer from a local folder (never the hub)."""
    if path is None:
        raise ValueError(f"{why} needs data.tokenizer: a local Hugging Face tokenizer folder (with a chat template "
                         "for conversations)")
    if not Path(path).is_dir():
        raise ValueError(f"data.tokenizer ({path!r}) must be a local Hugging Face tokenizer folder for {why} "
                         f"({'it does not exist' if not Path(path).exists() else 'it is a file'})")
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(path))


class SampleEncoder:
    """Encodes records of one format with one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer, fmt: str, loss_on: str = "all_assistant"):
        if loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on ({loss_on!r}) must be one of {', '.join(LOSS_ON)}")
        self.tok, self.fmt, self.loss_on = tokenizer, fmt, loss_on
        self.eos = tokenizer.eos_token_id
        self.bos = getattr(tokenizer, "bos_token_id", None)
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        self.markers = bool(self.template and _GENERATION.search(self.template))

    # ---- plain text ----
    def text_ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _plain(self, prompt: str, completion: str) -> Encoded:
        if self.eos is None:
            raise ValueError("data.tokenizer has no eos_token: a plain completion ends with it (set eos_token)")
        p = ([self.bos] if self.bos is not None else []) + self.text_ids(prompt)
        c = self.text_ids(completion) + [self.eos]
        return Encoded(p + c, [False] * len(p) + [True] * len(c))

    # ---- conversations ----
    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def conversation(self, messages: list[dict], turns: list[int], where: str) -> Encoded:
        """ids of ``messages`` rendered by the template, supervised on the assistant turns ``turns`` (indices
        into ``messages``)."""
        if self.template is None:
            raise ValueError(f"{where}: data.tokenizer has no chat_template: conversations need one")
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.markers:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            ids, flags = list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
            runs = _runs(flags)
            if set(turns) == set(assistant):
                mask = flags
            elif len(runs) == len(assistant):
                mask = [False] * len(ids)
                for turn, (a, b) in zip(assistant, runs):
                    if turn in turns:
                        mask[a:b] = [True] * (b - a)
            else:
                raise ValueError(f"{where}: the chat template's generation markers cover {len(runs)} span(s) for "
                                 f"{len(assistant)} assistant turn(s): cannot tell the turns apart for "
                                 f"data.loss_on={self.loss_on}")
            if not any(mask[t] for t in range(len(mask))):
                raise ValueError(f"{where}: the chat template's generation markers mark no token of the assistant "
                                 "turns: it cannot mark assistant tokens")
            return Encoded(ids, mask)
        full = self._render(messages, False)
        spans = []
        for i in turns:
            before = self._render(messages[:i], True) if i else ""
            upto = self._render(messages[:i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto)) or len(upto) == len(before):
                raise ValueError(f"{where}: the chat template cannot mark assistant tokens: rendering the "
                                 f"conversation up to turn {i} is not a prefix of rendering it further (prefix "
                                 "rendering is not monotone) and it has no {% generation %} markers; use a template "
                                 "with generation markers")
            spans.append((len(before), len(upto)))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = [any(a <= s < b for a, b in spans) and e > s for s, e in offsets]
        if not any(mask):
            raise ValueError(f"{where}: no token of the assistant turns survives tokenisation")
        return Encoded(ids, mask)

    def _turns(self, messages: list[dict], first: int = 0) -> list[int]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
        return turns[-1:] if self.loss_on == "last_assistant" else turns

    def _reply(self, prompt, completion, where: str) -> Encoded:
        if isinstance(completion, str):
            return self._plain(prompt, completion)
        messages = prompt + completion
        return self.conversation(messages, self._turns(messages, first=len(prompt)), where)

    # ---- records ----
    def encode(self, record: dict, where: str) -> list[Encoded]:
        """The documents of one record: one, or two (chosen, rejected) for a preference pair."""
        fmt = self.fmt
        if fmt == "text":
            text = record["text"]
            if not isinstance(text, str):
                raise ValueError(f"{where}: text must be a string, not {text!r:.80}")
            ids = self.text_ids(text) + ([self.eos] if self.eos is not None else [])
            return [Encoded(ids, [True] * len(ids))]
        if fmt == "messages":
            messages = check_messages(record["messages"], where)
            if any(m["role"] == "assistant" and not m["content"] for m in messages):
                raise ValueError(f"{where}: an assistant turn is empty: nothing to train on")
            return [self.conversation(messages, self._turns(messages), where)]
        if fmt == "prompt_completion":
            completion = check_completion(record["completion"], where)
            return [self._reply(check_prompt(record["prompt"], completion, where), completion, where)]
        chosen = check_completion(record["chosen"], where, "chosen")
        rejected = check_completion(record["rejected"], where, "rejected")
        prompt = check_prompt(record["prompt"], chosen, where)
        return [self._reply(prompt, chosen, where), self._reply(prompt, rejected, where)]


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    out, start = [], None
    for t, f in enumerate(flags + [False]):
        if f and start is None:
            start = t
        elif not f and start is not None:
            out.append((start, t))
            start = None
    return out
