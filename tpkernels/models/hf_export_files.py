"""What a Hugging Face export needs beside its weights to stand alone: the base's special-token ids,
its ``generation_config.json`` (what makes ``generate`` and ``pipeline`` stop at EOS), and the
tokenizer with its chat template, so that

    pipeline("text-generation", model="export/")      # or AutoTokenizer.from_pretrained("export/")

works on the folder alone.

* Special ids (``bos_token_id``, ``eos_token_id`` — an int or a list, as Llama-3 and Qwen have —,
  ``pad_token_id``): the base's ``config.json`` values, kept as written; a key the base does not set
  comes from the tokenizer; byte-level text (no tokenizer) ends documents with id 256. Without
  this, config.json would carry the family's class defaults (Llama: bos 1, eos 2), which are not the
  base's.
* ``generation_config.json``: the base's, copied (it may hold sampling defaults and the end-of-turn
  ids); otherwise one written by ``transformers.GenerationConfig`` from the special ids. Its EOS
  list also holds the exported tokenizer's EOS when that is another token (a chat template's end of
  turn: the fine-tuned model ends its replies with it), so ``generate`` stops there too.
* Tokenizer: ``data.tokenizer`` when the run had one, else the base folder's tokenizer files, loaded
  and saved with transformers (``save_pretrained`` writes every file ``AutoTokenizer`` reads, the
  chat template included). A ``tokenizers`` JSON file is wrapped in ``PreTrainedTokenizerFast`` with
  its end-of-document token as EOS; byte-level text (no tokenizer at all) gets a byte-level BPE
  tokenizer without merges whose id of each byte is the byte (256: ``<|endoftext|>``), the ids the
  run trained on.

Nothing here runs code from the folders it reads (no ``trust_remote_code``).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_EOD_TOKEN = "<|endoftext|>"


def base_folder(init_from: str | None, name: str | None) -> Path | None:
    """The Hugging Face folder a run's model came from: ``model.init_from``, else ``model.name`` when it
    is a folder or a config.json path (a preset name: None)."""
    for src in (init_from, name):
        if not src:
            continue
        p = Path(src)
        if p.is_dir() and (p / "config.json").is_file():
            return p
        if p.is_file() and p.suffix == ".json":
            return p.parent
    return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a readable JSON file: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, not a {type(d).__name__}")
    return d


def _check_id(key: str, value, vocab_size: int, where: str):
    """``value`` when it is a token id (or a non-empty list of them) of the vocabulary; else a warning, and None
    (the export is written all the same: the base's config is data, and an id past the embedding is useless)."""
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids) or not ids:
        warnings.warn(f"export: {where} sets {key} ({value!r}), not a token id (or a non-empty list of them) in "
                      f"[0, vocab size {vocab_size}); the export leaves it out", UserWarning, stacklevel=4)
        return None
    return value


def load_export_tokenizer(tokenizer: str | None, base: Path | None):
    """The transformers tokenizer an export carries (see the module docstring), or None when the run's
    tokenizer is the base's and the base folder has no tokenizer files."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415

    if tokenizer is None:
        if base is not None:
            if any((base / f).is_file() for f in TOKENIZER_FILES):
                return AutoTokenizer.from_pretrained(str(base))
            return None
        return byte_level_tokenizer()
    p = Path(tokenizer)
    if not p.exists():  # the weights are exported all the same; the tokenizer can be copied in by hand
        warnings.warn(f"export: data.tokenizer ({tokenizer!r}) does not exist from here ({str(Path.cwd())!r}): the "
                      "export has no tokenizer; export from the folder the run's paths are relative to, or copy the "
                      "tokenizer files into it", UserWarning, stacklevel=3)
        return None
    if p.is_dir():
        return AutoTokenizer.from_pretrained(str(p))
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(str(p))
    eod = next((t for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]") if tok.token_to_id(t) is not None), None)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    # the data layer ends documents with this token, or with the id just past the vocabulary (added here)
    fast.add_special_tokens({"eos_token": eod or BYTE_EOD_TOKEN})
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ``tokenizers``' ByteLevel pre-tokenizer
    produces): printable Latin-1 bytes map to themselves, the others to 256 + n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def byte_level_tokenizer():
    """A transformers tokenizer whose ids are the UTF-8 bytes (0–255) and 256 ``<|endoftext|>``: the
    package's byte-level text (``tpkernels.data.tokenizer``) as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": BYTE_EOD_TOKEN})  # id 256
    return fast


