"""FP8 for a MoE model's routed experts (issue 42, tpkernels.functional.grouped_fp8): the experts' grouped
GEMMs run through the FP8 scaled GEMM as two FP8 linears per MoE layer (``layers.<i>.experts.gate_up`` /
``.down``) of the model's one Fp8State, tensorwise delayed. Held to: the one-process fp8 run (EP2 on two
ranks: losses and the experts' amax histories), a resume at another EP size (the experts' FP8 state
restored by name: the resumed step and its histories equal the uninterrupted run's), and the bf16 run
(within the dense FP8 layouts' 5% band); what cannot run FP8 is named."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from test_moe_train import MIXTRAL, cfg_of
from tpkernels.train import Trainer

FP8 = {"training.precision": "fp8", "fp8.layers": "all", "fp8.recipe": "delayed", "fp8.learn": False,
       "training.steps": 3, "parallel.num_microbatches": 1}
EP2 = {"parallel.dp": 2, "parallel.ep": 2, "parallel.micro_batch_size": 1}
ONE = {"parallel.micro_batch_size": 2}  # the same global micro-batch on one process
NAMES = [f"layers.{i}.experts.{m}" for i in range(2) for m in ("gate_up", "down")]


@pytest.fixture(scope="module")
def mixtral16(tmp_path_factory):
    """A tiny Mixtral whose expert GEMMs FP8 takes (hidden 32, expert ffn 32: 16-multiples per rank)."""
    folder = tmp_path_factory.mktemp("mixtral16")
    (folder / "config.json").write_text(json.dumps({**MIXTRAL, "num_local_experts": 4, "intermediate_size": 32,
                                                    "torch_dtype": "bfloat16"}))
    return folder


def _run(cfg) -> tuple[list[float], dict[str, torch.Tensor], "Trainer"]:
    t = Trainer(cfg)
    losses = [h["loss"] for h in t.train()]
    st = t.fp8.state
    return losses, {n: st.history[st.index[n]].clone() for n in NAMES}, t


def _ep_worker(rank, world, folder, ckpt, seed):
    import shutil

    import torch.distributed as dist

    run = {**FP8, "training.seed": seed}
    full, hist, _ = _run(cfg_of(folder, **run, **EP2, **{"checkpoint.save_dir": str(ckpt / "a"),
                                                          "checkpoint.save_every": 2}))
    if rank == 0:
        shutil.copytree(ckpt / "a" / "step_00000002", ckpt / "b" / "step_00000002")
    dist.barrier()
    resumed, rhist, t = _run(cfg_of(folder, **run, **{"parallel.dp": 2, "parallel.micro_batch_size": 1,
                                                      "checkpoint.save_dir": str(ckpt / "b")}))  # EP1
    return full, hist, resumed, rhist, t.fp8.state.local


def test_ep2_fp8_equals_one_process_and_resumes_at_ep1(rank_pool, mixtral16, tmp_path, fresh_seed):
    seed = fresh_seed % 2**31
    full, hist, resumed, rhist, local = rank_pool(2).run(_ep_worker, mixtral16, tmp_path, seed, timeout=300)[0]
    assert set(NAMES) <= set(local)  # the experts ran FP8 on this rank
    one, one_hist, _ = _run(cfg_of(mixtral16, **{**FP8, **ONE, "training.seed": seed}))
    # the same tokens, weights and scales (step 0: the current amax of all the rows, agreed over EP; then the
    # world-reduced history): the runs part by bf16 rounding only (attention at micro-batch 1 and 2, the DP
    # all-reduce's summation order; measured within 2e-3)
    torch.testing.assert_close(torch.tensor(full), torch.tensor(one), rtol=5e-3, atol=0)
    for n in NAMES:
        assert (hist[n][:, -3:] > 0).all(), n  # three steps of every role recorded
        # step 0 (the same model, the same tokens): the weight's amax, the max over both EP ranks' experts, is
        # the one process's exactly; the input's, over all the rows, within one E4M3 step (2⁻³: a bf16 ulp of
        # the attention output can flip the FP8 rounding of gate_up's input, and so down's: measured 3%); the
        # output gradient's ~2× (a DP rank backpropagates dp × its share of the loss; measured 1.77-2.05×).
        # Later steps' amaxes follow the parted trajectories (a max over few rows), so only step 0 is held.
        w, one_w = hist[n][:, -3], one_hist[n][:, -3]
        assert w[1] == one_w[1], n
        torch.testing.assert_close(w[0], one_w[0], rtol=2.0 ** -3, atol=0, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(w[2], 2 * one_w[2], rtol=0.25, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    # resumed at EP1 from the EP2 step-2 checkpoint: the experts' histories restored by name, so step 2 casts
    # with the uninterrupted run's scales: its loss and the histories after it are the uninterrupted run's
    assert len(resumed) == 1
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[2:]), rtol=1e-6, atol=0)
    for n in NAMES:
        torch.testing.assert_close(rhist[n], hist[n], rtol=1e-6, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_fp8_experts_track_bf16(mixtral16, fresh_seed):
    """One process, 5 steps: fp8 (experts included) within 5% of bf16 step by step (the dense layouts' band)."""
    run = {**FP8, "training.steps": 5, "training.seed": fresh_seed % 2**31}
    fp8, hist, t = _run(cfg_of(mixtral16, **run))
    bf16 = [h["loss"] for h in Trainer(cfg_of(mixtral16, **{**run, "training.precision": "bf16"})).train()]
    assert "experts" in t.fp8.kinds and fp8 != bf16
    assert all((hist[n] > 0).any() for n in NAMES)
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=0.05, atol=0)


