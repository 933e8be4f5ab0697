"""DPO in the trainer: the objective against a logits oracle, every layout against the one-process run,
the cached reference against the online one, its key (a QLoRA run never reads a LoRA run's reference),
two runs filling one cache at once, and bad input named.

Preference pairs (prompt/chosen/rejected, conversational) go through the tiny chat tokenizer of
tests/data_checks.py and are packed pairs-per-row; the model is test_train's small Llama in fp64."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from data_checks import MARKED, PLAIN, from_hf_keys, make_tokenizer, save_hf_llama, write_jsonl
from test_train import small
from tpkernels.functional.preference import preference_loss
from tpkernels.models import ParallelTransformer
from tpkernels.models.preference import PreferenceObjective
from tpkernels.parallel import ParallelConfig
from tpkernels.parallel.state import ParallelState
from tpkernels.train import Trainer
from tpkernels.train import reference_cache as rc
from tpkernels.train.data import data_of
from tpkernels.train.dpo import PairInfo, cache_key

SEQ = 40
PROMPTS = [("what is two plus three", "five", "four"), ("why is the sky blue", "because", "no"),
           ("tell me a story", "once upon a time the end", "no"), ("hello how are you", "fine thanks", "bye"),
           ("what is the answer", "yes", "no again"), ("hi", "hello", "ok bye")]


def _pairs(n: int) -> list[dict]:
    out = []
    for k in range(n):
        p, c, r = PROMPTS[k % len(PROMPTS)]
        out.append({"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                    "rejected": [{"role": "assistant", "content": r}]})
    return out


def _cfg(tmp_path, **kw):
    tok = tmp_path / "tok"
    if not tok.exists():
        make_tokenizer(tok, MARKED)
        write_jsonl(tmp_path / "pairs.jsonl", _pairs(30))
    return small(**{"data.source": str(tmp_path / "pairs.jsonl"), "data.tokenizer": str(tok), "seq_length": SEQ,
                    "training.precision": "fp64", "steps": 3, "dpo.cache_dir": str(tmp_path / "ref"),
                    "optimizer.lr": 3e-2, "optimizer.clip_grad": 1.0, **kw})


def _model(cfg, rows):
    state = ParallelState.create(ParallelConfig(micro_batch_size=rows, num_microbatches=1, dp=1))
    return ParallelTransformer(cfg.model_config(), state, seed=cfg.training.seed, dtype=torch.float64)


@pytest.mark.parametrize("loss_type,sft_weight", [("sigmoid", 0.0), ("ipo", 0.5), ("simpo", 0.0), ("hinge", 0.0)])
def test_objective_equals_the_logits_oracle(tmp_path, loss_type, sft_weight, fresh_seed):
    """Loss and every gradient of the pipeline objective (2 micro-batches) against log_softmax of the full
    logits, per-sequence sums by a plain loop, and the same preference_loss on a random reference."""
    cfg = _cfg(tmp_path)
    batch = data_of(cfg, cfg.model_config().vocab_size).batch(0, 4)
    target = batch.targets()
    info = PairInfo.of(batch, target)
    g = torch.Generator().manual_seed(fresh_seed)
    ref = -20 * torch.rand(info.num_pairs, 2, generator=g, dtype=torch.float64)
    model = _model(cfg, 2)
    obj = PreferenceObjective(model.head, model.state, beta=0.3, loss_type=loss_type, sft_weight=sft_weight)
    obj.begin_step(info.num_pairs, info.chosen_tokens, ref)
    rt = model.pipeline("1f1b", 2, loss_fn=obj)
    loss = model.step(batch.ids, {"target": target, "doc": info.doc}, batch.position_ids, runtime=rt,
                      num_targets=info.num_pairs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # the oracle: every token's log-prob from the logits, sums per (pair, chosen) by a loop
    model.zero_grad(set_to_none=True)
    lp = torch.log_softmax(model.forward(batch.ids, batch.position_ids), dim=-1)
    sums = torch.zeros(info.num_pairs, 2, dtype=torch.float64)
    counts = torch.zeros(info.num_pairs, 2, dtype=torch.float64)
    for r in range(target.shape[0]):
        for t in range(target.shape[1]):
            if target[r, t] != -100 and batch.pair_index[r, t] >= 0:
                k, side = int(batch.pair_index[r, t]), 0 if bool(batch.chosen[r, t]) else 1
                sums[k, side] = sums[k, side] + lp[r, t, target[r, t]]
                counts[k, side] += 1
    assert bool((counts > 0).all()) and counts[:, 0].sum() == info.chosen_tokens
    losses, _ = preference_loss(sums[:, 0], sums[:, 1], ref[:, 0], ref[:, 1], beta=0.3, loss_type=loss_type,
                                chosen_lengths=counts[:, 0], rejected_lengths=counts[:, 1])
    want = losses.mean() + sft_weight * -sums[:, 0].sum() / counts[:, 0].sum()
    want.backward()
    torch.testing.assert_close(torch.tensor(loss, dtype=torch.float64), want.detach(), rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-8, atol=1e-12, msg=n)


def _train(tmp_path, kw: dict) -> dict:
    t = Trainer(_cfg(tmp_path, **kw))
    hist = t.train()
    return {k: [h[k] for h in hist] for k in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins",
                                              "logps/chosen", "logps/rejected")}


def assert_same_run(got: dict, want: dict, rtol: float) -> None:
    """Two runs' metrics (``_train``'s), step by step, to ``rtol``. rewards/accuracies, the share of pairs whose
    margin is > 0, jumps where a margin crosses 0: it is compared only at steps whose margins are far from
    roundoff. Not at step 0, where the policy is the reference and every margin is the roundoff of two
    evaluations of the same log-probs (its sign is noise: a DP2xCP2 run once counted other pairs than one
    process, TPK_SEED=2626986829); after an update the margins are O(lr), orders of magnitude above it."""
    for run in (got, want):
        assert abs(run["rewards/margins"][0]) < 1e-12  # step 0: policy = reference
    for k in want:
        first = 1 if k == "rewards/accuracies" else 0
        torch.testing.assert_close(torch.tensor(got[k][first:]), torch.tensor(want[k][first:]), rtol=rtol, atol=1e-12,
                                   msg=k)


def _worker(rank, world, tmp_path, kw):
    return _train(tmp_path, kw)


LAYOUTS = {
    "tp2pp2-sp-1f1b": dict(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=2),
    "dp2cp2": dict(dp=2, cp=2, micro_batch_size=1, num_microbatches=1),
    "pp2-zb-h1-mbs1x2": dict(pp=2, schedule="zb-h1", micro_batch_size=1, num_microbatches=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_what_one_process_trains(rank_pool, tmp_path, layout):
    """3 steps of DPO (cached reference, filled by the first run and read by the next): each step's loss,
    gradient norm and TRL metrics equal the one-process whole-batch run to 1e-6 relative (the accuracies
    after step 0: assert_same_run)."""
    want = _train(tmp_path, dict(micro_batch_size=2, num_microbatches=1, log_every=1))
    assert want["loss"][0] == pytest.approx(0.6931471805599453, rel=1e-12)  # step 0: policy = reference, log 2
    assert want["loss"][-1] < want["loss"][0]
    kw = {**LAYOUTS[layout], "log_every": 1}
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1) * kw.get("cp", 1)
    for got in rank_pool(world).run(_worker, tmp_path, kw, timeout=300):
        assert_same_run(got, want, rtol=1e-6)


def test_cached_reference_equals_a_frozen_model(tmp_path):
    """Full fine-tuning: the cached reference and a frozen copy of the initial weights beside the policy
    give the same run."""
    kw = {"micro_batch_size": 2, "num_microbatches": 1, "log_every": 1}
    cached = _train(tmp_path, {**kw, "dpo.reference": "cached"})
    frozen = _train(tmp_path, {**kw, "dpo.reference": "model"})
    assert_same_run(frozen, cached, rtol=1e-9)
    assert cached["loss"][-1] != cached["loss"][0]


def cached_equals_adapters_off(tmp_path, finetune: str) -> dict:
    """Train with the cached reference and with the adapters-off one: the same run, step by step (metrics
    to 1e-9); returns the config both used. The cache folder holds the other kind's reference first (a
    one-step run of QLoRA for LoRA, of LoRA for QLoRA): a key without model.finetune and model.quant read
    the 16-bit base's reference in a QLoRA run (step 0: 0.6926, not log 2), and the NF4 base's in LoRA."""
    kw = {"model.finetune": finetune, "model.lora_rank": 4, "micro_batch_size": 2, "num_microbatches": 1,
          "log_every": 1}
    other = {"lora": "qlora", "qlora": "lora"}[finetune]
    _train(tmp_path, {**kw, "model.finetune": other, "steps": 1, "optimizer.warmup_steps": 0})
    cached = _train(tmp_path, {**kw, "dpo.reference": "cached"})
    assert cached["loss"][0] == pytest.approx(math.log(2), rel=1e-12)  # policy = its own reference
    online = _train(tmp_path, {**kw, "dpo.reference": "adapters"})
    assert_same_run(online, cached, rtol=1e-9)
    assert cached["loss"][-1] != cached["loss"][0]
    return kw


def test_cached_reference_equals_adapters_off_with_lora(tmp_path):
    """LoRA: the reference read from the cache (computed once before training) and the one computed every
    step with the adapters turned off give the same run; the cache is re-used by the next run."""
    lora = cached_equals_adapters_off(tmp_path, "lora")
    folders = list((tmp_path / "ref").iterdir())
    assert len(folders) == 2 and all((f / "key.json").is_file() for f in folders)  # QLoRA's and LoRA's
    stamp = {p: p.stat().st_mtime_ns for f in folders for p in f.iterdir()}
    _train(tmp_path, {**lora, "dpo.reference": "cached"})  # a second run reads, never rewrites
    assert {p: p.stat().st_mtime_ns for f in folders for p in f.iterdir()} == stamp


@pytest.mark.parametrize("kw,message", [
    ({"dpo.reference": "adapters"}, "dpo.reference (adapters) needs model.finetune lora"),
    ({"dpo.beta": 0.0}, "dpo.beta (0.0) must be a finite number > 0"),
    ({"dpo.loss_type": "ipo", "dpo.label_smoothing": 0.1}, "dpo.label_smoothing (0.1) applies to loss_type sigmoid"),
    ({"training.task": "dpo", "data.source": "random-documents"}, "training.task dpo needs a preference"),
])
def test_bad_dpo_settings_are_named(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trainer(_cfg(tmp_path, **{"training.task": "dpo", **kw}))


def test_sequence_logps_equal_transformers_on_the_same_weights(tmp_path):
    """From a saved Hugging Face Llama: step 0's logps/chosen and logps/rejected (the policy's sequence
    log-probs, means over the pairs) equal transformers' on each sequence run alone (fp64), and the
    reward margin is 0 there (policy = cached reference)."""
    import transformers

    cfg0 = _cfg(tmp_path)
    folder = save_hf_llama(tmp_path / "hf", cfg0.model_config().vocab_size, seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").double().eval()
    kw = {**from_hf_keys(folder), "micro_batch_size": 2, "num_microbatches": 1, "log_every": 1}
    first = _train(tmp_path, kw)
    batch = data_of(cfg0, cfg0.model_config().vocab_size).batch(0, 2)
    target = batch.targets()
    sums = {}
    with torch.no_grad():
        for r in range(2):
            starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [SEQ]
            for a, b in zip(starts, starts[1:]):
                if int(batch.pair_index[r, a]) < 0:
                    continue  # filler
                lp = torch.log_softmax(hf(batch.ids[r:r + 1, a:b]).logits[0], dim=-1)
                t = target[r, a:b]
                keep = t != -100
                sums[(int(batch.pair_index[r, a]), bool(batch.chosen[r, a]))] = float(lp[keep, t[keep]].sum())
    pairs = len(sums) // 2
    want_c = sum(sums[(k, True)] for k in range(pairs)) / pairs
    want_r = sum(sums[(k, False)] for k in range(pairs)) / pairs
    torch.testing.assert_close(torch.tensor(first["logps/chosen"][0]), torch.tensor(want_c), rtol=1e-9, atol=0)
    torch.testing.assert_close(torch.tensor(first["logps/rejected"][0]), torch.tensor(want_r), rtol=1e-9, atol=0)
    assert first["rewards/margins"][0] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("loss_type,sft_weight", [("sigmoid", 0.7), ("simpo", 0.0)])
def test_verify_step0_reference_is_the_runs_step0(tmp_path, loss_type, sft_weight):
    """--verify-step0's single-process fp64 loss of the whole batch (the reference being the initial
    model) equals a DPO run's step 0 at micro-batches of 1 row (log 2 + the SFT term; SimPO's own)."""
    from tpkernels.train.cli import single_process_loss

    kw = {"dpo.loss_type": loss_type, "dpo.sft_weight": sft_weight, "micro_batch_size": 1, "num_microbatches": 4,
          "log_every": 1}
    got = _train(tmp_path, kw)["loss"][0]
    want = single_process_loss(_cfg(tmp_path, **kw), 4)
    assert got == pytest.approx(want, rel=1e-9)
    if loss_type == "sigmoid":
        assert want > 0.6931471805599453 + 0.1  # the SFT term is in it


def test_cached_reference_fills_for_any_dataset_size_and_held_out_pairs(tmp_path):
    """A dataset whose rows do not fill whole global batches (the last one padded by repeating rows) and a
    held-out set of 5 pairs: the default cached reference is filled for both, each pair once."""
    cfg = _cfg(tmp_path)
    write_jsonl(tmp_path / "few.jsonl", _pairs(5))
    hist = Trainer(_cfg(tmp_path, **{"eval.source": str(tmp_path / "few.jsonl"), "eval.every": 3,
                                     "eval.batches": 1, "micro_batch_size": 4, "num_microbatches": 1})).train()
    assert "eval/rewards/accuracies" in hist[-1] and cfg.dpo.reference == "cached"
    assert len(list((tmp_path / "ref").iterdir())) == 2  # the training pairs' cache and the held-out ones'


def test_a_blend_of_preference_sources_trains_dpo(tmp_path):
    _cfg(tmp_path)
    write_jsonl(tmp_path / "more.jsonl", _pairs(9)[3:])
    blend = f"0.5 {tmp_path / 'pairs.jsonl'} 0.5 {tmp_path / 'more.jsonl'}"
    hist = _train(tmp_path, {"data.source": blend, "dpo.reference": "model", "micro_batch_size": 2,
                             "num_microbatches": 1, "log_every": 1})
    assert hist["loss"][0] == pytest.approx(0.6931471805599453, rel=1e-12)  # DPO's step 0, not a token loss


def test_implied_dpo_refuses_adapters_without_lora_and_eval_errors_name_eval_source(tmp_path):
    with pytest.raises(ValueError, match=r"dpo.reference \(adapters\) needs model.finetune lora"):
        Trainer(_cfg(tmp_path, **{"dpo.reference": "adapters"}))  # training.task auto: the pairs imply dpo
    with pytest.raises(ValueError, match=r"eval.source \('.*nope.jsonl'\) does not exist"):
        Trainer(_cfg(tmp_path, **{"eval.source": str(tmp_path / "nope.jsonl"), "eval.every": 1}))


def test_cache_key_holds_what_changes_the_reference_and_nothing_else(tmp_path):
    """cache_key: the fine-tuning kind, the base's quantisation (and its TP size, which changes the NF4
    bytes), the dtype, FP8's linears, the seed, the data settings and the chat template change it; β, the
    loss type, the LoRA rank, the layout of a 16-bit base do not."""
    def key(tp=1, fp8_linears=None, **kw):
        cfg = _cfg(tmp_path, **kw)
        return cache_key(cfg, cfg.model_config(), data_of(cfg, cfg.model_config().vocab_size).packed, tp=tp,
                         fp8_linears=fp8_linears).digest

    base = key()
    lora = key(**{"model.finetune": "lora"})
    nf4 = key(**{"model.finetune": "qlora"})
    same = [key(**{"dpo.beta": 0.5, "dpo.loss_type": "ipo"}), key(tp=2, **{"dpo.reference": "cached"})]
    assert same == [base, base]
    assert key(tp=2, **{"model.finetune": "lora", "model.lora_rank": 8}) == lora
    differ = [base, lora, nf4, key(tp=2, **{"model.finetune": "qlora"}),
              key(**{"model.finetune": "qlora", "model.quant": "int8"}), key(**{"training.precision": "fp32"}),
              key(**{"training.precision": "fp8"}), key(fp8_linears=["qkv"], **{"training.precision": "fp8"}),
              key(**{"training.seed": 1}), key(**{"data.overflow": "truncate"}), key(**{"seq_length": SEQ + 1})]
    make_tokenizer(tmp_path / "tok", PLAIN)  # the same vocabulary, another chat template
    differ.append(key())
    assert len(set(differ)) == len(differ)


def _hold_after_deciding(rank: int, world: int, tmp_path, kw: dict):
    """A run whose rank 0, right after reading which pairs the cache lacks, waits until another run has
    completed the cache; its other ranks wait for that before their first look at the folder (where
    they make one): so they see the folder the other run left, rank 0's view is out of date."""
    done = tmp_path / "b-done"

    def wait():
        deadline = time.monotonic() + 120
        while not done.exists():
            assert time.monotonic() < deadline, "the other run never finished"
            time.sleep(0.02)

    missing, complete = rc.ReferenceCache.missing, rc.ReferenceCache.complete

    def missing_then_wait(self, n):
        out = missing(self, n)
        (tmp_path / "a-decided").touch()
        wait()
        return out

    def wait_then_complete(self):
        wait()
        return complete.fget(self)

    if rank == 0:
        rc.ReferenceCache.missing = missing_then_wait
    else:
        rc.ReferenceCache.complete = property(wait_then_complete)
    try:
        return _train(tmp_path, kw)
    finally:
        rc.ReferenceCache.missing, rc.ReferenceCache.complete = missing, complete


