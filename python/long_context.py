"""Train a small Llama on long sequences with context parallelism: CP = 1, 2 and 4 on gloo ranks.

    python python/long_context.py [--seq-len 8192] [--steps 3] [--algo ring]

Each run trains the same model on the same data for ``steps`` steps; CP = c splits every sequence
over c ranks (rank r holds chunks r and 2c−1−r of 2c, the load-balanced "zigzag"), exchanging
K/V around a ring of isend/irecv in every attention layer. Printed per run: the tokens each rank
holds, the peak bytes autograd keeps for the backward on one rank (what CP divides), the step
time (the median after the first step), and the losses, which must equal CP = 1's: context
parallelism changes where the work runs, not the result. On GPUs, launch ``tpkernels train``
with ``parallel.cp`` under torchrun instead. The default 8192 tokens keep the example under a
minute on two cores; ``--seq-len 32768`` runs too.
"""

from __future__ import annotations

import argparse

from tpkernels.train import TrainConfig
from tpkernels.train.activation_memory import measure_training
from tpkernels.train.launch import launch

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (a multiple of 8 for CP 4)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algo", default="ring", choices=("ring", "allgather", "a2a"))
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes to run (1 is the reference)")
    args = ap.parse_args()
    base = TrainConfig.from_values({
        "model": {"name": "Llama-2-7B", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
                  "vocab": 256},
        "data": {"source": "random", "seq_length": args.seq_len},
        "parallel": {"micro_batch_size": 1, "num_microbatches": 1, "cp_algo": args.algo},
        "training": {"steps": args.steps}, "optimizer": {"lr": 1e-3, "warmup_steps": 1},
        "logging": {"progress": False}})
    sizes = sorted(set([1] + args.cp))
    rows = []
    for cp in sizes:
        out = launch(measure_training, cp, base.with_values({"parallel.cp": cp}))
        rows.append((cp, out))
    ref = rows[0][1][0]
    print(f"Llama (2 layers, hidden 64, 4/2 heads), one sequence of {args.seq_len} tokens per step, "
          f"{args.steps} steps, cp_algo {args.algo}, float32 on gloo ranks")
    print(f"{'CP':>3} {'tokens/rank':>11} {'saved activations/rank':>23} {'vs CP1':>7} {'step s':>7}  losses")
    for cp, out in rows:
        peak = max(o["peak_bytes"] for o in out)
        step = max(o["step_s"] for o in out)
        print(f"{cp:>3} {args.seq_len // cp:>11} {peak / MIB:>19.1f} MiB {peak / ref['peak_bytes']:>7.2f} {step:>7.2f}  "
              + " ".join(f"{x:.5f}" for x in out[0]["losses"]))
        for a, b in zip(out[0]["losses"], ref["losses"]):
            if abs(a - b) > 1e-4 * abs(b):
                raise SystemExit(f"CP{cp} loss {a} differs from CP1's {b}")
    print("every CP size trains to the losses of CP1")


if __name__ == "__main__":
    main()
