"""QLoRA on routed experts (issue 42): a MoE layer's stacked experts held as a frozen NF4 / int8 base
(tpkernels.functional.grouped_quantized, tpkernels.models.moe_quant).

Oracles: bitsandbytes' quantize_4bit / dequantize_4bit of each expert's Hugging Face tensor (w1, w3, w2)
for the bytes and values; a float64 grouped GEMM over those dequantised values for the GEMM and its input
gradient; and for layouts, the one-process model of the same quantised base in float64.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tpkernels.functional.grouped_quantized import GroupedQuantizedWeight, grouped_quantized_gemm
from tpkernels.quant.nf4 import BLOCK

transformers = pytest.importorskip("transformers")

E, K, H, F = 5, 2, 24, 20  # odd expert count, top-2; H·F not a multiple of 64 per TP2 rank (short blocks)
MIXTRAL = dict(vocab_size=61, hidden_size=H, intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=K, max_position_embeddings=64, num_local_experts=E)


def _hf(seed: int, experts: int = E):
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**MIXTRAL, "num_local_experts": experts}))


@contextlib.contextmanager
def _eager():
    with torch._dynamo.config.patch(disable=True):  # bitsandbytes compiles its odd-shape dequantisation
        yield


def _bnb_values(w: torch.Tensor) -> torch.Tensor:
    bnbF = pytest.importorskip("bitsandbytes.functional")
    with _eager():
        packed, state = bnbF.quantize_4bit(w.contiguous(), blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
        return bnbF.dequantize_4bit(packed, state), packed.reshape(-1)


def _check_experts_are_bitsandbytes(moe, sd: dict, layer: int, tp_rank: int = 0, tp: int = 1) -> None:
    """Each local expert's pieces = bitsandbytes' bytes and values of its HF tensors' TP rectangles."""
    f = F // tp
    rows = slice(tp_rank * f, (tp_rank + 1) * f)
    first = moe.ctx.ep_rank * moe.num_local
    for j in range(moe.num_local):
        pre = f"model.layers.{layer}.block_sparse_moe.experts.{first + j}."
        gu, down = (moe.quantized[n].experts[j] for n in ("w_gate_up", "w_down"))
        want = [sd[pre + "w1.weight"][rows], sd[pre + "w3.weight"][rows], sd[pre + "w2.weight"][:, rows]]
        bnb = [_bnb_values(w) for w in want]
        for q, (_, packed) in zip(gu.pieces() + down.pieces(), bnb):
            assert torch.equal(q.packed, packed), f"expert {first + j}: packed codes differ from bitsandbytes'"
        deq = moe.quantized["w_gate_up"].dequantize()[j]
        assert torch.equal(deq.t(), torch.cat([bnb[0][0], bnb[1][0]]))
        assert torch.equal(moe.quantized["w_down"].dequantize()[j].t(), bnb[2][0])


def _hf_names(hf) -> dict:
    from tpkernels.models.hf_checkpoint import unfuse_experts

    return unfuse_experts({k: v.detach() for k, v in hf.state_dict().items()}, "mixtral")


