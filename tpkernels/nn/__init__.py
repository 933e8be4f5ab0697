"""Drop-in ``nn.Module``s."""

from tpkernels.nn.attention import FlashAttention
from tpkernels.nn.bias_gelu import BiasGeLU
from tpkernels.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tpkernels.nn.vocab_parallel import VocabParallelEmbedding

__all__ = ["BiasGeLU", "FlashAttention", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]
