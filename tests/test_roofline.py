"""benchmarks/roofline.py: the floors it computes (hand-computed rows) and the measured column it
fills from benchmark CSVs, on the CPU."""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def rl():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("roofline")
    finally:
        sys.path.remove(str(BENCH))


def test_attention_flops_and_bytes(rl):
    b, s, h, d = 2, 8192, 16, 128
    full = 4 * b * s * s * h * d  # QKᵀ and PV, 2 FLOPs per multiply-add
    assert rl.attention(b, s, s, h, h, d, False, "fwd")[0] == full
    assert rl.attention(b, s, s, h, h, d, True, "fwd")[0] == full / 2
    assert rl.attention(b, s, s, h, h, d, True, "bwd")[0] == 2.5 * full / 2
    assert rl.attention(b, s, s, h, h, d, True, "fwd+bwd")[0] == 3.5 * full / 2
    # q, k, v read and out written in bf16, lse in fp32
    assert rl.attention(b, s, s, h, h, d, True, "fwd")[1] == 4 * b * s * h * d * 2 + 4 * b * s * h
    # GQA: k and v are read for hk heads only
    assert rl.attention(1, s, s, 32, 8, d, True, "fwd")[1] == (2 * s * 32 + 2 * s * 8) * d * 2 + 4 * s * 32


def test_memory_bound_bytes(rl):
    rows, n = 8192, 4096
    # rms_norm with the residual: x, residual in, y, h out (bf16), rstd out (fp32)
    assert rl.rms_norm(rows, n, "fwd")[1] == 4 * 2 * rows * n + 4 * rows
    # backward: dy, dh, h in, dx out, rstd in, 528 programs' fp32 dweight partials written and read
    assert rl.rms_norm(rows, n, "bwd")[1] == 4 * 2 * rows * n + 4 * rows + 2 * 4 * 528 * n
    assert rl.swiglu(rows, 14336, "fwd")[1] == 3 * 2 * rows * 14336
    assert rl.bias_gelu(16384, 4096, "fwd")[1] == 2 * 2 * 16384 * 4096
    assert rl.rotary(rows, 32, 8, 128, "fwd")[1] == 2 * 2 * rows * 40 * 128 + 8 * rows * 64


def test_gemm_comm_flops_match_the_benchmark(rl):
    """The virtual rows do every emulated rank's work: bench_gemm_comm.py's FLOP count."""
    from bench_gemm_comm import _rank_shapes

    for name, op, M, K, N in [s for shapes in rl.GEMM_COMM_SHAPES.values() for s in shapes]:
        m, k, n = _rank_shapes(op, M, K, N, 8)
        bench = 2.0 * (8 * m if op == "ag" else m) * k * n * 8
        assert rl.GEMM_COMM[op](M, K, N, 8)[0] * 8 == bench, name
    # Flux AG+GEMM, one of 8 ranks: 7 shards of 512×12288 bf16 cross NVLink
    assert rl.all_gather_matmul(4096, 12288, 49152, 8)[2] == 7 * 512 * 12288 * 2


def test_floor_bound_and_table_rows(rl):
    table = rl.floors(["H100-SXM", "H200"])
    by = {(r.work.kernel, r.work.mode, r.work.shape): r for r in table["H200"]}
    # attention forward, s 8192 causal, 2 × 16 heads of 128: 2.2 TFLOP at 989 TFLOP/s
    r = by[("flash_attn", "fwd", "b2 s8192 h16 d128 causal")]
    flops = 4 * 2 * 8192**2 * 16 * 128 / 2
    assert r.work.flops == flops and r.bound == "compute"
    assert r.floor_s == pytest.approx(flops / 989e12)
    assert r.fp8_s() == pytest.approx(flops / 1979e12)
    # bias_gelu forward at 64M elements: 268 MB at 4.8 TB/s
    r = by[("bias_gelu", "fwd", "16384×4096 (64M)")]
    assert r.bound == "memory" and r.floor_s == pytest.approx(4 * 64 * 2**20 / 4.8e12)
    assert r.fp8_s() is None
    # the same work on the H100-SXM's 3.35 TB/s
    h100 = next(x for x in table["H100-SXM"] if x.work == r.work)
    assert h100.floor_s == pytest.approx(4 * 64 * 2**20 / 3.35e12)
    # a per-rank TP row whose NVLink transfer outlasts its GEMM: 70B down GEMM+AR at M=256
    r = next(x for x in table["H200"] if x.work.kernel == "gemm_comm ar per rank TP8" and "M=256" in x.work.shape)
    assert r.bound == "link" and r.floor_s == pytest.approx(r.work.link_bytes / 450e9)


