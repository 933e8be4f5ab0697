"""The Llama-family ops vs eager PyTorch vs torch.compile, forward and forward+backward, at Llama-3-8B
widths. (Liger-Kernel, the GPU peer, is not in this script yet: its GPU step has not been run.)

    python benchmarks/bench_llama_ops.py [--tokens 8192] [--device cpu|cuda] [--reps N]

Shapes: rms_norm (tokens, 4096) with the residual add; swiglu the fused (tokens, 2·14336) gate+up
output; rotary q (tokens, 32, 128) and k (tokens, 8, 128); linear_cross_entropy hidden (tokens, 4096)
against a vocabulary of 128256 (fewer tokens and vocab on the CPU: see --lce-*). fp32 on the CPU,
bf16 on a GPU. "GB/s" counts the bytes each op must move (its floor: what the fused kernel reads
and writes once), for every variant, so the column compares times on one scale; "copy%" is that
over the copy bandwidth measured in the same run. linear_cross_entropy is judged by time against
the unfused GEMM + loss and by its peak memory (the allocator's on a GPU; the largest tensor made,
on the CPU). Writes benchmarks/results/llama_ops_<device>.csv and a PNG ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, copy_bandwidth_gbs, device_slug, print_table, pyplot, run_metadata, time_ms, write_csv  # noqa: E402,E501

import tpkernels  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
PEAK_FN: dict = {}  # variant -> the function whose tensors the CPU peak records


# ---- the eager PyTorch versions a user would otherwise run (Hugging Face's Llama code) ----

def rms_eager(x, w, res):
    h = x + res
    hf = h.float()
    return (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * w, h


def swiglu_eager(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def rotary_eager(q, k, cos, sin, pos):
    c, s = cos[pos][:, None], sin[pos][:, None]
    c, s = torch.cat([c, c], -1).to(q.dtype), torch.cat([s, s], -1).to(q.dtype)

    def rot(x):
        x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return x * c + torch.cat([-x2, x1], -1) * s

    return rot(q), rot(k)


def lce_eager(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


class _Largest(TorchDispatchMode):
    """The largest tensor made that is not shaped like an input or its gradient (``skip``: numels)."""

    def __init__(self, skip):
        super().__init__()
        self.bytes, self.skip = 0, set(skip)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() not in self.skip:
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _peak_bytes(fn, device, *inputs) -> int:
    """GPU: the allocator's peak above what was allocated before. CPU: the largest intermediate tensor
    (not input- or gradient-shaped), e.g. the logits."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with _Largest(t.numel() for t in inputs) as m:
        fn()
    return m.bytes


