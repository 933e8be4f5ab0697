"""``fp8.layers: auto``: FP8 for a decoder layer's linear only where the GEMM model predicts it faster,
the quantisation passes and the halved SP all-gather included.

    choices = fp8_layer_choices(model_preset("Llama-3-8B"), tp=8, sequence_parallel=True, tokens=8192,
                                gpu=gpu_preset("H200"))
    print(format_choices(choices))

One micro-batch of one linear y = x·W on one TP rank: x (m × k), W (k × n), dY (m × n); m the rank's
tokens (the full sequence after the SP all-gather), k and n per rank (step_time._linear_shapes).

GEMMs  forward x·W, input gradient dY·Wᵀ, weight gradient xᵀ·dY (dropped when frozen): 2·m·k·n FLOPs
       each, timed by gemm_model.gemm_time at its own shape, in bf16 or fp8 (1-byte operands, bf16
       output, the FP8 peak × Efficiency.gemm_fp8).
Casts  FP8 only. One pass per tensor reads its 16 bits and writes 8 (amax fused: delayed scaling).
       Hopper's FP8 GEMMs take K-major operands only, so a tensor two GEMMs contract along different
       axes writes a transposed 8-bit copy in the same pass (+1 byte/element):
         x    3·m_x·k  + m·k  (xᵀ for the weight gradient; not when frozen)
         W    4·k·n           (W for the forward, Wᵀ for the input gradient; every micro-batch: an upper
                               bound, TransformerEngine keeps it over a step's micro-batches)
         dY   3·m·n    + m·n  (dYᵀ for the weight gradient; not when frozen)
       m_x = m / tp for a column-parallel layer under SP (cast on the local shard, then gathered in
       fp8), else m. Bytes at HBM bandwidth × Efficiency.hbm (measured: Fp8Rates.cast_gbs), plus
       one kernel's fixed cost per pass (Efficiency.gemm_launch_s; measured: Fp8Rates.cast_op_s).
Comm   under SP with tp > 1, a column-parallel layer (qkv, gate_up / up) all-gathers its input in the
       forward (2·m·k bytes in bf16, m·k in fp8; the gathered input is kept for the weight gradient),
       a row-parallel layer (out, down) its output gradient in the backward (2·m·n, m·n in fp8).
       The rowwise recipe gathers 16-bit values (``fp8_gather=False``: per-token scales would follow
       every ring chunk). Exposed as step_time.py counts TP comm (tp_overlap.py): the ring over the
       GEMM it feeds (one of the linear's equal-FLOP GEMMs) exposes its first chunk and what the
       gather outlasts that GEMM, scaled by Efficiency.tp_overlap (0 on CPUs: all exposed). FP8's
       shorter GEMM hides less of the same bytes. The
       reduce-scatters of partial sums stay fp32 either way and are left out. Without a GPU
       (measured rates alone) no link is known: no comm counted.
Rates  ``rates`` (measured on this machine) take precedence: the measured GEMM rates at efficiency 1,
       no waves or tiles (measure.calibrate's convention); else ``gpu``'s peaks × its generation's
       calibrated efficiencies with the lone-GEMM ceilings of LONE_GEMM (or ``eff``).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass

from tpkernels.description import ModelConfig
from tpkernels.planner.collectives import group_collective_time
from tpkernels.planner.efficiency import Efficiency, calibrated_for
from tpkernels.planner.tp_overlap import ring_exposed

# A layer's choice compares lone GEMMs, not whole steps: the ceilings of one large GEMM (bf16: the
# ≈ 790 TFLOP/s one H200 measured for an 8192³ matmul, 0.83 of the peak with the model's wave and k
# factors; FP8: 0.62 of the FP8 peak, TransformerEngine's per-tensor-scaled kernels as fitted on NeMo
# 24.12's H100 runs when each generation had its own fit). The whole-step ceilings of
# efficiency.CALIBRATED_ALL also carry a step's gaps and clock drops, which a ratio of two GEMMs cancels.
LONE_GEMM = {"gemm": 0.83, "gemm_fp8": 0.62}
from tpkernels.planner.gemm_model import gemm_time
from tpkernels.planner.hardware import ClusterSpec, GPUSpec
from tpkernels.planner.step_time import _linear_shapes

FP8_MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need k and n (the leading dimensions) multiples of 16
COLUMN_LAYERS = ("qkv", "gate_up", "up")


@dataclass(frozen=True)
class Fp8Rates:
    """Rates measured on this machine (``measure_fp8_rates``)."""

    device: str
    bf16_tflops: float
    fp8_tflops: float  # torch._scaled_mm, per-tensor scales, bf16 output
    cast_gbs: float  # (2 read + 1 written) bytes per element / time of amax + scale + cast to e4m3
    cast_op_s: float = 0.0  # the same pass on a tiny tensor: its fixed cost (dispatch on a CPU)


@dataclass(frozen=True)
class Fp8LayerChoice:
    name: str  # the linear's attribute: qkv, out (attention.py), gate_up / up, down (mlp.py)
    m: int
    k: int
    n: int
    bf16_s: float  # one micro-batch: GEMMs + exposed bf16 all-gather (nan: no rate; module doc)
    fp8_s: float  # the same in FP8, casts included (inf: no FP8 GEMM on this device)
    gain: float  # bf16_s / fp8_s
    chosen: bool
    reason: str
    bf16_comm_s: float = 0.0  # the exposed SP all-gather inside bf16_s
    fp8_comm_s: float = 0.0  # the same at half the bytes, inside fp8_s
    cast_s: float = 0.0  # the quantisation passes inside fp8_s


def _measured(rates: Fp8Rates, eff: Efficiency) -> tuple[GPUSpec, Efficiency]:
    gpu = GPUSpec(f"measured {rates.device}", rates.bf16_tflops, 1.0, rates.cast_gbs, None, 1.0, 1.0,
                  peak_tflops_fp8=rates.fp8_tflops, sm_count=1, tile_m=1, tile_n=1, generation="cpu")
    eff = eff.replace(gemm=1.0, gemm_fp8=1.0, gemm_k0=0.0, gemm_tail=0.0, hbm=1.0, gemm_launch_s=0.0)
    return gpu, eff.replace(tp_overlap=0.0) if rates.device == "cpu" else eff  # gloo hides nothing


def _gemms(m: float, k: float, n: float, gpu: GPUSpec, eff: Efficiency, precision: str, wgrad: bool) -> float:
    t = gemm_time(m, n, k, gpu, eff, precision) + gemm_time(m, k, n, gpu, eff, precision)
    return t + (gemm_time(k, n, m, gpu, eff, precision) if wgrad else 0.0)


def _exposed(comm: float, gemm: float, eff: Efficiency, tp: int) -> float:
    """The all-gather of ``comm`` s pipelined over one GEMM of ``gemm`` s in tp chunks, of which the
    machine hides Efficiency.tp_overlap."""
    return comm - eff.tp_overlap * (comm - ring_exposed(comm, gemm, tp))


def fp8_layer_choices(model: ModelConfig, *, tp: int, sequence_parallel: bool, tokens: int, frozen: bool = False,
                      gpu: GPUSpec | None = None, rates: Fp8Rates | None = None, min_gain: float = 1.05,
                      eff: Efficiency | None = None, cluster: ClusterSpec | None = None,
                      learned: dict[str, float] | None = None, fp8_gather: bool = True) -> list[Fp8LayerChoice]:
    """One choice per linear of a decoder layer (module doc). ``tokens``: this rank's micro-batch tokens
    (m); ``cluster``: the links of the SP all-gather (default: one node of ``gpu``); ``learned``: gains
    a run measured on this machine (:func:`gain_key` -> bf16 / fp8 time of the whole linear, its
    communication included), which replace the prediction of their shapes; ``fp8_gather``: the recipe
    all-gathers FP8 bytes (current, delayed), else 16-bit values (rowwise)."""
    gpu = gpu or (cluster.gpu if cluster else None)
    names = ["qkv", "out", "gate_up" if model.gated_mlp else "up", "down"]
    base = eff or (calibrated_for(gpu).replace(**LONE_GEMM) if gpu else Efficiency())
    if rates is not None:
        rgpu, reff = _measured(rates, base)
        cast_gbs, cast_op = rates.cast_gbs, rates.cast_op_s
        no_fp8 = None
    elif gpu is not None:
        rgpu, reff = gpu, base
        cast_gbs, cast_op = gpu.hbm_gbs * base.hbm, base.gemm_launch_s
        no_fp8 = None if gpu.peak_tflops_fp8 else f"no FP8 tensor cores on {gpu.name}"
    else:
        rgpu = None
        no_fp8 = "no FP8 GEMM rate for this device (no GPU preset): fp8.measure true measures one"
    if gpu is not None and cluster is None:
        cluster = ClusterSpec(gpu, gpus_per_node=max(8, tp))
    m, wgrad = tokens, not frozen
    out = []
    for name, (k, n) in zip(names, _linear_shapes(model, tp)):
        shape = {"name": name, "m": int(m), "k": int(k), "n": int(n)}
        seen = (learned or {}).get(gain_key(name, m, k, n, tp, frozen, sequence_parallel and tp > 1))
        if seen is not None:
            bad = [f"{d} ({int(v)}) not a multiple of {FP8_MULTIPLE} (FP8 GEMMs)" for d, v in (("k", k), ("n", n))
                   if v % FP8_MULTIPLE]
            chosen = not bad and seen >= min_gain
            out.append(Fp8LayerChoice(**shape, bf16_s=math.nan, fp8_s=math.nan, gain=seen, chosen=chosen,
                                      reason="; ".join(bad) or f"measured {seen:.2f}× on this machine by an earlier "
                                                             "run (fp8.learn)"))
            continue
        if rgpu is None:
            out.append(Fp8LayerChoice(**shape, bf16_s=math.nan, fp8_s=math.nan, gain=math.nan, chosen=False,
                                      reason=no_fp8))
            continue
        # SP all-gathers: a column layer's input (forward; the gathered input is kept for the weight
        # gradient, not gathered again), a row layer's output gradient (backward); in FP8 at 1 byte an
        # element unless the recipe gathers 16-bit values (rowwise)
        sp_on = sequence_parallel and tp > 1 and cluster is not None
        elems = (m * k if name in COLUMN_LAYERS else m * n) if sp_on else 0.0
        ag = group_collective_time("all_gather", 2.0 * elems, tp, 1, cluster, reff) if elems else 0.0
        ag8 = group_collective_time("all_gather", (1.0 if fp8_gather else 2.0) * elems, tp, 1, cluster, reff) \
            if elems else 0.0
        gathers = sp_on and name in COLUMN_LAYERS and fp8_gather
        g16 = _gemms(m, k, n, rgpu, reff, "bf16", wgrad)
        per_gemm = 3 if wgrad else 2  # the gather feeds one of the linear's equal-FLOP GEMMs
        bf16_comm = _exposed(ag, g16 / per_gemm, reff, tp)
        bf16 = g16 + bf16_comm
        if no_fp8:
            out.append(Fp8LayerChoice(**shape, bf16_s=bf16, fp8_s=math.inf, gain=0.0, chosen=False, reason=no_fp8,
                                      bf16_comm_s=bf16_comm))
            continue
        m_x = m / tp if gathers else m
        cast_bytes = 3 * m_x * k + 4 * k * n + 3 * m * n + ((m * k + m * n) if wgrad else 0.0)
        cast = cast_bytes / (cast_gbs * 1e9) + 3 * cast_op
        g8 = _gemms(m, k, n, rgpu, reff, "fp8", wgrad)
        fp8_comm = _exposed(ag8, g8 / per_gemm, reff, tp)
        fp8 = g8 + cast + fp8_comm
        gain = bf16 / fp8
        bad = [f"{d} ({int(v) if v == int(v) else v}) not a multiple of {FP8_MULTIPLE} (FP8 GEMMs)"
               for d, v in (("k", k), ("n", n)) if v % FP8_MULTIPLE]
        chosen = not bad and gain >= min_gain
        if bad:
            reason = "; ".join(bad)
        elif chosen:
            reason = f"predicted {gain:.2f}× faster"
        elif g8 >= g16:
            reason = (f"predicted {gain:.2f}×: the FP8 GEMMs are slower than bf16 here ({1e3 * g8:.3g} vs "
                      f"{1e3 * g16:.3g} ms)")
        elif gain < 1:
            reason = (f"predicted {gain:.2f}×: the casts ({1e3 * cast:.3g} ms) cost more than the FP8 GEMMs "
                      f"save ({1e3 * (g16 - g8):.3g} ms)")
        else:
            reason = f"predicted {gain:.2f}×, below the {min_gain:.2f}× threshold"
        out.append(Fp8LayerChoice(**shape, bf16_s=bf16, fp8_s=fp8, gain=gain, chosen=chosen, reason=reason,
                                  bf16_comm_s=bf16_comm, fp8_comm_s=fp8_comm, cast_s=cast))
    return out


def gain_key(kind: str, m: int, k: int, n: int, tp: int, frozen: bool, gathered: bool) -> str:
    """The learned-gain key of a linear: its kind (qkv, out, gate_up, up, down: which also says its
    communication, column or row-parallel), its micro-batch GEMM (tokens m, k in, n out per rank), the TP
    degree and SP (what it communicates) and whether its weight is frozen (no weight-gradient GEMM).
    Two kinds with one GEMM shape keep separate gains: a column layer gathers its input under SP, a
    row layer reduce-scatters its output."""
    return f"{kind} {int(m)}x{int(k)}x{int(n)} tp{int(tp)}{' sp' if gathered else ''}{' frozen' if frozen else ''}"


def _gains_path():
    from tpkernels.planner.fit import cache_path  # noqa: PLC0415

    return cache_path().parent / "fp8_gains.json"


def load_gains(machine: str) -> dict[str, float]:
    """The FP8 gains runs measured on ``machine`` (planner.fit.machine_key), by :func:`gain_key`."""
    try:
        data = json.loads(_gains_path().read_text())
    except (OSError, ValueError):
        return {}
    got = data.get(machine) if isinstance(data, dict) else None
    return {k: float(v) for k, v in got.items() if isinstance(v, (int, float))} if isinstance(got, dict) else {}


def save_gains(machine: str, gains: dict[str, float]):
    """Keep ``gains`` for ``machine`` (merged over earlier ones); returns the file."""
    path = _gains_path()
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[machine] = {**(data.get(machine) if isinstance(data.get(machine), dict) else {}), **gains}
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this writer's own: two runs saving at once never write into each other's file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _median_time(fn, sync, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_fp8_rates(device, sizes=(1024, 2048), reps: int = 3) -> Fp8Rates:
    """Time square bf16 ``torch.matmul`` and ``torch._scaled_mm`` (e4m3 operands, fp32 scalar scales, bf16
    out) at each size (the best rate is kept), and this project's cast (quant/fp8.py's current scaling:
    amax in fp32, scale, clamp, convert) on the largest size and on a 16 × 16 tensor (its fixed cost)."""
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    e4m3, top = torch.float8_e4m3fn, 448.0
    one = torch.ones((), device=dev, dtype=torch.float32)
    bf16 = fp8 = 0.0
    for s in sizes:
        a, b = (torch.randn(s, s, device=dev, dtype=torch.bfloat16) for _ in range(2))
        a8, b8 = a.to(e4m3), b.to(e4m3)  # b8 (N, K) row-major: b8.t() is the column-major operand
        flops = 2.0 * s ** 3
        bf16 = max(bf16, flops / _median_time(lambda a=a, b=b: torch.matmul(a, b.t()), sync, reps) / 1e12)
        fp8 = max(fp8, flops / _median_time(
            lambda a=a8, b=b8: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), sync, reps) / 1e12)

    def cast(x):
        scale = top / x.abs().float().amax().clamp_min(1e-12)
        return (x.float() * scale).clamp(-top, top).to(e4m3)

    s = max(sizes)
    x, tiny = torch.randn(s, s, device=dev, dtype=torch.bfloat16), torch.randn(16, 16, device=dev, dtype=torch.bfloat16)
    op = _median_time(lambda: cast(tiny), sync, 3 * reps)
    full = _median_time(lambda: cast(x), sync, reps)
    return Fp8Rates(dev.type, bf16, fp8, 3.0 * x.numel() / max(full - op, full / 2) / 1e9, op)


def format_choices(choices: list[Fp8LayerChoice]) -> str:
    """A table: layer, this rank's GEMM, predicted bf16 and fp8 ms per micro-batch, gain, choice, reason."""
    rows = [("layer", "GEMM m×k×n", "bf16 ms", "fp8 ms", "gain", "fp8", "reason")]
    for c in choices:
        rows.append((c.name, f"{c.m}×{c.k}×{c.n}", "—" if math.isnan(c.bf16_s) else f"{1e3 * c.bf16_s:.3f}",
                     "—" if not math.isfinite(c.fp8_s) else f"{1e3 * c.fp8_s:.3f}",
                     "—" if not c.gain or math.isnan(c.gain) else f"{c.gain:.2f}×", "yes" if c.chosen else "no",
                     c.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows)
