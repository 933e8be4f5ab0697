"""Generation: a KV-cached decoding loop over a ParallelTransformer at any TP layout, sampling as
Hugging Face defines it, and text in and out through the run's tokenizer. Loading a checkpoint or a
Hugging Face folder for it and the ``tpkernels generate`` command live in tpkernels.train
(generate_load, generate_cli), which reads checkpoints.

The names below import on first use (PEP 562): the command line reads prompts without torch."""

import importlib

_WHERE = {"Completion": "engine", "Generator": "engine", "unpad": "engine", "Sampling": "sampling",
          "TextCodec": "text"}

__all__ = ["Completion", "Generator", "Sampling", "TextCodec", "unpad"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"tpkernels.generate.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'tpkernels.generate' has no attribute {name!r}")
