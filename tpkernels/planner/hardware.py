"""GPU and cluster descriptions for the planner.

Peak figures are the vendors' dense tensor-core numbers (no 2:4 sparsity): NVIDIA's H100 and H200
datasheets give 1,979 TFLOP/s bf16 and 3,958 fp8 for the SXM parts with sparsity, half that dense
(989 and 1,979), and HBM 3.35 TB/s (H100 SXM, 80 GB) and 4.8 TB/s (H200, 141 GB). Link bandwidths are
per GPU and per direction: NVLink 3 (A100) 300 GB/s, NVLink 4 (H100/H200) 450 GB/s, PCIe 4.0 x16
32 GB/s, PCIe 5.0 x16 64 GB/s. Inter-node bandwidth is per GPU (one 200 Gb/s HDR NIC per A100
in a DGX A100 = 25 GB/s; one 400 Gb/s NDR NIC per H100/H200 = 50 GB/s). Every field can be
overridden (``GPUSpec.replace`` / the CLI's ``--gpu-*`` flags).

H100-96GB-500W is the H100 of Meta's Grand Teton hosts (torchtitan's published runs): HBM2e at 2.4
TB/s and a 500 W power limit, whose peak its users say lies between the SXM (989 / 1,979 TFLOP/s at
700 W) and NVL (835 / 1,671) parts without knowing it (torchtitan's benchmarks/
llama3_h100_202412_torchtitan.md, note 2): planned at the midpoint of the two datasheet figures, 912 /
1,825, with no datasheet behind it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
GIB = 2**30


def _check_positive(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name} ({value!r}) must be a finite number > 0")

GENERATIONS = ("ampere", "ada", "hopper", "cpu")
PCIE_GEN4_GBS = 32.0
PCIE_GEN5_GBS = 64.0


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. TFLOP/s are dense peaks; bandwidths in GB/s (1e9 bytes/s)."""

    name: str
    peak_tflops_bf16: float
    memory_gib: float
    hbm_gbs: float
    nvlink_gbs: float | None  # per direction; None = no NVLink (PCIe only)
    pcie_gbs: float
    inter_node_gbs: float
    peak_tflops_fp8: float | None = None
    # What the GEMM-efficiency model needs (tpkernels/planner/gemm_model.py): the streaming
    # multiprocessors that run one output tile each, the tile cuBLAS picks for large bf16 GEMMs on
    # this generation (Hopper's warp-specialised kernels: 128×256; Ampere: 128×128), and the
    # generation, which selects the calibrated constants (efficiency.calibrated_for).
    sm_count: int = 108
    tile_m: int = 128
    tile_n: int = 128
    generation: str = "ampere"
    peak_tflops_fp32: float | None = None  # fp32 GEMM rate; set for measured CPUs (fp32 training there)

    def __post_init__(self):
        for f in ("peak_tflops_bf16", "memory_gib", "hbm_gbs", "nvlink_gbs", "pcie_gbs", "inter_node_gbs",
                  "peak_tflops_fp8", "peak_tflops_fp32"):
            _check_positive(f, getattr(self, f), optional=f in ("nvlink_gbs", "peak_tflops_fp8", "peak_tflops_fp32"))
        for f in ("sm_count", "tile_m", "tile_n"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f} ({value!r}) must be a positive integer")
        if self.generation not in GENERATIONS:
            raise ValueError(f"generation ({self.generation!r}) must be one of {', '.join(GENERATIONS)}")

    def peak_tflops(self, precision: str) -> float:
        if precision in ("bf16", "fp16"):
            return self.peak_tflops_bf16
        if precision == "fp8":
            if self.peak_tflops_fp8 is None:
                raise ValueError(f"precision ('fp8') is not supported by {self.name}: it has no FP8 tensor cores")
            return self.peak_tflops_fp8
        if precision == "fp32":
            if self.peak_tflops_fp32 is None:
                raise ValueError(f"precision ('fp32') has no rate for {self.name}: plan 16-bit training on GPUs, "
                                 "or measure this machine (tpkernels plan --measure)")
            return self.peak_tflops_fp32
        raise ValueError(f"precision ({precision!r}) must be one of bf16, fp16, fp8, fp32")

    def replace(self, **changes) -> "GPUSpec":
        return dataclasses.replace(self, **changes)


_HOPPER = dict(sm_count=132, tile_n=256, generation="hopper")

GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("A100-40GB", 312.0, 40.0, 1555.0, 300.0, PCIE_GEN4_GBS, 25.0, sm_count=108),
        GPUSpec("A100-80GB", 312.0, 80.0, 2039.0, 300.0, PCIE_GEN4_GBS, 25.0, sm_count=108),
        GPUSpec("H100-SXM", 989.0, 79.6, 3350.0, 450.0, PCIE_GEN5_GBS, 50.0, peak_tflops_fp8=1979.0, **_HOPPER),
        GPUSpec("H100-PCIe", 756.0, 79.6, 2000.0, None, PCIE_GEN5_GBS, 25.0, peak_tflops_fp8=1513.0,
                **{**_HOPPER, "sm_count": 114}),
        GPUSpec("H100-96GB-500W", 912.0, 95.5, 2400.0, 450.0, PCIE_GEN5_GBS, 50.0, peak_tflops_fp8=1825.0,
                **_HOPPER),
        GPUSpec("H200", 989.0, 140.4, 4800.0, 450.0, PCIE_GEN5_GBS, 50.0, peak_tflops_fp8=1979.0, **_HOPPER),
        GPUSpec("A10-24GB", 125.0, 22.5, 600.0, None, PCIE_GEN4_GBS, 12.5, sm_count=72),
        GPUSpec("L20", 119.5, 44.5, 864.0, None, PCIE_GEN4_GBS, 12.5, peak_tflops_fp8=239.0, sm_count=92,
                generation="ada"),
    )
}

_ALIASES = {
    "a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-80": "A100-80GB", "a100-40g": "A100-40GB",
    "a100-40": "A100-40GB", "h100": "H100-SXM", "h100-sxm5": "H100-SXM", "h800": "H100-SXM",
    "h100-pcie": "H100-PCIe", "h200": "H200", "a10": "A10-24GB", "a10-24g": "A10-24GB", "l20": "L20",
}


def gpu_preset(name: str) -> GPUSpec:
    key = name.strip()
    for preset in GPU_PRESETS:
        if preset.lower() == key.lower():
            return GPU_PRESETS[preset]
    alias = _ALIASES.get(key.lower())
    if alias:
        return GPU_PRESETS[alias]
    raise ValueError(f"gpu ({name!r}) is not a known preset; choose one of {', '.join(GPU_PRESETS)}")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` machines with ``gpus_per_node`` GPUs each.

    intra_link: "nvlink" or "pcie"; None picks NVLink when the GPU has it.
    intra_node_gbs / inter_node_gbs: override the per-GPU, per-direction link bandwidth.
    """

    gpu: GPUSpec
    gpus_per_node: int = 8
    nodes: int = 1
    intra_link: str | None = None
    intra_node_gbs: float | None = None
    inter_node_gbs: float | None = None

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        for name in ("intra_node_gbs", "inter_node_gbs"):
            _check_positive(name, getattr(self, name), optional=True)
        if self.intra_link not in (None, "nvlink", "pcie"):
            raise ValueError(f"intra_link ({self.intra_link!r}) must be 'nvlink' or 'pcie'")
        if self.intra_link == "nvlink" and self.gpu.nvlink_gbs is None and self.intra_node_gbs is None:
            raise ValueError(f"intra_link ('nvlink') is not available on {self.gpu.name}; use 'pcie' "
                             "or give intra_node_gbs")

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def link(self) -> str:
        if self.intra_link:
            return self.intra_link
        return "nvlink" if self.gpu.nvlink_gbs else "pcie"

    @property
    def intra_gbs(self) -> float:
        if self.intra_node_gbs is not None:
            return self.intra_node_gbs
        return self.gpu.nvlink_gbs if self.link == "nvlink" else self.gpu.pcie_gbs

    @property
    def inter_gbs(self) -> float:
        return self.inter_node_gbs if self.inter_node_gbs is not None else self.gpu.inter_node_gbs

    def group_bandwidth_gbs(self, span_gpus: int) -> float:
        """Per-GPU bandwidth of a ring whose members span ``span_gpus`` consecutive ranks."""
        return self.intra_gbs if span_gpus <= self.gpus_per_node else min(self.intra_gbs, self.inter_gbs)

    def describe(self) -> str:
        return (f"{self.nodes}×{self.gpus_per_node} {self.gpu.name} ({self.link} {self.intra_gbs:.3g} GB/s in a node, "
                f"{self.inter_gbs:.3g} GB/s per GPU between nodes)")
