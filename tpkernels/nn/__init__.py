"""Drop-in ``nn.Module``s."""

from tpkernels.nn.bias_gelu import BiasGeLU

__all__ = ["BiasGeLU"]