def test_experts_fp8_choice_and_refusals_are_named(mixtral16, tmp_path):
    t = Trainer(cfg_of(mixtral16, **{**FP8, "fp8.layers": "qkv,out", "training.steps": 1}))
    assert t.fp8.state.names == [f"layers.{i}.{k}" for i in range(2) for k in ("qkv", "out")]  # experts kept bf16
    assert "the routed experts stay bf16" in Trainer(cfg_of(mixtral16, **{**FP8, "fp8.layers": "auto"})).fp8.table()
    # a matrix moved back to bf16 (the guardrail's disable) casts nothing from then on; its sibling still does
    t = Trainer(cfg_of(mixtral16, **{**FP8, "training.steps": 1}))
    st = t.fp8.state
    st.disable("layers.0.experts.down")
    t.train()
    assert not st.history[st.index["layers.0.experts.down"]].any()
    assert (st.history[st.index["layers.0.experts.gate_up"]][:, -1] > 0).all()
    assert [m["layer"] for m in st.moved] == ["layers.0.experts.down"]
    with pytest.raises(ValueError, match=r"fp8.recipe rowwise .* the routed experts: their grouped GEMMs run tensorwise"):
        Trainer(cfg_of(mixtral16, **{**FP8, "fp8.recipe": "rowwise"}))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**MIXTRAL, "num_local_experts": 4, "intermediate_size": 24}))
    with pytest.raises(ValueError, match=r"layers.0.experts.gate_up: the experts' per-rank \(in, out\) = "
                                         r"\(32, 48\) must be multiples of 16 .*out 48|layers.0.experts.down"):
        Trainer(cfg_of(odd, **{**FP8, "fp8.layers": "experts"}))


def test_zero_bubble_defers_the_fp8_expert_weight_gradients_to_w(mixtral16, fresh_seed):
    """A forward inside split_weight_grads (a zb-h1 F) with FP8 experts: B leaves the experts' weights without
    a gradient and queues their FP8 dW products; W lands exactly the gradients of an ordinary backward."""
    from tpkernels.functional.weight_grad import WeightGradStore, defer_weight_grads, split_weight_grads
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.moe import MoE
    from tpkernels.quant.fp8_state import Fp8Recipe, Fp8State

    mc = cfg_of(mixtral16).model_config()
    ids = torch.randint(0, mc.vocab_size, (2, 11))

    def run(split: bool):
        model = ParallelTransformer(mc, None, seed=fresh_seed % 2**31, dtype=torch.bfloat16)
        state = Fp8State(Fp8Recipe("current"), NAMES)
        for m in model.modules():
            if isinstance(m, MoE):
                m.enable_fp8(state)
        store = WeightGradStore()
        with split_weight_grads(split):
            loss = model(ids, target=ids)
        with defer_weight_grads(store) if split else contextlib.nullcontext():  # B, or an ordinary backward
            loss.backward()
        in_b = {n: p.grad is not None for n, p in model.named_parameters() if "w_gate_up" in n or "w_down" in n}
        store.flush()
        assert (state.step_amax[:, 2] > 0).all()  # every expert matrix cast its output gradient: FP8 ran
        return in_b, {n: p.grad for n, p in model.named_parameters()}

    in_b, want = run(False)
    assert all(in_b.values())
    in_b, got = run(True)
    assert not any(in_b.values()) and len(in_b) == 4
    for k, g in want.items():
        assert torch.equal(got[k], g), k