def test_one_process_experts_hold_bitsandbytes_bytes_and_no_full_precision_copy(fresh_seed):
    """quant nf4 on a Mixtral: every expert's w1 / w3 / w2 quantised alone as bitsandbytes does (bytes and
    dequantised values); the stacked expert weights are meta stand-ins (no full-precision copy), and the
    model computes with exactly the dequantised values (logits = a full-precision model holding them)."""
    from tpkernels.models import ParallelTransformer

    hf = _hf(fresh_seed)
    sd = _hf_names(hf)
    q = ParallelTransformer.from_hf(hf, None, dtype=torch.float32, quant="nf4")
    moe = q.chunks[0].layers[1].mlp
    assert moe.w_gate_up.is_meta and moe.w_down.is_meta and not any("w_gate_up" in n for n, _ in q.named_parameters())
    _check_experts_are_bitsandbytes(moe, sd, 1)
    full = ParallelTransformer.from_hf(hf, None, dtype=torch.float32)
    full.load_hf_(q.to_hf_state_dict())  # the quantised model's values, dequantised
    ids = torch.randint(0, MIXTRAL["vocab_size"], (2, 9))
    torch.testing.assert_close(q(ids), full(ids), rtol=1e-5, atol=1e-6)
    # dequantize_ gives back frozen parameters holding the same values
    for slot in moe.quantized_weights().values():
        slot.dequantize_()
    assert moe.quantized is None and not moe.w_gate_up.requires_grad
    torch.testing.assert_close(moe.w_down, full.chunks[0].layers[1].mlp.w_down, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_grouped_quantized_gemm_equals_float64_on_the_dequantised_experts(fmt, fresh_seed):
    """Forward and input gradient of odd-sized groups with an empty expert = the float64 grouped GEMM on the
    dequantised experts; the weight gets no gradient."""
    g = torch.Generator().manual_seed(fresh_seed)
    counts = torch.tensor([3, 0, 7, 1])
    w = torch.randn(4, 21, 13, generator=g)  # (L, in, out)
    gq = GroupedQuantizedWeight(fmt, 4, (13, 21), torch.float32).load_(w, [6, 7] * 4)
    x = torch.randn(int(counts.sum()), 21, generator=g, requires_grad=True)
    y = grouped_quantized_gemm(x, gq, counts)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    wd = gq.dequantize(torch.float64)
    assert not torch.equal(wd, w.double())  # quantised: the oracle is the dequantised values, not w
    groups = torch.repeat_interleave(torch.arange(4), counts)
    want = torch.einsum("ni,nio->no", x.double(), wd[groups])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), torch.einsum("no,nio->ni", dy.double(), wd[groups]), rtol=1e-5,
                               atol=1e-5)


def test_bad_inputs_are_named():
    gq = GroupedQuantizedWeight("nf4", 2, (8, 6), torch.float32)
    with pytest.raises(RuntimeError, match="never loaded"):
        grouped_quantized_gemm(torch.zeros(3, 6), gq, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"stacked weight shape \(2, 8, 6\) must be \(num_experts, in, out\) = "):
        gq.load_(torch.zeros(2, 8, 6))
    with pytest.raises(ValueError, match=r"row_splits \[5, 5\] must cut each of the 2 experts' 8 rows"):
        gq.load_(torch.zeros(2, 6, 8), [5, 5])
    gq.load_(torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match=r"counts must be non-negative and sum to the rows of x \(3\), got \[1, 1\]"):
        grouped_quantized_gemm(torch.zeros(3, 6), gq, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"counts \(shape \(3,\) torch.int64\) must be a 1-D integer tensor of 2"):
        grouped_quantized_gemm(torch.zeros(3, 6), gq, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"x \(\(3, 5\)\) must be \(N, in\) with in = 6"):
        grouped_quantized_gemm(torch.zeros(3, 5), gq, torch.tensor([1, 2]))


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    """(folder of a tiny fp32 Mixtral with 4 experts, its tensors under the checkpoint's names)."""
    folder = tmp_path_factory.mktemp("qmixtral")
    hf = _hf(1234, experts=4)
    hf.save_pretrained(str(folder))
    return str(folder), _hf_names(hf)


