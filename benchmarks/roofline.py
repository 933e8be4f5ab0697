"""A static roofline: every kernel at the benchmark shapes against the H100-SXM and H200 peaks.

    python benchmarks/roofline.py                              # floors: a table, results/roofline_<gpu>.csv and .png
    python benchmarks/roofline.py --measured $OUT --out $OUT   # + what a GPU run measured (benchmarks/gpu_check.sh)
    python benchmarks/roofline.py --markdown                   # the table as Markdown (docs/results.md)

For each kernel, at the shapes its benchmark runs in gpu_check.sh: the FLOPs it does, the fewest bytes
it must move through HBM (every input read once, every output written once) and, for the
communicating ops, the bytes that must cross NVLink. The formulas are the floors written next to the
kernels (flash_attn.py, rms_norm.py, layer_norm.py, swiglu.py, rotary.py, bias_gelu.py, ag_matmul.py,
matmul_signal.py, tile_reduce.py, functional/context_parallel.py), one function per kernel below;
where a kernel states none, the derivation is in the function's docstring.

    floor = max(FLOPs / dense bf16 peak, HBM bytes / HBM bandwidth, NVLink bytes / NVLink bandwidth)

The largest term is the bound (compute, memory or link). Intensity = FLOPs per HBM byte; the ridge
(peak / bandwidth) is 295 FLOP/B on an H100-SXM and 206 on an H200: below it a kernel is
memory-bound. "fp8 µs" is the compute term at the FP8 peak for the tensor-core kernels (none runs FP8
yet): how far an FP8 version could go. The elementwise kernels' FLOPs count exp, erf, rsqrt and a
division as one each: they only place those kernels on the plot, two orders of magnitude under the
ridge. Peaks and bandwidths: the planner's GPU presets (tpkernels/planner/hardware.py, the vendors'
dense datasheet figures), not measurements: KINDS.md's measured H200 ceilings (bf16 GEMM about 790
TFLOP/s, copy about 4.3 TB/s) are 80% and 90% of them.

--measured FOLDER|CSV...: reads the CSVs the GPU benchmarks write (bench_attention.py, bench_llama_ops.py,
bench_norms.py, bench_bias_gelu.py, bench_gemm_comm.py --mode virtual, bench_context_parallel.py --mode virtual, as
gpu_check.sh runs them into $OUT). Rows measured on a GPU that one preset denotes fill that preset's
"measured µs" and "% of floor" (floor / measured: 100% is the floor; ours, or the fastest of ours
where a benchmark has several). CPU rows are ignored. bench_llama_ops.py's CSV does not record its
token count: it is read back from its rms_norm forward bytes, and the linear_cross_entropy rows are
taken at the script's GPU defaults (8192 tokens, vocabulary 128256).

The TP and CP rows come twice where the benchmark runs on one GPU: "virtual" is what
bench_gemm_comm.py --mode virtual times (every one of the TP ranks' kernels at once on one GPU, the
emulated NVLink traffic as device copies and reads), "per rank" is one GPU of a real TP=8 group
(floors only, with the NVLink term). The CP rows are one rank of a real ring; the virtual benchmark
times the same kernels with the K/V blocks already local, which changes nothing here: those rows
are compute-bound by far.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bias_gelu import COLS as GELU_COLS  # noqa: E402
from bench_gemm_comm import SHAPES as GEMM_COMM_SHAPES  # noqa: E402
from bench_llama_ops import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB  # noqa: E402
from common import RESULTS_DIR, pyplot, run_metadata  # noqa: E402

from tpkernels.functional.gemm_comm_fused import ONE_SHOT_MAX_ELEMENTS  # noqa: E402
from tpkernels.planner.hardware import GPU_PRESETS, GPUSpec  # noqa: E402
from tpkernels.planner.measure import preset_for_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPUS = ("H100-SXM", "H200")
BF16 = 2  # bytes per element of every kernel here (the benchmarks' GPU dtype)
MODES = ("fwd", "bwd", "fwd+bwd")
# programs of the row-reduction kernels' backward grids (rms_norm, bias_gelu): occupancy.program_target
# asks 4 resident programs per SM, and the H100-SXM and the H200 have 132 SMs
PROGRAMS = 4 * 132

# the benchmarks' GPU shapes, as gpu_check.sh runs them
ATTN_TOKENS, ATTN_HIDDEN, ATTN_HEADDIM, ATTN_SEQLENS = 16384, 2048, 128, (2048, 8192)  # bench_attention.py
LLAMA_TOKENS, LCE_TOKENS = 8192, 8192  # bench_llama_ops.py's GPU defaults (--tokens, --lce-tokens)
LN_ROWS, LN_HIDDEN = 8192, 1600  # bench_norms.py's GPU rows, GPT-2 XL's hidden (the larger of its two)
GELU_ELEMENTS_M = 64  # bench_bias_gelu.py --sizes ... 64: the 64M-element target shape
TP = 8  # bench_gemm_comm.py --tp
CP_SEQ, CP_SIZES = 32768, (2, 4, 8)  # bench_context_parallel.py --mode virtual --seq 32768 --cp 2 4 8 (32/8 heads, d 128)


# ---- one function per kernel: (FLOPs, HBM bytes) or (FLOPs, HBM bytes, NVLink bytes) -------------

def _modes(mode: str, fwd: tuple, bwd: tuple) -> tuple:
    """The fwd, bwd or fwd+bwd (sum) of two cost tuples."""
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {', '.join(MODES)}")
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": tuple(a + b for a, b in zip(fwd, bwd))}[mode]


def attention(b: int, sq: int, sk: int, hq: int, hk: int, d: int, causal: bool, mode: str,
              elem: int = BF16) -> tuple[float, float]:
    """flash_attn.py's floors. Forward 4·b·hq·sq·sk·d FLOPs (QKᵀ and PV), halved when causal; backward
    2.5× that (FlashAttention's convention: QKᵀ recomputed, dV, dP, dQ, dK). Bytes: forward q, k, v
    read, out written, lse (fp32) written; backward q, out, dout, k, v read, dq, dk, dv written, lse
    and delta (fp32) read."""
    fwd_flops = 4.0 * b * hq * sq * sk * d / (2.0 if causal else 1.0)
    fwd = (fwd_flops, elem * d * b * (2 * sq * hq + 2 * sk * hk) + 4 * b * sq * hq)
    bwd = (2.5 * fwd_flops, elem * d * b * (4 * sq * hq + 4 * sk * hk) + 8 * b * sq * hq)
    return _modes(mode, fwd, bwd)


def rms_norm(rows: int, n: int, mode: str, elem: int = BF16) -> tuple[float, float]:
    """rms_norm.py's floors with the fused residual add: forward reads x and the residual, writes y
    and h (4·b·M·N) and rstd (4 bytes a row); backward reads dy, dh and h, writes dx (4·b·M·N), reads
    rstd, and writes then reduces PROGRAMS·N fp32 dweight partial sums (6% of its bytes at 8192
    rows). FLOPs per element: forward 5 (residual add, square and sum, ×rstd, ×weight), backward 10."""
    fwd = (5.0 * rows * n, 4 * elem * rows * n + 4 * rows)
    bwd = (10.0 * rows * n, 4 * elem * rows * n + 4 * rows + 2 * 4 * min(rows, PROGRAMS) * n)
    return _modes(mode, fwd, bwd)


def swiglu(rows: int, f: int, mode: str, elem: int = BF16) -> tuple[float, float]:
    """swiglu.py's floors: forward reads gate and up, writes y (3·b·M·F); backward reads dy, gate and
    up, writes dgate and dup (5·b·M·F). FLOPs per output element: forward 5 (sigmoid as 3, two
    products), backward 11 (sigmoid again, its derivative, four products)."""
    return _modes(mode, (5.0 * rows * f, 3 * elem * rows * f), (11.0 * rows * f, 5 * elem * rows * f))


def rotary(tokens: int, hq: int, hk: int, d: int, mode: str, elem: int = BF16) -> tuple[float, float]:
    """rotary.py's floor for q and k in one call: read x, write out (2·b per element), plus 8 bytes of
    fp32 cos/sin per token and rotary pair. 6 FLOPs per rotated pair. The backward is the same kernel
    with the opposite angles."""
    n = tokens * (hq + hk) * d
    one = (3.0 * n, 2 * elem * n + 8 * tokens * (d // 2))
    return _modes(mode, one, one)


def linear_cross_entropy(tokens: int, hidden: int, vocab: int, mode: str, elem: int = BF16) -> tuple[float, float]:
    """The LM-head GEMM and its loss, chunked (functional/linear_cross_entropy.py; cross_entropy.py
    has the per-chunk passes). FLOPs: the logits GEMM 2·T·H·V; with gradients (made in the same pass)
    dh and dW two more GEMMs of the same size (softmax work, ~5·T·V, is left out). Compulsory bytes:
    read hidden and the weight, the int64 targets, write the fp32 losses; with gradients write dh and
    dW too. The chunked implementation also moves each logits chunk ~3 times (about 6·T·V bytes in
    bf16): not compulsory, and 5% of the compute term at these shapes."""
    fwd = (2.0 * tokens * hidden * vocab, elem * (tokens + vocab) * hidden + 12 * tokens)
    grads = (4.0 * tokens * hidden * vocab, elem * (tokens + vocab) * hidden)
    return _modes(mode, fwd, grads)


def bias_gelu(rows: int, n: int, mode: str, elem: int = BF16) -> tuple[float, float]:
    """bias_gelu.py's floors: forward reads x, writes y (2·b·M·N); backward reads grad and x, writes
    dx (3·b·M·N), and writes then reduces programs_m·N fp32 bias partial sums (programs_m·programs_n
    ≈ PROGRAMS, tiles 256 columns wide: 0.3% of the bytes here). FLOPs per element: forward 6 (bias
    add, exact erf GeLU as 5), backward 12 (the GeLU again and its derivative: exp and 5 products and
    sums, the bias partial sum)."""
    programs_m = min(rows, max(1, PROGRAMS // math.ceil(n / 256)))
    return _modes(mode, (6.0 * rows * n, 2 * elem * rows * n),
                  (12.0 * rows * n, 3 * elem * rows * n + 2 * 4 * programs_m * n))


def layer_norm(rows: int, n: int, mode: str, residual: bool = True, elem: int = BF16) -> tuple[float, float]:
    """layer_norm.py's floors: forward reads x (and the residual), writes y (and h): 2·b·M·N (4·b·M·N
    with the residual), 8 bytes of mean and rstd a row; backward reads dy and h (and dh), writes dx:
    3·b·M·N (4·b·M·N with dh), reads mean and rstd, and writes then reduces PROGRAMS·N·8 bytes of fp32
    dweight and dbias partial sums. FLOPs per element: forward 8 with the residual add (7 without),
    backward 15 with dh (14 without)."""
    r = 1 if residual else 0
    return _modes(mode, ((7.0 + r) * rows * n, (2 + 2 * r) * elem * rows * n + 8 * rows),
                  ((14.0 + r) * rows * n, (3 + r) * elem * rows * n + 8 * rows + 2 * 8 * min(rows, PROGRAMS) * n))


def all_gather_matmul(M: int, K: int, N: int, tp: int, elem: int = BF16) -> tuple[float, float, float]:
    """One rank of the fused AG+GEMM (ag_matmul.py's floor), A (M/tp, K) per rank gathered, B (K, N/tp):
    2·M·K·N/tp FLOPs; HBM: the gathered A, B and the output, plus the peers' tp−1 shards written here
    as they arrive and this rank's shard read by its tp−1 peers; NVLink: the tp−1 shards in."""
    m, n = M // tp, N // tp
    hbm = elem * (M * K + K * n + M * n + 2 * (tp - 1) * m * K)
    return 2.0 * M * K * n, hbm, elem * (tp - 1) * m * K


def matmul_reduce_scatter(M: int, K: int, N: int, tp: int, elem: int = BF16) -> tuple[float, float, float]:
    """One rank of the fused GEMM+RS (matmul_signal.py + tile_reduce.py MODE 0), A (M, K/tp), B (K/tp, N):
    2·M·K·N/tp FLOPs; HBM: A and B read, the fp32 partials (M, N) written and read once (its own
    M/tp rows by this rank, the rest by the peers that own them), its (M/tp, N) output written;
    NVLink: (tp−1)·4·(M/tp)·N bytes of fp32 partials in."""
    k, m = K // tp, M // tp
    hbm = elem * (M * k + k * N) + 8 * M * N + elem * m * N
    return 2.0 * M * k * N, hbm, 4.0 * (tp - 1) * m * N


def matmul_all_reduce(M: int, K: int, N: int, tp: int, elem: int = BF16) -> tuple[float, float, float]:
    """One rank of the fused GEMM+AR (matmul_signal.py + tile_reduce.py), A (M, K/tp), B (K/tp, N), one-shot
    up to gemm_comm_fused.ONE_SHOT_MAX_ELEMENTS outputs, else two-shot. One-shot: every rank reads
    every rank's fp32 partials (this rank's are read tp times), writes the whole output; NVLink
    (tp−1)·4·M·N. Two-shot: each rank reduces 1/tp of the tiles from every rank's partials (this
    rank's partials are read once in all), writes them to its output and its shared buffer, then
    copies the other tiles from their owners; NVLink (tp−1)/tp·(4 + b)·M·N."""
    k = K // tp
    gemm = elem * (M * k + k * N) + 4 * M * N
    if M * N <= ONE_SHOT_MAX_ELEMENTS:
        return 2.0 * M * k * N, gemm + 4 * tp * M * N + elem * M * N, 4.0 * (tp - 1) * M * N
    share = (tp - 1) / tp * M * N
    hbm = gemm + 4 * M * N + 2 * elem * M * N / tp + 2 * elem * share
    return 2.0 * M * k * N, hbm, (4 + elem) * share


GEMM_COMM = {"ag": all_gather_matmul, "rs": matmul_reduce_scatter, "ar": matmul_all_reduce}


def cp_ring_forward(S: int, cp: int, hq: int, hk: int, d: int, b: int = 1,
                    elem: int = BF16) -> tuple[float, float, float]:
    """One rank's causal attention forward under zigzag ring CP (functional/context_parallel.py's
    cost): 2·b·hq·d·S²/cp FLOPs (the causal whole sequence shared evenly); HBM: its q and out (S/cp
    tokens), lse, every K/V block read once (S tokens of hk heads) and the cp−1 received blocks
    written; NVLink: the cp−1 blocks, (cp−1)·2·b·(S/cp)·hk·d·elem bytes, in."""
    flops = 2.0 * b * hq * d * S * S / cp
    hbm = elem * d * b * (2 * S // cp * hq + 2 * S * hk + 2 * (cp - 1) * (S // cp) * hk) + 4 * b * (S // cp) * hq
    return flops, hbm, elem * d * b * 2 * (cp - 1) * (S // cp) * hk


# ---- the rows: every kernel at its benchmark's shapes --------------------------------------------

@dataclass(frozen=True)
class Work:
    kernel: str
    mode: str
    shape: str
    flops: float
    hbm_bytes: float
    link_bytes: float = 0.0
    tensor_cores: bool = False  # an FP8 version would use the FP8 peak
    key: tuple = ()  # what a measured CSV row is matched by
    plot: bool = True  # one GPU's work (the per-rank TP rows need NVLink: not on the one-GPU plot)


def layer_norm_exists() -> bool:
    return (ROOT / "tpkernels" / "kernels" / "triton" / "layer_norm.py").is_file()


def works() -> list[Work]:
    out = []
    for s in ATTN_SEQLENS:
        b, h = ATTN_TOKENS // s, ATTN_HIDDEN // ATTN_HEADDIM
        for causal in (False, True):
            for mode in ("fwd", "bwd"):
                f, by = attention(b, s, s, h, h, ATTN_HEADDIM, causal, mode)
                out.append(Work("flash_attn", mode, f"b{b} s{s} h{h} d{ATTN_HEADDIM}{' causal' if causal else ''}",
                                f, by, tensor_cores=True, key=("flash_attn", mode, b, s, h, ATTN_HEADDIM, causal)))
    t, lce, fb = LLAMA_TOKENS, LCE_TOKENS, ("fwd", "fwd+bwd")  # bench_llama_ops/bias_gelu: forward, forward+backward
    gelu_rows = GELU_ELEMENTS_M * (1 << 20) // GELU_COLS
    out += [Work("rms_norm", m, f"{t}×{HIDDEN} + residual", *rms_norm(t, HIDDEN, m), key=("rms_norm", m, t)) for m in fb]
    if layer_norm_exists():  # bench_norms.py: GPT-2 XL's width, alone and with the residual add
        out += [Work("layer_norm", m, f"{LN_ROWS}×{LN_HIDDEN}{' + residual' if res else ''}",
                     *layer_norm(LN_ROWS, LN_HIDDEN, m, res), key=("layer_norm", m, LN_ROWS, LN_HIDDEN, res))
                for res in (False, True) for m in fb]
    out += [Work("swiglu", m, f"{t}×{FFN} (fused gate+up in)", *swiglu(t, FFN, m), key=("swiglu", m, t)) for m in fb]
    out += [Work("rotary", m, f"{t} tok, q {HEADS} + k {KV_HEADS} heads, d{HEAD_DIM}",
                 *rotary(t, HEADS, KV_HEADS, HEAD_DIM, m), key=("rotary", m, t)) for m in fb]
    out += [Work("linear_cross_entropy", m, f"{lce}×{HIDDEN}, vocab {VOCAB}", *linear_cross_entropy(lce, HIDDEN, VOCAB, m),
                 tensor_cores=True, key=("linear_cross_entropy", m, lce)) for m in fb]
    out += [Work("bias_gelu", m, f"{gelu_rows}×{GELU_COLS} ({GELU_ELEMENTS_M}M)", *bias_gelu(gelu_rows, GELU_COLS, m),
                 key=("bias_gelu", m, GELU_ELEMENTS_M)) for m in fb]
    for shapes in GEMM_COMM_SHAPES.values():
        for name, op, M, K, N in shapes:
            f, hbm, link = GEMM_COMM[op](M, K, N, TP)
            dims = f"M{M} K{K} N{N}"
            out.append(Work(f"gemm_comm {op} virtual TP{TP}", "fwd", f"{name}: {dims}, {TP} ranks on 1 GPU",
                            TP * f, TP * hbm, tensor_cores=True, key=("gemm_comm", name, TP)))
            out.append(Work(f"gemm_comm {op} per rank TP{TP}", "fwd", f"{name}: {dims}, 1 of {TP} GPUs",
                            f, hbm, link, tensor_cores=True, plot=False))
    f, by = attention(1, CP_SEQ, CP_SEQ, 32, 8, 128, True, "fwd")
    out.append(Work("flash_attn", "fwd", f"b1 s{CP_SEQ} h32/8 d128 causal (CP1)", f, by, tensor_cores=True,
                    key=("cp whole", CP_SEQ)))
    for cp in CP_SIZES:
        out.append(Work(f"cp ring (zigzag) CP{cp}", "fwd", f"one rank of s{CP_SEQ} h32/8 d128 causal",
                        *cp_ring_forward(CP_SEQ, cp, 32, 8, 128), tensor_cores=True, key=("cp zigzag", cp, CP_SEQ)))
    return out


# ---- floors --------------------------------------------------------------------------------------

@dataclass
class Measured:
    ms: float
    by: str  # benchmark and variant
    device: str
    torch: str = ""
    triton: str = ""
    date: str = ""


@dataclass
class Row:
    work: Work
    gpu: GPUSpec
    measured: Measured | None = None
    extra: dict = field(default_factory=dict)

    @property
    def terms_s(self) -> dict[str, float]:
        g = self.gpu
        return {"compute": self.work.flops / (g.peak_tflops_bf16 * 1e12),
                "memory": self.work.hbm_bytes / (g.hbm_gbs * 1e9),
                "link": self.work.link_bytes / ((g.nvlink_gbs or g.pcie_gbs) * 1e9)}

    @property
    def floor_s(self) -> float:
        return max(self.terms_s.values())

    @property
    def bound(self) -> str:
        terms = self.terms_s
        return max(terms, key=terms.get)

    @property
    def intensity(self) -> float:
        return self.work.flops / self.work.hbm_bytes

    def fp8_s(self) -> float | None:
        if not self.work.tensor_cores or self.gpu.peak_tflops_fp8 is None:
            return None
        return self.work.flops / (self.gpu.peak_tflops_fp8 * 1e12)

    def pct_of_floor(self) -> float | None:
        return 100.0 * self.floor_s * 1e3 / self.measured.ms if self.measured else None

    def csv_row(self, meta: dict) -> dict:
        w, g, t, m = self.work, self.gpu, self.terms_s, self.measured
        fp8 = self.fp8_s()
        return {"gpu": g.name, "peak_bf16_tflops": g.peak_tflops_bf16, "peak_fp8_tflops": g.peak_tflops_fp8 or "",
                "hbm_tbs": g.hbm_gbs / 1e3, "nvlink_gbs": g.nvlink_gbs or "", "kernel": w.kernel, "mode": w.mode,
                "shape": w.shape, "dtype": "bfloat16", "gflop": _sig(w.flops / 1e9), "hbm_mb": _sig(w.hbm_bytes / 1e6),
                "link_mb": _sig(w.link_bytes / 1e6) if w.link_bytes else "", "flop_per_byte": _sig(self.intensity),
                "ridge_flop_per_byte": _sig(g.peak_tflops_bf16 * 1e12 / (g.hbm_gbs * 1e9)),
                "compute_us": _sig(t["compute"] * 1e6), "memory_us": _sig(t["memory"] * 1e6),
                "link_us": _sig(t["link"] * 1e6) if w.link_bytes else "", "floor_us": _sig(self.floor_s * 1e6),
                "bound": self.bound, "fp8_compute_us": _sig(fp8 * 1e6) if fp8 else "",
                "measured_us": _sig(m.ms * 1e3) if m else "", "pct_of_floor": round(self.pct_of_floor(), 1) if m else "",
                "achieved_tflops": _sig(w.flops / m.ms / 1e9) if m else "",
                "achieved_tbs": _sig(w.hbm_bytes / m.ms / 1e9) if m else "",
                "measured_by": m.by if m else "", "measured_device": m.device if m else "",
                "measured_torch": m.torch if m else "", "measured_triton": m.triton if m else "",
                "measured_date": m.date if m else "", **meta}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def floors(gpu_names=GPUS) -> dict[str, list[Row]]:
    ws = works()
    return {name: [Row(w, GPU_PRESETS[name]) for w in ws] for name in gpu_names}


# ---- measured CSVs -------------------------------------------------------------------------------

MODE_NAMES = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwd+bwd", "forward": "fwd", "forward+backward": "fwd+bwd"}
LLAMA_OPS = {"rms_norm": "rms_norm", "swiglu": "swiglu", "rotary": "rotary", "linear_cross_entropy": "linear_cross_entropy"}


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _measured_rows(path: Path, notes: list[str]) -> list[tuple[tuple, Measured]]:
    """(key, measurement) pairs of one benchmark CSV; [] for a CSV of another kind."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    cols = set(rows[0])

    def meas(r, ms, by):
        return Measured(ms, f"{path.stem}: {by}", r.get("device", ""), r.get("torch", ""), r.get("triton", ""),
                        r.get("date", ""))

    out = []
    if {"provider", "seqlen", "headdim", "causal"} <= cols:  # bench_attention.py
        for r in rows:
            if r["provider"].startswith("ours"):
                key = ("flash_attn", r["mode"], int(r["batch"]), int(r["seqlen"]), int(r["nheads"]), int(r["headdim"]),
                       r["causal"] == "True")
                out.append((key, meas(r, _num(r["ms"]), r["provider"])))
    elif {"op", "variant", "GBps"} <= cols and rows[0]["op"].startswith("layer_norm"):  # bench_norms.py
        for r in rows:
            shape = re.search(r"(\d+)x(\d+)$", r["op"])
            if shape and r["variant"] == "ours":
                key = ("layer_norm", MODE_NAMES[r["mode"]], int(shape[1]), int(shape[2]), "+ residual" in r["op"])
                out.append((key, meas(r, _num(r["ms"]), "ours")))
    elif {"op", "variant", "GBps"} <= cols:  # bench_llama_ops.py: its tokens from the rms_norm forward's bytes
        rms = [r for r in rows if r["op"].startswith("rms_norm") and r["mode"] == "forward" and r["variant"] == "ours"]
        tokens = round(_num(rms[0]["GBps"]) * 1e6 * _num(rms[0]["ms"]) / (4 * BF16 * HIDDEN)) if rms else 0
        if abs(tokens - LLAMA_TOKENS) > 0.1 * LLAMA_TOKENS:
            notes.append(f"{path.name}: {tokens} tokens (from the rms_norm bytes), not {LLAMA_TOKENS}: not used")
            return []
        for r in rows:
            kernel = next((k for name, k in LLAMA_OPS.items() if r["op"].startswith(name)), None)
            if kernel and r["variant"] == "ours":
                n = LCE_TOKENS if kernel == "linear_cross_entropy" else LLAMA_TOKENS
                out.append(((kernel, MODE_NAMES[r["mode"]], n), meas(r, _num(r["ms"]), "ours")))
    elif {"elements_M", "variant", "copy%"} <= cols:  # bench_bias_gelu.py: the fastest of ours
        for r in rows:
            if r["variant"].startswith("ours") and r["dtype"] == "bfloat16":
                out.append((("bias_gelu", MODE_NAMES[r["mode"]], int(r["elements_M"])), meas(r, _num(r["ms"]), r["variant"])))
    elif {"fused_ms", "lone_gemm_ms"} <= cols:  # bench_gemm_comm.py --mode virtual, default movers
        for r in rows:
            if (r.get("copy"), r.get("reducer"), r.get("rs_mode")) == ("engine", "triton", "pull"):
                out.append((("gemm_comm", r["shape"], int(r["tp"])), meas(r, _num(r["fused_ms"]), "fused")))
    elif {"zigzag slowest ms", "whole ms", "cp"} <= cols:  # bench_context_parallel.py --mode virtual
        for r in rows:
            if r["heads"] == "32/8":
                out.append((("cp whole", int(r["seq"])), meas(r, _num(r["whole ms"]), "whole sequence")))
                out.append((("cp zigzag", int(r["cp"]), int(r["seq"])), meas(r, _num(r["zigzag slowest ms"]),
                                                                            "zigzag, slowest rank")))
    return [(k, m) for k, m in out if m.ms == m.ms and m.ms > 0]


def read_measured(paths: list[Path]) -> tuple[dict[str, dict[tuple, Measured]], list[str]]:
    """{preset name: {key: fastest measurement}} from benchmark CSVs (files or folders of them), and notes."""
    files = []
    for p in paths:
        files += sorted(q for q in p.glob("*.csv") if not q.name.startswith("roofline")) if p.is_dir() else [p]
    found: dict[str, dict[tuple, Measured]] = {}
    notes, cpu = [], 0
    for path in files:
        for key, m in _measured_rows(path, notes):
            spec = preset_for_device(m.device) if m.device else None
            if spec is None:
                cpu += 1
                continue
            mine = found.setdefault(spec.name, {})
            if key not in mine or m.ms < mine[key].ms:
                mine[key] = m
    if cpu:
        notes.append(f"{cpu} measured rows from devices without a GPU preset (CPU runs) ignored")
    if not any(found.values()):
        notes.append(f"no GPU measurement in {', '.join(str(p) for p in paths)}: the measured column stays empty")
    return found, notes


def fill(table: dict[str, list[Row]], measured: dict[str, dict[tuple, Measured]]) -> None:
    for name, rows in table.items():
        mine = measured.get(name, {})
        for r in rows:
            r.measured = mine.get(r.work.key) if r.work.key else None


# ---- output --------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    """3 significant digits, whole numbers from 1000 up (no exponents in the table)."""
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def _fmt_us(s: float) -> str:
    return _fmt(s * 1e6)


def summary_rows(table: dict[str, list[Row]]) -> tuple[list[str], list[list[str]]]:
    """One line per kernel: the shapes' work, each GPU's floor and bound, FP8, the measured column."""
    names = list(table)
    first = table[names[0]]
    measured_gpu = next((n for n in names if any(r.measured for r in table[n])), None)
    head = ["kernel", "mode", "shape", "GFLOP", "HBM MB", "FLOP/B"]
    for n in names:
        head += [f"{n} floor µs", "bound"]
    head += [f"fp8 µs ({names[-1]})", f"measured µs ({measured_gpu or 'no GPU run'})", "% of floor"]
    lines = []
    for i, r0 in enumerate(first):
        w = r0.work
        line = [w.kernel, w.mode, w.shape, _fmt(w.flops / 1e9), _fmt(w.hbm_bytes / 1e6), _fmt(r0.intensity)]
        for n in names:
            r = table[n][i]
            line += [_fmt_us(r.floor_s), r.bound]
        fp8 = table[names[-1]][i].fp8_s()
        line.append(_fmt_us(fp8) if fp8 else "—")
        m = table[measured_gpu][i] if measured_gpu else None
        line += [_fmt_us(m.measured.ms / 1e3), f"{m.pct_of_floor():.0f}%"] if m and m.measured else ["—", "—"]
        lines.append(line)
    return head, lines


def print_text(head, lines) -> None:
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    left = {0, 1, 2}
    fmt = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    print(fmt(head))
    for ln in lines:
        print(fmt(ln))


def print_markdown(head, lines) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for ln in lines:
        print("| " + " | ".join(ln) + " |")


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def write_csvs(table: dict[str, list[Row]], out: Path) -> list[Path]:
    meta = run_metadata_cpu()
    paths = []
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in table.items():
        data = [r.csv_row(meta) for r in rows]
        path = out / f"roofline_{slug(name)}.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
        paths.append(path)
    return paths


def run_metadata_cpu() -> dict:
    """This run's torch/triton versions and date (the floors are computed, not measured, on this machine)."""
    import torch  # noqa: PLC0415

    meta = run_metadata(torch.device("cpu"))
    return {"computed_on": meta["device"], "torch": meta["torch"], "triton": meta["triton"], "date": meta["date"]}


def plot(rows: list[Row], path: Path) -> bool:
    """The roofline of one GPU (bf16 and FP8 ceilings, HBM slope) with every one-GPU kernel on it: hollow
    at its floor, filled where it was measured (at the achieved FLOP/s)."""
    plt = pyplot()
    if plt is None:
        return False
    g = rows[0].gpu
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [10 ** (e / 20) for e in range(-20, 101)]  # 0.1 .. 1e5 FLOP/B
    bw = g.hbm_gbs * 1e9
    ax.plot(xs, [min(g.peak_tflops_bf16, bw * x / 1e12) for x in xs], "k-", lw=1.5, label=f"bf16 {g.peak_tflops_bf16:g} TFLOP/s")
    if g.peak_tflops_fp8:
        ax.plot(xs, [min(g.peak_tflops_fp8, bw * x / 1e12) for x in xs], "k--", lw=1, label=f"fp8 {g.peak_tflops_fp8:g} TFLOP/s")
    families = list(dict.fromkeys(r.work.kernel.split(" ")[0] for r in rows if r.work.plot))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, fam in enumerate(families):
        sel = [r for r in rows if r.work.plot and r.work.kernel.split(" ")[0] == fam]
        c = colors[i % len(colors)]
        ax.scatter([r.intensity for r in sel], [r.work.flops / r.floor_s / 1e12 for r in sel], facecolors="none",
                   edgecolors=c, label=f"{fam} (floor)")
        got = [r for r in sel if r.measured]
        if got:
            ax.scatter([r.intensity for r in got], [r.work.flops / r.measured.ms / 1e9 for r in got], color=c,
                       label=f"{fam} (measured)")
    ax.set(xscale="log", yscale="log", xlabel="FLOP per HBM byte", ylabel="TFLOP/s",
           title=f"{g.name}: {g.hbm_gbs / 1e3:g} TB/s HBM; floors hollow, measured filled")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPU_PRESETS), help="planner presets")
    ap.add_argument("--measured", nargs="+", type=Path, default=None,
                    help="benchmark CSVs, or folders of them (gpu_check.sh's $OUT), to fill the measured column")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="where roofline_<gpu>.csv/.png go")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    table = floors(args.gpus)
    notes = []
    if args.measured:
        measured, notes = read_measured(args.measured)
        fill(table, measured)
    for name in args.gpus:
        g = GPU_PRESETS[name]
        print(f"{name}: bf16 {g.peak_tflops_bf16:g} TFLOP/s, fp8 {g.peak_tflops_fp8 or '—'} TFLOP/s, HBM "
              f"{g.hbm_gbs / 1e3:g} TB/s, NVLink {g.nvlink_gbs or '—'} GB/s, ridge "
              f"{g.peak_tflops_bf16 * 1e3 / g.hbm_gbs:.0f} FLOP/B")
    head, lines = summary_rows(table)
    (print_markdown if args.markdown else print_text)(head, lines)
    for n in notes:
        print("note:", n)
    for path in write_csvs(table, args.out):
        print(f"wrote {path}")
    if not args.no_plot:
        for name, rows in table.items():
            path = args.out / f"roofline_{slug(name)}.png"
            if plot(rows, path):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
