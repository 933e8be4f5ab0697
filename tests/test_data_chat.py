"""Chat templates and the assistant mask: the package's mask (generation markers, or prefix rendering)
equals a separate, simple rule on the rendered tokens for every turn and for the last only, with a
word-level tokenizer and with a byte-level BPE whose offsets are trimmed (code indentation, a
conversation opening with an assistant turn after a preamble and an injected system prompt); prompt/
completion supervises the completion and its EOS; every bad input (an unknown role too) is a named error."""

from __future__ import annotations

import pytest

from data_checks import (CHATS, CODE_CHATS, CODE_MARKED, CODE_PLAIN, CODE_SPACED, MARKED, NOT_MONOTONE, PLAIN,
                         SPECIAL, make_bytelevel_tokenizer, make_tokenizer, reference_mask)
from tpkernels.data.chat import SampleEncoder, load_hf_tokenizer


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    toks = {name: load_hf_tokenizer(str(make_tokenizer(root / name, tpl)), "test")
            for name, tpl in (("plain", PLAIN), ("marked", MARKED), ("not_monotone", NOT_MONOTONE),
                              ("none", None))}
    for name, tpl in (("code_plain", CODE_PLAIN), ("code_marked", CODE_MARKED), ("code_spaced", CODE_SPACED),
                      ("code_twice", CODE_PLAIN + "{% for m in messages %}{{ m['content'] }}{% endfor %}")):
        toks[name] = load_hf_tokenizer(str(make_bytelevel_tokenizer(root / name, tpl)), "test")
    return toks


@pytest.mark.parametrize("template", ["plain", "marked"])
@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_assistant_mask_equals_the_simple_rule(toks, template, loss_on):
    enc = SampleEncoder(toks[template], "messages", loss_on)
    assert enc.markers == (template == "marked")
    for k, chat in enumerate(CHATS):
        (doc,) = enc.encode(chat, f"record {k}")
        assert doc.mask == reference_mask(doc.ids, last_only=loss_on == "last_assistant"), k
        end = SPECIAL.index("<|end|>")
        assert doc.mask[len(doc.ids) - 1 - doc.ids[::-1].index(end)]  # the closing end-of-turn is supervised


@pytest.mark.parametrize("template", ["code_plain", "code_marked", "code_spaced"])
@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_code_mask_keeps_whitespace_tokens_and_skips_the_preamble(toks, template, loss_on):
    """Byte-level BPE, offsets trimmed: indentation tokens (empty offsets) are supervised like the rest of the
    reply; a conversation opening with an assistant turn supervises neither the preamble (<s>) nor the system
    prompt the template injects. code_spaced: the space after the header is prompt when it is a token of its
    own, and a token merging it with the reply's first characters (indentation) is the reply's."""
    tok = toks[template]
    enc = SampleEncoder(tok, "messages", loss_on)
    spaces = 0
    for k, chat in enumerate(CODE_CHATS):
        (doc,) = enc.encode(chat, f"record {k}")
        rendered = tok(tok.apply_chat_template(chat["messages"], tokenize=False), add_special_tokens=False,
                       return_offsets_mapping=True)
        assert doc.ids == rendered["input_ids"]  # the rendering, tokenized
        want = reference_mask(doc.ids, last_only=loss_on == "last_assistant", tok=tok)
        header = tok.convert_tokens_to_ids("<|assistant|>")
        for t in range(len(doc.ids) - 1):
            if doc.ids[t] == header and tok.decode(doc.ids[t + 1:t + 2]) == " ":  # the template's own space
                want[t + 1] = False
        assert doc.mask == want, k
        offsets = rendered["offset_mapping"]
        blank = [m for i, m, (a, b) in zip(doc.ids, doc.mask, offsets) if tok.decode([i]).isspace() and a == b]
        spaces += sum(blank)
    assert spaces >= 2  # whitespace-only tokens with empty (trimmed) offsets were among the supervised


def test_conversational_and_plain_prompt_completion(toks):
    tok = toks["plain"]
    enc = SampleEncoder(tok, "prompt_completion")
    chat = CHATS[0]["messages"]
    (conv,) = enc.encode({"prompt": chat[:3], "completion": chat[3:]}, "r")
    (whole,) = SampleEncoder(tok, "messages", "last_assistant").encode({"messages": chat}, "r")
    assert conv.ids == whole.ids and conv.mask == whole.mask  # only the completion's turn
    (plain,) = enc.encode({"prompt": "what is two plus three", "completion": "five"}, "r")
    ids = tok("what is two plus three five", add_special_tokens=False)["input_ids"]
    assert plain.ids == [tok.bos_token_id] + ids + [tok.eos_token_id]
    assert plain.mask == [False] * 6 + [True, True]  # the completion and its EOS


def test_preference_records_give_chosen_then_rejected(toks):
    enc = SampleEncoder(toks["marked"], "preference")
    prompt = [{"role": "user", "content": "what is two plus three"}]
    chosen, rejected = enc.encode({"prompt": prompt, "chosen": [{"role": "assistant", "content": "five"}],
                                   "rejected": [{"role": "assistant", "content": "four"}]}, "r")
    assert chosen.ids[:-3] == rejected.ids[:-3] and chosen.ids != rejected.ids
    assert chosen.mask == reference_mask(chosen.ids) and rejected.mask == reference_mask(rejected.ids)


def test_bad_inputs_are_named_errors(toks):
    msgs = SampleEncoder(toks["plain"], "messages")
    with pytest.raises(ValueError, match=r"record 7: the messages end with a 'user' turn"):
        msgs.encode({"messages": CHATS[0]["messages"][:3]}, "record 7")
    with pytest.raises(ValueError, match="cannot mark assistant tokens.*not monotone"):
        SampleEncoder(toks["not_monotone"], "messages").encode(CHATS[0], "r")
    with pytest.raises(ValueError, match="no chat_template"):
        SampleEncoder(toks["none"], "messages").encode(CHATS[0], "r")
    pc = SampleEncoder(toks["plain"], "prompt_completion")
    with pytest.raises(ValueError, match="the completion is empty"):
        pc.encode({"prompt": "hi", "completion": ""}, "r")
    with pytest.raises(ValueError, match="assistant turn is empty"):
        pc.encode({"prompt": [{"role": "user", "content": "hi"}],
                   "completion": [{"role": "assistant", "content": ""}]}, "r")
    with pytest.raises(ValueError, match="each message must be"):
        msgs.encode({"messages": [{"role": "user"}]}, "r")
    with pytest.raises(ValueError, match=r"data.loss_on \('every'\) must be one of"):
        SampleEncoder(toks["plain"], "messages", "every")
    with pytest.raises(ValueError, match="needs data.tokenizer"):
        load_hf_tokenizer(None, "chat")
    for role in ("robot", "assitant"):
        bad = [{"role": "user", "content": "hi"}, {"role": role, "content": "hello"},
               {"role": "assistant", "content": "bye"}]
        with pytest.raises(ValueError, match=rf"record 4: message 1 has role '{role}': a role must be one of "
                                             "system, user, assistant"):
            msgs.encode({"messages": bad}, "record 4")
        with pytest.raises(ValueError, match=rf"r \(prompt\): message 0 has role '{role}'"):
            pc.encode({"prompt": bad[1:2], "completion": bad[2:]}, "r")
    opening = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "bye"}]}
    with pytest.raises(ValueError, match="does not render the opening assistant turn's content as given"):
        SampleEncoder(toks["code_twice"], "messages").encode(opening, "r")
