"""The planner for QLoRA: the decoder layers' linear weights cost NF4's ≈ 0.516 (int8's 1 + a scale per
row) bytes per parameter and the rest 2; adapters as for LoRA; the dequantising GEMMs run at
QLORA_GEMM_EFFICIENCY of a bf16 GEMM when compute-bound and read a quarter of the weight bytes."""

from __future__ import annotations

import argparse

import pytest

from tpkernels.cli import main
from tpkernels.description import ModelConfig, model_preset
from tpkernels.parallel import ParallelConfig
from tpkernels.planner import ClusterSpec, gpu_preset
from tpkernels.planner.cli import add_parser, load
from tpkernels.planner.efficiency import calibrated_for
from tpkernels.planner.estimate import estimate
from tpkernels.planner.gemm_model import linear_time
from tpkernels.planner.memory import GIB, NF4_BYTES_PER_PARAM, stage_memory
from tpkernels.planner.search import plan
from tpkernels.planner.step_time import QLORA_GEMM_EFFICIENCY, _linear_shapes, step_time
from tpkernels.planner.workload import TrainingSetup
from tpkernels.quant import nf4_bytes_per_param

# 4 layers, h 256, 8 heads, 2 KV heads (head 32), SwiGLU ffn 688, vocab 1000
SMALL = ModelConfig("llama", 4, 256, 8, 688, 1000, num_kv_heads=2)
L13 = model_preset("Llama-2-13B")
A10x32 = ClusterSpec(gpu_preset("A10-24GB"), 8, 4)


def test_nf4_bytes_match_the_quantiser():
    assert NF4_BYTES_PER_PARAM == pytest.approx(nf4_bytes_per_param(), rel=1e-12)
    assert 0.5158 < NF4_BYTES_PER_PARAM < 0.5160


def test_small_model_weights_by_hand():
    """TP2 PP2, stage 0: 2 layers of linears quantised, norms and the embedding at 2 bytes, adapters at 2."""
    cfg = ParallelConfig(tp=2, pp=2, dp=1, num_microbatches=2)
    linears = 2 * (256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 688) / 2  # q, k, v, o, gate/up/down; /tp
    sixteen_bit = 2 * 2 * 256 + 1024 * 256 / 2  # two norms per layer (replicated), vocab padded to 1024, /tp
    adapters = 2 * 16 * (2 * 512 + 2 * (256 + 64) + 2 * (256 + 688) + (688 + 256)) / 2
    rows = 2 * (256 / 2 + 2 * 64 / 2 + 2 * 688 / 2 + 256 + 256)  # int8: q, k, v, gate, up split; o, down all h
    lora = stage_memory(SMALL, TrainingSetup(8, 128, finetune="lora"), cfg, 0)
    nf4 = stage_memory(SMALL, TrainingSetup(8, 128, finetune="qlora"), cfg, 0)
    int8 = stage_memory(SMALL, TrainingSetup(8, 128, finetune="qlora", quant="int8"), cfg, 0)
    assert lora.weights == pytest.approx(2 * (linears + sixteen_bit + adapters))
    assert nf4.weights == pytest.approx(0.5 * linears + linears / 64 + linears / 4096 + 2 * sixteen_bit + 2 * adapters)
    assert int8.weights == pytest.approx(linears + 4 * rows + 2 * sixteen_bit + 2 * adapters)
    # the adapters train alike: gradients and optimizer states do not change
    for q in (nf4, int8):
        assert (q.gradients, q.optimizer, q.activations) == (lora.gradients, lora.optimizer, lora.activations)
        assert q.gradients == pytest.approx(4 * adapters)


def test_small_model_kv_replicated_past_the_kv_heads():
    """TP4 > 2 KV heads: each rank keeps one whole K and V head (32 rows of 256), quantised too."""
    cfg = ParallelConfig(tp=4, pp=1, dp=1, num_microbatches=1)
    per_layer = 256 * 64 + 2 * 256 * 32 + 64 * 256 + 3 * 256 * 172  # q, k, v (one head each), o, gate/up/down
    lora = stage_memory(SMALL, TrainingSetup(8, 128, finetune="lora"), cfg, 0)
    nf4 = stage_memory(SMALL, TrainingSetup(8, 128, finetune="qlora"), cfg, 0)
    assert lora.weights - nf4.weights == pytest.approx(4 * per_layer * (2 - nf4_bytes_per_param()))


