"""SFT: the loss is the global token mean over the assistant tokens only. A DP2 run on 2 gloo ranks in
fp64 gives, at step 0, the one-process fp64 loss whose labels are masked by a separate rule
(data_checks.reference_mask); packed rows give the loss of the same samples one per row; TP2×PP2+SP,
CP2 and interleaved PP2 train what one process trains, step for step."""

from __future__ import annotations

import pytest
import torch

from data_checks import CHATS, MARKED, from_hf_keys, make_tokenizer, reference_mask, save_hf_llama, write_jsonl
from test_train import small
from tpkernels.models import ParallelTransformer
from tpkernels.parallel import ParallelConfig
from tpkernels.parallel.state import ParallelState
from tpkernels.train import Trainer
from tpkernels.train.data import data_of

SEQ = 48


def _cfg(tmp_path, **kw):
    tok = tmp_path / "tok"
    if not tok.exists():
        make_tokenizer(tok, MARKED)
        write_jsonl(tmp_path / "chat.jsonl", CHATS * 4)
    return small(**{"data.source": str(tmp_path / "chat.jsonl"), "data.tokenizer": str(tok), "seq_length": SEQ,
                    "training.precision": "fp64", "steps": 2, **kw})


def _worker(rank, world, tmp_path):
    return [h["loss"] for h in Trainer(_cfg(tmp_path, dp=2, micro_batch_size=1, num_microbatches=2)).train()]


def _reference_targets(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Next-token targets within each document, kept where the simple rule marks the label token."""
    target = torch.full_like(ids, -100)
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            mask = reference_mask(ids[r, a:b].tolist())
            for t in range(a, b - 1):
                if mask[t + 1 - a]:
                    target[r, t] = ids[r, t + 1]
    return target


def _model(cfg, rows):
    state = ParallelState.create(ParallelConfig(micro_batch_size=rows, num_microbatches=1, dp=1))
    return ParallelTransformer(cfg.model_config(), state, seed=cfg.training.seed, dtype=torch.float64)


def test_sft_loss_on_2_ranks_equals_the_masked_fp64_reference(rank_pool, tmp_path):
    cfg = _cfg(tmp_path)
    batch = data_of(cfg, cfg.model_config().vocab_size).batch(0, 4)
    assert cfg.training.task == "auto" and batch.loss_mask is not None
    target = _reference_targets(batch.ids, batch.position_ids)
    assert torch.equal(target, batch.targets())  # the package's targets are the rule's
    assert 0 < int((target != -100).sum()) < int((batch.position_ids[:, 1:] != 0).sum())  # prompts excluded
    want = _model(cfg, 4).evaluate(batch.ids, target, position_ids=batch.position_ids, num_microbatches=1)
    (loss_a, _), (loss_b, _) = rank_pool(2).run(_worker, tmp_path, timeout=300)
    assert loss_a == loss_b
    torch.testing.assert_close(torch.tensor(loss_a), torch.tensor(want), rtol=1e-9, atol=0)


def test_packed_and_unpacked_give_the_same_loss(tmp_path):
    cfg = _cfg(tmp_path)
    batch = data_of(cfg, cfg.model_config().vocab_size).batch(0, 4)
    target = batch.targets()
    model = _model(cfg, 1)
    packed = _model(cfg, 4).evaluate(batch.ids, target, position_ids=batch.position_ids, num_microbatches=1)
    total = count = 0.0
    for r in range(4):  # each sample alone in its own row (the filler left out)
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [SEQ]
        for a, b in zip(starts, starts[1:]):
            n = int((target[r, a:b] != -100).sum())
            if n:
                one = model.evaluate(batch.ids[r:r + 1, a:b], target[r:r + 1, a:b], num_microbatches=1)
                total, count = total + one * n, count + n
    torch.testing.assert_close(torch.tensor(packed), torch.tensor(total / count), rtol=1e-9, atol=0)


def _train(tmp_path, kw):
    hist = Trainer(_cfg(tmp_path, steps=3, **kw)).train()
    return [h["loss"] for h in hist], [h["grad_norm"] for h in hist]


def _layout_worker(rank, world, tmp_path, kw):
    return _train(tmp_path, kw)


@pytest.mark.parametrize("kw", [dict(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=2),
                                dict(cp=2, micro_batch_size=2, num_microbatches=1),
                                dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batch_size=1,
                                     num_microbatches=2)],
                         ids=["tp2pp2-sp", "cp2", "pp2-interleaved"])
def test_sft_at_every_layout_trains_what_one_process_trains(rank_pool, tmp_path, kw):
    """3 SFT steps (prompts masked): losses and gradient norms equal the one-process run to 1e-6."""
    want = _train(tmp_path, dict(micro_batch_size=2, num_microbatches=1))
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
    for loss, norm in rank_pool(world).run(_layout_worker, tmp_path, kw, timeout=300):
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want[0]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want[1]), rtol=1e-6, atol=0)


def test_sft_step0_equals_transformers_on_the_same_weights(rank_pool, tmp_path):
    """A Hugging Face Llama saved to disk, trained from it at DP2: step 0's loss is transformers' NLL over
    the assistant tokens (labels masked by the separate rule), each sample run alone through
    ``LlamaForCausalLM`` (eager attention, fp64), summed and divided by their count."""
    import transformers

    cfg0 = _cfg(tmp_path)
    folder = save_hf_llama(tmp_path / "hf", cfg0.model_config().vocab_size, seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").double().eval()
    kw = from_hf_keys(folder)
    batch = data_of(cfg0, cfg0.model_config().vocab_size).batch(0, 4)
    target = _reference_targets(batch.ids, batch.position_ids)
    total = count = 0.0
    with torch.no_grad():
        for r in range(4):
            starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [SEQ]
            for a, b in zip(starts, starts[1:]):
                t = target[r, a:b]
                if (t != -100).any():
                    logits = hf(batch.ids[r:r + 1, a:b]).logits[0]
                    total += float(torch.nn.functional.cross_entropy(logits, t, ignore_index=-100, reduction="sum"))
                    count += int((t != -100).sum())
    (loss_a, _), (loss_b, _) = rank_pool(2).run(_hf_worker, tmp_path, kw, timeout=300)
    assert loss_a == loss_b
    torch.testing.assert_close(torch.tensor(loss_a[0]), torch.tensor(total / count), rtol=1e-9, atol=0)


def _hf_worker(rank, world, tmp_path, kw):
    return _train(tmp_path, dict(dp=2, micro_batch_size=1, num_microbatches=2, **kw))


def test_sft_with_lora_zero1_recompute_at_dp2_trains_what_one_process_trains(rank_pool, tmp_path):
    lora = {"model.finetune": "lora", "model.lora_rank": 4, "zero1": True, "recompute": "full"}
    want = _train(tmp_path, dict(micro_batch_size=2, num_microbatches=1, **lora))
    assert want[0][-1] != want[0][0]
    for loss, norm in rank_pool(2).run(_layout_worker, tmp_path, dict(dp=2, micro_batch_size=1,
                                                                      num_microbatches=1, **lora), timeout=300):
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want[0]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want[1]), rtol=1e-6, atol=0)


def test_sft_in_bf16_tracks_fp64(tmp_path):
    """bf16 weights and activations with fp32 masters: each step's loss within 2% of the fp64 run's."""
    want = _train(tmp_path, dict(micro_batch_size=2, num_microbatches=1))[0]
    got = _train(tmp_path, {"micro_batch_size": 2, "num_microbatches": 1, "training.precision": "bf16"})[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
