"""Training data: the global batch of step k, the same at every layout, sharded over DP.

    data = make_data(source, seq, seed, vocab_size, tokenizer)   # "random", "random-documents", a text file / folder
    ids, position_ids = data.batch(step, global_batch)      # (global_batch, seq), on the CPU
    mine = rows_of_dp_rank(ids, dp_rank, dp)

Deterministic and resumable: the batch of step k depends only on (seed, k), so a run resumed at
step k, or restarted at another layout, sees the same tokens (the data position is the step).

* ``RandomTokens`` (``random``): uniform ids, one document per row (benchmarks).
* ``RandomDocuments`` (``random-documents``): uniform ids in documents of uneven length packed into
  rows, positions restarting at each: what packed text is to the loss (micro-batches hold
  different numbers of targets) without a corpus; the tests' default.
* ``PackedText``: a text file or a folder of ``*.txt`` files, tokenized by a ``tokenizers`` /
  ``transformers`` tokenizer from a local path, or byte-level (ids 0–255 of the UTF-8 bytes,
  256 = end of document) when none is given; documents (separated by blank lines) packed into
  rows of ``seq`` tokens;
  ``position_ids`` restart at each document so attention never crosses one. Rows are shuffled per
  epoch with the seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

EOD = 256
BYTE_VOCAB = 257


class RandomTokens:
    def __init__(self, vocab_size: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab_size, seq, seed

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab, (rows, self.seq), generator=g), None


class RandomDocuments:
    """Documents of 1 to ``seq // 2`` tokens (uniform lengths, at least 1 to 2), uniform ids, packed into
    rows back to back; the last document of a row is cut at the row's end. ``batch`` returns
    position_ids restarting at 0 at each document."""

    def __init__(self, vocab_size: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab_size, seq, seed
        self.longest = max(2, seq // 2)

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 7_777_777)
        ids = torch.randint(0, self.vocab, (rows, self.seq), generator=g)
        pos = torch.empty_like(ids)
        for r in range(rows):
            t = 0
            while t < self.seq:
                n = min(int(torch.randint(1, self.longest + 1, (), generator=g)), self.seq - t)
                pos[r, t:t + n] = torch.arange(n)
                t += n
        return ids, pos


def load_tokenizer(path: str):
    """(encode(text) -> ids, end-of-document id, vocabulary size) of a ``tokenizers`` JSON file or a
    Hugging Face tokenizer folder."""
    p = Path(path)
    if not p.exists():  # a local path only: never a network lookup for a typo
        raise ValueError(f"data.tokenizer ({path!r}) does not exist: give a tokenizers JSON file or a local Hugging "
                         "Face tokenizer folder")
    if p.is_file():
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(p))
        eod = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]") if tok.token_to_id(t)
                    is not None), None)
        size = tok.get_vocab_size()
        return (lambda text: tok.encode(text).ids), (size if eod is None else eod), size + (eod is None)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(str(p))
    eod = tok.eos_token_id if tok.eos_token_id is not None else len(tok)
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"]), eod, max(len(tok), eod + 1)


def text_source(path: str | Path, vocab_size: int, tokenizer: str | None = None):
    """(the .txt files, encode, end-of-document id) of a text source, every rule checked but nothing
    tokenized yet: what a launcher checks once before its ranks each read the corpus."""
    if tokenizer is None:
        encode, eod, needed = (lambda text: list(text.encode())), EOD, BYTE_VOCAB
    else:
        encode, eod, needed = load_tokenizer(tokenizer)
    if vocab_size < needed:
        raise ValueError(f"vocab ({vocab_size}) must be at least {needed} for "
                         f"{'byte-level text' if tokenizer is None else 'data.tokenizer ' + repr(tokenizer)} "
                         "(model.vocab sets it)")
    path = Path(path)
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"data.source ({str(path)!r}) must be 'random', 'random-documents', a text file or a "
                         "folder of .txt files")
    return files, encode, eod


class PackedText:
    """Documents of a text file / folder of .txt files packed into rows (see the module docstring);
    ``tokenizer``: a ``tokenizers`` JSON or an HF tokenizer folder instead of bytes."""

    def __init__(self, path: str | Path, seq: int, seed: int, vocab_size: int, tokenizer: str | None = None):
        files, encode, eod = text_source(path, vocab_size, tokenizer)
        path = Path(path)
        tokens = []
        for f in files:
            for doc in f.read_text(errors="replace").split("\n\n"):
                doc = doc.strip()
                if doc:
                    tokens += list(encode(doc)) + [eod]
        n = len(tokens) // seq
        if n < 1:
            raise ValueError(f"data.source ({str(path)!r}) has {len(tokens)} tokens: fewer than one row of "
                             f"data.seq_length ({seq})")
        self.ids = torch.tensor(tokens[:n * seq]).view(n, seq)
        self.pos = restart_per_document(self.ids, eod)
        self.seq, self.seed, self.rows = seq, seed, n

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.empty(rows, dtype=torch.long)
        for i in range(rows):
            k = step * rows + i
            epoch, j = divmod(k, self.rows)
            perm = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            idx[i] = perm[j]
        return self.ids[idx], self.pos[idx]


def restart_per_document(ids: torch.Tensor, eod: int = EOD) -> torch.Tensor:
    """Positions counting from 0 at each row start and after each end-of-document token (a document
    cut by a row end continues from 0 in the next row)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eod
    t = torch.arange(ids.shape[1]).expand_as(ids)
    return t - torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values


SYNTHETIC = {"random": RandomTokens, "random-documents": RandomDocuments}


def make_data(source: str, seq: int, seed: int, vocab_size: int, tokenizer: str | None = None):
    if source in SYNTHETIC:
        return SYNTHETIC[source](vocab_size, seq, seed)
    return PackedText(source, seq, seed, vocab_size, tokenizer)


def rows_of_dp_rank(t: torch.Tensor | None, dp_rank: int, dp: int) -> torch.Tensor | None:
    """This DP replica's contiguous share of the global batch."""
    if t is None:
        return None
    per = t.shape[0] // dp
    return t[dp_rank * per:(dp_rank + 1) * per]
