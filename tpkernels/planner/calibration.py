"""Published training runs that state their layout and throughput, read into planner questions, and
the fit of the planner's shared constants to them.

The tables live in the repository, ``benchmarks/data/`` (one CSV per source, where each number
comes from in its header, the list in ``sources.md``): Narayanan et al. 2021 (A100, Megatron-LM),
NVIDIA NeMo 2024 and Megatron-Bridge performance summaries (H100), torchtitan's published runs
(H100, H200). They are not package data: an installed planner carries only the constants fitted on
them (``efficiency.py``). ``benchmarks/planner_calibration.py`` fits on all sources but one and
predicts the held-out one, for each in turn. ``benchmarks/data/held_out/`` holds runs kept out of every
fit (:func:`held_out_rows`): the mixture-of-experts rows, predicted with the constants the other
sources gave.

Every row is compared by step time: the published step = the row's tokens (or hardware FLOPs) per
step over its throughput; error = published step / predicted step − 1 (+ = the planner predicts a
faster run than was measured).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from tpkernels.description import ModelConfig, model_preset
from tpkernels.parallel import ParallelConfig
from tpkernels.planner.efficiency import Efficiency, calibrated_for
from tpkernels.planner.estimate import Estimate, estimate, layout_errors
from tpkernels.planner.hardware import ClusterSpec, gpu_preset
from tpkernels.planner.search import Plan, plan
from tpkernels.planner.workload import TrainingSetup

NARAYANAN = "narayanan2021"
PAPER_FIXED = dict(sequence_parallel=False, recompute="full", zero1=False)  # Narayanan et al. 2021
# The constants the calibration fits, shared by every GPU generation (each a share of that GPU's own
# peak or a byte count, so a value fitted on one generation is a prediction for another).
# elementwise_traffic is not among them: the published runs are GEMM-bound, so its value trades off
# against gemm's along a flat valley (fitted on the Hopper sources alone, 6.9 with gemm 0.68 and 8.0
# with gemm 0.706 gave the same objective within 0.1%) and the fit moved it to wherever the worst
# rows pulled it (7.96 without Narayanan's rows, 2.86 without the Hopper ones): it keeps its
# counted value (Efficiency.elementwise_traffic, 4 bytes per stored byte).
FITTED = ("gemm", "attention")
# Constants that move with a fitted one: FP8 GEMMs reach the same share of the FP8 peak as bf16 GEMMs
# of the bf16 peak (fitted apart on all sources they came out 0.704 and 0.689; tied, the bf16
# ceiling is also seen by the FP8-only sources, and held out, Narayanan's A100 rows go from 28% to 6%
# mean error).
TIED = {"gemm": ("gemm_fp8",)}
BOUNDS = {"gemm": (0.3, 0.95), "attention": (0.1, 0.95), "elementwise_traffic": (1.0, 16.0)}


def with_constant(eff: Efficiency, name: str, value: float) -> Efficiency:
    """``eff`` with the fitted constant ``name`` (and the constants TIED to it) set to ``value``."""
    return eff.replace(**{name: value, **{tied: value for tied in TIED.get(name, ())}})


@dataclass(frozen=True)
class Row:
    """One published run: the model, the cluster, the layout and software, and what it measured."""

    source: str  # the source's name (its CSV's stem)
    label: str
    spec: ModelConfig
    gpu: str
    gpus: int
    config: ParallelConfig
    training: TrainingSetup
    published_step_s: float
    published_tflops_per_gpu: float  # as the source reports it (its own FLOP count); 0 when it gives none
    fixed: tuple = ()  # (name, value) of the software choices the source fixes, for search()

    @property
    def model(self) -> str:
        return self.label

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(gpu_preset(self.gpu), gpus_per_node=8, nodes=self.gpus // 8)

    @property
    def generation(self) -> str:
        return gpu_preset(self.gpu).generation

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    def layout(self) -> str:
        c = self.config
        return f"TP{c.tp}" + (f" CP{c.cp}" if c.cp > 1 else "") + f" PP{c.pp}" + \
            (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "") + f" DP{c.dp}" + \
            (f" EP{c.ep}" if c.ep > 1 else "") + f" mbs{c.micro_batch_size}"


def _read(path: Path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def narayanan_rows(path: Path) -> list[Row]:
    """Narayanan et al. 2021, Table 1 (Megatron-LM GPT runs on A100-80GB): fp16, attention without
    FlashAttention, full activation recompute, no SP, no distributed optimizer, DP gradient
    all-reduce after the backward. The table counts hardware FLOPs: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    rows = []
    for r in _read(path):
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
        rows.append(Row(path.stem, f"GPT-{r['model']}@{gpus}", spec, "A100-80GB", gpus, cfg, train,
                        flops / (tflops * 1e12 * gpus), tflops,
                        tuple({**PAPER_FIXED, "micro_batch_size": mbs}.items())))
    return rows


