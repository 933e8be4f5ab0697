"""MoE router (tpkernels/functional/moe_router.py) against transformers' own routers and loss, and
brute-force oracles for ties, capacity dropping, the bias and the sequence-level loss."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter, load_balancing_loss_func

from tpkernels.functional.moe_router import load_balancing_loss, route, update_balance_bias, z_loss


def _hidden(t, h):
    return torch.randn(t, h, dtype=torch.float64)


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True)])
def test_route_matches_transformers_router(family, norm):
    t, h, e, k = 37, 12, 7, int(torch.randint(1, 4, ()).item())
    if family == "mixtral":
        hf = MixtralTopKRouter(MixtralConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k))
    else:
        hf = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k,
                                               norm_topk_prob=norm))
    hf = hf.double()
    with torch.no_grad():
        hf.weight.normal_()
    x = _hidden(t, h)
    hf_logits, hf_weights, hf_experts = hf(x)
    w = hf.weight.detach().clone().requires_grad_(True)
    r = route(F.linear(x, w), k, normalize=norm)
    assert torch.equal(r.experts, hf_experts)
    torch.testing.assert_close(r.weights.double(), hf_weights.double(), rtol=0, atol=0)
    torch.testing.assert_close(r.logits, hf_logits.float(), rtol=0, atol=0)
    assert r.dropped is None and r.weights.dtype == torch.float32
    g = torch.randn(t, k, dtype=torch.float64)
    (r.weights.double() * g).sum().backward()
    (hf_weights.double() * g).sum().backward()
    torch.testing.assert_close(w.grad, hf.weight.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    t, e, k = 53, 5, 2
    logits = torch.randn(t, e, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(t) > 0.3).to(torch.int64) if masked else None
    ref = load_balancing_loss_func((logits,), e, k, mask[None] if masked else None)
    r = route(logits, k, score_dtype=torch.float64)
    ours = load_balancing_loss(r.scores, r.experts, e, token_mask=mask)
    # transformers sums the probabilities and counts in float32 whatever the logits' dtype
    torch.testing.assert_close(ours, ref.double(), rtol=2e-6, atol=0)
    (g_ref,) = torch.autograd.grad(ref, logits)
    (g_ours,) = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)


def _oracle_topk(sel, k):
    return [sorted(range(len(row)), key=lambda i: (-row[i], i))[:k] for row in sel.tolist()]


def test_ties_go_to_the_lower_expert_id_and_the_bias_only_selects():
    t, e, k = 64, 7, 3
    logits = torch.randint(0, 3, (t, e)).double()  # many exact ties
    logits[0] = 1.0  # a row of all-equal scores: experts 0, 1, 2
    r = route(logits, k, score_dtype=torch.float64)
    assert r.experts[0].tolist() == [0, 1, 2]
    assert r.experts.tolist() == _oracle_topk(torch.softmax(logits, -1), k)
    # sigmoid + bias (DeepSeek-V3): the biased scores select, the unbiased ones weigh
    bias = torch.randint(-1, 2, (e,)).double() * 0.25
    rs = route(logits, k, score="sigmoid", bias=bias, score_dtype=torch.float64)
    s = torch.sigmoid(logits)
    assert rs.experts.tolist() == _oracle_topk(s + bias, k)
    chosen = s.gather(1, rs.experts)
    torch.testing.assert_close(rs.weights, chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    rn = route(logits, k, score="sigmoid", bias=bias, normalize=False, score_dtype=torch.float64)
    torch.testing.assert_close(rn.weights, chosen, rtol=0, atol=0)


def test_capacity_keeps_the_highest_scores_earlier_token_on_ties():
    t, e, k, cf = 41, 5, 2, 0.75
    logits = torch.randint(0, 4, (t, e)).double()
    r = route(logits, k, capacity_factor=cf, score_dtype=torch.float64)
    cap = math.ceil(cf * t * k / e)
    assert r.capacity == cap
    scores = torch.softmax(logits, -1)
    expected = torch.zeros(t, k, dtype=torch.bool)
    for ex in range(e):
        slots = [(-scores[tt, ex].item(), tt, j) for tt in range(t) for j in range(k) if r.experts[tt, j] == ex]
        for _, tt, j in sorted(slots)[cap:]:
            expected[tt, j] = True
    assert expected.any(), "the draw must drop something"
    assert torch.equal(r.dropped, expected)
    free = route(logits, k, score_dtype=torch.float64)
    assert torch.equal(r.experts, free.experts)
    torch.testing.assert_close(r.weights, free.weights.masked_fill(expected, 0.0), rtol=0, atol=0)
    assert torch.equal(r.kept_experts, free.experts.masked_fill(expected, -1))
    assert int(r.tokens_per_expert().max()) <= cap and int(r.tokens_per_expert().sum()) == t * k - int(expected.sum())


def test_sequence_level_loss_and_z_loss_against_per_sequence_oracle():
    e, k = 6, 2
    lengths = [1, 9, 4, 17]  # packed documents of uneven length
    t = sum(lengths)
    logits = torch.randn(t, e, dtype=torch.float64, requires_grad=True)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.rand(t) > 0.2
    mask[0] = True
    r = route(logits, k, score_dtype=torch.float64)
    ours = load_balancing_loss(r.scores, r.experts, e, per_sequence=seq, token_mask=mask)
    parts = []
    for s in range(len(lengths)):
        sel = (seq == s) & mask
        if sel.any():
            parts.append(load_balancing_loss_func((logits[sel],), e, k))
    ref = torch.stack(parts).mean().double()  # transformers sums in float32
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=0)
    torch.testing.assert_close(*torch.autograd.grad(ours, logits), *torch.autograd.grad(ref, logits),
                               rtol=1e-5, atol=1e-7)
    zl = z_loss(r.logits, token_mask=mask)
    torch.testing.assert_close(zl, (torch.logsumexp(logits[mask], -1) ** 2).mean(), rtol=1e-12, atol=0)


def _shares(rank, world_size, logits, experts, seq, mask):
    """Each rank holds every other token (a CP-like split of the same sequences); returns its shares."""
    mine = torch.arange(rank, logits.shape[0], world_size)
    lg = logits[mine].clone().requires_grad_(True)
    scores = torch.softmax(lg, -1)
    e = logits.shape[1]
    a = load_balancing_loss(scores, experts[mine], e, token_mask=mask[mine], group=dist.group.WORLD)
    b = load_balancing_loss(scores, experts[mine], e, token_mask=mask[mine], group=dist.group.WORLD,
                            per_sequence=seq[mine])
    z = z_loss(lg, token_mask=mask[mine], group=dist.group.WORLD)
    grads = [torch.autograd.grad(v, lg, retain_graph=True)[0] for v in (a, b, z)]
    # group None: this rank's tokens only, even inside an initialised process group
    alone = z_loss(lg, token_mask=mask[mine])
    assert torch.allclose(alone, (torch.logsumexp(lg[mask[mine]], -1) ** 2).mean()), "group=None must stay local"
    return [a.item(), b.item(), z.item()], mine, grads


def test_rank_shares_sum_to_the_global_losses_and_gradients(rank_pool):
    e, k = 5, 2
    lengths = [3, 11, 6]
    t = sum(lengths)
    logits = torch.randn(t, e, dtype=torch.float64, requires_grad=True)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.rand(t) > 0.25
    experts = route(logits.detach(), k, score_dtype=torch.float64).experts
    scores = torch.softmax(logits, -1)
    ref = [load_balancing_loss(scores, experts, e, token_mask=mask),
           load_balancing_loss(scores, experts, e, token_mask=mask, per_sequence=seq),
           z_loss(logits, token_mask=mask)]
    out = rank_pool(2).run(_shares, logits.detach(), experts, seq, mask)
    for i in range(3):
        assert sum(o[0][i] for o in out) == pytest.approx(ref[i].item(), rel=1e-12, abs=1e-14)
        g = torch.zeros_like(logits)
        for _, mine, grads in out:
            g[mine] = grads[i]
        torch.testing.assert_close(g, torch.autograd.grad(ref[i], logits, retain_graph=True)[0], rtol=1e-10, atol=1e-14)


def test_update_balance_bias_moves_against_the_load():
    bias = torch.zeros(4)
    counts = torch.tensor([10, 2, 4, 4])  # mean 5
    update_balance_bias(bias, counts, 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


@pytest.mark.parametrize("call,match", [
    (lambda: route(torch.randn(4, 3), 4), r"top_k \(4\) must be an int with 1 <= top_k <= num_experts \(3\)"),
    (lambda: route(torch.randn(4, 3), 0), r"top_k \(0\)"),
    (lambda: route(torch.randn(4, 3, 2), 1), r"logits must be 2-D"),
    (lambda: route(torch.randn(4, 3), 1, score="relu"), r"score \('relu'\) must be one of"),
    (lambda: route(torch.randn(4, 3), 1, capacity_factor=0), r"capacity_factor \(0\)"),
    (lambda: route(torch.randn(4, 3), 1, bias=torch.zeros(4)), r"bias must be .* \(3,\)"),
    (lambda: load_balancing_loss(torch.rand(4, 3), torch.zeros(4, 2, dtype=torch.long), 5), r"num_experts \(5\)"),
    (lambda: load_balancing_loss(torch.rand(4, 3), torch.zeros(4, 2, dtype=torch.long), 3,
                                 per_sequence=torch.zeros(3, dtype=torch.long)), r"per_sequence must be .* \(4,\)"),
    (lambda: update_balance_bias(torch.zeros(3), torch.zeros(4), 0.1), r"counts must be .* \(3,\)"),
])
def test_bad_inputs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_route_matches_transformers_deepseek_v3_router():
    """sigmoid scores, the aux-loss-free bias, group-limited selection, normalisation and scaling as
    transformers' DeepseekV3TopkRouter (float32, as it computes)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    t, h, e, k = 33, 12, 16, 3
    cfg = DeepseekV3Config(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.normal_()
        hf.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(t, h)
    _, hf_weights, hf_experts = hf(x)
    r = route(F.linear(x, hf.weight.detach()), k, score="sigmoid", bias=hf.e_score_correction_bias, groups=4,
              top_groups=2, scale=2.5)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs by expert id
    ours_e, order = r.experts.sort(-1)
    theirs_e, torder = hf_experts.sort(-1)
    assert torch.equal(ours_e, theirs_e)
    torch.testing.assert_close(r.weights.gather(1, order), hf_weights.gather(1, torder), rtol=1e-6, atol=1e-7)
    chosen_groups = (r.experts // (e // 4))
    assert all(len(set(row)) <= 2 for row in chosen_groups.tolist())
    with pytest.raises(ValueError, match=r"groups \(3\) must be an int >= 1 dividing num_experts \(16\)"):
        route(torch.randn(2, e), k, groups=3, top_groups=1)
    with pytest.raises(ValueError, match=r"top_k \(3\) must be <= top_groups · experts per group = 1 · 2"):
        route(torch.randn(2, e), k, groups=8, top_groups=1)