def _write(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_measured_column_from_benchmark_csvs(rl, tmp_path, capsys):
    meta = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-12-03"}
    attn = {**meta, "dtype": "bfloat16", "headdim": 128, "nheads": 16, "batch": 2, "seqlen": 8192, "causal": True,
            "mode": "fwd", "provider": "ours (triton)", "ms": 4.0, "tflops": 0, "peak_pct": "", "ratio_vs_peer": ""}
    rows = [attn, {**attn, "provider": "sdpa flash (FA2)", "ms": 3.0},
            {**attn, "device": "CPU x86_64 x2 threads", "seqlen": 2048, "batch": 8, "ms": 1.0}]
    _write(tmp_path / "attention_key_shapes.csv", rows)
    gemm = {"shape": "flux AG+GEMM", "op": "ag", "tp": 8, "m": 512, "k": 12288, "n": 6144, "fused_ms": 6.0,
            "lone_gemm_ms": 5.5, **meta, "copy": "engine", "reducer": "triton", "rs_mode": "pull"}
    _write(tmp_path / "gemm_comm_virtual_nvidia_h200.csv", [gemm, {**gemm, "copy": "kernel", "fused_ms": 1.0}])
    ln = {**meta, "op": "layer_norm + residual 8192x1600", "mode": "forward+backward", "variant": "ours", "ms": 0.2,
          "GBps": 1.0, "copy_pct": 1.0, "ours_speedup": 1.0}
    _write(tmp_path / "norms_nvidia_h200.csv", [ln, {**ln, "variant": "eager", "ms": 0.1}])
    out = tmp_path / "out"
    assert rl.main(["--measured", str(tmp_path), "--out", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "measured µs (H200)" in text and "CPU runs) ignored" in text
    with open(out / "roofline_h200.csv") as f:
        got = list(csv.DictReader(f))
    fwd = next(r for r in got if r["kernel"] == "flash_attn" and r["mode"] == "fwd"
               and r["shape"] == "b2 s8192 h16 d128 causal")
    floor_us = 4 * 2 * 8192**2 * 16 * 128 / 2 / 989e12 * 1e6
    assert float(fwd["measured_us"]) == 4000.0  # ours, not the peer
    assert float(fwd["pct_of_floor"]) == pytest.approx(100 * floor_us / 4000, abs=0.1)
    assert fwd["measured_device"] == "NVIDIA H200" and fwd["measured_triton"] == "3.6.0"
    ag = next(r for r in got if r["kernel"] == "gemm_comm ag virtual TP8" and "flux" in r["shape"])
    assert float(ag["measured_us"]) == 6000.0  # the default movers' run, not the tagged one
    if rl.layer_norm_exists():
        ln = next(r for r in got if r["kernel"] == "layer_norm" and r["mode"] == "fwd+bwd" and "residual" in r["shape"])
        assert float(ln["measured_us"]) == 200.0
    assert sum(r["measured_us"] != "" for r in got) == 2 + rl.layer_norm_exists()  # nothing else was measured
    with open(out / "roofline_h100_sxm.csv") as f:
        assert all(r["measured_us"] == "" for r in csv.DictReader(f))  # measured on an H200 only