def test_llama_13b_base_bytes_by_hand():
    """TP2 PP4: stage 0 holds 10 layers and the embedding, the last stage 10 layers, the final norm and the head."""
    cfg = ParallelConfig(tp=2, pp=4, dp=4, num_microbatches=128, sequence_parallel=True, zero1=True)
    linears = 10 * (4 * 5120 * 5120 + 3 * 5120 * 13824) / 2
    norms = 10 * 2 * 5120
    vocab = 32000 * 5120 / 2  # 32000 is already a multiple of 128 · 2
    train = TrainingSetup(512, 4096, finetune="qlora")
    lora = TrainingSetup(512, 4096, finetune="lora")
    first, last = stage_memory(L13, train, cfg, 0), stage_memory(L13, train, cfg, 3)
    first_l, last_l = stage_memory(L13, lora, cfg, 0), stage_memory(L13, lora, cfg, 3)
    adapters = first_l.gradients / 4
    assert first.weights == pytest.approx(0.51587 * linears + 2 * (norms + vocab) + 2 * adapters, rel=1e-5)
    assert last.weights == pytest.approx(0.51587 * linears + 2 * (norms + 5120 + vocab) + 2 * adapters, rel=1e-5)
    # QLoRA saves exactly (2 − 0.516) bytes on each quantised weight: 2.19 GiB per GPU here, nothing else moves
    saved = (2 - NF4_BYTES_PER_PARAM) * linears
    assert saved / GIB == pytest.approx(2.19, abs=0.01)
    assert first_l.total - first.total == pytest.approx(saved)
    assert last_l.total - last.total == pytest.approx(saved)


def test_dequantising_gemm_cost():
    gpu, eff = gpu_preset("A10-24GB"), calibrated_for(gpu_preset("A10-24GB"))
    launch = eff.gemm_launch_s
    # large M: compute-bound, 1 / 0.8 of the bf16 GEMM on the forward and the input gradient, no weight gradient
    bf = linear_time(4096, 5120, 6912, gpu, eff, weight_grad=False)
    q = linear_time(4096, 5120, 6912, gpu, eff, weight_grad=False, weight_bytes=NF4_BYTES_PER_PARAM,
                    compute_scale=QLORA_GEMM_EFFICIENCY)
    for a, b in zip(q[:2], bf[:2]):
        assert (a - launch) / (b - launch) == pytest.approx(1 / 0.8)
    assert q[2] == bf[2] == 0.0
    # small M on a wide weight (TP1's gate/up, 5120 × 27648): bf16 is memory-bound, and NF4 reads ~3.9× fewer
    # weight bytes; the dequantising GEMM is then bounded by its own (slower) compute
    bw = gpu.hbm_gbs * 1e9 * eff.hbm
    bf = linear_time(16, 5120, 27648, gpu, eff, weight_grad=False)
    q = linear_time(16, 5120, 27648, gpu, eff, weight_grad=False, weight_bytes=NF4_BYTES_PER_PARAM,
                    compute_scale=QLORA_GEMM_EFFICIENCY)
    assert bf[0] == pytest.approx(2 * (16 * 5120 + 5120 * 27648 + 16 * 27648) / bw + launch)
    assert (16 * 5120 * 2 + 5120 * 27648 * NF4_BYTES_PER_PARAM + 16 * 27648 * 2) / bw + launch <= q[0] < 0.5 * bf[0]
    # its input gradient (k = 27648, 40 output tiles on 72 SMs) is compute-bound at bf16 already: 1 / 0.8
    assert (q[1] - launch) / (bf[1] - launch) == pytest.approx(1 / 0.8)


def test_qlora_step_pays_the_dequant_on_the_linears_only():
    cfg = ParallelConfig(tp=2, pp=4, dp=4, num_microbatches=128, sequence_parallel=True, zero1=True)
    eff = calibrated_for(A10x32.gpu)
    lora = step_time(L13, TrainingSetup(512, 4096, finetune="lora"), cfg, A10x32, eff)
    qlora = step_time(L13, TrainingSetup(512, 4096, finetune="qlora"), cfg, A10x32, eff)
    assert qlora.total > lora.total
    # the linears' forward + input gradient, 10 layers × 128 micro-batches of 4096 tokens, at bf16
    lin = sum(sum(linear_time(4096, k, n, A10x32.gpu, eff, weight_grad=False)[:2]) - 2 * eff.gemm_launch_s
              for k, n in _linear_shapes(L13, 2))
    assert qlora.gemm - lora.gemm == pytest.approx(10 * 128 * lin * (1 / QLORA_GEMM_EFFICIENCY - 1), rel=1e-6)
    assert (qlora.elementwise, qlora.dp_comm, qlora.optimizer) == (lora.elementwise, lora.dp_comm, lora.optimizer)
    # the same useful work: MFU counts no weight gradient for either
    a = estimate(L13, TrainingSetup(512, 4096, finetune="qlora"), A10x32, cfg, eff)
    b = estimate(L13, TrainingSetup(512, 4096, finetune="lora"), A10x32, cfg, eff)
    assert a.model_flops == b.model_flops and a.mfu < b.mfu


