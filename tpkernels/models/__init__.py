"""Whole models: GPT-2 and Llama-family Transformers at any TP × PP × DP layout, Hugging Face in and out."""

from tpkernels.description import ModelConfig
from tpkernels.models.sequence import next_token_targets, positions_from_cu_seqlens
from tpkernels.models.transformer import ParallelTransformer, TransformerChunk, stage_layers

__all__ = ["ModelConfig", "ParallelTransformer", "TransformerChunk", "next_token_targets", "positions_from_cu_seqlens",
           "stage_layers"]
