"""Narayanan et al. 2021, Table 1 (Megatron-LM GPT runs on A100-80GB): the planner's check against
published throughput.

Each row fixes what the paper's system used: fp16, attention without FlashAttention, full
activation recompute, no sequence parallelism (it came a year later), no distributed optimizer,
the table's micro-batch size, and DGX A100 nodes (8 GPUs on NVLink, one 200 Gb/s HDR NIC each).
The table counts hardware FLOPs (recompute included): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.efficiency import A100_CALIBRATED, Efficiency
from tpkernels.planner.estimate import Estimate, estimate, layout_errors
from tpkernels.planner.hardware import ClusterSpec, gpu_preset
from tpkernels.planner.models import ModelSpec, model_preset
from tpkernels.planner.search import Plan, plan
from tpkernels.planner.workload import TrainingSetup

TABLE = "megatron_narayanan2021_table1.csv"
PAPER_FIXED = dict(sequence_parallel=False, recompute="full", zero1=False)


@dataclass(frozen=True)
class Row:
    model: str
    tp: int
    pp: int
    virtual_stages: int
    gpus: int
    global_batch: int
    micro_batch: int
    tflops_per_gpu: float

    @property
    def spec(self) -> ModelSpec:
        return model_preset(f"GPT-{self.model}")

    @property
    def config(self) -> ParallelConfig:
        dp = self.gpus // (self.tp * self.pp)
        return ParallelConfig(self.tp, self.pp, dp, self.virtual_stages, self.micro_batch,
                              self.global_batch // (self.micro_batch * dp), **PAPER_FIXED)

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(gpu_preset("A100-80GB"), gpus_per_node=8, nodes=self.gpus // 8)

    @property
    def training(self) -> TrainingSetup:
        return TrainingSetup(self.global_batch, 2048, precision="fp16", flash_attention=False)


def table_rows() -> list[Row]:
    text = resources.files("tpkernels.planner").joinpath("data", TABLE).read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return [Row(r["model"], int(r["tp"]), int(r["pp"]), int(r["virtual_stages"]), int(r["gpus"]),
                int(r["global_batch"]), int(r["micro_batch"]), float(r["tflops_per_gpu"]))
            for r in csv.DictReader(lines)]


def predict(row: Row, eff: Efficiency = A100_CALIBRATED) -> Estimate:
    errs = layout_errors(row.spec, row.training, row.cluster, row.config)
    if errs:
        raise ValueError(f"published layout of GPT-{row.model} rejected: {errs}")
    return estimate(row.spec, row.training, row.cluster, row.config, eff)


def search(row: Row, eff: Efficiency = A100_CALIBRATED) -> Plan:
    """The planner's ranking for the row's model, GPU count and batch, under the paper's fixed choices."""
    return plan(row.spec, row.training, row.cluster, eff, fixed={**PAPER_FIXED, "micro_batch_size": row.micro_batch})


def rank_of_published(row: Row, p: Plan) -> int | None:
    for i, e in enumerate(p.ranked, 1):
        if (e.config.tp, e.config.pp) == (row.tp, row.pp):
            return i
    return None
