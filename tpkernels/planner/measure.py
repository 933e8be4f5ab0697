"""`tpkernels plan --measure`: time this machine's GEMM rate, memory bandwidth and a collective,
and turn them into planner constants.

If the machine's accelerator is the GPU being planned for, the measured rates replace the
efficiency constants (gemm, hbm, link). Otherwise (a CPU, or another GPU) the planner plans for a
cluster of *this* device: its measured rates become the peaks, with efficiency 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec, GPUSpec
from tpkernels.planner.models import ModelSpec
from tpkernels.planner.workload import TrainingSetup

CPU_TOKENS, GPU_TOKENS = 256, 8192  # GEMM rows timed; the CPU size keeps --measure near a second
CPU_MAX_WIDTH = 4096  # cap on the CPU GEMM width, same reason


@dataclass(frozen=True)
class Measurement:
    device: str  # "cuda" or "cpu"
    device_name: str
    gemm_tflops: float  # achieved over one layer's four linear GEMMs
    gemm_dtype: str
    gemm_flops: float  # FLOPs of the timed layer
    copy_gbs: float  # (read + write bytes) / time of a large device copy
    memory_gib: float
    collective: str | None = None
    busbw_gbs: float | None = None  # all-reduce bus bandwidth, 2(n-1)/n · bytes / time

    def describe(self) -> str:
        text = (f"{self.device_name}: GEMM {self.gemm_tflops:.3g} TFLOP/s ({self.gemm_dtype}), "
                f"copy {self.copy_gbs:.0f} GB/s, {self.memory_gib:.0f} GiB")
        if self.busbw_gbs is not None:
            text += f", {self.collective} bus bandwidth {self.busbw_gbs:.2f} GB/s"
        else:
            text += ", no collective measured (one device)"
        return text


def _median_time(fn, sync, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def layer_gemm_shapes(model: ModelSpec, tokens: int, max_width: int | None = None) -> list[tuple[int, int, int]]:
    """(M, K, N) of the four linear GEMMs of one layer: QKV, output projection, MLP up(+gate), down."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    up = f * (model.mlp_matrices - 1)
    shapes = [(tokens, h, q + 2 * kv), (tokens, q, h), (tokens, h, up), (tokens, f, h)]
    if max_width:
        scale = min(1.0, max_width / h)
        shapes = [(m, max(64, int(k * scale)), max(64, int(n * scale))) for m, k, n in shapes]
    return shapes


def _allreduce_worker(rank: int, world_size: int, numel: int, reps: int) -> float:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    x = torch.ones(numel, device=dev)
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    dist.all_reduce(x)
    sync()
    dist.barrier()
    t = _median_time(lambda: dist.all_reduce(x), sync, reps)
    return 2 * (world_size - 1) / world_size * x.numel() * x.element_size() / t / 1e9


def measure(model: ModelSpec, train: TrainingSetup, collective: bool = True) -> Measurement:
    import torch  # noqa: PLC0415

    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    # bf16 on GPUs (what training runs); fp32 on CPUs, where bf16 GEMMs are emulated on many parts.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = layer_gemm_shapes(model, GPU_TOKENS if on_gpu else CPU_TOKENS, None if on_gpu else CPU_MAX_WIDTH)
    pairs = [(torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype))
             for m, k, n in shapes]
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    t = _median_time(lambda: [a @ b for a, b in pairs], sync, reps=5)
    del pairs
    src = torch.empty(2**26 if on_gpu else 2**24, device=dev)  # 256 MiB / 64 MiB of fp32
    dst = torch.empty_like(src)
    tc = _median_time(lambda: dst.copy_(src), sync, reps=7)
    copy_gbs = 2 * src.numel() * src.element_size() / tc / 1e9
    del src, dst
    if on_gpu:
        name = torch.cuda.get_device_name()
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        import os  # noqa: PLC0415
        import platform  # noqa: PLC0415

        name = f"CPU {platform.machine()} ×{torch.get_num_threads()} threads"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    coll = busbw = None
    ranks = 2
    if collective and (not on_gpu or torch.cuda.device_count() >= ranks):
        from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: PLC0415

        backend = "nccl" if on_gpu else "gloo"
        numel = 2**26 if on_gpu else 2**22
        busbw = min(run_on_ranks(_allreduce_worker, ranks, numel, 5, backend=backend, timeout=120))
        coll = f"{backend} all-reduce over {ranks} ranks"
    return Measurement(dev, name, flops / t / 1e12, str(dtype).replace("torch.", ""), flops, copy_gbs, mem,
                       coll, busbw)


def _same_gpu(spec: GPUSpec, device_name: str) -> bool:
    """Does CUDA's device name (e.g. 'NVIDIA H100 80GB HBM3') denote this preset?"""
    family = spec.name.split("-")[0].upper()  # A100, H100, H200, A10, L20
    words = device_name.upper().replace("-", " ").split()
    if family not in words:
        return False
    if spec.name.endswith("PCIe") != ("PCIE" in words):
        return False
    return True


def preset_for_device(device_name: str) -> GPUSpec | None:
    """The planner's GPU preset that CUDA's device name denotes, if any."""
    from tpkernels.planner.hardware import GPU_PRESETS  # noqa: PLC0415

    return next((spec for spec in GPU_PRESETS.values() if _same_gpu(spec, device_name)), None)


def calibrate(cluster: ClusterSpec, eff: Efficiency, meas: Measurement) -> tuple[ClusterSpec, Efficiency, list[str]]:
    """Constants (and, for a foreign device, the device itself) from a measurement."""
    notes = []
    if meas.device == "cuda" and _same_gpu(cluster.gpu, meas.device_name):
        gpu = cluster.gpu
        changes = {"gemm": min(1.0, meas.gemm_tflops / gpu.peak_tflops_bf16),
                   "hbm": min(1.0, meas.copy_gbs / gpu.hbm_gbs)}
        if meas.busbw_gbs is not None:
            changes["link"] = min(1.0, meas.busbw_gbs / cluster.intra_gbs)
        notes.append(f"this is a {gpu.name}: constants set from the measurement: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in changes.items()))
        return cluster, eff.replace(**changes), notes
    gpu = GPUSpec(
        name=f"measured {meas.device_name}", peak_tflops_bf16=meas.gemm_tflops, memory_gib=meas.memory_gib,
        hbm_gbs=meas.copy_gbs, nvlink_gbs=None,
        pcie_gbs=meas.busbw_gbs if meas.busbw_gbs is not None else cluster.intra_gbs,
        inter_node_gbs=meas.busbw_gbs if meas.busbw_gbs is not None else cluster.inter_gbs,
        peak_tflops_fp8=meas.gemm_tflops,
    )
    notes.append(f"this machine's device ({meas.device_name}) is not a {cluster.gpu.name}: planning for "
                 f"{cluster.nodes}×{cluster.gpus_per_node} of this device at its measured rates (efficiency 1)")
    mine = ClusterSpec(gpu, cluster.gpus_per_node, cluster.nodes, "pcie", gpu.pcie_gbs, gpu.inter_node_gbs)
    return mine, eff.replace(gemm=1.0, hbm=1.0, link=1.0), notes
