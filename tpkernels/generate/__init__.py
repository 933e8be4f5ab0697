"""Generation: a KV-cached decoding loop over a ParallelTransformer at any TP layout, sampling as
Hugging Face defines it, and text in and out through the run's tokenizer. Loading a checkpoint or a
Hugging Face folder for it and the ``tpkernels generate`` command live in tpkernels.train
(generate_load, generate_cli), which reads checkpoints.

The names below import on first use (PEP 562): the command line reads prompts without torch."""

from tpkernels._lazy import lazy_names

__all__ = ["Completion", "Generator", "Sampling", "TextCodec", "unpad"]
__getattr__ = lazy_names(__name__, {"Completion": "engine", "Generator": "engine", "unpad": "engine",
                                    "Sampling": "sampling", "TextCodec": "text"})