def table_rows_of(path: Path) -> list[Row]:
    """Rows of a table in the common format (``source,table,model,layers,…,tokens_per_sec_per_gpu``):
    the model's shape, the GPU, the layout and the software (precision, recompute, full/LoRA,
    whether TP communication overlaps the GEMMs, the data-parallel reduction's dtype). SP whenever
    TP > 1; ZeRO-1 with overlapped gradient reduction and parameter gather whenever there is data
    parallelism (Megatron's distributed optimizer; FSDP's per-layer gathers hide the same way on
    NVLink); overlapped P2P."""
    rows = []
    for r in _read(path):
        n = {k: int(r[k]) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gpus", "global_batch",
                                    "micro_batch", "seq_length", "tp", "pp", "cp", "virtual_stages")}
        # mixture-of-experts tables add: head_dim, experts, top_k, expert_ffn, shared_ffn, ep, dispatcher, moe_chunks
        moe = {k: int(r[k]) for k in ("head_dim", "experts", "top_k", "expert_ffn", "shared_ffn", "ep", "moe_chunks")
               if r.get(k)}
        experts = {}
        if moe.get("experts"):
            experts = dict(num_experts=moe["experts"], experts_per_token=moe["top_k"],
                           moe_ffn_hidden_size=moe["expert_ffn"], shared_expert_ffn_hidden_size=moe.get("shared_ffn", 0))
        # the sources' shapes as their FLOPs count them: no biases, rotary, RMSNorm-sized norms
        kind = "mixtral" if experts else "llama" if r["mlp"] == "swiglu" else "gpt2"
        spec = ModelConfig(kind, n["layers"], n["hidden"], n["heads"],
                           n["ffn"], n["vocab"], num_kv_heads=n["kv_heads"], head_dim=moe.get("head_dim"),
                           activation="swiglu" if r["mlp"] == "swiglu" else "gelu_tanh",
                           max_position_embeddings=n["seq_length"], name=r["model"], **experts)
        dp = n["gpus"] // (n["tp"] * n["pp"] * n["cp"])
        # "op": torchtitan's per-op selective checkpointing (TrainingSetup.selective_policy)
        recompute, policy = (("selective", "every_other_matmul") if r["recompute"] == "op"
                             else (r["recompute"], "attention"))
        cfg = ParallelConfig(tp=n["tp"], pp=n["pp"], dp=dp, virtual_stages=n["virtual_stages"],
                             micro_batch_size=n["micro_batch"],
                             num_microbatches=n["global_batch"] // (n["micro_batch"] * dp),
                             sequence_parallel=n["tp"] > 1, recompute=recompute, zero1=dp * n["cp"] > 1,
                             cp=n["cp"], overlap_comm=r["tp_overlap"] in ("1", "async_tp"), ep=moe.get("ep", 1),
                             moe_chunks=moe.get("moe_chunks", 1))
        train = TrainingSetup(n["global_batch"], n["seq_length"], precision=r["precision"], finetune=r["finetune"],
                              overlap_grad_reduce=True, overlap_param_gather=True, overlap_p2p=True,
                              grad_reduce_fp32=r["grad_reduce"] == "fp32",
                              selective_policy=policy,
                              tp_overlap_style="async_tp" if r["tp_overlap"] == "async_tp" else "userbuffers",
                              kernels=r.get("kernels") or "fused",
                              moe_dispatch="dedup" if r.get("dispatcher") in ("hybridep", "deepep") else "alltoall")
        step = n["global_batch"] * n["seq_length"] / (float(r["tokens_per_sec_per_gpu"]) * n["gpus"])
        tflops = float(r["model_tflops_per_gpu"]) if r.get("model_tflops_per_gpu") else 0.0
        label = f"{r['model']}@{n['gpus']} {r['table']}"
        rows.append(Row(r["source"], label, spec, r["gpu"], n["gpus"], cfg, train, step, tflops,
                        (("recompute", recompute), ("micro_batch_size", n["micro_batch"]))))
    return rows


