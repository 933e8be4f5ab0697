"""The constants that turn FLOPs and bytes into seconds, one set per GPU generation.

Peaks are never reached; these factors say how much of each peak a well-tuned training step gets.
Each set is fitted once, on published runs that state their layout (tpkernels/planner/data/, reported row
by row by ``benchmarks/planner_calibration.py``):
  Ampere  Narayanan et al. 2021, Table 1 (GPT 1.7B–1T on 32–3072 A100-80GB, Megatron-LM).
  Hopper  NVIDIA NeMo 24.12 performance summary (GPT-3, Llama 2, Nemotron pre-training on 8–512
          DGX-H100 GPUs), with the GEMM ceiling fixed by a measured fact: one H200 (same SMs and
          clocks as the H100 SXM) runs a large bf16 matmul at ≈ 790 TFLOP/s.
Two published tables are kept out of every fit to check that the model generalises: the Megatron-LM
README's weak-scaling table and Korthikanti et al. 2022's end-to-end runs.
``tpkernels plan --measure`` replaces the ceiling, memory and link factors with numbers timed on
the current machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    # --- GEMMs (tpkernels/planner/gemm_model.py explains the model) ---
    # Share of the dense bf16/fp16 tensor-core peak that the main loop of a large GEMM sustains.
    gemm: float = 0.80
    # The same for FP8 GEMMs (TransformerEngine's per-tensor scaled kernels) over the FP8 peak.
    gemm_fp8: float = 0.60
    # Iterations of k that each tile's prologue and epilogue cost: efficiency k / (k + gemm_k0).
    gemm_k0: float = 128.0
    # Share of the last, partial wave of tiles that idles after cuBLAS's stream-K / split-K
    # scheduling: on average half a wave idles without them; they recover about half of it.
    gemm_tail: float = 0.25
    # Fixed cost of every GEMM kernel: launch latency and the first tile's pipeline fill.
    gemm_launch_s: float = 1e-5
    # Fixed cost of every other kernel (step_time.ELEMENTWISE_KERNELS_PER_LAYER of them). 0 on GPUs:
    # launches are asynchronous and hide behind the running kernels. On a CPU each op's dispatch
    # (and its autograd bookkeeping) runs on the critical path; --measure times it.
    kernel_launch_s: float = 0.0
    # --- attention core ---
    # FlashAttention forward+backward FLOPs (counted in full, without causal halving, as Megatron's
    # formula does) over (time × bf16 peak). Causal kernels skip the masked half, so this can be
    # higher than the GEMM efficiency.
    attention: float = 0.40
    # --- memory-bound kernels ---
    # Bytes moved by the non-GEMM kernels (norms, softmax, GeLU, dropout, residual adds) per byte of
    # activation they store, forward + backward. Each stored tensor is written once and read about
    # twice in forward, and its gradient is written and read again in backward.
    elementwise_traffic: float = 4.0
    # Bytes the vocabulary-parallel cross-entropy moves per logit, in units of one stored logit: the
    # logits are written by the head GEMM, read for the max, the exp-sum and the target pick, and
    # the softmax gradient is written and read by the backward GEMMs (ours fuses them per chunk,
    # but each chunk's logits still make these passes). --measure times it on CPUs.
    logit_traffic: float = 6.0
    # Share of the HBM bandwidth those memory-bound kernels (and memory-bound GEMMs) reach.
    hbm: float = 0.8
    # --- communication ---
    # NCCL bus bandwidth / link bandwidth for ring collectives and P2P (A100 NVLink: ~230 of 300 GB/s).
    link: float = 0.75
    # Fixed cost of one step of a ring collective (NCCL's launch and handshake); a phase over n
    # ranks has n − 1 steps.
    collective_latency_s: float = 5e-6
    # Fixed cost of one pipeline send/recv beyond its bytes: NCCL's handshake plus the stream
    # synchronisation around it that stalls the sending stage's next kernels (Megatron-LM's P2P
    # path synchronises the device after batch_isend_irecv).
    p2p_latency_s: float = 3e-4
    # Share of the sequence-parallel all-gather / reduce-scatter time hidden behind the chunked
    # GEMMs (tpkernels.all_gather_matmul / matmul_reduce_scatter ring; Flux reports 76–81%).
    tp_overlap: float = 0.75
    # Size of one data-parallel gradient bucket (Megatron-Core's default: 40M parameters in fp32).
    dp_bucket_bytes: float = 160e6
    # --- optimizer ---
    # Bytes read + written per trained parameter by the optimizer step (Adam: 16-bit weight, fp32
    # grad, master, two moments read; weight, master and moments written).
    optimizer_bytes_per_param: float = 34.0
    # --- ranks sharing cores (CPUs) ---
    # Share of a core each rank runs on while every rank is busy: cores / (ranks × threads) when a CPU
    # host runs more rank threads than it has cores (measure.calibrate sets it and slows the rates by
    # it), else 1. Below 1, a rank idle in the pipeline bubble hands its core to the busy ones, so
    # the bubble costs only what the machine's total work does not already fill (step_time.py).
    core_share: float = 1.0
    # --- corrections measured on one machine (tpkernels.planner.fit: fitted to autotune trials) ---
    # Compute-bound parts (GEMMs, memory-bound kernels, the bubble, the optimizer) × compute_scale,
    # exposed communication × comm_scale, and a fixed cost per step (host work, per-rank overhead
    # that no parallelism divides) added.
    compute_scale: float = 1.0
    comm_scale: float = 1.0
    step_overhead_s: float = 0.0

    def replace(self, **changes) -> "Efficiency":
        return dataclasses.replace(self, **changes)


A100_CALIBRATED = Efficiency(gemm=0.70, elementwise_traffic=4.0, p2p_latency_s=1e-4, link=0.75)
"""Ampere: gemm, elementwise_traffic, p2p_latency_s and link fitted on Narayanan et al. 2021,
Table 1 (grid search minimising the worst row's error). The 0.70 ceiling sits below what cuBLAS
reaches on one large A100 GEMM (≈ 0.8): it also carries the 2021 software's unfused kernels between
the GEMMs that the per-byte elementwise term does not see. attention is unused (no FlashAttention
in those runs); it keeps Hopper's value for planning FlashAttention runs on Ampere."""

H100_CALIBRATED = Efficiency(gemm=0.83, gemm_fp8=0.62, attention=0.40, elementwise_traffic=6.0, tp_overlap=0.5)
"""Hopper (H100, H200): gemm fixed by the measured ≈ 790 TFLOP/s of an 8192³ bf16 matmul on one
H200: 0.83 × 989 TFLOP/s × the model's wave (0.98) and k (0.98) factors at that shape = 790; gemm_fp8, attention,
elementwise_traffic (FP8 adds the cast and amax kernels) and tp_overlap fitted on NeMo 24.12's
H100 pre-training table. The structural constants (gemm_k0, gemm_tail, gemm_launch_s) are
shared with Ampere."""

CALIBRATED = {"ampere": A100_CALIBRATED, "hopper": H100_CALIBRATED}


def calibrated_for(gpu) -> Efficiency:
    """The constants of ``gpu``'s generation; GPUs of a generation without published runs here (Ada)
    borrow Ampere's, which ``notes_for`` says."""
    return CALIBRATED.get(gpu.generation, A100_CALIBRATED)


def is_calibrated(gpu) -> bool:
    return gpu.generation in CALIBRATED