def _layout_worker(rank, world, folder, sd, layout, ids):
    """A quantised (nf4) Mixtral at ``layout``, float64: bitsandbytes' bytes of this rank's rectangles, its
    logits, token loss, the gathered dequantised weights and every gradient (HF names, gathered)."""
    import torch.distributed as dist

    from model_checks import all_stages
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState

    state = ParallelState.create(ParallelConfig(**layout))
    pc = state.config
    model = ParallelTransformer.from_hf(folder, state, dtype=torch.float64, quant="nf4")
    for i in (0, 1):
        _check_experts_are_bitsandbytes(model.chunks[0].layers[i].mlp, sd, i, state.tp_rank, pc.tp)
    rows = slice(state.dp_rank * ids.shape[0] // pc.dp, (state.dp_rank + 1) * ids.shape[0] // pc.dp)
    logits = model(ids[rows]).detach()
    loss = model(ids[rows], target=next_token_targets(ids[rows]))  # this replica's token mean (equal counts)
    loss.backward()
    model.finish_grad_sync()
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (state.dp_rank, logits))
        logits = torch.cat([t for _, t in sorted({d: t for d, t in every}.items())])
    return dict(logits=logits, weights=all_stages(model.to_hf_state_dict()),
                grads=all_stages(model.to_hf_state_dict("grad")))


