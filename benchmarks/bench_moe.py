"""Mixture-of-Experts benchmarks, by section (``--section``; default: every section):

    python benchmarks/bench_moe.py [--section dispatch] [--worlds 2 4] [--reps 7]

dispatch  the expert-parallel step of one MoE layer (tpkernels.functional.moe_dispatch.dispatch_combine:
          token dispatch all-to-all, the local experts' SwiGLU MLP, combine all-to-all; forward and
          backward) on gloo ranks of this machine at each --worlds size, chunked (the all-to-all of
          chunk i+1 in flight while the experts compute chunk i, both directions) against chunks=1
          (all-to-all, then the GEMMs, then the all-to-all back: no overlap), side by side in one run,
          the variants interleaved rep by rep. Columns: step time (median over reps of the slowest
          rank), speedup over chunks=1, the exposed all-to-all time (communication time during which no
          expert GEMM ran, from the comm trace: waits, regroup gathers and copies included) and the
          share of the all-to-all time hidden behind the GEMMs; experts_only_ms: the same expert work
          (the rows this rank's experts receive, the same chunks, forward and backward) with no
          communication, which
          separates a gain of the overlap from a gain of smaller GEMMs. Routing balanced (uniform) and skewed
          (expert 0 gets half of the copies: its rank computes longest and the others wait for it in
          the all-to-all, which the exposed time then includes). The expert MLP is the grouped SwiGLU of
          tpkernels.functional.grouped_gemm where it exists, else one matmul per local expert.
          CPU ranks share this machine's cores, so the overlap can only use what the GEMMs leave idle
          (gloo's threads): read the CPU numbers as a check that chunking costs little, not as the
          GPU's gain.
kernels   the MoE kernels (tpkernels.functional.grouped_gemm / moe_permute; Triton on CUDA, the reference
          on the CPU) against the peers a user would otherwise write, same shapes, same run: one
          torch.matmul per expert (loop), every expert padded to the largest count and one bmm
          (padded_bmm), torch.nn.functional.grouped_mm; forward GEMM, GEMM forward+backward, the expert
          SwiGLU MLP forward+backward, and the permutation round trip against a mask-per-expert loop.
          Columns: our time and GFLOP/s, each peer's time over ours (> 1: ours is faster). Balanced and
          skewed routing (expert 0 in every token's choices). --device cuda for the GPU rows (bf16).

Writes benchmarks/results/moe_<section>_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, print_table, run_metadata, time_ms, write_csv  # noqa: E402


# ----------------------------------------------------------------------------------------- dispatch

def _expert_mlp(which: str = "auto"):
    """(name, fn(rows, w_gate_up (L, H, 2F), w_down (L, F, H), local_counts) -> (M, H)): the contract's
    ``grouped_swiglu_mlp`` signature. ``which``: "grouped", "loop" (a matmul per local expert) or "auto"
    (grouped where it exists)."""
    if which != "loop":
        try:
            from tpkernels.functional.grouped_gemm import grouped_swiglu_mlp  # noqa: PLC0415

            return "grouped_swiglu_mlp", grouped_swiglu_mlp
        except ImportError:
            if which == "grouped":
                raise

    def per_expert(rows, w_gate_up, w_down, counts):
        outs = []
        for x, wgu, wd in zip(rows.split(counts.tolist()), w_gate_up, w_down):
            gate, up = (x @ wgu).chunk(2, dim=-1)
            outs.append((torch.nn.functional.silu(gate) * up) @ wd)
        return torch.cat(outs) if outs else rows.new_zeros(0, w_down.shape[-1])

    return "matmul per local expert", per_expert


def _skewed_counts(g: torch.Generator, rows: int, experts: int) -> torch.Tensor:
    """(experts,) counts summing to ``rows``: expert 0 half of them, the rest spread at random."""
    major = rows // 2
    idx = torch.randint(0, experts, (rows - major,), generator=g)
    counts = torch.bincount(idx, minlength=experts)
    counts[0] += major
    return counts


def _balanced_counts(g: torch.Generator, rows: int, experts: int) -> torch.Tensor:
    return torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)


ROUTINGS = {"skewed": _skewed_counts, "balanced": _balanced_counts}


def _dispatch_rank(rank, world, tokens, top_k, hidden, ffn, local_experts, chunk_set, reps, routing, which):
    import torch.distributed as dist  # noqa: PLC0415

    from tpkernels.functional.moe_dispatch import _cut, _segments, dispatch_combine  # noqa: PLC0415
    from tpkernels.parallel import control  # noqa: PLC0415
    from tpkernels.parallel.trace import CommTrace, _merge  # noqa: PLC0415

    torch.set_num_threads(1)  # every rank one thread: world 4 already oversubscribes 2 cores
    g = torch.Generator().manual_seed(1000 + rank)
    name, mlp = _expert_mlp(which)
    experts = world * local_experts
    counts = ROUTINGS[routing](g, tokens * top_k, experts)
    x = torch.randn(tokens * top_k, hidden, generator=g).requires_grad_()
    w_gu = (torch.randn(local_experts, hidden, 2 * ffn, generator=g) / hidden ** 0.5).requires_grad_()
    w_d = (torch.randn(local_experts, ffn, hidden, generator=g) / ffn ** 0.5).requires_grad_()
    dy = torch.randn(tokens * top_k, hidden, generator=g)

    def step(chunks):
        y = dispatch_combine(x, counts, lambda rows, lc: mlp(rows, w_gu, w_d, lc), dist.group.WORLD,
                             num_local_experts=local_experts, chunks=chunks)
        y.backward(dy)
        x.grad = w_gu.grad = w_d.grad = None

    # the same expert work without communication, cut into the same chunks: tells a gain of the overlap
    # from a gain of smaller GEMMs (the rows every rank sends to this rank's experts, as it receives them)
    every = control.all_gather_ints(counts)                                # (P, E)
    per_local = every[:, rank * local_experts:(rank + 1) * local_experts].sum(0)
    xl = torch.randn(int(per_local.sum()), hidden, generator=g).requires_grad_()
    dyl = torch.randn(xl.shape[0], hidden, generator=g)
    pieces = {}
    for c in chunk_set:
        _, cut = _cut(per_local[None], c)                                  # (C, 1, L)
        start = torch.cumsum(per_local, 0) - per_local
        lo = torch.cumsum(cut[:, 0], 0) - cut[:, 0]                        # (C, L) offset inside each expert
        pieces[c] = [(_segments(start + lo[i], cut[i, 0]), cut[i, 0]) for i in range(c)]

    def experts_only(c):
        ys = [mlp(xl.index_select(0, idx), w_gu, w_d, lc) for idx, lc in pieces[c]]
        torch.cat(ys).backward(dyl)
        xl.grad = w_gu.grad = w_d.grad = None

    local = {c: [] for c in chunk_set}
    times = {c: [] for c in chunk_set}
    exposed = {c: [] for c in chunk_set}
    comm = {c: [] for c in chunk_set}
    for c in chunk_set:  # warm-up
        step(c)
        experts_only(c)
    for _ in range(reps):
        for c in chunk_set:  # interleaved: a load spike hits every variant alike
            control.barrier()
            with CommTrace() as tr:
                t0 = time.perf_counter()
                step(c)
                t = time.perf_counter() - t0
            spans = [s for s in tr.spans if "all_to_all" in s.name]
            a2a = _merge([(s.start, s.end) for s in spans])
            total = sum(e - s for s, e in a2a)
            gemm = _merge(tr.intervals("gemm"))
            hidden = sum(max(0.0, min(ce, ge) - max(cs, gs)) for cs, ce in a2a for gs, ge in gemm)
            times[c].append(t)
            t0 = time.perf_counter()
            experts_only(c)
            local[c].append(time.perf_counter() - t0)
            exposed[c].append(total - hidden)
            comm[c].append(total)
    return name, times, exposed, comm, local


def dispatch_rows(args) -> list[dict]:
    from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: PLC0415

    rows, chunk_set = [], sorted(set([1] + args.chunks))
    meta = run_metadata(torch.device("cpu"))
    for world, routing in [(w, r) for w in args.worlds for r in args.routing]:
        out = run_on_ranks(_dispatch_rank, world, args.tokens, args.top_k, args.hidden, args.ffn,
                           args.local_experts, chunk_set, args.reps, routing, args.expert_fn, timeout=1800)
        name = out[0][0]
        # per rep, the slowest rank decides the step
        step = {c: statistics.median(max(r[1][c][i] for r in out) for i in range(args.reps)) for c in chunk_set}
        for c in chunk_set:
            exp = statistics.median(max(r[2][c][i] for r in out) for i in range(args.reps))
            tot = statistics.median(max(r[3][c][i] for r in out) for i in range(args.reps))
            alone = statistics.median(max(r[4][c][i] for r in out) for i in range(args.reps))
            a2a_bytes = 2 * 2 * args.tokens * args.top_k * args.hidden * 4  # fwd + bwd, dispatch + combine
            rows.append({
                "world": world, "routing": routing, "threads/rank": 1, "chunks": c, "tokens/rank": args.tokens, "top_k": args.top_k, "hidden": args.hidden,
                "ffn": args.ffn, "experts": world * args.local_experts, "expert_fn": name,
                "step_ms": round(step[c] * 1e3, 2), "speedup_vs_chunks1": round(step[1] / step[c], 3),
                "a2a_ms": round(tot * 1e3, 2), "exposed_a2a_ms": round(exp * 1e3, 2),
                "hidden_share": round(1 - exp / tot, 3) if tot > 0 else 0.0,
                "experts_only_ms": round(alone * 1e3, 2),
                "a2a_MB_per_rank": round(a2a_bytes / 1e6, 2), **meta,
            })
    return rows


# ------------------------------------------------------------------------------------------ kernels

def _kernel_inputs(routing: str, tokens: int, top_k: int, experts: int, device, dtype, seed: int = 0):
    """(experts (T, k) with distinct ids per token, counts (E,)): balanced (uniform) or skewed (expert 0
    in every token's choices, so it holds T of the T·k copies)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if routing == "skewed":
        has0 = (ids == 0).any(1)
        ids[~has0, 0] = 0
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    return ids.to(device), counts


def _padded_bmm(x, w, counts):
    """The dense peer: every expert's rows padded to the largest count, one bmm, the rows picked back."""
    e, cap = counts.numel(), int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    ex = torch.repeat_interleave(torch.arange(e, device=x.device), counts.to(x.device))
    slot = torch.arange(x.shape[0], device=x.device) - starts.to(x.device)[ex]
    xp = x.new_zeros(e, cap, x.shape[1]).index_put((ex, slot), x)
    return torch.bmm(xp, w)[ex, slot]


def _loop_gemm(x, w, counts):
    """The per-expert peer: one torch.matmul per expert on its rows."""
    return torch.cat([a @ b for a, b in zip(x.split(counts.tolist()), w)])


def _loop_permute(x, experts, num_experts):
    """The loop peer of permute: each expert's token copies found by a mask, one expert at a time."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    slots = [torch.nonzero(flat == e).flatten() for e in range(num_experts)]
    row_map = torch.cat(slots)
    return x[row_map // k], row_map


def _loop_unpermute(ys, row_map, weights, t):
    k = weights.shape[1]
    out = ys.new_zeros(t, ys.shape[1])
    return out.index_add(0, row_map // k, ys * weights.reshape(-1)[row_map, None].to(ys.dtype))


def _round_trip(permute, unpermute, x, experts, num_experts, weights):
    x_sorted, _, row_map = permute(x, experts, num_experts)
    return unpermute(x_sorted, row_map, weights, x.shape[0])


def _interleaved(op: str, impls: dict, device, reps: int) -> dict:
    """Median ms of each implementation. CUDA: do_bench each. CPU: the implementations take turns rep by rep,
    so a load spike of this shared machine hits them alike. A peer that cannot run these shapes is left out."""
    ok = {}
    for name, fn in impls.items():
        try:
            fn()  # warm-up (and the check that it runs)
            ok[name] = fn
        except (RuntimeError, NotImplementedError) as exc:
            print(f"  {op} / {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    if device.type == "cuda":
        return {name: time_ms(fn, device, reps) for name, fn in ok.items()}
    times = {name: [] for name in ok}
    for _ in range(reps):
        for name, fn in ok.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernel_rows(args) -> list[dict]:
    """Our grouped GEMM / expert MLP / permutation against the per-expert loop a user would write, one dense
    padded bmm, and torch's own grouped_mm, same shapes, same run. Median of --reps (CUDA: do_bench)."""
    import torch.nn.functional as F  # noqa: PLC0415

    from tpkernels.functional.grouped_gemm import grouped_gemm, grouped_swiglu_mlp  # noqa: PLC0415
    from tpkernels.functional.moe_permute import permute, unpermute  # noqa: PLC0415

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = run_metadata(device)
    t, k, e, h, f = args.k_tokens, args.k_top_k, args.k_experts, args.k_hidden, args.k_ffn
    rows = []
    for routing in args.routing:
        experts, counts = _kernel_inputs(routing, t, k, e, device, dtype)
        n = int(counts.sum())
        x = torch.randn(n, h, device=device, dtype=dtype)
        xt = torch.randn(t, h, device=device, dtype=dtype)
        w_gu = torch.randn(e, h, 2 * f, device=device, dtype=dtype) / h ** 0.5
        w_d = torch.randn(e, f, h, device=device, dtype=dtype) / f ** 0.5
        weights = torch.rand(t, k, device=device)
        offs = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
        cd = counts.to(device)

        def train(fn, *leaves):
            leaves = [a.detach().requires_grad_(True) for a in leaves]
            return lambda: fn(*leaves).backward(torch.ones(n, leaves[-1].shape[-1], device=device, dtype=dtype))

        def loop_mlp(a, wgu, wd):
            gate, up = _loop_gemm(a, wgu, counts).chunk(2, dim=-1)
            return _loop_gemm(F.silu(gate) * up, wd, counts)

        def bmm_mlp(a, wgu, wd):
            gate, up = _padded_bmm(a, wgu, counts).chunk(2, dim=-1)
            return _padded_bmm(F.silu(gate) * up, wd, counts)

        b = x.element_size()
        gemm_bytes = (n * h + e * h * 2 * f + n * 2 * f) * b  # the forward's floor: x, the weights, y once each
        cases = {  # op -> (flops, {impl: fn})
            "grouped_gemm fwd (H -> 2F)": (2 * n * h * 2 * f, {
                "ours": lambda: grouped_gemm(x, w_gu, cd), "loop": lambda: _loop_gemm(x, w_gu, counts),
                "padded_bmm": lambda: _padded_bmm(x, w_gu, counts),
                "torch_grouped_mm": lambda: F.grouped_mm(x, w_gu, offs=offs)}),
            "grouped_gemm fwd+bwd": (3 * 2 * n * h * 2 * f, {
                "ours": train(lambda a, b: grouped_gemm(a, b, cd), x, w_gu),
                "loop": train(lambda a, b: _loop_gemm(a, b, counts), x, w_gu),
                "padded_bmm": train(lambda a, b: _padded_bmm(a, b, counts), x, w_gu)}),
            "expert SwiGLU MLP fwd+bwd": (3 * 2 * n * h * 3 * f, {
                "ours": train(lambda a, b, c: grouped_swiglu_mlp(a, b, c, cd), x, w_gu, w_d),
                "loop": train(loop_mlp, x, w_gu, w_d), "padded_bmm": train(bmm_mlp, x, w_gu, w_d)}),
            "permute + unpermute": (0, {
                "ours": lambda: _round_trip(permute, unpermute, xt, experts, e, weights),
                "loop": lambda: _loop_unpermute(*_loop_permute(xt, experts, e), weights, t)}),
        }
        if device.type == "cuda":  # torch's grouped_mm has a backward on CUDA (its CPU fallback has none here)
            cases["grouped_gemm fwd+bwd"][1]["torch_grouped_mm"] = train(
                lambda a, b: F.grouped_mm(a, b, offs=offs), x, w_gu)
        for op, (flops, impls) in cases.items():
            ms = _interleaved(op, impls, device, args.reps)
            ours = ms["ours"]
            row = {"op": op, "routing": routing, "experts": e, "rows": n, "max_rows": int(counts.max()), "hidden": h,
                   "ffn": f, "dtype": str(dtype).replace("torch.", ""), "ours_ms": round(ours, 3),
                   "ours_GFLOPs": round(flops / ours / 1e6, 1) if flops else "",
                   # the permutation's floor: gather reads and writes N·H, the combine reads N·H and writes T·H
                   "ours_GBps": round((3 * n + t) * h * b / ours / 1e6, 1) if not flops else
                   (round(gemm_bytes / ours / 1e6, 1) if op.startswith("grouped_gemm fwd (") else "")}
            for name in ("loop", "padded_bmm", "torch_grouped_mm"):
                row[f"{name}_ms"] = round(ms[name], 3) if name in ms else ""
                row[f"{name}/ours"] = round(ms[name] / ours, 2) if name in ms else ""
            rows.append({**row, **meta})
    return rows


KERNEL_COLUMNS = ["op", "routing", "rows", "max_rows", "ours_ms", "ours_GFLOPs", "ours_GBps", "loop/ours",
                  "padded_bmm/ours", "torch_grouped_mm/ours"]


SECTIONS = {"dispatch": dispatch_rows, "kernels": kernel_rows}
COLUMNS = {"dispatch": ["world", "routing", "chunks", "experts", "expert_fn", "step_ms", "speedup_vs_chunks1", "a2a_ms",
                        "exposed_a2a_ms", "hidden_share", "experts_only_ms", "a2a_MB_per_rank"],
           "kernels": KERNEL_COLUMNS}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", choices=sorted(SECTIONS), action="append",
                    help="run only these sections (repeatable; default: all)")
    ap.add_argument("--reps", type=int, default=7)
    d = ap.add_argument_group("dispatch")
    d.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    d.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    d.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    d.add_argument("--top-k", type=int, default=2)
    d.add_argument("--hidden", type=int, default=256)
    d.add_argument("--ffn", type=int, default=512, help="each expert's FFN width")
    d.add_argument("--local-experts", type=int, default=2, help="experts per EP rank")
    d.add_argument("--routing", nargs="+", choices=sorted(ROUTINGS), default=["balanced", "skewed"],
                   help="skewed: expert 0 gets half of every rank's copies (its rank works longest)")
    d.add_argument("--expert-fn", choices=["auto", "grouped", "loop"], default="auto")
    kn = ap.add_argument_group("kernels")
    kn.add_argument("--device", default="cpu", help="cpu or cuda (bfloat16 there, float32 on the CPU)")
    kn.add_argument("--k-tokens", type=int, default=2048)
    kn.add_argument("--k-top-k", type=int, default=2)
    kn.add_argument("--k-experts", type=int, default=8)
    kn.add_argument("--k-hidden", type=int, default=512)
    kn.add_argument("--k-ffn", type=int, default=512, help="each expert's FFN width")
    args = ap.parse_args(argv)
    for section in args.section or sorted(SECTIONS):
        rows = SECTIONS[section](args)
        print(f"\n[{section}] {rows[0]['device']}, torch {rows[0]['torch']}")
        print_table(rows, COLUMNS[section])
        path = write_csv(f"moe_{section}_{device_slug(torch.device(args.device if section == 'kernels' else 'cpu'))}",
                         rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
