"""The constants that turn FLOPs and bytes into seconds.

Peaks are never reached; these factors say how much of each peak a well-tuned training step gets.
Two of them (calibration.FITTED: gemm, with gemm_fp8 tied to it, and attention) are fitted on the
published runs in benchmarks/data/, every other one is structural and says in its comment what it stands for. Two published tables are kept out of
every fit (and out of the repository) to check that the model generalises: the Megatron-LM README's
weak-scaling table and Korthikanti et al. 2022's end-to-end runs.
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
    # Share of the hiding that the software's TP overlap achieves structurally (tp_overlap.py: a
    # ring exposes its first chunk and what outlasts the GEMM) that this machine gets: 1 on GPUs
    # (copy engines / a few SMs move the data while the GEMM runs), 0 where the collectives progress
    # on the same cores as the GEMMs (gloo on CPUs: measure.py sets it).
    tp_overlap: float = 1.0
    # Size of one data-parallel gradient bucket (Megatron-Core's default: 40M parameters in fp32).
    dp_bucket_bytes: float = 160e6
    # --- optimizer ---
    # Bytes read + written per trained parameter by the optimizer step (Adam: 16-bit weight, fp32
    # grad, master, two moments read; weight, master and moments written).
    optimizer_bytes_per_param: float = 34.0
    # --- ranks sharing cores (CPUs) ---
    # Share of a core each rank runs on while every rank is busy: cores / (ranks × threads) when a CPU
    # host runs more rank threads than it has cores (measure.calibrate sets it and slows the rates by
    # it), else 1. The pipeline bubble stays the schedule's: measured runs on 2 cores idled as much as
    # the simulator says (a waiting gloo rank does not hand its core to the busy ones).
    core_share: float = 1.0
    # --- corrections measured on one machine (tpkernels.planner.fit: fitted to autotune trials) ---
    # Rates that scale with the work, so a fit on one model transfers to another: compute-bound parts
    # (GEMMs, memory-bound kernels, the bubble, the optimizer) × compute_scale, exposed communication
    # × comm_scale, and op_overhead_s per kernel on the critical path (StepTime.ops: host dispatch,
    # autograd bookkeeping).
    compute_scale: float = 1.0
    comm_scale: float = 1.0
    op_overhead_s: float = 0.0

    def replace(self, **changes) -> "Efficiency":
        return dataclasses.replace(self, **changes)


CALIBRATED_ALL = Efficiency(gemm=0.700, gemm_fp8=0.700, attention=0.394)
"""Every generation: gemm (= gemm_fp8, calibration.TIED) and attention (calibration.FITTED) fitted
on all the published runs in benchmarks/data/ (Narayanan et al. 2021 on A100; NeMo 2024 and
Megatron-Bridge on H100; torchtitan on its 500 W H100s and H200) by ``calibration.fit_constants`` (the
mean over sources of each source's RMS log error); ``benchmarks/planner_calibration.py`` fits them
again without each source in turn and reports how well the held-out source is predicted (docs/planner.md). One set for all
generations: each constant is a share of the GPU's own peak (or a byte count), the generations
differ by their GPUSpec (peaks, SMs, tiles, bandwidths). The GEMM ceiling is what whole training
steps sustain: below a lone large GEMM's (≈ 0.8 of the peak: 790 TFLOP/s of an 8192³ bf16 matmul
on one H200), as a step also pays clock drops under sustained load, kernel gaps and launch waits
the per-kernel terms do not see. The structural constants (gemm_k0, gemm_tail, launch costs, hbm,
elementwise_traffic, link, latencies) keep their documented defaults."""

# The names the package used when each generation had its own fit: one set now.
A100_CALIBRATED = H100_CALIBRATED = CALIBRATED_ALL

CALIBRATED = {"ampere": CALIBRATED_ALL, "hopper": CALIBRATED_ALL}


def calibrated_for(gpu) -> Efficiency:
    """The constants of ``gpu``'s generation; GPUs of a generation without published runs here (Ada)
    borrow Ampere's, which ``notes_for`` says."""
    return CALIBRATED.get(gpu.generation, A100_CALIBRATED)


def is_calibrated(gpu) -> bool:
    return gpu.generation in CALIBRATED
