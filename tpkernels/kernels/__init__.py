"""Kernel launchers by backend: ``triton/`` (Triton), ``reference`` (pure PyTorch); the C++ and
CUDA kernels live in ``tpkernels._C`` (sources in ``csrc/``)."""
