"""Published training runs that state their layout and throughput: what the planner's constants are
fitted on, and how each row is turned into a planner question.

Tables are package data, ``tpkernels/planner/data/`` (with their sources in each file's header):
  A100  ``megatron_narayanan2021_table1.csv``: Narayanan et al. 2021, Table 1 (Megatron-LM GPT runs
        on A100-80GB): fp16, attention without FlashAttention, full activation recompute, no
        sequence parallelism (it came a year later), no distributed optimizer, DP gradient
        all-reduce after the backward; DGX A100 nodes (8 GPUs on NVLink, one 200 Gb/s HDR NIC
        each). The table counts hardware FLOPs: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
  H100  ``nemo_24.12_h100_pretrain.csv``: NVIDIA NeMo 24.12 pre-training on DGX-H100 (FP8 linear
        GEMMs, bf16 attention, SP with TP overlap, distributed optimizer with overlapped
        gradient reduction and parameter gather, overlapped P2P, no recompute). Tokens per second per GPU.

Every row is compared by step time: the published step = the row's tokens (or hardware FLOPs) per
step over its throughput; error = published step / predicted step − 1 (+ = the planner predicts a
faster run than was measured).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tpkernels.parallel import ParallelConfig
from tpkernels.planner.efficiency import Efficiency, calibrated_for
from tpkernels.planner.estimate import Estimate, estimate, layout_errors
from tpkernels.planner.hardware import ClusterSpec, gpu_preset
from tpkernels.description import ModelConfig, model_preset
from tpkernels.planner.search import Plan, plan
from tpkernels.planner.workload import TrainingSetup

A100_TABLE = "megatron_narayanan2021_table1.csv"
H100_TABLE = "nemo_24.12_h100_pretrain.csv"
HELD_OUT_TABLE = "h100_held_out.csv"
PAPER_FIXED = dict(sequence_parallel=False, recompute="full", zero1=False)  # Narayanan et al. 2021


@dataclass(frozen=True)
class Row:
    """One published run: the model, the cluster, the layout and software, and what it measured."""

    source: str  # table file
    label: str
    spec: ModelConfig
    gpu: str
    gpus: int
    config: ParallelConfig
    training: TrainingSetup
    published_step_s: float
    published_tflops_per_gpu: float  # as the source reports it (its own FLOP count)
    fixed: tuple = ()  # (name, value) of the software choices the source fixes, for search()

    @property
    def model(self) -> str:
        return self.label

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(gpu_preset(self.gpu), gpus_per_node=8, nodes=self.gpus // 8)

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    def layout(self) -> str:
        c = self.config
        return f"TP{c.tp}" + (f" CP{c.cp}" if c.cp > 1 else "") + f" PP{c.pp}" + \
            (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "") + f" DP{c.dp} mbs{c.micro_batch_size}"


def _read(name: str, data_dir: Path | None = None) -> list[dict]:
    """A table's rows: from ``data_dir`` if given, else the package's own copy (installed with it)."""
    text = (data_dir / name).read_text() if data_dir is not None else \
        resources.files("tpkernels.planner").joinpath("data", name).read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def a100_rows(data_dir: Path | None = None) -> list[Row]:
    rows = []
    for r in _read(A100_TABLE, data_dir):
        # the published runs trained with dropout 0.1: its masks are part of their activation memory
        spec = model_preset(f"GPT-{r['model']}").replace(dropout=0.1, dropout_source="hidden_dropout")
        tp, pp, v, gpus = int(r["tp"]), int(r["pp"]), int(r["virtual_stages"]), int(r["gpus"])
        gbs, mbs = int(r["global_batch"]), int(r["micro_batch"])
        dp = gpus // (tp * pp)
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, virtual_stages=v, micro_batch_size=mbs,
                             num_microbatches=gbs // (mbs * dp), **PAPER_FIXED)
        train = TrainingSetup(gbs, 2048, precision="fp16", flash_attention=False, overlap_grad_reduce=False)
        l, h, s, V = spec.num_layers, spec.hidden_size, 2048, spec.vocab_size
        flops = 96 * gbs * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        tflops = float(r["tflops_per_gpu"])
        rows.append(Row(A100_TABLE, r["model"], spec, "A100-80GB", gpus, cfg, train,
                        flops / (tflops * 1e12 * gpus), tflops,
                        tuple({**PAPER_FIXED, "micro_batch_size": mbs}.items())))
    return rows


def h100_rows(data_dir: Path | None = None) -> list[Row]:
    """The rows the H100 constants were fitted on (no context parallelism)."""
    return [r for r in _h100_table(data_dir) if r.config.cp == 1]


def held_out_rows(data_dir: Path | None = None) -> list[Row]:
    """Published H100 rows kept out of the fit: NeMo's with context parallelism (CP2 at 8k), added after
    the planner modelled CP, and ``h100_held_out.csv`` (Megatron-Bridge 25.11, torchtitan's bf16 and
    TP8 runs), added after the constants were fixed; their error is what a new run can expect."""
    return [r for r in _h100_table(data_dir) if r.config.cp > 1] + _h100_table(data_dir, HELD_OUT_TABLE)


def _h100_table(data_dir: Path | None = None, table: str = H100_TABLE) -> list[Row]:
    """Rows of a NeMo-style H100 table; ``precision`` and ``recompute`` columns, where a table has
    them, override NeMo's FP8 without recompute."""
    rows = []
    for r in _read(table, data_dir):
        n = {k: int(r[k]) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gpus", "global_batch",
                                    "micro_batch", "seq_length", "tp", "pp", "cp", "virtual_stages")}
        # NeMo's shapes as the table's FLOPs count them: no biases, rotary, RMSNorm-sized norms
        spec = ModelConfig("llama" if r["mlp"] == "swiglu" else "gpt2", n["layers"], n["hidden"], n["heads"],
                           n["ffn"], n["vocab"], num_kv_heads=n["kv_heads"],
                           activation="swiglu" if r["mlp"] == "swiglu" else "gelu_tanh",
                           max_position_embeddings=n["seq_length"], name=r["model"])
        dp = n["gpus"] // (n["tp"] * n["pp"] * n["cp"])
        recompute, precision = r.get("recompute") or "none", r.get("precision") or "fp8"
        cfg = ParallelConfig(tp=n["tp"], pp=n["pp"], dp=dp, virtual_stages=n["virtual_stages"],
                             micro_batch_size=n["micro_batch"],
                             num_microbatches=n["global_batch"] // (n["micro_batch"] * dp),
                             sequence_parallel=n["tp"] > 1,
                             recompute=recompute, zero1=dp * n["cp"] > 1, cp=n["cp"])
        train = TrainingSetup(n["global_batch"], n["seq_length"], precision=precision, overlap_grad_reduce=True,
                              overlap_param_gather=True, overlap_p2p=True)
        tokens_per_gpu = float(r["tokens_per_sec_per_gpu"])
        step = n["global_batch"] * n["seq_length"] / (tokens_per_gpu * n["gpus"])
        # published model TFLOP/s where the table gives them, else 6·N + attention per token (Megatron's count)
        tflops = (float(r["model_tflops_per_gpu"]) if r.get("model_tflops_per_gpu") else
                  spec.model_flops_per_step(n["global_batch"], n["seq_length"]) / step / n["gpus"] / 1e12)
        label = f"{r['model']}@{n['gpus']}" + (f" ({r['source']})" if r.get("source") else "")
        rows.append(Row(table, label, spec, "H100-SXM", n["gpus"], cfg, train, step, tflops,
                        (("recompute", recompute), ("micro_batch_size", n["micro_batch"]))))
    return rows


