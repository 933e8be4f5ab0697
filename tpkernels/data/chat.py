"""Records to token ids and loss masks, through the tokenizer's own chat template.

    enc = SampleEncoder(tokenizer, fmt="messages", loss_on="all_assistant")
    docs = enc.encode(record, where="chat.jsonl record 3")   # [Encoded(ids, mask)]; 2 for a preference pair

``Encoded.ids`` (n,) and ``Encoded.mask`` (n,), both lists: ``mask[t]`` True when token t is a
supervised target (the label-token convention of :class:`~tpkernels.data.batch.TokenBatch`).

The assistant mask of a conversation, in two steps:

1. the assistant spans, in characters of the rendered conversation:

   * a template with generation markers (``{% generation %}`` … ``{% endgeneration %}``): the text the
     markers enclose (the template rendered once more with each marker replaced by a sentinel character);
   * otherwise by prefix rendering: assistant turn i covers the characters that rendering
     ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt (the assistant
     header stays a prompt; the end-of-turn / EOS the template closes the turn with is supervised, the
     whitespace the template puts after it is not). A conversation that opens with an assistant turn has no
     ``messages[:0]`` to render (Hugging Face refuses an empty conversation): that turn starts where the
     template puts its content, found by rendering the turn with a sentinel content, so a preamble and an
     injected system prompt stay prompt. A template whose renderings are not prefixes of one another
     cannot mark assistant tokens this way: a named error, never a loss on the whole sequence.

2. the tokens: the rendered conversation is tokenized once, and a span [a, b) covers tokens
   ``n(a) … n(b) - 1``, ``n(c)`` being the token count of the rendering's first c characters tokenized
   alone (a token the tokenizer merged across a span's edge belongs to the span). Token counts, not
   character offsets: a tokenizer that trims its offsets (``tokenizers``' ByteLevel default) gives a
   whitespace-only token such as code indentation an empty offset, which an offset rule drops.

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
# {% generation %} / {% endgeneration %} with their whitespace-control dashes (kept when the tag becomes a sentinel)
_GENERATION = re.compile(r"\{%(-?)\s*generation\s*(-?)%\}")
_END_GENERATION = re.compile(r"\{%(-?)\s*endgeneration\s*(-?)%\}")
# private-use code points: no template or tokenizer gives them a meaning, so they mark positions in a rendering
OPEN, CLOSE, CONTENT = "\ue000", "\ue001", "\ue002\ue003"


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
    def _render(self, messages, add_generation_prompt: bool, where: str, template: str | None = None) -> str:
        from jinja2.exceptions import TemplateError  # noqa: PLC0415 (transformers' template engine)

        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                chat_template=template or self.template)
        except TemplateError as e:
            raise ValueError(f"{where}: the chat template refuses the conversation ({e})") from None

    def conversation(self, messages: list[dict], turns: list[int], where: str) -> Encoded:
        """ids of ``messages`` rendered by the template, supervised on the assistant turns ``turns`` (indices
        into ``messages``)."""
        if self.template is None:
            raise ValueError(f"{where}: data.tokenizer has no chat_template: conversations need one")
        full = self._render(messages, False, where)
        spans = self._marked_spans(messages, turns, full, where) if self.markers else \
            [self._turn_span(messages, i, full, where) for i in turns]
        return self._masked(full, spans, where)

    def _marked_spans(self, messages, turns, full: str, where: str) -> list[tuple[int, int]]:
        """[a, b) in ``full`` of the generation blocks of ``turns``."""
        # each marker becomes a block that prints its sentinel: block tags keep the marker's whitespace
        # handling (trim_blocks and lstrip_blocks apply to block tags, not to {{ }})
        tpl = _GENERATION.sub(lambda m: "{%%%s if true %%}%s{%% endif %s%%}" % (m[1], OPEN, m[2]), self.template)
        tpl = _END_GENERATION.sub(lambda m: "{%%%s if true %%}%s{%% endif %s%%}" % (m[1], CLOSE, m[2]), tpl)
        marked = self._render(messages, False, where, tpl)
        spans, plain, at, start = [], [], 0, None
        for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
            if piece in (OPEN, CLOSE):
                if (piece == OPEN) != (start is None):
                    start = -1  # nested or unmatched markers: refused below
                    break
                if piece == OPEN:
                    start = at
                else:
                    spans, start = spans + [(start, at)] * (at > start), None
            else:
                plain.append(piece)
                at += len(piece)
        if start is not None or "".join(plain) != full:
            raise ValueError(f"{where}: the chat template's {{% generation %}} blocks cannot be located in its "
                             "rendering (unmatched or nested markers, or a rendering that changes with them)")
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if set(turns) == set(assistant):
            return spans
        if len(spans) != len(assistant):
            raise ValueError(f"{where}: the chat template's generation markers cover {len(spans)} span(s) for "
                             f"{len(assistant)} assistant turn(s): cannot tell the turns apart for "
                             f"data.loss_on={self.loss_on}")
        return [s for turn, s in zip(assistant, spans) if turn in turns]

    def _turn_span(self, messages, i: int, full: str, where: str) -> tuple[int, int]:
        """[a, b) in ``full`` of assistant turn ``i`` by prefix rendering (see the module docstring)."""
        upto = self._render(messages[:i + 1], False, where)
        if i:
            before = self._render(messages[:i], True, where)
        else:  # no empty conversation to render: where the template puts a sentinel content
            probe = self._render([{**messages[0], "content": CONTENT}], False, where)
            if probe.count(CONTENT) != 1:
                raise ValueError(f"{where}: the chat template does not render the opening assistant turn's content "
                                 "as given: cannot tell where that turn starts; start the conversation with a user "
                                 "or system turn, or use a template with {% generation %} markers")
            before = probe[:probe.index(CONTENT)]
        if not (upto.startswith(before) and full.startswith(upto)) or len(upto.rstrip()) <= len(before):
            raise ValueError(f"{where}: the chat template cannot mark assistant tokens: rendering the "
                             f"conversation up to turn {i} is not a prefix of rendering it further (prefix "
                             "rendering is not monotone) and it has no {% generation %} markers; use a template "
                             "with generation markers")
        return len(before), len(upto.rstrip())

    def _masked(self, full: str, spans: list[tuple[int, int]], where: str) -> Encoded:
        """``full`` tokenized, the tokens of ``spans`` supervised (by token counts of prefixes)."""
        ids = self.text_ids(full)

        def count(c: int, end: bool) -> int:  # tokens before character c; at an end, a merged edge token is in
            pre = self.text_ids(full[:c])
            if ids[:len(pre)] == pre:  # the usual case: the edge is a token boundary
                return len(pre)
            n = next((k for k, (x, y) in enumerate(zip(pre, ids)) if x != y), len(ids))  # the first one it changed
            return min(n + end, len(ids))

        mask = [False] * len(ids)
        for a, b in spans:
            t0, t1 = count(a, False), count(b, True)
            mask[t0:t1] = [True] * max(t1 - t0, 0)
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