def special_ids(base: Path | None, tok, vocab_size: int) -> dict:
    """{key: id or list of ids} for SPECIAL_KEYS: the base config.json's, then the tokenizer's for keys the
    base leaves unset (None: neither sets it)."""
    out = dict.fromkeys(SPECIAL_KEYS)
    if base is not None:
        cfg = _read_json(base / "config.json")
        for k in SPECIAL_KEYS:
            if cfg.get(k) is not None:
                out[k] = _check_id(k, cfg[k], vocab_size, f"{str(base / 'config.json')!r}")
    if tok is not None:
        for k in SPECIAL_KEYS:
            v = getattr(tok, k, None)
            if out[k] is None and v is not None and 0 <= v < vocab_size:
                out[k] = v
    return out


PROBE = "Hello, wörld! 12 + 3.5 = 15.5\n\tdef f(x):  return x  # ok <|end|> </s>"


def _check_reload(out: Path, tok, where: str) -> None:
    """Warn when ``AutoTokenizer.from_pretrained(out)`` encodes otherwise than the run's tokenizer: transformers
    picks the tokenizer class by the model type for some families (a qwen2 export always loads as Qwen2Tokenizer,
    which rebuilds its own pre-tokenizer), so a tokenizer of another kind would reload as a different one."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    again = AutoTokenizer.from_pretrained(str(out))
    if again(PROBE)["input_ids"] != tok(PROBE)["input_ids"]:
        warnings.warn(f"export: AutoTokenizer.from_pretrained({str(out)!r}) loads the tokenizer ({where}) as "
                      f"{type(again).__name__} (transformers picks it by the model type), which encodes text otherwise "
                      f"than the run did; load it with PreTrainedTokenizerFast.from_pretrained({str(out)!r}) instead",
                      UserWarning, stacklevel=3)


def _stop_ids(eos, tok):
    """The ids generation stops at: the model's EOS (an id or a list) and the tokenizer's own EOS when it is
    another (a chat template's end-of-turn token, as TRL's SFT sets it), in that order; None when neither."""
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    extra = getattr(tok, "eos_token_id", None) if tok is not None else None
    if extra is not None and extra not in ids:
        ids.append(extra)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def write_standalone_files(out: str | Path, *, base: Path | None, tokenizer: str | None, vocab_size: int) -> dict:
    """Complete the export in ``out`` (config.json already written): the special ids into config.json,
    generation_config.json, and the tokenizer files. Returns what was done: {"special_ids", "generation_config"
    ("base" or "written"), "tokenizer" (where it came from, why none was written, or None)}."""
    from transformers import GenerationConfig  # noqa: PLC0415

    out = Path(out)
    tok, note = load_export_tokenizer(tokenizer, base), None
    if tok is not None and len(tok) > vocab_size:  # e.g. a run on random tokens with a small vocab: no text
        note = (f"no tokenizer written: {tokenizer or base or 'byte-level text'} has {len(tok)} tokens, more than the "
                f"model's vocab ({vocab_size})")
        tok = None
    ids = special_ids(base, tok, vocab_size)
    cfg_path = out / "config.json"
    cfg = _read_json(cfg_path)
    cfg.update(ids)  # None where neither base nor tokenizer sets one (not the family's class default)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    stop = _stop_ids(ids["eos_token_id"], tok)
    if base is not None and (base / "generation_config.json").is_file():
        shutil.copyfile(base / "generation_config.json", out / "generation_config.json")
        gen = "base"
        if stop is not None:
            path = out / "generation_config.json"
            g = _read_json(path)
            g["eos_token_id"] = _stop_ids(g.get("eos_token_id"), tok) if g.get("eos_token_id") is not None else stop
            path.write_text(json.dumps(g, indent=2) + "\n")
    else:
        GenerationConfig(**{k: v for k, v in {**ids, "eos_token_id": stop}.items() if v is not None}).save_pretrained(
            str(out))
        gen = "written"
    where = note
    if tok is not None:
        tok.save_pretrained(str(out))
        where = tokenizer or (str(base) if base is not None else "byte-level")
        _check_reload(out, tok, where)
    return {"special_ids": ids, "generation_config": gen, "tokenizer": where}


__all__ = ["SPECIAL_KEYS", "base_folder", "byte_level_tokenizer", "load_export_tokenizer", "special_ids",
           "write_standalone_files"]