def table_rows(data_dir: Path | None = None) -> list[Row]:
    """Every calibration row, A100 first."""
    return a100_rows(data_dir) + h100_rows(data_dir)


def predict(row: Row, eff: Efficiency | None = None) -> Estimate:
    errs = layout_errors(row.spec, row.training, row.cluster, row.config)
    if errs:
        raise ValueError(f"published layout of {row.label} rejected: {errs}")
    return estimate(row.spec, row.training, row.cluster, row.config, eff or calibrated_for(row.cluster.gpu))


def error(row: Row, eff: Efficiency | None = None) -> float:
    """published step / predicted step − 1: + when the planner is optimistic."""
    return row.published_step_s / predict(row, eff).step_time - 1.0


def search(row: Row, eff: Efficiency | None = None) -> Plan:
    """The planner's ranking for the row's model, GPU count and batch, under the software choices the
    source fixes (Narayanan et al.: no SP, full recompute, no ZeRO; NeMo: no recompute) and its
    micro-batch size."""
    return plan(row.spec, row.training, row.cluster, eff, fixed=dict(row.fixed))


def rank_of_published(row: Row, p: Plan) -> int | None:
    for i, e in enumerate(p.ranked, 1):
        if (e.config.tp, e.config.pp) == (row.tp, row.pp):
            return i
    return None
