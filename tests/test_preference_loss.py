"""preference_loss and sft_loss against TRL's own code on the same log-probs (float64), losses,
gradients and the logged metrics: DPOTrainer._compute_loss (sigmoid, ipo, hinge, and the
["sigmoid", "sft"] RPO combination), called with a stand-in trainer and model that return the
per-token log-probs; CPOTrainer.cpo_loss + get_batch_logps for SimPO (reference-free, length-
averaged, with TRL's label smoothing) and for the conservative (label-smoothed) sigmoid, which TRL
1.16's DPOTrainer no longer applies to "sigmoid" (its label_smoothing serves robust/EXO only), so
cDPO is checked against the same formula in CPO's "sigmoid". Bad arguments are named errors."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tpkernels.functional.preference import (
    METRIC_NAMES,
    preference_loss,
    sequence_logps,
    sequence_token_counts,
    sft_loss,
)

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")

PAIRS, T = 5, 11  # sequences of T tokens; chosen rows first, then the rejected ones (TRL's batch order)


def _batch(seed):
    """Per-token log-probs (2·PAIRS, T−1) of the shifted targets, TRL's completion_mask (2·PAIRS, T)
    and reference sequence log-probs. Rejected sequence 1 has an empty completion."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(2 * PAIRS, T, dtype=torch.int64)
    for i in range(2 * PAIRS):
        start = int(torch.randint(1, 5, (), generator=g))
        end = int(torch.randint(start + 1, T + 1, (), generator=g))
        completion[i, start:end] = 1
    completion[PAIRS + 1] = 0
    token = -torch.rand(2 * PAIRS, T - 1, generator=g, dtype=torch.float64) * 3
    ref = (token * completion[:, 1:]).sum(1) + torch.randn(2 * PAIRS, generator=g, dtype=torch.float64)
    return token, completion, ref[:PAIRS], ref[PAIRS:]


def _trl_dpo(token, completion, ref_c, ref_r, *, beta, loss_types, loss_weights=None):
    """TRL's DPOTrainer._compute_loss on a stand-in trainer whose model returns ``token`` (masked)."""
    shift = completion[:, 1:]
    zeros = torch.zeros_like(token)

    class Model:
        training = True

        def __call__(self, **kwargs):
            return SimpleNamespace(log_probs=token * shift, entropy=zeros, mean_logits=zeros,
                                   is_top1=torch.zeros_like(shift, dtype=torch.bool))

    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    model = Model()
    trainer = SimpleNamespace(model=model, accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                              precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types,
                              loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=0.0,
                              use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * PAIRS, T, dtype=torch.int64), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(token, completion, ref_c, ref_r, **kwargs):
    """Our path: per-document sums of the packed rows (each row one document), then the loss."""
    shift = completion[:, 1:]
    doc = torch.arange(2 * PAIRS).unsqueeze(1).expand_as(shift).contiguous()
    logps = sequence_logps(token, shift.bool(), doc, 2 * PAIRS)
    counts = sequence_token_counts(shift.bool(), doc, 2 * PAIRS)
    losses, metrics = preference_loss(logps[:PAIRS], logps[PAIRS:], ref_c, ref_r, chosen_lengths=counts[:PAIRS],
                                      rejected_lengths=counts[PAIRS:], **kwargs)
    return losses, metrics, logps, counts


def _metric_means(metrics):
    assert set(metrics) == set(METRIC_NAMES)
    assert all(not v.requires_grad for v in metrics.values())
    return {k: float(v.mean()) for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 2.5])
def test_dpo_losses_equal_trl(fresh_seed, loss_type, beta):
    token, completion, ref_c, ref_r = _batch(fresh_seed)
    t_trl = token.clone().requires_grad_()
    loss_trl, m_trl = _trl_dpo(t_trl, completion, ref_c, ref_r, beta=beta, loss_types=[loss_type])
    loss_trl.backward()

    t = token.clone().requires_grad_()
    losses, metrics, _, _ = _ours(t, completion, ref_c, ref_r, beta=beta, loss_type=loss_type)
    assert losses.shape == (PAIRS,)
    losses.mean().backward()
    torch.testing.assert_close(losses.mean().detach(), loss_trl.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t.grad, t_trl.grad, rtol=1e-12, atol=1e-14)
    ours = _metric_means(metrics)
    for name in METRIC_NAMES:  # TRL takes the accuracies' mean in float32
        rel = 1e-7 if name == "rewards/accuracies" else 1e-12
        assert ours[name] == pytest.approx(m_trl[name], rel=rel, abs=1e-14), name


@pytest.mark.parametrize("sft_weight", [0.3, 1.0])
def test_rpo_sft_term_equals_trl(fresh_seed, sft_weight):
    """TRL's RPO: loss_type=["sigmoid", "sft"], loss_weights=[1, α]: the SFT term is the mean NLL
    over all chosen completion tokens of the batch."""
    token, completion, ref_c, ref_r = _batch(fresh_seed)
    t_trl = token.clone().requires_grad_()
    loss_trl, _ = _trl_dpo(t_trl, completion, ref_c, ref_r, beta=0.1, loss_types=["sigmoid", "sft"],
                           loss_weights=[1.0, sft_weight])
    loss_trl.backward()
    t = token.clone().requires_grad_()
    losses, _, logps, counts = _ours(t, completion, ref_c, ref_r, beta=0.1, loss_type="sigmoid")
    loss = losses.mean() + sft_weight * sft_loss(logps[:PAIRS], counts[:PAIRS].sum())
    loss.backward()
    torch.testing.assert_close(loss.detach(), loss_trl.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t.grad, t_trl.grad, rtol=1e-12, atol=1e-14)


