"""Generation: a KV-cached decoding loop over a ParallelTransformer at any TP layout, sampling as
Hugging Face defines it, and text in and out through the run's tokenizer. Loading a checkpoint or a
Hugging Face folder for it and the ``tpkernels generate`` command live in tpkernels.train
(generate_load, generate_cli), which reads checkpoints."""

from tpkernels.generate.engine import Completion, Generator, unpad
from tpkernels.generate.sampling import Sampling
from tpkernels.generate.text import TextCodec

__all__ = ["Completion", "Generator", "Sampling", "TextCodec", "unpad"]
