"""Decoding speed of ``tpkernels.generate`` (KV cache, TP1 and TP2) vs transformers' ``generate`` on the
same model, side by side in one run: greedy, fp32, the same prompts, the same tokens checked.

    python benchmarks/bench_generate.py [--layers 8] [--hidden 512] [--batch 1 4] [--prompt 64] [--new 64]

Decode tokens/s = batch × (new − 1) / (time to generate ``new`` tokens − time to generate 1), so the
prompt's prefill is left out of both sides; the contenders run in turn, rep after rep (a load change
hits them alike), and each rate is from the median over ``--reps`` of (full − one). Transformers
and our TP1 run in this process with ``--threads`` threads (default 1: on a shared, loaded machine
two OpenMP threads spin-wait for each other and a 2-thread figure measures the neighbours), our TP2
on two gloo ranks of one thread each (so it has twice TP1's cores). A Llama-shaped model (GQA, SwiGLU, RMSNorm,
rotary), random weights, eos off (every run makes exactly ``new`` tokens). Prints a table, writes
benchmarks/results/generate_<device>.csv ($OUT instead, if set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, print_table, run_metadata, write_csv  # noqa: E402


def _save_model(folder: str, layers: int, hidden: int, vocab: int, seed: int = 0) -> str:
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # weights large enough that greedy continuations vary (and equal tokens mean something)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.5 / hidden ** 0.5)
    model.save_pretrained(folder)
    return folder


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


_MODELS: dict = {}  # the one-process models, built once and reused by every rep


def _ours(rank, world, folder, prompts, new):
    """One rep at TP ``world``: (seconds for `new` tokens, seconds for 1, the tokens)."""
    from tpkernels.generate import Generator  # noqa: PLC0415
    from tpkernels.models import ParallelTransformer  # noqa: PLC0415
    from tpkernels.parallel import ParallelConfig  # noqa: PLC0415
    from tpkernels.parallel.state import ParallelState  # noqa: PLC0415

    if (folder, world) not in _MODELS or world > 1:  # the rank pool drops its groups after each call
        state = ParallelState.create(ParallelConfig(tp=world)) if world > 1 else None
        gen = Generator(ParallelTransformer.from_hf(folder, state))
        with torch.inference_mode():
            gen.generate(prompts, 2)  # warm-up
        _MODELS[(folder, world)] = gen
    gen = _MODELS[(folder, world)]
    with torch.inference_mode():
        full = _seconds(lambda: gen.generate(prompts, new))
        one = _seconds(lambda: gen.generate(prompts, 1))
        tokens = [o.ids for o in gen.generate(prompts, new)]
    return full, one, tokens


def _hf(folder, prompts, new):
    import transformers  # noqa: PLC0415

    if folder not in _MODELS:
        _MODELS[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = _MODELS[folder]
    ids = torch.tensor(prompts)  # equal lengths: no padding on either side

    def run(n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        run(2)  # warm-up
        full = _seconds(lambda: run(new))
        one = _seconds(lambda: run(1))
        tokens = run(new)[:, ids.shape[1]:].tolist()
    return full, one, tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of transformers and our TP1")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tpkernels.parallel.local_ranks import RankPool  # noqa: PLC0415

    meta = run_metadata(torch.device("cpu"))
    rows = []
    pools = {tp: RankPool(tp, timeout=1800) for tp in args.tp if tp > 1}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = _save_model(tmp, args.layers, args.hidden, args.vocab)
            g = torch.Generator().manual_seed(0)
            for batch in args.batch:
                prompts = torch.randint(0, args.vocab, (batch, args.prompt), generator=g).tolist()
                runs: dict = {"hf": []} | {tp: [] for tp in args.tp}
                for _ in range(args.reps):  # the contenders in turn, rep after rep: load drifts hit all alike
                    runs["hf"].append(_hf(folder, prompts, args.new))
                    for tp in args.tp:
                        one = _ours(0, 1, folder, prompts, args.new) if tp == 1 else \
                            pools[tp].run(_ours, folder, prompts, args.new)[0]
                        runs[tp].append(one)

                def rate(rs):
                    return batch * (args.new - 1) / statistics.median(full - one for full, one, _ in rs)
                ref_rate, ref_tokens = rate(runs["hf"]), runs["hf"][0][2]
                rows.append({"impl": "transformers generate", "tp": 1, "batch": batch,
                             "decode_tok_s": f"{ref_rate:.1f}", "vs_transformers": "1.00", "same_tokens": "-", **meta})
                for tp in args.tp:
                    r = rate(runs[tp])
                    rows.append({"impl": "tpkernels generate", "tp": tp, "batch": batch, "decode_tok_s": f"{r:.1f}",
                                 "vs_transformers": f"{r / ref_rate:.2f}",
                                 "same_tokens": all(t == ref_tokens for _, _, t in runs[tp]), **meta})
    finally:
        for pool in pools.values():
            pool.close()
    print(f"decode tokens/s, Llama {args.layers} layers, hidden {args.hidden}, GQA 8/4, vocab {args.vocab}, fp32, "
          f"prompt {args.prompt}, {args.new} new tokens, greedy; {meta['device']} (TP2: 2 ranks x 1 thread), "
          f"torch {meta['torch']}")
    print_table(rows, ["impl", "tp", "batch", "decode_tok_s", "vs_transformers", "same_tokens"])
    name = "generate_" + device_slug(torch.device("cpu"))
    print(f"wrote {write_csv(name, rows)}")


if __name__ == "__main__":
    main()