def test_quantised_experts_at_ep2_tp2_equal_one_process_on_their_dequantised_values(rank_pool, mixtral_folder,
                                                                                    fresh_seed):
    """EP2×TP2+SP (world 4) with an NF4 base (experts and TP linears): each rank's expert rectangles are
    bitsandbytes' bytes of that rectangle alone; logits and every gradient (router, norms, embedding, head:
    through the experts' input gradients) equal the one-process float64 model holding the layout's
    dequantised weights; the quantised weights get no gradient; an export's one-process rebuild of the TP2
    base (dequantize_as_trained_at_) gives the same expert values."""
    from tpkernels.models import ParallelTransformer, next_token_targets
    from tpkernels.parallel import ParallelConfig

    folder, sd = mixtral_folder
    layout = dict(tp=2, dp=2, ep=2, sequence_parallel=True)
    ids = torch.randint(0, MIXTRAL["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(fresh_seed))
    world = ParallelConfig(**layout).world_size
    got = rank_pool(world).run(_layout_worker, folder, sd, layout, ids, timeout=120)[0]
    ref = ParallelTransformer.from_hf(folder, None, dtype=torch.float64)
    ref.load_hf_(got["weights"])
    # what an export of a TP2 run rebuilds in one process: the same dequantised values, bit for bit
    from tpkernels.models.hf_io import dequantize_as_trained_at_

    rebuilt = ParallelTransformer(ref.config, None, init=None, dtype=torch.float64, quant="nf4")
    dequantize_as_trained_at_(rebuilt, folder, 2)
    rebuilt_sd = rebuilt.to_hf_state_dict()
    assert all(torch.equal(rebuilt_sd[n], got["weights"][n]) for n in got["weights"] if ".experts." in n)
    torch.testing.assert_close(got["logits"], ref(ids).detach(), rtol=1e-9, atol=1e-10)
    ref(ids, target=next_token_targets(ids)).backward()
    want = ref.to_hf_state_dict("grad")
    assert set(got["grads"]) == set(want)
    quantised = [n for n in want if ".experts." in n or "self_attn" in n]  # the NF4 base: the experts, attention
    assert quantised and all(not got["grads"][n].any() for n in quantised)
    for name in set(want) - set(quantised):
        torch.testing.assert_close(got["grads"][name], want[name], rtol=1e-7, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


# ---- tpkernels train: QLoRA SFT on a Mixtral (adapters on attention and every routed expert, NF4 base) ----

def _qlora_cfgs(folder, data, seed):
    from test_moe_train import _finetune_cfgs

    kw = _finetune_cfgs(folder, data, seed)["sft-lora"]
    return {**kw, "model.finetune": "qlora"}


def _qlora_run(cfg, ids) -> dict:
    """Train ``cfg``; the losses, aux losses, which expert adapters moved and the trained model's logits on ids."""
    from tpkernels.train import Trainer

    t = Trainer(cfg)
    hist = t.train()
    t.finish_saving()
    adapters = [bool(p.detach().abs().sum() > 0) for n, p in t.model.named_parameters() if ".mlp.lora.B_" in n]
    experts = [n for n, _ in t.model.named_parameters() if "w_gate_up" in n or "w_down" in n]
    with torch.no_grad():
        logits = t.model(ids)
    return {"loss": [h["loss"] for h in hist], "aux": [h["moe/aux_loss"] for h in hist], "logits": logits,
            "expert_adapters": adapters, "expert_params": experts}


def _qlora_worker(rank, world, folder, data, seed, ids):
    from test_moe_train import cfg_of

    return _qlora_run(cfg_of(folder, **_qlora_cfgs(folder, data, seed), **{
        "parallel.dp": 2, "parallel.ep": 2, "checkpoint.save_dir": str(data / "ckpt"), "checkpoint.save_every": 2}),
        ids)


def test_qlora_sft_at_ep2_trains_what_one_process_trains_and_exports_it(rank_pool, tmp_path, fresh_seed):
    """model.finetune qlora on a Mixtral: the experts (and attention) an NF4 base, adapters on attention and on
    every routed expert; at EP2 (each rank quantises its own experts: the same bytes as one process) the losses
    and aux losses of every step equal the one-process run's (float64), the expert adapters train, no
    full-precision expert parameter exists; export-hf of the EP2 checkpoint (the base dequantised as the run
    quantised it, adapters merged) loads in transformers' MixtralForCausalLM with the trained model's logits."""
    import json

    import transformers

    from test_moe_train import MIXTRAL as CFG, cfg_of
    from tpkernels.train import checkpoint

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**CFG, "num_local_experts": 4}))
    folder, seed = tmp_path / "m", fresh_seed % 2**31
    ids = torch.randint(0, CFG["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(seed))
    got = rank_pool(2).run(_qlora_worker, folder, tmp_path, seed, ids, timeout=300)[0]
    want = _qlora_run(cfg_of(folder, **{**_qlora_cfgs(folder, tmp_path, seed), "parallel.micro_batch_size": 2}), ids)
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=1e-9, atol=0)
    torch.testing.assert_close(torch.tensor(got["aux"]), torch.tensor(want["aux"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-7, atol=1e-9)
    assert got["expert_params"] == [] and got["expert_adapters"] == [True] * 4  # B_gu, B_d of 2 layers trained
    checkpoint.export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager",
                                                           attn_implementation="eager", dtype=torch.float64)
    # transformers routes in fp32 (a combine weight rounded there moves a logit by ~1e-8 relative to ours)
    torch.testing.assert_close(hf(input_ids=ids).logits, got["logits"], rtol=1e-5, atol=1e-6)


def test_adapters_off_turns_off_the_expert_adapters_too(fresh_seed):
    """DPO's reference 'adapters' (the base model): with trained (nonzero) adapters on attention and on the
    routed experts, adapters_off gives the base model's logits exactly, over a QLoRA base; after it the
    adapted logits come back."""
    from tpkernels.models import ParallelTransformer
    from tpkernels.models.lora import EXPERTS, TARGETS, apply_lora
    from tpkernels.train.dpo import adapters_off

    hf = _hf(fresh_seed)
    model = ParallelTransformer.from_hf(hf, None, dtype=torch.float64, quant="nf4")
    ids = torch.randint(0, MIXTRAL["vocab_size"], (2, 7))
    with torch.no_grad():
        base = model(ids)
        apply_lora(model, 4, 8.0, TARGETS + (EXPERTS,), seed=fresh_seed)
        for n, p in model.named_parameters():
            if ".lora." in n and (n.endswith("B") or "B_" in n):
                p.normal_(0.0, 0.3)
        adapted = model(ids)
        with adapters_off(model):
            off = model(ids)
        assert (adapted - base).abs().max() > 1e-3  # the expert and attention adapters move the logits
        torch.testing.assert_close(off, base, rtol=0, atol=1e-12)
        torch.testing.assert_close(model(ids), adapted, rtol=0, atol=0)