def test_fp8_training_runs_the_dequantising_gemms_in_bf16():
    """The kernels dequantise to the activations' dtype: FP8 speeds nothing up there (the head stays bf16 too)."""
    h100 = ClusterSpec(gpu_preset("H100-SXM"), 8, 1)
    cfg = ParallelConfig(tp=2, pp=1, dp=4, num_microbatches=4, sequence_parallel=True)
    eff = calibrated_for(h100.gpu)
    fp8 = step_time(L13, TrainingSetup(16, 4096, precision="fp8", finetune="qlora"), cfg, h100, eff)
    bf16 = step_time(L13, TrainingSetup(16, 4096, finetune="qlora"), cfg, h100, eff)
    lora8 = step_time(L13, TrainingSetup(16, 4096, precision="fp8", finetune="lora"), cfg, h100, eff)
    assert fp8.gemm == pytest.approx(bf16.gemm) and lora8.gemm < 0.8 * fp8.gemm


@pytest.mark.parametrize("cfg", [
    # one GPU holds the whole 13B: 26 GB of bf16 weights do not fit 22.5 GiB, 6.8 GB of NF4 do
    ParallelConfig(tp=1, pp=1, dp=32, micro_batch_size=2, num_microbatches=8, recompute="full", zero1=True),
    # TP2 without recompute: 2.2 GiB of base weights saved make room for the activations
    ParallelConfig(tp=2, pp=1, dp=16, micro_batch_size=1, num_microbatches=32, sequence_parallel=True, zero1=True),
], ids=["TP1-PP1-DP32", "TP2-PP1-DP16-no-recompute"])
def test_13b_on_32_a10_fits_only_with_qlora(cfg):
    eff = calibrated_for(A10x32.gpu)
    q = estimate(L13, TrainingSetup(512, 4096, finetune="qlora"), A10x32, cfg, eff)
    lo = estimate(L13, TrainingSetup(512, 4096, finetune="lora"), A10x32, cfg, eff)
    assert q.fits and not lo.fits, (q.memory.total / GIB, lo.memory.total / GIB)


def test_13b_plan_finds_layouts_lora_cannot_fit():
    q = plan(L13, TrainingSetup(512, 4096, finetune="qlora"), A10x32)
    lo = plan(L13, TrainingSetup(512, 4096, finetune="lora"), A10x32)
    layouts = lambda p: {(e.config.tp, e.config.pp, e.config.dp) for e in p.ranked}  # noqa: E731
    assert (1, 1, 32) in layouts(q) and (1, 1, 32) not in layouts(lo)
    assert layouts(lo) < layouts(q)  # every LoRA layout also fits QLoRA
    assert q.best.config.recompute == "none" and q.best.memory.total / GIB < 22.5 * 0.9


def test_cli_plans_qlora(capsys):
    base = ["plan", "--model", "Llama-2-13B", "--gpu", "A10-24GB", "--nodes", "4", "--model.finetune", "qlora",
            "--top", "2"]
    assert main(base) == 0
    assert "bf16, adam, QLoRA nf4 r=16" in capsys.readouterr().out
    assert main(base + ["--model.quant", "int8"]) == 0
    assert "QLoRA int8 r=16" in capsys.readouterr().out
    assert main(base + ["--training.task", "dpo", "--dpo.reference", "adapters"]) == 0
    assert "DPO reference (adapters)" in capsys.readouterr().out


def test_quant_without_qlora_is_refused(capsys):
    args = ["plan", "--model", "Llama-2-13B", "--gpu", "A10-24GB", "--model.finetune", "lora", "--model.quant", "nf4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.quant ('nf4') needs model.finetune qlora (now 'lora')" in err and "Traceback" not in err
    assert main(args[:-4] + ["--model.quant", "int8"]) == 2  # full fine-tune
    assert "model.quant ('int8') needs model.finetune qlora (now 'full')" in capsys.readouterr().err
    # the ValueError the CLI turns into that line, from the plan config's checks
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    with pytest.raises(ValueError, match=r"model\.quant \('nf4'\) needs model\.finetune qlora"):
        load(ap.parse_args(args))
    with pytest.raises(ValueError, match=r"quant \('nf4'\) needs finetune 'qlora' \(finetune is 'full'\)"):
        TrainingSetup(8, 2048, quant="nf4")
    with pytest.raises(ValueError, match=r"quant \('fp4'\) must be one of nf4, int8"):
        TrainingSetup(8, 2048, finetune="qlora", quant="fp4")
    assert TrainingSetup(8, 2048, finetune="qlora").quant == "nf4"
    assert TrainingSetup(8, 2048, finetune="lora", quant="none").quant is None
