"""Public functions and their autograd, one module per op family."""

from tpkernels.functional.bias_gelu import bias_gelu

__all__ = ["bias_gelu"]
