"""The planner for fine-tuning tasks: SFT costs what pre-training costs on the same tokens; DPO's
reference costs a forward-only pipeline pass, per step when online, once before training when cached;
a frozen reference model adds its 16-bit weights."""

from __future__ import annotations

import random

import pytest

from tpkernels.cli import main
from tpkernels.parallel import ParallelConfig
from tpkernels.planner import ClusterSpec, gpu_preset, model_preset
from tpkernels.planner.efficiency import A100_CALIBRATED
from tpkernels.planner.memory import stage_memory, stage_params_per_rank
from tpkernels.planner.step_time import step_time
from tpkernels.planner.workload import TrainingSetup

MODEL = model_preset("Llama-2-13B")
CLUSTER = ClusterSpec(gpu_preset("A100-80GB"), 8, 2)


def _layouts(rng):
    for _ in range(6):
        pp = rng.choice([1, 2, 4])
        v = rng.choice([1, 2]) if pp > 1 else 1
        m = pp * rng.randint(1, 4) * (v if v > 1 else 1)
        yield ParallelConfig(tp=rng.choice([1, 2, 4]), pp=pp, dp=1, virtual_stages=v, num_microbatches=m,
                             sequence_parallel=True, micro_batch_size=rng.choice([1, 2]))


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_sft_costs_what_pretraining_costs(fresh_seed, finetune):
    for cfg in _layouts(random.Random(fresh_seed)):
        base = TrainingSetup(cfg.num_microbatches * cfg.micro_batch_size, 2048, finetune=finetune)
        sft = base.replace(task="sft")
        assert step_time(MODEL, sft, cfg, CLUSTER, A100_CALIBRATED) == step_time(MODEL, base, cfg, CLUSTER,
                                                                                  A100_CALIBRATED)
        assert stage_memory(MODEL, sft, cfg, 0) == stage_memory(MODEL, base, cfg, 0)


def test_dpo_reference_costs_one_forward_pass(fresh_seed):
    for cfg in _layouts(random.Random(fresh_seed)):
        base = TrainingSetup(cfg.num_microbatches * cfg.micro_batch_size, 2048, finetune="lora")
        pre = step_time(MODEL, base, cfg, CLUSTER, A100_CALIBRATED)
        cached = step_time(MODEL, base.replace(task="dpo"), cfg, CLUSTER, A100_CALIBRATED)
        online = step_time(MODEL, base.replace(task="dpo", dpo_reference="adapters"), cfg, CLUSTER, A100_CALIBRATED)
        # cached: nothing per step; the pass before training is reported apart
        assert cached.total == pytest.approx(pre.total) and cached.reference == 0
        assert cached.reference_prepass > 0
        # online: the same forward-only pass inside every step
        assert online.reference == pytest.approx(cached.reference_prepass)
        assert online.total == pytest.approx(pre.total + online.reference)
        # forwards only: less than the step's compute (forward + backward), more than a third of a LoRA step's
        # GEMMs (LoRA's backward skips the base weight gradients)
        assert pre.compute / 3 < online.reference < pre.total


def test_frozen_reference_model_adds_its_weights():
    cfg = ParallelConfig(tp=2, pp=2, dp=1, num_microbatches=4)
    full = TrainingSetup(8, 2048, task="dpo")
    params = stage_params_per_rank(MODEL, cfg, 0)
    cached = stage_memory(MODEL, full, cfg, 0)
    frozen = stage_memory(MODEL, full.replace(dpo_reference="model"), cfg, 0)
    assert frozen.weights - cached.weights == pytest.approx(2.0 * params)
    assert frozen.activations == cached.activations and frozen.gradients == cached.gradients
    lora = TrainingSetup(8, 2048, finetune="lora", task="dpo")
    assert stage_memory(MODEL, lora.replace(dpo_reference="adapters"), cfg, 0) == stage_memory(MODEL, lora, cfg, 0)


def test_bad_task_settings_are_named():
    with pytest.raises(ValueError, match=r"task \('rlhf'\) must be one of pretrain, sft, dpo"):
        TrainingSetup(8, 2048, task="rlhf")
    with pytest.raises(ValueError, match=r"dpo_reference \('adapters'\) needs a LoRA fine-tune"):
        TrainingSetup(8, 2048, task="dpo", dpo_reference="adapters")


def test_cli_plans_dpo_and_names_bad_flags(capsys):
    base = ["plan", "--model", "Llama-2-13B", "--gpu", "A10-24GB", "--nodes", "4", "--model.finetune", "lora",
            "--global-batch", "64", "--seq-len", "2048", "--top", "2"]
    assert main(base + ["--training.task", "dpo", "--dpo.reference", "adapters"]) == 0
    out = capsys.readouterr().out
    assert "dpo (reference: adapters)" in out and "DPO reference (adapters): a forward-only pass each step" in out
    assert main(base + ["--task", "dpo"]) == 0
    assert "DPO reference (cached): one forward-only pass over the data before training" in capsys.readouterr().out
    assert main(base + ["--training.task", "sft"]) == 0
    assert ", sft" in capsys.readouterr().out
    assert main(["plan", "--model", "Llama-2-13B", "--gpu", "A10-24GB", "--training.task", "dpo",
                 "--dpo.reference", "adapters"]) == 2
    err = capsys.readouterr().err
    assert "dpo.reference (adapters) needs model.finetune lora" in err and "Traceback" not in err
    assert main(base + ["--training.task", "rlhf"]) == 2
    assert "rlhf" in capsys.readouterr().err
