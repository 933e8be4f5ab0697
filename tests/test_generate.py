"""Generation (tpkernels.generate): greedy tokens equal transformers' ``generate`` token for token at
TP1, TP2 and TP4 (GQA with replicated KV heads), the KV-cached steps equal a full re-forward, batched
prompts of different lengths (packed, or padded left or right) equal each prompt alone, sampling
processors equal transformers' own, stops, and bad inputs named."""

from __future__ import annotations

import pytest
import torch

from generate_checks import hf_greedy, random_prompts, save_varied_model
from model_checks import VOCAB
from tpkernels.generate import Generator, Sampling

FP64 = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def one_thread():
    """torch's CPU attention kernel in fp64 spins for milliseconds per call with 2 OpenMP threads on a busy
    2-core machine (measured 7.6 ms vs 0.02 ms with one thread on these tiny shapes)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ours(folder: str, state=None):
    from tpkernels.models import ParallelTransformer

    return ParallelTransformer.from_hf(folder, state, dtype=torch.float64)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_greedy_equals_transformers_batched_and_padded(tmp_path, fresh_seed, family):
    """llama: GQA and Llama 3.1 rope scaling; gpt2: learned positions; mistral: a sliding window (5) shorter
    than the sequences. Three prompts of odd lengths in one batch (packed prefill, rows of different lengths
    decoding through the varlen path), then the same batch padded on the left and on the right."""
    folder = save_varied_model(family, tmp_path / family, fresh_seed % 1000)
    prompts = random_prompts(fresh_seed, (7, 1, 13))
    want = hf_greedy(folder, prompts, 9)
    gen = Generator(_ours(folder))
    outs = gen.generate(prompts, max_new_tokens=9)
    assert [o.ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    width = max(map(len, prompts)) + 2
    for side in ("left", "right"):
        ids = torch.full((3, width), 5, dtype=torch.int64)  # pad id 5: a real token, so the mask must matter
        mask = torch.zeros(3, width, dtype=torch.int64)
        for r, p in enumerate(prompts):
            cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
            ids[r, cols], mask[r, cols] = torch.tensor(p), 1
        assert [o.ids for o in gen.generate(ids, 9, attention_mask=mask)] == want, side


def test_repetition_penalty_and_eos_equal_transformers(tmp_path, fresh_seed):
    folder = save_varied_model("llama", tmp_path / "m", fresh_seed % 1000)
    prompts = random_prompts(fresh_seed + 1, (6, 11))
    gen = Generator(_ours(folder))
    want = hf_greedy(folder, prompts, 10, repetition_penalty=1.7)
    assert [o.ids for o in gen.generate(prompts, 10, Sampling(repetition_penalty=1.7))] == want
    # EOS: the third token of the first prompt's greedy reply ends it there (kept, as transformers keeps it)
    free = hf_greedy(folder, prompts[:1], 10)[0]
    eos = free[2]
    out = gen.generate(prompts[:1], 10, stop_ids={eos})[0]
    assert out.ids == hf_greedy(folder, prompts[:1], 10, eos_token_id=eos)[0] == free[:free.index(eos) + 1]
    assert out.finish_reason == "stop"


def test_cached_steps_equal_a_full_reforward(tmp_path, fresh_seed):
    """Prefill three prompts of different lengths, append 3 tokens to every row at once, then 1 at a time: the
    logits of each appended position equal those of a full forward of the row alone (fp64)."""
    from tpkernels.models.kv_cache import KVCache

    folder = save_varied_model("llama", tmp_path / "m", fresh_seed % 1000)
    model = _ours(folder)
    gen = Generator(model)
    prompts = random_prompts(fresh_seed, (5, 12, 2))
    rows = [list(p) for p in prompts]
    cache = KVCache(model, 3, 24)
    steps = []
    with cache.attached(model):
        last = gen.prefill(cache, prompts)
        for n in (3, 1, 1):
            new = torch.randint(0, VOCAB, (3, n))
            steps.append((n, gen.extend(cache, new)))
            for r in range(3):
                rows[r] += new[r].tolist()
    for r, p in enumerate(prompts):  # the full forwards, with the cache detached
        torch.testing.assert_close(last[r], model(torch.tensor([p]))[0, -1], **FP64)
        full = model(torch.tensor([rows[r]]))[0]
        end = len(rows[r])
        for n, got in reversed(steps):
            torch.testing.assert_close(got[r], full[end - n:end], **FP64)
            end -= n
    assert cache.lengths == [len(r) for r in rows]
    assert all(m.kv_cache is None for m in model.modules() if hasattr(m, "kv_cache"))  # detached after


def _tp_worker(rank, world, folder, prompts, max_new, seed):
    """At TP ``world``: greedy tokens, the cached step against a full forward, and sampled tokens."""
    from tpkernels.models.kv_cache import KVCache
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(tp=world))
    model = _ours(folder, state)
    gen = Generator(model)
    greedy = [o.ids for o in gen.generate(prompts, max_new)]
    cache = KVCache(model, len(prompts), 32)
    with cache.attached(model):
        gen.prefill(cache, prompts)
        nxt = torch.tensor([[p[0]] for p in prompts])
        got = gen.extend(cache, nxt)[:, 0]
    full = torch.stack([model(torch.tensor([p + [p[0]]]))[0, -1] for p in prompts])
    err = float((got - full).abs().max())
    sampled = [o.ids for o in gen.generate(prompts, max_new, Sampling(temperature=0.9, top_k=20, top_p=0.9),
                                           seed=seed)]
    with torch.no_grad():  # a broken weight (token 0's head row, rank 0's shard): TP rank 0's refusal is every rank's
        if rank == 0:
            model.head.weight[0, 0] = float("nan")
    try:
        gen.generate(prompts, 2)
        failure = None
    except FloatingPointError as e:
        failure = str(e)
    return greedy, err, sampled, failure


@pytest.mark.parametrize("world", [4])
def test_tensor_parallel_greedy_equals_transformers(rank_pool, tmp_path, fresh_seed, world):
    """TP2 (a KV head per rank) and TP4 (2 KV heads over 4 ranks: each rank caches the replicated head its
    query heads read). Sampled tokens are the same on every rank and the same as one process's (TP rank 0
    samples with the same seeded generator from the same logits). A NaN in the head is refused by TP rank 0
    and raised on every rank (the others wait in the broadcast: no hang)."""
    folder = save_varied_model("llama", tmp_path / "m", fresh_seed % 1000)
    prompts = random_prompts(fresh_seed, (4, 9, 1))
    want = hf_greedy(folder, prompts, 8)
    results = rank_pool(world).run(_tp_worker, folder, prompts, 8, fresh_seed, timeout=120)
    one = Generator(_ours(folder)).generate(prompts, 8, Sampling(temperature=0.9, top_k=20, top_p=0.9),
                                            seed=fresh_seed)
    for greedy, err, sampled, failure in results:
        assert greedy == want
        assert err < 1e-10
        assert sampled == [o.ids for o in one]
        assert failure is not None and "logits hold NaN or inf at new token 0" in failure


def test_sampling_processors_equal_transformers(fresh_seed):
    """Sampling.scores against transformers' RepetitionPenalty, Temperature, TopK and TopP processors in that
    order (the order generate applies them), on random logits with ties broken by noise."""
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(fresh_seed)
    b, v = 3, 53
    logits = torch.randn(b, v, generator=g, dtype=torch.float64) * 3
    history = torch.randint(0, v, (b, 9), generator=g)
    seen = torch.zeros(b, v, dtype=torch.bool)
    seen.scatter_(1, history, True)
    for temp, k, p, pen in ((0.7, 11, 0.8, 1.3), (1.5, 0, 0.5, 0.8), (0.3, 5, 1.0, 1.0), (1.0, 0, 0.999, 2.0)):
        ref = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(pen), TemperatureLogitsWarper(temp)]
                                  + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else []))
        want = ref(history, logits.clone())
        got = Sampling(temp, k, p, pen).scores(logits, seen)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (temp, k, p, pen)
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-12, atol=1e-12)
        tokens = Sampling(temp, k, p, pen).next_tokens(logits, seen, torch.Generator().manual_seed(fresh_seed))
        assert bool(torch.isfinite(want.gather(1, tokens[:, None])).all())  # sampled among the kept tokens


def test_stop_strings_context_and_streaming(tmp_path, fresh_seed):
    """A stop string ends a row and is cut from its text; a prompt near the context ends with "context" when
    the sequence fills max_position_embeddings (64); stream() sees every token in order."""
    folder = save_varied_model("gpt2", tmp_path / "m", fresh_seed % 1000)
    gen = Generator(_ours(folder))
    prompts = random_prompts(fresh_seed, (3, 61))

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    free = gen.generate(prompts, 6)
    assert len(free[1].ids) == 3 and free[1].finish_reason == "context"  # 61 + 3 = 64 tokens
    stop = f"<{free[0].ids[1]}>"  # the second token's text: the first prompt stops at (or before) it
    seen = []
    outs = gen.generate(prompts[:1], 6, stop_strings=[stop], decode=decode, stream=lambda r, t: seen.append((r, t)))
    first = free[0].ids[:free[0].ids.index(free[0].ids[1]) + 1]
    assert outs[0].ids == first and outs[0].finish_reason == "stop_string"
    assert outs[0].text == decode(first[:-1])  # cut before the stop string
    assert seen == [(0, t) for t in first]


def test_bad_inputs_are_named(tmp_path, fresh_seed):
    from tpkernels.generate import TextCodec
    from tpkernels.train.generate_load import resolve

    folder = save_varied_model("llama", tmp_path / "m", fresh_seed % 1000, layers=1)
    gen = Generator(_ours(folder))
    with pytest.raises(ValueError, match=r"prompt 1 has 64 tokens.*max_position_embeddings\) is 64"):
        gen.generate([[1, 2], [3] * 64], 4)
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 97.*vocab_size \(97\)"):
        gen.generate([[97]], 4)
    with pytest.raises(ValueError, match=r"prompt 1 holds 2.5: a prompt is a list of token ids"):
        gen.generate([[1], [2.5]], 4)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        gen.generate([[]], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens \(0\) must be an integer >= 1"):
        gen.generate([[1]], 0)
    with pytest.raises(ValueError, match=r"attention_mask row 0 has a hole"):
        gen.generate(torch.tensor([[1, 2, 3]]), 2, attention_mask=torch.tensor([[1, 0, 1]]))
    for kw, msg in ((dict(top_p=0), r"top_p \(0\) must be in \(0, 1\]"), (dict(top_p=1.5), r"top_p \(1.5\)"),
                    (dict(temperature=-0.5), r"temperature \(-0.5\) must be a finite number >= 0"),
                    (dict(temperature=float("nan")), r"temperature \(nan\)"),
                    (dict(top_k=-1), r"top_k \(-1\) must be an integer >= 0"),
                    (dict(repetition_penalty=0), r"repetition_penalty \(0\) must be a finite number > 0")):
        with pytest.raises(ValueError, match=msg):
            Sampling(**kw)
    with pytest.raises(ValueError, match=r"checkpoint \('.*nowhere'\) does not exist"):
        resolve(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither a checkpoint, a folder of complete checkpoints nor a Hugging Face"):
        resolve(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"--chat needs a tokenizer with a chat template; byte-level text has none"):
        TextCodec.load(None).chat([{"role": "user", "content": "hi"}])
