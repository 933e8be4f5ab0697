"""Chat templates and the assistant mask: the package's mask (generation markers, or prefix rendering)
equals a separate, simple rule on the rendered tokens for every turn and for the last only; prompt/
completion supervises the completion and its EOS; every bad input is a named error."""

from __future__ import annotations

import pytest

from data_checks import CHATS, MARKED, NOT_MONOTONE, PLAIN, SPECIAL, make_tokenizer, reference_mask
from tpkernels.data.chat import SampleEncoder, load_hf_tokenizer


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {name: load_hf_tokenizer(str(make_tokenizer(root / name, tpl)), "test")
            for name, tpl in (("plain", PLAIN), ("marked", MARKED), ("not_monotone", NOT_MONOTONE),
                              ("none", None))}


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