def sources(directory: Path) -> dict[str, list[Row]]:
    """Every source's rows in ``directory`` (a source checkout's ``benchmarks/data``: the tables are not
    package data, the planner ships only the constants fitted on them), by source name (the CSV's
    stem), in file-name order."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"calibration data ({directory}) must be a folder of published tables (*.csv), "
                                "as a source checkout's benchmarks/data")
    out = {}
    for path in sorted(Path(directory).glob("*.csv")):
        out[path.stem] = narayanan_rows(path) if path.stem == NARAYANAN else table_rows_of(path)
    if not out:
        raise FileNotFoundError(f"no calibration tables (*.csv) in {directory}")
    return out


HELD_OUT = "held_out"


def held_out_rows(directory: Path) -> list[Row]:
    """Published runs kept out of every fit (``directory``/held_out/*.csv, the common table format): the
    planner predicts them with the constants fitted on :func:`sources`, and nothing is ever fitted on
    them (the mixture-of-experts runs: docs/planner.md, "Mixture of experts")."""
    folder = Path(directory) / HELD_OUT
    return [r for path in sorted(folder.glob("*.csv")) for r in table_rows_of(path)] if folder.is_dir() else []


def all_rows(directory: Path | None = None) -> list[Row]:
    return [r for rows in sources(directory).values() for r in rows]


def predict(row: Row, eff: Efficiency | None = None) -> Estimate:
    errs = layout_errors(row.spec, row.training, row.cluster, row.config)
    if errs:
        raise ValueError(f"published layout of {row.label} rejected: {errs}")
    return estimate(row.spec, row.training, row.cluster, row.config, eff or calibrated_for(row.cluster.gpu))


def error(row: Row, eff: Efficiency | None = None) -> float:
    """published step / predicted step − 1: + when the planner is optimistic."""
    return row.published_step_s / predict(row, eff).step_time - 1.0


def loss(groups: list[list[Row]], eff: Efficiency) -> float:
    """The fit's objective: the mean over sources of each source's root-mean-square log error (every
    source weighs the same, however many rows it has)."""
    per = [math.sqrt(sum(math.log1p(error(r, eff)) ** 2 for r in rows) / len(rows)) for rows in groups if rows]
    return sum(per) / len(per)


def fit_constants(groups: list[list[Row]], start: Efficiency, names: tuple = FITTED) -> Efficiency:
    """The constants ``names`` (with those TIED to them) that minimise :func:`loss` on ``groups`` (one
    list of rows per source): a coordinate search in multiplicative steps from 20% down to 0.5%,
    inside BOUNDS, from ``start`` (its tied constants first set to their leader's value)."""
    for name in names:
        start = with_constant(start, name, getattr(start, name))
    eff, best = start, loss(groups, start)
    for step in (0.2, 0.1, 0.05, 0.02, 0.01, 0.005):
        improved = True
        while improved:
            improved = False
            for name in names:
                lo, hi = BOUNDS[name]
                for f in (1 + step, 1 / (1 + step)):
                    value = min(hi, max(lo, getattr(eff, name) * f))
                    trial = with_constant(eff, name, value)
                    value_loss = loss(groups, trial)
                    if value_loss < best - 1e-9:
                        eff, best, improved = trial, value_loss, True
    return eff


def search(row: Row, eff: Efficiency | None = None) -> Plan:
    """The planner's ranking for the row's model, GPU count and batch, under the software choices the
    source fixes (Narayanan et al.: no SP, full recompute, no ZeRO; others: their recompute) and its
    micro-batch size."""
    return plan(row.spec, row.training, row.cluster, eff, fixed=dict(row.fixed))


def rank_of_published(row: Row, p: Plan) -> int | None:
    for i, e in enumerate(p.ranked, 1):
        if (e.config.tp, e.config.pp) == (row.tp, row.pp):
            return i
    return None
