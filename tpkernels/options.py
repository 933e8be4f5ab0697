"""Dataclasses as config files and command-line flags: the one mechanism of ``tpkernels train`` and
``tpkernels plan``.

A config is a dataclass whose fields are values or sections (dataclasses again). Every value has one
dotted key, the same in a YAML/TOML file (nested or dotted), on the command line
(``--parallel.tp 2``, ``--parallel.micro-batch-size 2``) and in error messages. Types come from the
fields' real annotations (``typing.get_type_hints``): ``int``, ``float``, ``bool``, ``str``, those
``| None``, a ``choices`` tuple in the field's metadata. They are checked when the config is read,
with the key, the value and the expected type (``parallel.sequence_parallel ('no') must be true or
false``); text from the command line is parsed by the same types (``true``/``false``, ``none``).
Aliases (``--tp`` for ``parallel.tp``) are a table the caller passes; a file may use an alias
only with a note naming the real key (the old flat config files keep working).

Why not tyro or jsonargparse (both turn dataclasses into CLIs with config files, and DESIGN.md
prefers a library): the GPU machine's image holds neither, and it installs nothing from a
registry, so either would travel as wheels into every GPU session (tyro brings five packages);
and both would still need our own layer for what this package promises: TOML files beside
YAML, duplicate YAML keys refused, old flat keys mapped with a note, a frozen ParallelConfig used
as a section as is, and errors in the house format on every rank. What that leaves of them is
~150 lines, so this module is those lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a switch on the command line is spelled as in a file (YAML/TOML: true, false); the planner's compact layout
# strings (``SP=yes,zero=off``) take the looser words too (``coerce(..., loose=True)``)
_TRUE, _FALSE = ("true",), ("false",)
_LOOSE_TRUE, _LOOSE_FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_NONE = ("none", "null", "~")


def opt(default, help: str, choices: tuple | None = None):
    """A field with its help text (and allowed values)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=meta)


def section(factory, help: str = ""):
    """A field holding a section: a dataclass instance made by ``factory`` (the class: its defaults)."""
    return dataclasses.field(default_factory=factory, metadata={"help": help, "section": True})


@dataclass(frozen=True)
class Key:
    """One value of a config: its dotted ``path``, type, default, help and allowed values."""

    path: str
    type: Any
    default: Any
    help: str = ""
    choices: tuple | None = None

    @property
    def optional(self) -> bool:
        return _optional(self.type)[1]

    @property
    def base(self):
        return _optional(self.type)[0]

    def describe_type(self) -> str:
        base = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(self.base, "a value")
        if self.choices:
            base = "one of " + ", ".join(map(str, self.choices))
        return base + (" or none" if self.optional else "")


def _optional(tp) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), type(None) in typing.get_args(tp)
    return tp, False