def cases(device, dtype, tokens, lce_tokens, lce_vocab):
    """name -> (floor bytes fwd, floor bytes fwd+bwd, {variant: (fwd fn, fwd+bwd fn)})."""
    b = torch.tensor([], dtype=dtype).element_size()
    out = {}

    x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    def rms_fb(fn):
        def run():
            xs, rs, ws = (t.detach().requires_grad_() for t in (x, res, w))
            y, h = fn(xs, ws, rs)
            torch.autograd.backward([y, h], [dy, dy])
        return run

    ours_rms = lambda a, ww, r: tpkernels.rms_norm(a, ww, 1e-5, residual=r)  # noqa: E731
    comp_rms = torch.compile(rms_eager)
    out["rms_norm + residual"] = (4 * b * x.numel(), 9 * b * x.numel(), {
        "ours": (lambda: ours_rms(x, w, res), rms_fb(ours_rms)),
        "eager": (lambda: rms_eager(x, w, res), rms_fb(lambda a, ww, r: rms_eager(a, ww, r))),
        "torch.compile": (lambda: comp_rms(x, w, res), rms_fb(lambda a, ww, r: comp_rms(a, ww, r)))})

    gu = torch.randn(tokens, 2 * FFN, device=device, dtype=dtype)
    dyf = torch.randn(tokens, FFN, device=device, dtype=dtype)

    def sw_fb(fn):
        def run():
            g = gu.detach().requires_grad_()
            fn(g).backward(dyf)
        return run

    comp_sw = torch.compile(swiglu_eager)
    out["swiglu (fused gate+up)"] = (3 * b * dyf.numel(), 8 * b * dyf.numel(), {
        "ours": (lambda: tpkernels.swiglu(gu), sw_fb(tpkernels.swiglu)),
        "eager": (lambda: swiglu_eager(gu), sw_fb(swiglu_eager)),
        "torch.compile": (lambda: comp_sw(gu), sw_fb(comp_sw))})

    q = torch.randn(1, tokens, HEADS, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    cos, sin = tpkernels.rotary_cache(HEAD_DIM, tokens, 500000.0, device=device)
    pos = torch.arange(tokens, device=device)
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def rot_fb(fn):
        def run():
            qs, ks = q.detach().requires_grad_(), k.detach().requires_grad_()
            torch.autograd.backward(list(fn(qs, ks)), [dq, dk])
        return run

    ours_rot = lambda a, c: tpkernels.apply_rotary(a, c, cos, sin)  # noqa: E731
    eager_rot = lambda a, c: rotary_eager(a[0], c[0], cos, sin, pos)  # noqa: E731
    comp_rot = torch.compile(eager_rot)
    n_qk = q.numel() + k.numel()
    out["rotary q+k"] = (2 * b * n_qk, 4 * b * n_qk, {
        "ours": (lambda: ours_rot(q, k), rot_fb(ours_rot)),
        "eager": (lambda: eager_rot(q, k), rot_fb(lambda a, c: tuple(t[None] for t in eager_rot(a, c)))),
        "torch.compile": (lambda: comp_rot(q, k), rot_fb(lambda a, c: tuple(t[None] for t in comp_rot(a, c))))})

    h = torch.randn(lce_tokens, HIDDEN, device=device, dtype=dtype) / 8
    wv = torch.randn(lce_vocab, HIDDEN, device=device, dtype=dtype) / 8
    t = torch.randint(0, lce_vocab, (lce_tokens,), device=device)

    def lce_fb(fn):
        def run():
            hs, ws = h.detach().requires_grad_(), wv.detach().requires_grad_()
            fn(hs, ws).backward()
        return run

    ours_lce = lambda a, ww: tpkernels.linear_cross_entropy(a, ww, t)  # noqa: E731
    from tpkernels.functional.linear_cross_entropy import _chunk_pass, default_chunk_size  # noqa: PLC0415

    chunk = default_chunk_size(lce_tokens, HIDDEN, lce_vocab)

    def ours_loop():  # what the custom op runs (a dispatch mode does not see inside the op)
        _chunk_pass(h, wv, t, None, chunk, -100, 0.0, 0.0, None, True, "reference")

    PEAK_FN["ours"] = ours_loop
    out["linear_cross_entropy"] = (None, (h, wv), {
        "ours": (lambda: ours_lce(h, wv), lce_fb(ours_lce)),
        "eager (GEMM + F.cross_entropy)": (lambda: lce_eager(h, wv, t), lce_fb(lambda a, ww: lce_eager(a, ww, t)))})
    return out


def bench(device: torch.device, tokens: int, lce_tokens: int, lce_vocab: int, reps: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = run_metadata(device)
    copy = copy_bandwidth_gbs(tokens * HIDDEN, dtype, device, reps)
    rows = []
    for name, (fwd_bytes, fb_bytes, variants) in cases(device, dtype, tokens, lce_tokens, lce_vocab).items():
        for variant, (fwd, fb) in variants.items():
            for mode, fn, nbytes in (("forward", fwd, fwd_bytes), ("forward+backward", fb, fb_bytes)):
                with torch.no_grad() if mode == "forward" else torch.enable_grad():
                    ms = time_ms(fn, device, reps)
                row = {**meta, "op": name, "mode": mode, "variant": variant, "ms": round(ms, 3)}
                if isinstance(nbytes, int):
                    gbs = nbytes / ms / 1e6
                    row.update(GBps=round(gbs, 1), copy_pct=round(100 * gbs / copy, 1))
                else:
                    row.update(GBps="", copy_pct="")
                if name == "linear_cross_entropy" and mode == "forward+backward":
                    probe = PEAK_FN.get(variant, fb) if device.type == "cpu" else fb
                    row["peak_MiB"] = round(_peak_bytes(probe, device, *fb_bytes) / 2**20, 1)
                rows.append(row)
        for r in rows:
            if r["op"] == name:
                ours = next(x["ms"] for x in rows if x["op"] == name and x["mode"] == r["mode"] and x["variant"] == "ours")
                r["ours_speedup"] = round(r["ms"] / ours, 2)
    return rows, copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default 8192 on a GPU, 2048 on the CPU)")
    ap.add_argument("--lce-tokens", type=int, default=None, help="linear_cross_entropy tokens (GPU 8192, CPU 1024)")
    ap.add_argument("--lce-vocab", type=int, default=None, help="its vocabulary (GPU 128256, CPU 32000)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    tokens = args.tokens or (8192 if gpu else 2048)
    rows, copy = bench(device, tokens, args.lce_tokens or (8192 if gpu else 1024), args.lce_vocab or (VOCAB if gpu else 32000),
                       args.reps)
    for r in rows:
        r.setdefault("peak_MiB", "")
    print(f"{rows[0]['device']}, {tokens} tokens, copy bandwidth {copy:.1f} GB/s")
    print_table(rows, ["op", "mode", "variant", "ms", "GBps", "copy_pct", "ours_speedup", "peak_MiB"])
    path = write_csv(f"llama_ops_{device_slug(device)}", rows)
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        ops = sorted({r["op"] for r in rows})
        fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.5))
        for ax, op in zip(axes, ops):
            sel = [r for r in rows if r["op"] == op]
            names = sorted({r["variant"] for r in sel})
            for i, mode in enumerate(("forward", "forward+backward")):
                vals = [next(r["ms"] for r in sel if r["variant"] == n and r["mode"] == mode) for n in names]
                ax.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4, label=mode)
            ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, fontsize=7)
            ax.set_title(op, fontsize=9)
            ax.set_ylabel("ms")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / f"llama_ops_{device_slug(device)}.png", dpi=110)


if __name__ == "__main__":
    main()
