"""Expert-parallel dispatch/combine (``tpkernels.functional.moe_dispatch``) on gloo at world 1–4: outputs,
input gradients and expert-weight gradients against a one-process float64 reference, chunks 1/2/3 bit for
bit equal to each other (the expert MLP is row-wise), skewed routing, empty experts, a rank that sends
nothing, receive buffers poisoned with NaN; the overlap by construction (order of the traced events);
bad inputs named on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from tpkernels.functional.gemm_comm import poison_receive_buffers
from tpkernels.functional.moe_dispatch import dispatch_combine
from tpkernels.parallel.trace import CommTrace
from tpkernels.testing.errors import error_messages

H, F, H_OUT = 6, 5, 3


def expert_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A per-expert MLP written with index ops (no loop over experts): rows grouped by expert per
    ``counts`` (len(w1) entries); row i uses w1[e], w2[e] of its expert e. Row-wise: one (1, H) GEMM per row."""
    e = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts.to(x.device),
                                output_size=x.shape[0])
    h = torch.tanh(torch.bmm(x[:, None], w1[e])[:, 0])
    return torch.bmm(h[:, None], w2[e])[:, 0]


def _routing(g: torch.Generator, world: int, E: int, case: str) -> list[torch.Tensor]:
    """Per-rank counts (E,) for ``case``: "skewed" (expert 0 takes most rows, two experts empty),
    "silent" (the last rank sends nothing; an expert empty), "uniform", "empty" (no rank sends a row)."""
    out = []
    for r in range(world):
        n = int(torch.randint(5, 30, (1,), generator=g)) | 1  # odd: never a multiple of 2 chunks
        if (case == "silent" and r == world - 1) or case == "empty":
            n = 0
        p = torch.rand(E, generator=g, dtype=torch.float64) + 0.1
        major = 0
        if case == "skewed":  # expert 0 takes 80% of the rows, experts 1 and 2 none
            major = n - n // 5
            p[0] = 0.0
            if E > 3:
                p[1:3] = 0.0
        elif case == "silent":
            p[-1] = 0.0
        rest = n - major
        idx = torch.multinomial(p, rest, replacement=True, generator=g) if rest else torch.zeros(0, dtype=torch.int64)
        c = torch.bincount(idx, minlength=E)
        c[0] += major
        out.append(c)
    return out


def _reference(xs, counts, g_outs, w1, w2):
    """Every rank's rows through one process in float64: (outputs, x grads, w1 grad, w2 grad) of
    Σ_r <y_r, g_r>."""
    xs = [x.clone().requires_grad_() for x in xs]
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ys = [expert_mlp(x, c, w1, w2) for x, c in zip(xs, counts)]
    sum((y * go).sum() for y, go in zip(ys, g_outs)).backward()
    return [y.detach() for y in ys], [x.grad for x in xs], w1.grad, w2.grad