def is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def keys_of(cls, prefix: str = "", defaults=None) -> list[Key]:
    """Every value of config class ``cls`` (sections flattened), in field order. A section's defaults are
    those of the instance its factory makes (``parallel``'s dp is None there: what the world leaves)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        if is_section(tp):
            made = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            out += keys_of(tp, f"{prefix}{f.name}.", made)
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
        out.append(Key(prefix + f.name, tp, default, f.metadata.get("help", ""), f.metadata.get("choices")))
    return out


def _bad(key: Key, value, rule: str | None = None, *, text: bool = False) -> ValueError:
    # a file's string where a number or a switch belongs is named as one (YAML's `"no"`, TOML's `"2"`)
    shown = f"the string {value!r}" if isinstance(value, str) and key.base is not str and not text else repr(value)
    return ValueError(f"{key.path} ({shown}) must be {rule or key.describe_type()}")


def coerce(key: Key, value, *, text: bool = False, loose: bool = False):
    """``value`` as the type of ``key``: strictly for values of a file or a dict (YAML/TOML typed them),
    by parsing for command-line text (a switch: true or false, as a file spells it; ``loose``: also
    yes/no, on/off, 1/0). Raises ValueError naming the key, the value and the type."""
    if text and isinstance(value, str):
        low = value.strip().lower()
        if key.optional and low in _NONE:
            return None
        base = key.base
        true, false = (_LOOSE_TRUE, _LOOSE_FALSE) if loose else (_TRUE, _FALSE)
        try:
            if base is bool:
                if low not in true + false:
                    raise ValueError
                value = low in true
            elif base is int:
                value = int(value.strip())
            elif base is float:
                value = float(value.strip())
        except ValueError:
            raise _bad(key, value, text=True) from None
    if value is None:
        if key.optional:
            return None
        raise _bad(key, value)
    base = key.base
    if base is bool:
        if not isinstance(value, bool):
            raise _bad(key, value)
    elif base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value)
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(key, value)
        value = float(value)
        if not math.isfinite(value):
            raise _bad(key, value, "a finite number")
    elif base is str:
        if not isinstance(value, str):
            raise _bad(key, value)
    elif base is dict:
        if not isinstance(value, dict):
            raise _bad(key, value, "a mapping")
    if key.choices is not None and value not in key.choices:
        raise _bad(key, value)
    return value


def flatten(values: dict, cls=None, prefix: str = "", *, where: str | None = None) -> dict:
    """Nested dicts of a file (``{"parallel": {"tp": 2}}``) as dotted keys (``{"parallel.tp": 2}``);
    keys already dotted are kept. A dict under a key that is no section of ``cls`` stays whole. Two
    spellings of one key (``parallel: {tp: 2}`` and ``parallel.tp: 1``, or ``micro-batch-size`` and
    ``micro_batch_size``) are refused as a YAML key given twice is: which one would win is no rule a
    reader sees. ``where``: the file, for the message."""
    sections = _section_paths(cls) if cls is not None else None
    out: dict = {}
    _flatten_into(values, sections, prefix, (), out, {}, where)
    return out


def _flatten_into(values: dict, sections, prefix: str, chain: tuple, out: dict, spelled: dict, where) -> None:
    for k, v in values.items():
        path = prefix + str(k).replace("-", "_")
        if isinstance(v, dict) and (sections is None or path in sections):
            _flatten_into(v, sections, path + ".", (*chain, str(k)), out, spelled, where)
            continue
        spelling = "".join(f"{c}: {{" for c in chain) + str(k) + "}" * len(chain)
        if path in out:
            raise ValueError(f"config key {path!r} is given twice (as {spelled[path]!r} and as {spelling!r})"
                             f"{f' in {where}' if where else ''}; give each key once")
        out[path], spelled[path] = v, spelling


def _section_paths(cls, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            out.add(prefix + f.name)
            out |= _section_paths(hints[f.name], prefix + f.name + ".")
    return out


def resolve_aliases(values: dict, aliases: dict[str, str], *, where: str | None = None) -> dict:
    """``values`` with alias keys replaced by their real keys. ``where`` (a file name): note each alias
    used there (the file's old flat spelling still works, the note names the key to write)."""
    out, spelled = {}, {}
    for k, v in values.items():
        real = aliases.get(k, k)
        if real != k and where is not None:
            warnings.warn(f"{where}: config key {k!r} is the old flat spelling of {real!r}; it is read as "
                          f"{real!r} (write that)", FutureWarning, stacklevel=3)
        if real in out:
            raise ValueError(f"config key {real!r} is given twice (as {spelled[real]!r} and as {k!r})"
                             f"{f' in {where}' if where else ''}; give each key once")
        out[real], spelled[real] = v, k
    return out


def build(cls, values: dict, *, text: bool = False, base=None, prefix: str = ""):
    """An instance of ``cls`` from dotted ``values`` over ``base`` (default: ``cls()``'s defaults).
    Unknown keys raise ValueError naming the nearest known ones."""
    keys = {k.path: k for k in keys_of(cls)}
    unknown = sorted(set(values) - set(keys))
    if unknown:
        hints = {u: difflib.get_close_matches(u, list(keys), n=1) or
                 difflib.get_close_matches(u.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in keys], n=1)
                 for u in unknown}
        said = "; ".join(f"{u!r}" + (f" (did you mean {_full(h[0], keys)!r}?)" if h else "") for u, h in hints.items())
        raise ValueError(f"unknown config key{'s' if len(unknown) > 1 else ''} {said}; known keys: "
                         f"{', '.join(keys)}")
    typed = {p: coerce(keys[p], v, text=text) for p, v in values.items()}
    return _assemble(cls, typed, base if base is not None else cls(), "")


def _full(match: str, keys: dict) -> str:
    return match if match in keys else next(k for k in keys if k.rsplit(".", 1)[-1] == match)


def _assemble(cls, typed: dict, current, prefix: str):
    hints = typing.get_type_hints(cls)
    changes = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if is_section(hints[f.name]):
            inner = {p: v for p, v in typed.items() if p.startswith(path + ".")}
            if inner:
                changes[f.name] = _assemble(hints[f.name], inner, getattr(current, f.name), path + ".")
        elif path in typed:
            changes[f.name] = typed[path]
    return dataclasses.replace(current, **changes) if changes else current


def as_dict(config) -> dict:
    """The nested dict of a config (what a file would hold)."""
    return dataclasses.asdict(config)


