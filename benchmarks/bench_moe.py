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
          share of the all-to-all time hidden behind the GEMMs. Routing balanced (uniform) and skewed
          (expert 0 gets half of the copies: its rank computes longest and the others wait for it in
          the all-to-all, which the exposed time then includes). The expert MLP is the grouped SwiGLU of
          tpkernels.functional.grouped_gemm where it exists, else one matmul per local expert.
          CPU ranks share this machine's cores, so the overlap can only use what the GEMMs leave idle
          (gloo's threads): read the CPU numbers as a check that chunking costs little, not as the
          GPU's gain.

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
from common import device_slug, print_table, run_metadata, write_csv  # noqa: E402


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

    from tpkernels.functional.moe_dispatch import dispatch_combine  # noqa: PLC0415
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

    times = {c: [] for c in chunk_set}
    exposed = {c: [] for c in chunk_set}
    comm = {c: [] for c in chunk_set}
    for c in chunk_set:  # warm-up
        step(c)
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
            exposed[c].append(total - hidden)
            comm[c].append(total)
    return name, times, exposed, comm


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
            a2a_bytes = 2 * 2 * args.tokens * args.top_k * args.hidden * 4  # fwd + bwd, dispatch + combine
            rows.append({
                "world": world, "routing": routing, "threads/rank": 1, "chunks": c, "tokens/rank": args.tokens, "top_k": args.top_k, "hidden": args.hidden,
                "ffn": args.ffn, "experts": world * args.local_experts, "expert_fn": name,
                "step_ms": round(step[c] * 1e3, 2), "speedup_vs_chunks1": round(step[1] / step[c], 3),
                "a2a_ms": round(tot * 1e3, 2), "exposed_a2a_ms": round(exp * 1e3, 2),
                "hidden_share": round(1 - exp / tot, 3) if tot > 0 else 0.0,
                "a2a_MB_per_rank": round(a2a_bytes / 1e6, 2), **meta,
            })
    return rows


SECTIONS = {"dispatch": dispatch_rows}
COLUMNS = {"dispatch": ["world", "routing", "chunks", "experts", "expert_fn", "step_ms", "speedup_vs_chunks1", "a2a_ms",
                        "exposed_a2a_ms", "hidden_share", "a2a_MB_per_rank"]}


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
    args = ap.parse_args(argv)
    for section in args.section or sorted(SECTIONS):
        rows = SECTIONS[section](args)
        print(f"\n[{section}] {rows[0]['device']}, torch {rows[0]['torch']}")
        print_table(rows, COLUMNS[section])
        path = write_csv(f"moe_{section}_{device_slug(torch.device('cpu'))}", rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
