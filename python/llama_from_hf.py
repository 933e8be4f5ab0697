"""Load a Hugging Face checkpoint into a TP × PP × DP layout and check its loss against transformers.

    torchrun --nproc-per-node 4 python/llama_from_hf.py CHECKPOINT_DIR --tp 2 --pp 2 --sp
    python python/llama_from_hf.py CHECKPOINT_DIR --tp 2 --pp 2 --nproc 4       # CPU: 4 gloo ranks
    python python/llama_from_hf.py                                              # a random tiny Llama

CHECKPOINT_DIR holds config.json and *.safetensors (Llama 2/3/3.1, Qwen2/2.5, Mistral or GPT-2).
Each rank reads only its own slices (its TP shard of its pipeline stage's layers), runs the
forward pass of the pipeline over random tokens and prints the loss; rank 0 prints the loss that
transformers computes for the same tokens next to it, and the program fails if they differ by more
than the tolerance of the dtype. Without a checkpoint, a random 4-layer Llama with GQA and Llama
3.1's rope scaling is written to a temporary folder first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def tiny_checkpoint(folder: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                    "rope_theta": 500000.0})
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def run(rank: int, world: int, args) -> float:
    import torch
    import torch.distributed as dist

    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    dtype = getattr(torch, args.dtype)
    config = ParallelConfig(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp), sequence_parallel=args.sp,
                            num_microbatches=args.microbatches)
    state = ParallelState.create(config)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.perf_counter()
    model = ParallelTransformer.from_hf(args.checkpoint, state, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch * config.dp, args.seq), generator=g)
    mine = ids.chunk(config.dp)[state.dp_rank].to(device)
    loss = model.evaluate(mine, next_token_targets(mine))
    if config.dp > 1:
        t = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=state.dp_group)
        loss = t.item() / config.dp
    print(f"rank {rank}: {state.describe()}, loaded in {load_s:.2f} s, loss {loss:.6f}", flush=True)
    if rank != 0:
        return loss
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = sum(hf(r, labels=r).loss.item() for r in ids.chunk(config.dp * args.microbatches)) / (
            config.dp * args.microbatches)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"{config.short()} ({config.world_size} rank(s), {args.dtype}): tpkernels loss {loss:.6f}, "
          f"transformers loss {want:.6f}, |difference| {abs(loss - want):.2e} (tolerance {tol:g})")
    if abs(loss - want) > tol:
        raise SystemExit(f"losses differ by {abs(loss - want):.3e} > {tol:g}")
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="Hugging Face checkpoint folder (default: a random tiny Llama)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many gloo ranks (machines without GPUs)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tmp = None
    if args.checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="tpk_tiny_llama_")
        args.checkpoint = tiny_checkpoint(tmp.name)
    if args.nproc:
        from tpkernels.parallel.local_ranks import run_on_ranks

        run_on_ranks(run, args.nproc, args, timeout=600)
    elif "RANK" in os.environ:  # torchrun
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        run(0, 1, args)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
