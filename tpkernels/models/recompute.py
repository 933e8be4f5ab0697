"""Activation recompute (ParallelConfig.recompute), with ``torch.utils.checkpoint`` (non-reentrant).

* "full": only each layer's inputs are kept; the whole layer runs again in backward.
* "selective": the attention core (q/k/v split, rotary, FlashAttention) runs again in backward, so
  its rotated q/k and softmax statistics are not kept (Korthikanti et al. 2022's selective
  recompute; with FlashAttention the score matrix is never stored in the first place).

Inside a zero-bubble schedule the forward kept weights out of the graph (their gradients go to W);
the recomputation does the same (``context_fn`` re-enters ``split_weight_grads`` as it was), so
W still lands every weight gradient once and no hook fires early. The recomputation is no new step
for the FP8 state (:func:`tpkernels.quant.fp8_state.fp8_frozen`): it records no amax and no count,
and reads the history the forward read, so it casts with the forward's scales and the weight
gradient reads the FP8 input the forward multiplied.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from torch.utils.checkpoint import checkpoint

from tpkernels.functional.weight_grad import split_weight_grads, splitting
from tpkernels.quant.fp8_state import fp8_frozen


def recomputed(fn, *args):
    """fn(*args), its activations recomputed in backward instead of kept."""
    split = splitting()
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), _recomputing(split)))


@contextmanager
def _recomputing(split: bool):
    with split_weight_grads(split), fp8_frozen():
        yield
