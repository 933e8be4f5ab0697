"""The config reference of docs/training.md, made from the config classes' own help strings (the
``opt(default, help, choices)`` of every key), so that the table cannot drift from the code
(tests/test_cli_flags.py checks the file holds what this prints).

    python -m tpkernels.train.config_table                              # print the table
    python -m tpkernels.train.config_table --write docs/training.md     # put it there, between the markers
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from tpkernels import options
from tpkernels.train.config import TrainConfig

START = "<!-- config-table:start (python -m tpkernels.train.config_table --write docs/training.md) -->"
END = "<!-- config-table:end -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def config_table(cls=TrainConfig) -> str:
    """A markdown table: a row per section (its help), then a row per key: the key, its default as the command
    line spells it, its help (and allowed values)."""
    hints = typing.get_type_hints(cls)
    sections = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)
                if options.is_section(hints[f.name])}
    rows = ["| key | default | what it sets |", "|---|---|---|"]
    seen = None
    for key in options.keys_of(cls):
        top = key.path.split(".", 1)[0] if "." in key.path else ""
        if top != seen:
            seen = top
            rows.append(f"| **`{top}`** | | {_cell(sections[top])} |" if top else "| **(top)** | | |")
        allowed = f" ({', '.join(map(str, key.choices))})" if key.choices and not all(
            str(c) in key.help for c in key.choices) else ""
        rows.append(f"| `{key.path}` | `{options.shown_default(key)}` | {_cell(key.help + allowed)} |")
    return "\n".join(rows) + "\n"


def current_in(doc: str) -> str | None:
    """The table between the markers of ``doc`` (None: no markers)."""
    if START not in doc or END not in doc:
        return None
    return doc.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write(path: str | Path) -> None:
    path = Path(path)
    doc = path.read_text()
    if current_in(doc) is None:
        raise ValueError(f"{path} has no {START} ... {END} markers")
    head, rest = doc.split(START, 1)
    path.write_text(f"{head}{START}\n{config_table()}{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        if len(sys.argv) != 3:
            raise SystemExit("usage: python -m tpkernels.train.config_table [--write docs/training.md]")
        write(sys.argv[2])
    else:
        print(config_table(), end="")