def test_two_runs_fill_one_cache_at_once(rank_pool, tmp_path):
    """Run A (DP2) decides that every pair is missing; run B (one process, same key) then fills and
    completes the cache before A goes on, and A's rank 1 sees B's complete cache. Both runs finish (A's
    parts are dropped, its finalize is a success; its ranks act on rank 0's decision, so they never
    disagree), and they train alike on the same reference: step 0 is log 2 on both."""
    _cfg(tmp_path)  # the tokenizer and data, written once before the runs
    kw = {"micro_batch_size": 1, "num_microbatches": 1, "log_every": 1, "steps": 1, "optimizer.warmup_steps": 0}
    got = {}

    def run_a():
        try:
            got["a"] = rank_pool(2).run(_hold_after_deciding, tmp_path, {**kw, "dp": 2}, timeout=240)
        except Exception as e:  # noqa: BLE001  (asserted below)
            got["a"] = e
        finally:
            (tmp_path / "a-ended").touch()

    a = threading.Thread(target=run_a)
    a.start()
    deadline = time.monotonic() + 120
    while not ((tmp_path / "a-decided").exists() or (tmp_path / "a-ended").exists()):
        assert time.monotonic() < deadline, "run A never read the cache"
        time.sleep(0.02)
    try:
        b = _train(tmp_path, {**kw, "micro_batch_size": 2})
    finally:
        (tmp_path / "b-done").touch()
        a.join(300)
    assert not isinstance(got["a"], Exception), got["a"]
    assert b["loss"][0] == pytest.approx(math.log(2), rel=1e-12)
    folders = list((tmp_path / "ref").iterdir())
    assert len(folders) == 1 and not list(folders[0].glob("part-*"))
    for a_rank in got["a"]:
        for k in b:
            torch.testing.assert_close(torch.tensor(a_rank[k]), torch.tensor(b[k]), rtol=1e-9, atol=1e-12, msg=k)
