"""Record formats, told apart by their columns (or named by ``data.format``), TRL's conventions.

=====================  ==================================  ========================================
format                 columns                             one record
=====================  ==================================  ========================================
``text``               ``text``                            a document (pre-training: every token)
``messages``           ``messages``                        [{role, content}, …] ending with an
                                                           assistant turn (loss on assistant turns)
``prompt_completion``  ``prompt``, ``completion``          strings, or conversational: a list of
                                                           messages and the assistant's reply list
``preference``         ``prompt``, ``chosen``,             strings, or conversational lists
                       ``rejected``                        (the chosen/rejected replies)
=====================  ==================================  ========================================

``check_*`` raise a ValueError naming the source, the record and the rule it breaks.
"""

from __future__ import annotations

FORMATS = ("auto", "text", "messages", "prompt_completion", "preference")
COLUMNS = {"text": ("text",), "messages": ("messages",), "prompt_completion": ("prompt", "completion"),
           "preference": ("prompt", "chosen", "rejected")}
CHAT_FORMATS = ("messages", "prompt_completion")  # training.task sft
ROLES = ("system", "user", "assistant")  # any other role (a typo, "robot") is refused, not trained as prompt


def detect_format(columns: list[str], given: str = "auto", source: str = "") -> str:
    """The format of records with ``columns``: ``given`` (its columns checked) or the first of
    preference, messages, prompt_completion, text whose columns are all there."""
    cols = set(columns)
    if given != "auto":
        missing = [c for c in COLUMNS[given] if c not in cols]
        if missing:
            raise ValueError(f"data.source ({source!r}) lacks column(s) {missing} of data.format {given!r}; its "
                             f"columns: {sorted(cols)}")
        return given
    if {"chosen", "rejected"} <= cols and "prompt" not in cols:
        raise ValueError(f"data.source ({source!r}) has chosen/rejected but no 'prompt' column (columns: "
                         f"{sorted(cols)}): give the prompt in its own column (TRL's explicit-prompt preference "
                         "format)")
    for fmt in ("preference", "messages", "prompt_completion", "text"):
        if set(COLUMNS[fmt]) <= cols:
            return fmt
    raise ValueError(f"data.source ({source!r}) has columns {sorted(cols)}: none of the formats' columns "
                     + "; ".join(f"{k}: {list(v)}" for k, v in COLUMNS.items()) + " (or set data.format)")


def is_conversational(value) -> bool:
    return isinstance(value, list)


def check_messages(messages, where: str, *, final_assistant: bool = True) -> list[dict]:
    """``messages`` as a list of {role, content} with string contents and a role of ``ROLES``; with
    ``final_assistant`` it must end with an assistant turn (a conversation whose reply is missing trains nothing)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}, not {messages!r:.80}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: each message must be {{role: str, content: str}}, not {m!r:.80}")
    for j, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has role {m['role']!r}: a role must be one of {', '.join(ROLES)}")
    if final_assistant and messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the messages end with a {messages[-1]['role']!r} turn: the last turn must be the "
                         "assistant's (the reply the loss trains on)")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def check_completion(value, where: str, name: str = "completion"):
    """A plain completion string or a conversational list of assistant turns, never empty."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: the {name} is empty: nothing to train on")
        return value
    msgs = check_messages(value, where + f" ({name})")
    for m in msgs:
        if m["role"] == "assistant" and not m["content"]:
            raise ValueError(f"{where}: the {name}'s assistant turn is empty: nothing to train on")
    return msgs


def check_prompt(value, completion, where: str):
    """The prompt, of the same kind (plain or conversational) as its completion."""
    if isinstance(completion, str):
        if not isinstance(value, str):
            raise ValueError(f"{where}: the prompt must be a string when the completion is one, not {value!r:.80}")
        return value
    return check_messages(value, where + " (prompt)", final_assistant=False)