def read_file(path: str | Path, what: str = "config") -> dict:
    """The nested mapping of a YAML (.yaml/.yml) or TOML (.toml) file. A YAML key given twice is an
    error (YAML's loaders keep the last one silently)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} ({str(path)!r}) does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib  # noqa: PLC0415

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{what} ({str(path)!r}) is not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        data = _load_yaml(text, path, what)
    else:
        raise ValueError(f"{what} ({str(path)!r}) must be a .yaml, .yml or .toml file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} ({str(path)!r}) must hold a mapping of keys to values")
    return data


def _load_yaml(text: str, path: Path, what: str):
    import yaml  # noqa: PLC0415

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"{what} ({str(path)!r}): key {key!r} is given twice (lines {seen[key]} and "
                                 f"{key_node.start_mark.line + 1}); give each key once")
            seen[key] = key_node.start_mark.line + 1
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(x for x in (e.context, e.problem) if x)
        raise ValueError(f"{what} ({str(path)!r}) is not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{what} ({str(path)!r}) is not valid YAML: {e}") from None


# ---- command line ----

@dataclass(frozen=True)
class Alias:
    """``--flag`` for ``path``; ``value`` set: a switch that sets that value (``--no-flash-attention``)."""

    path: str
    value: str | None = None


def add_flags(parser: argparse.ArgumentParser, cls, aliases: dict[str, str | Alias] | None = None,
              group_titles: dict[str, str] | None = None) -> None:
    """One ``--<key>`` flag per key of ``cls`` (``_`` or ``-`` alike), plus ``--<alias>`` flags. Values
    stay text until :func:`build` parses them by the key's type; a bool flag alone means true."""
    by_path: dict[str, list[str]] = {}
    for name, a in (aliases or {}).items():
        a = a if isinstance(a, Alias) else Alias(a)
        if a.value is None:
            by_path.setdefault(a.path, []).append(name)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key in keys_of(cls):
        top = key.path.split(".", 1)[0] if "." in key.path else ""
        if top not in groups:
            title = (group_titles or {}).get(top, f"{top} section" if top else "")
            groups[top] = parser.add_argument_group(title) if title else parser
        flags = [f"--{key.path}"]
        dashed = f"--{key.path.replace('_', '-')}"
        if dashed != flags[0]:
            flags.append(dashed)
        for name in by_path.get(key.path, []):
            for spelling in (f"--{name}", f"--{name.replace('_', '-')}"):
                if spelling not in flags:
                    flags.append(spelling)
        kw = dict(dest=key.path, default=argparse.SUPPRESS, metavar=_metavar(key),
                  help=(key.help + f" (default: {shown_default(key)})") if key.help else None)
        if key.base is bool:
            kw.update(nargs="?", const="true")
        groups[top].add_argument(*flags, **kw)
    for name, a in (aliases or {}).items():
        if isinstance(a, Alias) and a.value is not None:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=a.path, action="store_const", const=a.value,
                                default=argparse.SUPPRESS, help=f"{a.path} = {a.value}")


def shown_default(key: Key) -> str:
    """A key's default as the command line spells it (true/false, none)."""
    d = key.default
    return "none" if d is None else ("true" if d else "false") if isinstance(d, bool) else "''" if d == "" else str(d)


def unknown_flag_message(flags: list[str], parser: argparse.ArgumentParser) -> str:
    """``unknown flag '--stepz' (did you mean '--steps', i.e. training.steps?)``: the parser's nearest flag,
    as :func:`build` names the nearest key of an unknown file key."""
    known = {s: a.dest for a in parser._actions for s in a.option_strings if s.startswith("--")}
    said = []
    for flag in flags:
        name = flag.split("=", 1)[0]
        near = difflib.get_close_matches(name, list(known), n=1) or difflib.get_close_matches(
            name.replace("-", "_"), list(known), n=1)
        hint = ""
        if near:
            dest = known[near[0]]
            hint = f" (did you mean {near[0]!r}" + (f", i.e. {dest}" if "." in dest and dest not in near[0] else "") + "?)"
        said.append(f"{name!r}{hint}")
    keys = " (each config key is a --section.key flag)" if any("." in d for d in known.values()) else ""
    return f"unknown flag{'s' if len(said) > 1 else ''} {'; '.join(said)}; --help lists every flag{keys}"


def suggest_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (a subcommand's too) refuse an unknown ``--flag`` with the nearest known one, instead of
    argparse's bare "unrecognized arguments" (which the top-level parser would print)."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = parse(args, namespace)
        flags = [a for a in extra if a.startswith("--")]
        if flags:
            parser.exit(2, f"{parser.prog}: error: {unknown_flag_message(flags, parser)}\n")  # no usage: it is long
        return ns, extra

    parser.parse_known_args = parse_known_args


def _metavar(key: Key) -> str:
    if key.choices:
        return "{" + ",".join(map(str, key.choices)) + "}"
    return {bool: "true|false", int: "N", float: "X", str: "TEXT"}.get(key.base, "VALUE")


def flag_values(args: argparse.Namespace, cls) -> dict:
    """The dotted keys of ``cls`` that the command line gave, as text."""
    paths = {k.path for k in keys_of(cls)}
    return {k: v for k, v in vars(args).items() if k in paths}


__all__ = ["Alias", "Key", "add_flags", "as_dict", "build", "coerce", "flag_values", "flatten", "keys_of", "opt",
           "read_file", "resolve_aliases", "section", "shown_default", "suggest_unknown_flags", "unknown_flag_message"]
