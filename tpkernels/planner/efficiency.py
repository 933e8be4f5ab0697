"""The constants that turn FLOPs and bytes into seconds.

Peaks are never reached; these factors say how much of each peak a well-tuned training step gets.
Calibrated once, against Narayanan et al. 2021 Table 1 (GPT models, 32–3072 A100-80GB GPUs,
Megatron-LM; ``tpkernels/planner/data/megatron_narayanan2021_table1.csv``): with the values below
the planner predicts every row's TFLOP/s per GPU within the tolerance that
``benchmarks/planner_calibration.py`` prints (and tests/test_planner_calibration.py asserts).
``tpkernels plan --measure`` replaces the GEMM, memory and link factors with numbers timed on
the current machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    # Share of the dense tensor-core peak that large training GEMMs sustain (cuBLAS reaches 70-80%
    # of 312 TFLOP/s on large fp16 A100 GEMMs; this is the value the Table 1 fit gives).
    gemm: float = 0.68
    # Fixed cost of every GEMM kernel on top of its FLOPs: launch latency, the last partial wave of
    # tiles, prologue and epilogue. It is what makes tiny micro-batches and high TP on small models
    # lose, as they do in practice (Narayanan et al. 2021, Fig. 7).
    gemm_launch_s: float = 5e-5
    # Bytes moved by the non-GEMM kernels (norms, softmax, GeLU, dropout, residual adds) per byte of
    # activation they store, forward + backward. Each stored tensor is written once and read about
    # twice in forward, and its gradient is written and read again in backward.
    elementwise_traffic: float = 4.0
    # Share of the HBM bandwidth those memory-bound kernels reach.
    hbm: float = 0.8
    # NCCL bus bandwidth / link bandwidth for ring collectives and P2P (A100 NVLink: ~230 of 300 GB/s).
    link: float = 0.75
    # Fixed cost of one pipeline send/recv beyond its bytes: NCCL's handshake plus the stream
    # synchronisation around it that stalls the sending stage's next kernels (Megatron-LM's P2P
    # path synchronises the device after batch_isend_irecv).
    p2p_latency_s: float = 3e-4
    # Share of the sequence-parallel all-gather / reduce-scatter time hidden behind the chunked
    # GEMMs (tpkernels.all_gather_matmul / matmul_reduce_scatter ring; Flux reports 76–81%).
    tp_overlap: float = 0.75
    # Share of the last micro-batch's backward that the data-parallel gradient reduction can hide
    # behind (bucketed reduce as in DDP / Megatron --overlap-grad-reduce).
    dp_overlap: float = 0.0
    # Bytes read + written per trained parameter by the optimizer step (Adam: 16-bit weight, fp32
    # grad, master, two moments read; weight, master and moments written).
    optimizer_bytes_per_param: float = 34.0

    def replace(self, **changes) -> "Efficiency":
        return dataclasses.replace(self, **changes)


A100_CALIBRATED = Efficiency()