def _case_worker(rank, world, seed, cases):
    group = dist.group.WORLD if world > 1 else None
    g = torch.Generator().manual_seed(seed)  # the same draws on every rank: each can build the reference
    report = []
    for case, L in cases:
        E = world * L
        counts = _routing(g, world, E, case)
        xs = [torch.randn(int(c.sum()), H, generator=g, dtype=torch.float64) for c in counts]
        g_outs = [torch.randn(x.shape[0], H_OUT, generator=g, dtype=torch.float64) for x in xs]
        w1 = torch.randn(E, H, F, generator=g, dtype=torch.float64)
        w2 = torch.randn(E, F, H_OUT, generator=g, dtype=torch.float64)
        ref_y, ref_dx, ref_dw1, ref_dw2 = _reference(xs, counts, g_outs, w1, w2)
        mine = slice(rank * L, (rank + 1) * L)
        results = {}
        for chunks in (1, 2, 3):
            x = xs[rank].clone().requires_grad_()
            lw1, lw2 = w1[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
            with poison_receive_buffers():
                y = dispatch_combine(x, counts[rank], lambda rows, lc: expert_mlp(rows, lc, lw1, lw2), group,
                                     num_local_experts=L, chunks=chunks)
                (y * g_outs[rank]).sum().backward()
            assert y.shape == (x.shape[0], H_OUT) and y.dtype == torch.float64
            what = f"{case} L={L} chunks={chunks} rank {rank}"
            torch.testing.assert_close(y, ref_y[rank], rtol=1e-12, atol=1e-12, msg=f"y: {what}")
            torch.testing.assert_close(x.grad, ref_dx[rank], rtol=1e-12, atol=1e-12, msg=f"dx: {what}")
            # the expert weights' gradients sum rows of every rank: reduction order differs by chunk
            torch.testing.assert_close(lw1.grad, ref_dw1[mine], rtol=1e-11, atol=1e-11, msg=f"dw1: {what}")
            torch.testing.assert_close(lw2.grad, ref_dw2[mine], rtol=1e-11, atol=1e-11, msg=f"dw2: {what}")
            results[chunks] = (y.detach(), x.grad)
        for chunks in (2, 3):  # row-wise expert_fn: every chunking computes each row the same way
            assert torch.equal(results[chunks][0], results[1][0]), f"y differs at chunks={chunks} ({case})"
            assert torch.equal(results[chunks][1], results[1][1]), f"dx differs at chunks={chunks} ({case})"
        report.append((case, L, [int(c) for c in counts[rank]]))
    return report


CASES = [("skewed", 3), ("silent", 2), ("uniform", 1), ("empty", 2)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dispatch_combine_matches_one_process(rank_pool, fresh_seed, world):
    reports = rank_pool(world).run(_case_worker, fresh_seed, CASES)
    # the cases are what they say: expert 0 takes most rows, the last rank of "silent" sends nothing
    skewed = [r[0][2] for r in reports]
    assert all(c[0] > sum(c) / 2 for c in skewed)
    if world > 1:
        assert sum(reports[-1][1][2]) == 0


def _autograd_worker(rank, world, seed):
    """What a model does besides ``.backward()`` with leaf weights: no grad mode, ``torch.autograd.grad``,
    strided rows, weights read through a cast made outside expert_fn (a non-leaf shared by the chunks),
    explicit params, an input that needs no gradient, activation recompute, 16-bit rows with float32
    expert-weight gradient sums."""
    group, L = dist.group.WORLD, 2
    g = torch.Generator().manual_seed(seed)
    E = world * L
    counts = _routing(g, world, E, "skewed")
    xs = [torch.randn(int(c.sum()), H, generator=g, dtype=torch.float64) for c in counts]
    g_outs = [torch.randn(x.shape[0], H_OUT, generator=g, dtype=torch.float64) for x in xs]
    w1 = torch.randn(E, H, F, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, F, H_OUT, generator=g, dtype=torch.float64)
    ref_y, ref_dx, ref_dw1, ref_dw2 = _reference(xs, counts, g_outs, w1, w2)
    mine = slice(rank * L, (rank + 1) * L)
    x, go = xs[rank], g_outs[rank]
    tol = dict(rtol=1e-11, atol=1e-11)
    lw1, lw2 = w1[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
    fn = lambda rows, lc: expert_mlp(rows, lc, lw1, lw2)  # noqa: E731

    with torch.no_grad():  # inference: no graph anywhere
        y = dispatch_combine(x, counts[rank], fn, group, num_local_experts=L, chunks=2)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, ref_y[rank], **tol)

    xr = x.t().contiguous().t().requires_grad_()  # strided rows (a transposed buffer), as a view might come
    y = dispatch_combine(xr, counts[rank], fn, group, num_local_experts=L, chunks=1)
    torch.testing.assert_close(y, ref_y[rank], **tol)
    y = dispatch_combine(xr, counts[rank], fn, group, num_local_experts=L, chunks=3)
    dx, dw2 = torch.autograd.grad(y, [xr, lw2], go)  # returned, not accumulated; lw1 not asked for
    torch.testing.assert_close(dx, ref_dx[rank], **tol)
    torch.testing.assert_close(dw2, ref_dw2[mine], **tol)
    assert lw1.grad is None and lw2.grad is None

    # the weights cast outside expert_fn (as a model casting for its compute dtype would): a non-leaf
    # shared by every chunk; the input needs no gradient
    a1, a2 = lw1 * 1.0, lw2 * 1.0
    y = dispatch_combine(x, counts[rank], lambda rows, lc: expert_mlp(rows, lc, a1, a2), group,
                         num_local_experts=L, chunks=3)
    (y * go).sum().backward()
    torch.testing.assert_close(lw1.grad, ref_dw1[mine], **tol)
    torch.testing.assert_close(lw2.grad, ref_dw2[mine], **tol)

    # a cast weight given in params (differentiated through once, by the outer graph); lw2, not given, is
    # found: both get their gradient once (twice would double it)
    lw1.grad = lw2.grad = None
    c1 = 2.0 * lw1 - lw1  # equal to lw1 in float64, and its gradient passes 2 - 1 = 1 times
    y = dispatch_combine(x, counts[rank], lambda rows, lc: expert_mlp(rows, lc, c1, lw2), group,
                         num_local_experts=L, chunks=2, params=[c1])
    (y * go).sum().backward()
    torch.testing.assert_close(lw1.grad, ref_dw1[mine], **tol)
    torch.testing.assert_close(lw2.grad, ref_dw2[mine], **tol)

    # activation recompute (torch.utils.checkpoint, as the trainer's recompute): the backward runs the
    # forward's transfers again, on every rank in the same order
    lw1.grad = lw2.grad = None
    xr = x.clone().requires_grad_()
    y = torch.utils.checkpoint.checkpoint(
        lambda t: dispatch_combine(t, counts[rank], fn, group, num_local_experts=L, chunks=3), xr, use_reentrant=False)
    (y * go).sum().backward()
    torch.testing.assert_close(xr.grad, ref_dx[rank], **tol)
    torch.testing.assert_close(lw1.grad, ref_dw1[mine], **tol)

    # bfloat16 rows and weights: gradients of the weights summed over chunks in float32, returned in bfloat16
    b1, b2 = (w[mine].to(torch.bfloat16).requires_grad_() for w in (w1, w2))
    xb = x.to(torch.bfloat16).requires_grad_()
    y = dispatch_combine(xb, counts[rank], lambda rows, lc: expert_mlp(rows, lc, b1, b2), group,
                         num_local_experts=L, chunks=3)
    (y.float() * go.float()).sum().backward()
    assert y.dtype == xb.grad.dtype == b1.grad.dtype == torch.bfloat16
    # relative to the largest gradient of any expert (this rank's may all be empty experts: exact zeros)
    err = float((b1.grad.double() - ref_dw1[mine]).abs().max() / ref_dw1.abs().max())
    assert err < 0.05, err  # bf16 inputs, weights and products: a few bf16 ulps, not a wrong gradient
    return True


@pytest.mark.parametrize("world", [3])
def test_autograd_uses(rank_pool, fresh_seed, world):
    assert rank_pool(world).run(_autograd_worker, fresh_seed) == [True] * world


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_every_chunk_holds_a_slice_of_every_destination(fresh_seed, chunks):
    """The cut rule both sides apply: chunk c takes rows [c·n//C, (c+1)·n//C) of each peer's block; the
    per-expert counts of the chunks add up to the block's, and each chunk holds 1/C of every peer's rows
    (±1), whatever the skew or the empty experts."""
    from tpkernels.functional.moe_dispatch import _cut  # noqa: PLC0415

    g = torch.Generator().manual_seed(fresh_seed)
    per_expert = torch.randint(0, 9, (4, 5), generator=g) * torch.randint(0, 2, (4, 5), generator=g)
    per_expert[0] = 0  # a peer that sends nothing
    per_expert[1, 2] = 50  # one expert takes most rows
    rows, counts = _cut(per_expert, chunks)
    assert torch.equal(counts.sum(0), per_expert) and torch.equal(counts.sum(2), rows)
    n = per_expert.sum(1)
    assert ((rows - n / chunks).abs() < 1).all()
    # chunk c's rows of a peer are the next ones after chunk c-1's: expert by expert, in order
    flat = [torch.repeat_interleave(torch.arange(5), counts[c, p]) for p in range(4) for c in range(chunks)]
    for p in range(4):
        got = torch.cat(flat[p * chunks:(p + 1) * chunks])
        assert torch.equal(got, torch.repeat_interleave(torch.arange(5), per_expert[p]))


def test_compiled_models_do_not_trace_into_the_op():
    """torch.compile traced into the EP path fails (measured: AOT autograd's alias check on the received
    rows); the op is a graph break instead, and an expert_fn compiled on its own still compiles. Checked
    at one rank (compiling on gloo ranks costs about 10 s here): expert_fn never runs under the tracer, whether
    the op's first call is eager or compiled (the graph-break wrapper is made on the first call, so that importing
    tpkernels does not import torch._dynamo)."""
    traced = []

    def expert_fn(rows, local_counts):
        traced.append(torch.compiler.is_compiling())
        return rows * 3

    def f(x, counts):
        return dispatch_combine(x, counts, expert_fn, None, num_local_experts=2) + 1

    x, counts = torch.randn(5, H), torch.tensor([2, 3])
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager")
    for _ in range(2):
        assert torch.equal(compiled(x, counts), x * 3 + 1)
    assert traced == [False, False]


def _overlap_worker(rank, world, chunks):
    g = torch.Generator().manual_seed(100 + rank)
    L = 2
    counts = torch.tensor([7, 0, 12, 5, 3, 9][:world * L])
    x = torch.randn(int(counts.sum()), H, generator=g, requires_grad=True)
    w1 = torch.randn(L, H, F, generator=g, requires_grad=True)
    w2 = torch.randn(L, F, H_OUT, generator=g, requires_grad=True)
    with CommTrace() as tr:
        y = dispatch_combine(x, counts, lambda rows, lc: expert_mlp(rows, lc, w1, w2), dist.group.WORLD,
                             num_local_experts=L, chunks=chunks)
        y.sum().backward()

    def starts(name, cat):
        spans = sorted((s for s in tr.spans if s.name == name and s.cat == cat), key=lambda s: s.args["chunk"])
        assert [s.args["chunk"] for s in spans] == list(range(chunks)), name
        return [s.start for s in spans], [s.end for s in spans]

    out = {}
    for phase, comm, ret, fn in (("forward", "moe dispatch all_to_all", "moe dispatch return all_to_all",
                                  "moe expert_fn"),
                                 ("backward", "moe grad all_to_all", "moe grad return all_to_all",
                                  "moe expert_fn backward")):
        (post, arrived), (ret_post, _) = starts(comm, "comm"), starts(ret, "comm")
        run, ran = starts(fn, "gemm")
        out[phase] = {
            # chunk i+1's transfer was posted before expert_fn (or its backward) of chunk i started
            "next_posted_first": all(post[i + 1] < run[i] for i in range(chunks - 1)),
            # ... and was still travelling after chunk i's own transfer was complete
            "own_arrived_first": all(arrived[i] <= run[i] for i in range(chunks)),
            # chunk i's return trip was posted before chunk i+1 computed
            "return_posted_before_next": all(ret_post[i] < run[i + 1] for i in range(chunks - 1)),
            "return_after_own": all(ran[i] <= ret_post[i] for i in range(chunks)),
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_next_chunk_is_in_flight_while_expert_fn_runs(rank_pool, world):
    for per_rank in rank_pool(world).run(_overlap_worker, 3):
        for phase, facts in per_rank.items():
            assert all(facts.values()), (phase, facts)


def _errors_worker(rank, world):
    L = 2
    fn = lambda rows, lc: rows  # noqa: E731
    lonely = dist.new_group([0])  # every rank must create it; rank 1 is not a member
    good = torch.tensor([1, 2] * world)
    msgs = error_messages([
        # rank 0 alone passes counts that do not sum to its rows: every rank raises, naming rank 0
        lambda: dispatch_combine(torch.randn(3 + 4 * (rank == 0), 4) if rank == 0 else torch.randn(3 * world, 4),
                                 good, fn, dist.group.WORLD, num_local_experts=L),
        lambda: dispatch_combine(torch.randn(3 * world, 4), good, fn, dist.group.WORLD, num_local_experts=3),
        lambda: dispatch_combine(torch.randn(3 * world, 4), good, fn, dist.group.WORLD, num_local_experts=L,
                                 chunks=0),
        lambda: dispatch_combine(torch.randn(3 * world, 4), good.float(), fn, dist.group.WORLD, num_local_experts=L),
        lambda: dispatch_combine(torch.randn(3 * world, 4), good, lambda r, c: r[:1], dist.group.WORLD,
                                 num_local_experts=L),
        lambda: dispatch_combine(torch.randn(5, 4), torch.tensor([2, 2]), fn, None, num_local_experts=2),
        lambda: dispatch_combine(torch.randn(3 * world, 4), [1, 2] * world, fn, dist.group.WORLD, num_local_experts=L),
        lambda: dispatch_combine(torch.randn(3 * world), good, fn, dist.group.WORLD, num_local_experts=L),
    ])
    if rank == 1:
        msgs += error_messages([lambda: dispatch_combine(torch.randn(3, 4), torch.tensor([1, 2]), fn, lonely,
                                                         num_local_experts=2)])
    return msgs


def test_bad_inputs_are_named_on_every_rank(rank_pool):
    world = 2
    out = rank_pool(world).run(_errors_worker, timeout=60)
    for rank, msgs in enumerate(out):
        assert msgs[0].startswith("dispatch_combine: rank 0 of the expert-parallel group passed invalid counts: "
                                  "counts must sum to the number of rows of x_sorted"), msgs[0]
        assert ("here: counts [1, 2, 1, 2] sum to 6, x_sorted has 7 rows" in msgs[0]) == (rank == 0), msgs[0]
        assert msgs[1] == ("num_local_experts (3) × the expert-parallel group size (2) must equal len(counts) (4): "
                           "counts has one entry per global expert, and each rank of the group holds "
                           "num_local_experts of them")
        assert msgs[2] == "chunks (0) must be a positive int"
        assert msgs[3].startswith("counts must be a 1-D integer tensor (rows per expert), got shape (4,) torch.float32")
        assert msgs[4].startswith("expert_fn must return (M, H_out) for its M = ")
        assert msgs[5] == ("counts must be non-negative and sum to the number of rows of x_sorted (5), got counts "
                           "summing to 4: [2, 2]")
        assert msgs[6] == "counts must be a 1-D integer tensor (rows per expert), got a list"
        assert msgs[7] == "x_sorted must be an (N, H) tensor, got shape (6,)"
    assert out[1][8].startswith("rank 1 is not a member of the given process group (its global ranks: [0])")
