"""The data layer: sources, formats, chat templates, packing, the indexed format, blending.

One batch object for every kind of data (:class:`TokenBatch`); ``tpkernels.train.data.make_data``
picks the source from ``data.source``. Modules, one concept each:

* :mod:`~tpkernels.data.batch` — ``TokenBatch`` (ids, position_ids, loss_mask, pair_index, chosen).
* :mod:`~tpkernels.data.stream` — step k's rows of a source (deterministic in (seed, k)).
* :mod:`~tpkernels.data.synthetic`, :mod:`~tpkernels.data.text` — random tokens; text files.
* :mod:`~tpkernels.data.sources` — local JSONL/Parquet/Arrow/save_to_disk through ``datasets``.
* :mod:`~tpkernels.data.formats` — text, messages, prompt/completion, preference columns.
* :mod:`~tpkernels.data.chat` — chat templates and the assistant mask.
* :mod:`~tpkernels.data.packing` — best-fit packing into rows, overflow, pairs.
* :mod:`~tpkernels.data.records` — a records source as packed rows.
* :mod:`~tpkernels.data.indexed` — Megatron's .bin/.idx, memory-mapped.
* :mod:`~tpkernels.data.prepare` — ``tpkernels prepare-data``.
* :mod:`~tpkernels.data.blend` — weighted blends of sources.
"""

from tpkernels._lazy import lazy_names

__all__ = ["IGNORE_INDEX", "TokenBatch"]

# on first use: the tokenizer and the prompt reader are used without torch
__getattr__ = lazy_names(__name__, {"IGNORE_INDEX": "batch", "TokenBatch": "batch"})
