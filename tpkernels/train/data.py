"""Training data: the global batch of step k, the same at every layout, sharded over DP.

    data = make_data(source, seq, seed, vocab_size, tokenizer)   # see SOURCES below
    batch = data.batch(step, global_batch)     # TokenBatch: ids, position_ids, loss_mask, … (rows, seq)
    for b in held_out(data, batches, global_batch): ...   # validation: each row once, the last batch padded
    mine = batch.rows_of_dp_rank(dp_rank, dp)  # this DP replica's rows
    target = batch.targets()                   # next-token targets, IGNORE_INDEX where not supervised

Deterministic and resumable: the batch of step k depends only on (seed, k), so a run resumed at
step k, or restarted at another layout, sees the same tokens (the data position is the step).

Sources (``data.source``; the modules of :mod:`tpkernels.data` implement them):

* ``random``, ``random-documents``: synthetic tokens (:mod:`tpkernels.data.synthetic`).
* a .txt file or folder of them: :class:`~tpkernels.data.text.PackedText`.
* a ``.jsonl``/``.json``/``.parquet``/``.arrow`` file or a ``datasets.save_to_disk`` folder:
  :class:`~tpkernels.data.records.RecordData` (text, messages, prompt/completion, preference).
* a ``.bin``/``.idx`` prefix or a folder of them (``tpkernels prepare-data``):
  :class:`~tpkernels.data.indexed.IndexedTokens`, memory-mapped.
* ``"0.7 a 0.3 b"``: a weighted blend of the above (:mod:`tpkernels.data.blend`).
"""

from __future__ import annotations

import torch

from tpkernels.conventions import IGNORE_INDEX
from tpkernels.data.batch import TokenBatch
from tpkernels.data.blend import Blend, parse_blend
from tpkernels.data.sources import source_kind
from tpkernels.data.synthetic import SYNTHETIC, RandomDocuments, RandomTokens
from tpkernels.data.text import PackedText, restart_per_document, text_source
from tpkernels.data.tokenizer import BYTE_VOCAB, EOD, load_tokenizer
from tpkernels.data.unknown_tokens import check_unknown

TASKS = ("auto", "pretrain", "sft", "dpo")


def _one(source: str, seq: int, seed: int, vocab_size: int, tokenizer: str | None, fmt: str, loss_on: str,
         overflow: str, task: str | None):
    kind = source_kind(source)
    if kind == "records":
        from tpkernels.data.records import RecordData  # noqa: PLC0415 (datasets: only for these sources)

        return RecordData(source, seq, seed, vocab_size, tokenizer, fmt=fmt, loss_on=loss_on, overflow=overflow,
                          task=task)
    if task in ("sft", "dpo"):
        need = "a messages or prompt/completion" if task == "sft" else "a preference (prompt/chosen/rejected)"
        raise ValueError(f"training.task {task} needs {need} dataset (a .jsonl/.parquet/.arrow file or save_to_disk "
                         f"folder); data.source ({source!r}) is {kind} tokens")
    if fmt not in ("auto", "text"):
        raise ValueError(f"data.format ({fmt!r}) needs a records source (.jsonl/.json/.parquet/.arrow or a "
                         f"save_to_disk folder); data.source ({source!r}) is {kind} tokens")
    if kind == "synthetic":
        return SYNTHETIC[source](vocab_size, seq, seed)
    if kind == "indexed":
        from tpkernels.data.indexed import IndexedTokens  # noqa: PLC0415

        return IndexedTokens(source, seq, seed, vocab_size)
    return PackedText(source, seq, seed, vocab_size, tokenizer)


def make_data(source: str, seq: int, seed: int, vocab_size: int, tokenizer: str | None = None, *,
              fmt: str = "auto", loss_on: str = "all_assistant", overflow: str = "error", task: str = "auto",
              run_rows: int | None = None):
    """The data of ``data.source`` (see the module docstring); ``task``: ``training.task`` (``auto``: what the
    data implies); ``run_rows``: the rows the run reads (steps × global batch; a blend refuses a weight
    whose first row comes later)."""
    task = None if task == "auto" else task
    blend = parse_blend(source)
    if blend is None:
        return _one(source, seq, seed, vocab_size, tokenizer, fmt, loss_on, overflow, task)
    if any(p in SYNTHETIC for _, p in blend):
        raise ValueError(f"data.source ({source!r}): a blend mixes files, not synthetic sources")
    parts = [_one(p, seq, seed * 31 + j, vocab_size, tokenizer, fmt, loss_on, overflow, task)
             for j, (_, p) in enumerate(blend)]
    return Blend(parts, [w for w, _ in blend], [p for _, p in blend], run_rows)


def data_of(cfg, vocab_size: int, global_batch: int | None = None):
    """``make_data`` with a TrainConfig's data and training keys (``global_batch``: the layout's, for the
    run's length)."""
    d, t = cfg.data, cfg.training
    data = make_data(d.source, d.seq_length, t.seed, vocab_size, d.tokenizer, fmt=d.format, loss_on=d.loss_on,
                     overflow=d.overflow, task=t.task, run_rows=t.steps * global_batch if global_batch and t.epochs is None else None)
    check_unknown(data, d.tokenizer, d.max_unknown)  # a tokenizer made for other text: refused or warned, with the rate
    return data


def check_source(cfg, vocab_size: int) -> None:
    """The rules of a source checked without reading a corpus (before a launch: its ranks each read it):
    paths exist, tokenizer and vocabulary fit."""
    blend = parse_blend(cfg.data.source)
    for _, src in blend or [(1.0, cfg.data.source)]:
        kind = source_kind(src)
        if kind == "text":
            text_source(src, vocab_size, cfg.data.tokenizer)
        elif kind == "records":
            from tpkernels.data.sources import open_records  # noqa: PLC0415

            open_records(src)
        elif kind == "indexed":
            from tpkernels.data.indexed import IndexedTokens  # noqa: PLC0415

            IndexedTokens(src, cfg.data.seq_length, cfg.training.seed, vocab_size)


def held_out(data, batches: int, global_batch: int):
    """The global batches of one validation over ``data``: its rows in one pass, each once (a source's
    stream positions 0 … rows - 1, its first epoch; a blend's sources one after another, weights aside),
    at most ``batches`` × ``global_batch`` of them, the last batch padded with rows that hold no target
    (the loss is the token mean: they count nothing). The same rows at every layout. An endless synthetic
    source: its first ``batches`` batches."""
    n = getattr(data, "rows", None)
    if n is None:
        for b in range(batches):
            yield data.batch(b, global_batch)
        return
    for start in range(0, min(n, batches * global_batch), global_batch):
        positions = torch.arange(start, min(start + global_batch, n))
        yield (data.pass_at(positions) if isinstance(data, Blend) else data.rows_at(positions)).padded(global_batch)


def rows_of_dp_rank(t: torch.Tensor | None, dp_rank: int, dp: int) -> torch.Tensor | None:
    """This DP replica's contiguous share of the global batch."""
    if t is None:
        return None
    per = t.shape[0] // dp
    return t[dp_rank * per:(dp_rank + 1) * per]


__all__ = ["BYTE_VOCAB", "EOD", "IGNORE_INDEX", "PackedText", "RandomDocuments", "RandomTokens", "SYNTHETIC", "TASKS",
           "TokenBatch", "check_source", "data_of", "held_out", "load_tokenizer", "make_data",
           "restart_per_document", "rows_of_dp_rank", "text_source"]