def _logits_batch(seed, vocab=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * PAIRS, T, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2 * PAIRS, T), generator=g)
    for i in range(2 * PAIRS):  # a prompt of 1–4 tokens, the rest the completion (at least 1 token)
        labels[i, :int(torch.randint(1, 5, (), generator=g))] = -100
    return logits, labels


def _our_logps_from_logits(logits, labels):
    """Per-token log-probs the way our head makes them (shifted targets), summed per sequence."""
    target = labels[:, 1:]
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mask = target != -100
    doc = torch.arange(2 * PAIRS).unsqueeze(1).expand_as(mask).contiguous()
    return sequence_logps(lp, mask, doc, 2 * PAIRS), sequence_token_counts(mask, doc, 2 * PAIRS)


def _cpo(loss_type, beta, label_smoothing, gamma=0.5):
    return SimpleNamespace(alpha=0.0, beta=beta, loss_type=loss_type, simpo_gamma=gamma,
                           label_smoothing=label_smoothing, accelerator=SimpleNamespace(device=torch.device("cpu")))


@pytest.mark.parametrize("beta, gamma, smoothing", [(2.0, 0.5, 0.0), (0.7, 1.4, 0.2)])
def test_simpo_equals_trl_cpo(fresh_seed, beta, gamma, smoothing):
    logits, labels = _logits_batch(fresh_seed)
    z_trl = logits.clone().requires_grad_()
    avg = trl_cpo.CPOTrainer.get_batch_logps(z_trl, labels, average_log_prob=True)
    losses_trl, rc_trl, rr_trl = trl_cpo.CPOTrainer.cpo_loss(_cpo("simpo", beta, smoothing, gamma), avg[:PAIRS],
                                                             avg[PAIRS:])
    losses_trl.mean().backward()

    z = logits.clone().requires_grad_()
    logps, counts = _our_logps_from_logits(z, labels)
    losses, metrics = preference_loss(logps[:PAIRS], logps[PAIRS:], beta=beta, loss_type="simpo",
                                      label_smoothing=smoothing, simpo_gamma=gamma, chosen_lengths=counts[:PAIRS],
                                      rejected_lengths=counts[PAIRS:])
    losses.mean().backward()
    torch.testing.assert_close(losses.detach(), losses_trl.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z.grad, z_trl.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["rewards/chosen"], rc_trl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["rewards/rejected"], rr_trl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["logps/chosen"], avg[:PAIRS].detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["rewards/accuracies"], (rc_trl > rr_trl).double())


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_conservative_sigmoid_label_smoothing_equals_trl_formula(fresh_seed, smoothing):
    """cDPO: TRL's CPO "sigmoid" loss of the log-ratios is −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)."""
    token, completion, ref_c, ref_r = _batch(fresh_seed)
    t = token.clone().requires_grad_()
    losses, _, _, _ = _ours(t, completion, ref_c, ref_r, beta=0.4, loss_type="sigmoid",
                                label_smoothing=smoothing)
    losses.sum().backward()
    t_trl = token.clone().requires_grad_()
    seq = (t_trl * completion[:, 1:]).sum(1)
    losses_trl, _, _ = trl_cpo.CPOTrainer.cpo_loss(_cpo("sigmoid", 0.4, smoothing), seq[:PAIRS] - ref_c,
                                                   seq[PAIRS:] - ref_r)
    losses_trl.sum().backward()
    torch.testing.assert_close(losses.detach(), losses_trl.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t.grad, t_trl.grad, rtol=1e-12, atol=1e-14)
    plain, _, _, _ = _ours(token, completion, ref_c, ref_r, beta=0.4, loss_type="sigmoid")
    assert not torch.allclose(plain, losses.detach())


def test_sft_loss_normalisation():
    lp = torch.tensor([-3.0, -5.0], dtype=torch.float64, requires_grad=True)
    loss = sft_loss(lp, 4)
    assert float(loss.detach()) == 2.0
    loss.backward()
    assert torch.equal(lp.grad, torch.full((2,), -0.25, dtype=torch.float64))
    assert float(sft_loss(torch.zeros(0, dtype=torch.float64), 0)) == 0.0  # no tokens: 0, not nan


X = torch.tensor([-1.0, -2.0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_type="kto"), r"loss_type \('kto'\) must be one of sigmoid, ipo, hinge, simpo"),
    (dict(beta=0.0), r"beta \(0.0\) must be a finite number > 0"),
    (dict(label_smoothing=0.5), r"label_smoothing \(0.5\) must be in \[0, 0.5\)"),
    (dict(loss_type="hinge", label_smoothing=0.1), r"loss_type 'hinge' takes no label_smoothing"),
    (dict(loss_type="ipo"), r"loss_type 'ipo' normalises by the completion length: pass chosen_lengths"),
    (dict(ref_chosen=None), r"loss_type 'sigmoid' needs the reference log-probs"),
    (dict(ref_rejected=X[:1]), r"ref_rejected shape \(1,\) differs"),
    (dict(policy_chosen=X.long()), r"policy_chosen must be a floating-point tensor"),
    (dict(loss_type="simpo", chosen_lengths=torch.tensor([3, 4]), rejected_lengths=torch.tensor([1])),
     r"rejected_lengths shape \(1,\) must equal"),
])
def test_bad_arguments_are_named_errors(kwargs, message):
    args = dict(policy_chosen=X, policy_rejected=X, ref_chosen=X, ref_rejected=X, beta=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        preference_loss(**args)
