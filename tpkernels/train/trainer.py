"""The training loop: ``Trainer(cfg).train()``; ``tpkernels train`` calls it.

    cfg = TrainConfig.from_values({"model.name": "Llama-2-7B", "model.layers": 4, "model.hidden": 256,
                                   "parallel.tp": 2, "parallel.pp": 2, "training.steps": 50})
    history = Trainer(cfg).train()  # [{"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s"}, ...]

One step: this replica's rows of the global batch through ``model.step`` (the pipeline schedule
over ``num_microbatches`` micro-batches), the DP average (:class:`DataParallelGradReduce`,
overlapped with the backward by default), ``finish_grad_sync`` (SP, replicated KV, tied
embeddings), the global gradient norm and clipping, AdamW, the next learning rate.

The loss is the sum of the token losses over the global batch divided by the global count of
targets (those not ``IGNORE_INDEX``), counted on the host from the batch before the step: the
micro-batch size, their number, DP, CP and PP never change the objective, its gradients, the
norm or the clipping (Megatron's per-token loss; torchtitan's global token normalisation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tpkernels.models import ParallelTransformer
from tpkernels.models.grad_sync import DataParallelGradReduce
from tpkernels.models.lora import EXPERTS as LORA_EXPERTS, TARGETS as LORA_TARGETS, apply_lora
from tpkernels.parallel import control
from tpkernels.parallel.param_tags import tag_of
from tpkernels.parallel.state import ParallelState
from tpkernels.pipeline.schedules import PipelineFillWarning
from tpkernels.train import checkpoint, dpo
from tpkernels.train.config import TrainConfig
from tpkernels.functional.context_parallel import zigzag_split
from tpkernels.options import flatten
from tpkernels.train.eval_samples import EvalSamples
from tpkernels.train.output_paths import check_output_paths
from tpkernels.train.data import IGNORE_INDEX, data_of, held_out, make_data
from tpkernels.train.failures import (
    RankLostError,
    abort_process_groups,
    dead_and_blocked,
    lost_ranks,
    register_rank,
)
from tpkernels.parallel.trace import CommTrace
from tpkernels.train.slowdown import SlowdownMonitor
from tpkernels.train.metrics import (
    COMM_WARN,
    MetricsFile,
    comm_advice,
    exposed_comm_s,
    step_phases,
    idle_share,
    peak_flops,
    step_trace_events,
    write_trace,
)
from tpkernels.train.moe_bias import ExpertBias
from tpkernels.train.moe_objective import RouterObjective
from tpkernels.train.optim import clip_grads_, global_grad_norm, lr_at, make_optimizer
from tpkernels.train.progress import make_progress
from tpkernels.train.run_length import epochs_line, resolve_epochs
from tpkernels.train.fp8_policy import Fp8Policy
from tpkernels.train.precision import DTYPES, FULL, MixedPrecision


RANK0_ONLY_KEYS = ("logging.metrics_file", "logging.progress", "logging.tensorboard_dir")
# The layout warnings (ParallelConfig.warnings) this process has printed: each is said once, by the logging
# rank, even when a run builds several trainers at one layout (autotune's trial, then its winner).
_SAID: set[str] = set()


@dataclasses.dataclass
class StepBatch:
    """One step's inputs on this rank, on the host: ids, positions and targets (rows, seq) of its DP
    replica's rows (its zigzag share under CP), and the count of targets over the global batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    target: torch.Tensor | dict  # dpo: {"target": ..., "doc": each position's sequence}
    num_targets: int  # dpo: the step's pairs
    pairs: "dpo.PairInfo | None" = None  # dpo: the step's pairs (doc: this DP replica's rows, before CP)


@dataclasses.dataclass
class StepRecord:
    """What a step reports (the history entry, a line of the metrics file)."""

    step: int
    loss: float  # the token mean over the global batch
    lr: float
    grad_norm: float  # nan when the step was skipped
    step_s: float
    tokens_per_s: float
    skipped: bool  # fp16: inf/NaN gradients on some rank
    mfu: float
    comm_ratio: float  # exposed TP/CP comm over compute: the worst rank's on logging steps, this rank's else
    bubble: float
    phases: dict
    loss_scale: float | None = None  # fp16 only
    preference: dict | None = None  # dpo, on logging steps: TRL's metrics (rewards/chosen, ...), means over pairs

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.loss_scale is None:
            del out["loss_scale"]
        del out["preference"]
        out.update(self.preference or {})
        return out


def _is_expert(p: torch.Tensor) -> bool:
    """A MoE layer's routed-expert parameter (different on each EP rank: tpkernels.parallel.param_tags)."""
    t = tag_of(p)
    return t is not None and getattr(t, "expert_parallel", False)


def dp_rows(rows: int, dp: int, dp_rank: int, num_microbatches: int) -> torch.Tensor:
    """The rows of a global batch of ``rows`` that DP replica ``dp_rank`` of ``dp`` trains: the
    ``dp_rank``-th share of each of the ``num_microbatches`` global micro-batches (consecutive row
    blocks), so that global micro-batch i is the same rows whatever ``dp`` is."""
    m = num_microbatches if rows % (num_microbatches * dp) == 0 else 1
    mbs = rows // (m * dp)
    return (torch.arange(m)[:, None] * (dp * mbs) + dp_rank * mbs + torch.arange(mbs)[None, :]).reshape(-1)


def agree_on_config(cfg: TrainConfig) -> None:
    """Every rank must train the same config (a rank launched with other flags would diverge without a
    word, or hang in a collective of another shape): one exchange at start, the same error on every
    rank naming the first keys that differ."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    # what only rank 0 reads may differ (each node its own metrics path)
    mine = {k: v for k, v in flatten(cfg.to_dict()).items() if k not in RANK0_ONLY_KEYS}
    every = control.all_gather_objects(mine)
    for r, other in enumerate(every):
        diffs = [f"{k} ({every[0].get(k)!r} on rank 0, {other.get(k)!r} on rank {r})"
                 for k in sorted(set(every[0]) | set(other)) if every[0].get(k) != other.get(k)]
        if diffs:
            raise ValueError(f"ranks disagree on the training config: {'; '.join(diffs[:4])}; every rank must be "
                             "given the same config and flags")


class Trainer:
    """Builds the layout, the model, the optimizer and the data of ``cfg`` (collective: every rank)."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device | None = None, resume_dir: str | Path | None = None):
        """``resume_dir``: start from the latest complete checkpoint there instead of ``checkpoint.save_dir``'s
        (the autotune trial phase hands its state on this way; saves still go to ``save_dir``)."""
        self.cfg = cfg.check()
        agree_on_config(cfg)
        check_output_paths(cfg)  # every rank sees the same storage: the same verdict
        self.mc = cfg.model_config()
        seq = cfg.data.seq_length
        # validated as written (dp none: what the world leaves), then resolved for the world
        self.state = ParallelState.create(cfg.parallel, key_prefix="parallel.", **self.mc.layout_rules(seq))
        self.pc = self.state.config
        register_rank()
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        dtype = DTYPES[cfg.training.precision]
        self.model = self.build_model()
        ms, opt = cfg.model, cfg.optimizer
        # a MoE model's routed experts get adapters too (one pair per expert, split over TP and EP like them)
        targets = LORA_TARGETS + ((LORA_EXPERTS,) if self.mc.num_experts else ())
        self.lora_layers = apply_lora(self.model, ms.lora_rank, ms.lora_alpha, targets, seed=cfg.training.seed) \
            if ms.adapters else []
        self.fp8 = Fp8Policy(self) if cfg.training.precision == "fp8" else None
        self.mp = MixedPrecision(self.model, dtype, init_scale=cfg.training.initial_loss_scale) \
            if dtype not in FULL else None
        params = self.mp.masters if self.mp else list(self.model.parameters())
        self.master_of = self.mp.master_of if self.mp else {}
        # a MoE model's routed experts at ep > 1 differ over the EP ranks of the DP × CP group: reduced (and
        # ZeRO-sharded) over their expert-data-parallel group instead (tpkernels.models.grad_sync)
        experts = [p for p in self.model.parameters() if _is_expert(p)] if self.pc.ep > 1 else []
        self.optimizer = make_optimizer(params, opt.lr, opt.weight_decay, (opt.beta1, opt.beta2), opt.adam_eps,
                                        zero1_group=self.state.dp_cp_group if self.pc.zero1 else None,
                                        experts={id(self.master_of.get(id(p), p)) for p in experts},
                                        expert_zero1_group=self.state.edp_group)
        # registered after MixedPrecision's hooks: it sees the fp32 main_grad already accumulated
        # CP ranks hold replicas of the weights like DP ranks: their gradients are averaged over both
        replicas = self.pc.dp * self.pc.cp
        expert_ids = {id(p) for p in experts}
        dense = [p for p in self.model.parameters() if id(p) not in expert_ids]
        self.dp_reduce = DataParallelGradReduce(dense, self.state.dp_cp_group, self.pc.bucket_mb,
                                                overlap=self.pc.overlap_dp) if replicas > 1 else None
        # an expert's gradient sums the tokens its EP group sent it: summed over the other EP groups' copies and
        # divided by dp · cp, it is the replicas' average like every other gradient
        self.edp_reduce = DataParallelGradReduce(experts, self.state.edp_group, self.pc.bucket_mb,
                                                 overlap=self.pc.overlap_dp, average_over=replicas) \
            if experts else None
        self.router = self._router_objective()
        rate = cfg.training.moe_expert_bias_rate  # aux-loss-free balancing: its biases are run state
        self.expert_bias = ExpertBias(self.model, rate) if self.router is not None and rate > 0 else None
        self.data = data_of(cfg, self.mc.vocab_size, self.pc.global_batch_size)
        epochs = cfg.training.epochs
        if epochs is not None:  # the run's length in passes over the data: now that the data's rows are known
            self.cfg = cfg = resolve_epochs(cfg, self.data, self.pc.global_batch_size)
        said = epochs_line(cfg, self.data, self.pc.global_batch_size, epochs)
        if said:
            self._say_once(said)
        self.task = cfg.training.task if cfg.training.task != "auto" else getattr(self.data, "task", None) or "pretrain"
        if self.task == "dpo" and cfg.dpo.reference == "adapters" and not cfg.model.adapters:  # implied dpo
            raise ValueError(f"dpo.reference (adapters) needs model.finetune lora or qlora (now "
                             f"{cfg.model.finetune!r}: there are no adapters to turn off); use dpo.reference cached or "
                             "model")
        self.objective = dpo.make_objective(self) if self.task == "dpo" else None
        with warnings.catch_warnings():  # every rank's schedule warns: the logging rank says it, once (below)
            warnings.simplefilter("ignore", PipelineFillWarning)
            self.runtime = self.model.pipeline(self.pc.pipeline_schedule, self.pc.num_microbatches,
                                               seq_length=seq, loss_fn=self.objective)
        for msg in self.pc.warnings() if self.is_logger else ():
            if msg not in _SAID:
                _SAID.add(msg)
                print(f"warning: {msg}", flush=True)
        # the reference is the initial model's: computed before a checkpoint's weights are loaded
        self.reference = dpo.ReferenceLogps(self) if self.task == "dpo" else None
        if self.reference is not None:
            self.reference.fill(self)
        self.eval_data = self.eval_reference = None
        if cfg.eval.every:  # held-out data read as the training data is, with the same task
            d = cfg.data
            try:
                self.eval_data = make_data(cfg.eval.source, seq, cfg.training.seed, self.mc.vocab_size, d.tokenizer,
                                           fmt=d.format, loss_on=d.loss_on, overflow=d.overflow, task=self.task)
            except ValueError as e:  # the data layer names data.source: here it is eval.source
                raise ValueError(str(e).replace("data.source (", "eval.source (")) from e
            if self.task == "dpo":
                self.eval_reference = dpo.ReferenceLogps(self, self.eval_data, cfg.eval.source)
                self.eval_reference.fill(self)
        self.samples = EvalSamples(cfg, self.model) if cfg.eval.samples else None  # what the model says, as text
        self.step_index = 0
        self.history: list[dict] = []
        self.resumed_from = None
        self.step_flops = self.mc.model_flops_per_step(self.pc.global_batch_size, seq)
        self.peak, self.peak_label = peak_flops(self.device)
        self.metrics = MetricsFile.of(cfg, self.state.rank == 0)
        self._warned = False
        # the run's story on the logging rank: saves, "nothing to do", the comm/compute warning (autotune's
        # trials keep quiet: their checkpoints are a hand-over and its table reports their comm/compute)
        self.narrate = True
        self._first_step: int | None = None  # the first step this trainer trains (its warm-up)
        self._pending, self._ckpt_group = None, None
        at = cfg.autotune
        self.monitor = SlowdownMonitor(at.monitor_every, at.slowdown, at.sustain) if at.monitor_every else None
        self.slowdowns: list = []
        ck = cfg.checkpoint
        source = resume_dir or (ck.save_dir if ck.resume else None)
        self.saved_step: int | None = None  # the step of the newest checkpoint in save_dir of this run
        if source:
            found = checkpoint.resume(source, self.model, self.optimizer, self.master_of, self.run_state)
            if found is not None:
                path, meta = found
                self.step_index, self.resumed_from = int(meta["step"]), path
                if self.is_logger and resume_dir is None:  # the run's own checkpoint (not an autotune hand-over)
                    print(f"resumed from step {self.step_index} of {path} (saved at {meta.get('layout', '?')}"
                          f"{'' if meta.get('layout') in (None, self.pc.short()) else f'; now {self.pc.short()}'})",
                          flush=True)
                if ck.save_dir and Path(source).resolve() == Path(ck.save_dir).resolve():
                    self.saved_step = self.step_index
                if self.mp is not None and "loss_scale" in meta:
                    self.mp.load_state_dict(meta["loss_scale"])
                said = self.fp8.resumed(meta.get("fp8_moved")) if self.fp8 is not None else None
                if said and self.is_logger:
                    print(said, flush=True)
        # a new run's file starts empty; a resumed one drops the steps it trains again (MetricsFile)
        self.metrics.start(self.step_index if self.resumed_from is not None else None)
        if self.fp8 is not None:
            self.metrics.write(self.fp8.choice_record())
            if self.is_logger:
                print(self.fp8.table(), flush=True)

    def _router_objective(self) -> RouterObjective | None:
        """A MoE model's router losses in the objective (:mod:`tpkernels.train.moe_objective`), with the
        model's coefficients or the training config's; None for a dense model (which refuses them)."""
        t, mc = self.cfg.training, self.mc
        if not mc.num_experts:
            given = [f"training.{k} ({getattr(t, k)!r})" for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff")
                     if getattr(t, k) is not None]
            given += [f"training.moe_expert_bias_rate ({t.moe_expert_bias_rate!r})"] if t.moe_expert_bias_rate else []
            if given or t.moe_aux_loss_style != "per_layer":
                given += [f"training.moe_aux_loss_style ({t.moe_aux_loss_style!r})"] \
                    if t.moe_aux_loss_style != "per_layer" else []
                raise ValueError(f"{', '.join(given)} set for {mc.name or mc.model_type}, a dense model (no experts: "
                                 "model num_experts 0); leave them unset")
            return None
        aux = mc.router_aux_loss_coef if t.moe_aux_loss_coeff is None else t.moe_aux_loss_coeff
        z = mc.router_z_loss_coef if t.moe_z_loss_coeff is None else t.moe_z_loss_coeff
        return RouterObjective(self.model, aux, z, t.moe_aux_loss_style,
                               tokens_per_microbatch=self.pc.micro_batch_size * self.pc.dp * self.cfg.data.seq_length)

    def build_model(self) -> ParallelTransformer:
        """This rank's part of the run's model as it starts: ``model.init_from``'s weights, or the seed's
        (the same at every layout), before any adapter or checkpoint."""
        cfg, dtype = self.cfg, DTYPES[self.cfg.training.precision]
        quant = cfg.model.base_quant  # qlora: each rank quantises its shards as it reads them
        if cfg.model.init_from:
            return ParallelTransformer.from_hf(cfg.model.init_from, self.state, config=self.mc, device=self.device,
                                               overlap_comm=self.pc.overlap_comm, dtype=dtype, quant=quant)
        return ParallelTransformer(self.mc, self.state, seed=cfg.training.seed, device=self.device,
                                   overlap_comm=self.pc.overlap_comm, dtype=dtype, quant=quant)

    def save(self) -> Path:
        """A checkpoint of the steps done so far under ``checkpoint.save_dir`` (collective). With ``async_save``
        it is written in the background and completed at the next save or at the end of ``train``."""
        self.finish_saving()
        self.saved_step = self.step_index
        meta = {"config": self.cfg.to_dict(), "layout": self.pc.short(), "model": self.mc.name or self.mc.model_type,
                "model_config": dataclasses.asdict(self.mc)}
        if self.mp is not None:
            meta["loss_scale"] = self.mp.state_dict()
        if self.cfg.checkpoint.async_save:
            if self._ckpt_group is None and dist.is_initialized():
                self._ckpt_group = dist.new_group(backend="gloo")
            self._pending = checkpoint.save(self.cfg.checkpoint.save_dir, self.model, self.optimizer, self.step_index,
                                            meta, self.master_of, asynchronous=True, async_group=self._ckpt_group,
                                            run_state=self.run_state)
            self._say_saved(self._pending.final, " (written in the background)")
            return self._pending.final
        path = checkpoint.save(self.cfg.checkpoint.save_dir, self.model, self.optimizer, self.step_index, meta,
                               self.master_of, run_state=self.run_state)
        self._say_saved(path)
        return path

    def _say_saved(self, path, how: str = "") -> None:
        if self.is_logger and self.narrate:
            print(f"checkpoint: step {self.step_index} saved to {path}{how}", flush=True)

    def finish_saving(self) -> Path | None:
        """Complete an asynchronous save in flight (collective); its path, or None."""
        pending, self._pending = self._pending, None
        return pending.finish() if pending is not None else None

    def _guarded(self, fn, during: str):
        """``fn()``, with a lost rank named on every survivor (and where to restart from)."""
        try:
            return fn()
        except (FloatingPointError, checkpoint.CheckpointSaveError, ValueError):
            raise  # every rank raises it alike: nobody is lost
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(out_of_memory_advice(self, e)) from e
        except Exception as e:
            missing = lost_ranks()
            if not missing:
                raise
            lost, blocked = dead_and_blocked(missing)
            abort_process_groups()
            save_dir = self.cfg.checkpoint.save_dir
            last = checkpoint.latest(save_dir) if save_dir else None
            also = f"; rank(s) {blocked} are alive but blocked waiting for a lost one (they end with the job)" \
                if blocked else ""
            raise RankLostError(f"rank(s) {lost or missing} stopped responding during {during} ({self.pc.short()})"
                                f"{also}; the last complete checkpoint is {last or 'none'}: restart the job to resume "
                                f"from it ({type(e).__name__}: {str(e)[:200]})", lost or missing) from e

    def _write_trace(self, tr: CommTrace) -> None:
        """Every rank's GEMM, TP-transfer and pipeline spans of this step into one Chrome trace (rank 0)."""
        every = control.all_gather_objects(step_trace_events(self.state.rank, tr, self.runtime.timeline))
        if self.is_logger:
            write_trace(self.cfg.logging.trace, every)

    @property
    def is_logger(self) -> bool:
        return self.state.rank == 0

    def _logging_step(self, step: int) -> bool:
        return step % self.cfg.logging.log_every == 0 or step == self.cfg.training.steps - 1 or \
            (self._first_step is not None and step == self._first_step + 1)  # the first after the warm-up

    def prepare_batch(self, step: int) -> StepBatch:
        """Step ``step``'s rows of this rank (its DP replica's, its CP share) and the global count of
        targets, all on the host: the model checks them there (no device sync) and moves them."""
        return self.shard_batch(self.data.batch(step, self.pc.global_batch_size))

    def shard_batch(self, batch) -> StepBatch:
        """A global batch (``TokenBatch``) as this rank's :class:`StepBatch`; dpo: the targets carry each
        position's sequence and the count is the step's pairs."""
        pc, st = self.pc, self.state
        # IGNORE_INDEX at documents' last tokens and wherever the loss mask is off (SFT: the prompts)
        target = batch.targets(IGNORE_INDEX)
        pairs = dpo.PairInfo.of(batch, target) if self.task == "dpo" else None
        # the loss's denominator, whatever the layout: the targets (the pairs for dpo)
        num_targets = pairs.num_pairs if pairs is not None else int((target != IGNORE_INDEX).sum())
        # replica r takes the r-th share of each global micro-batch: micro-batch i is then the same rows at every DP
        # size (the token loss does not care; a MoE model's balancing loss is a per-micro-batch statistic)
        mine = dp_rows(target.shape[0], pc.dp, st.dp_rank, pc.num_microbatches)
        parts = {"ids": batch.ids, "pos": batch.position_ids, "target": target,
                 "doc": None if pairs is None else pairs.doc}
        parts = {k: None if v is None else v[mine] for k, v in parts.items()}
        if pairs is not None:
            pairs.doc = parts["doc"]
        if pc.cp > 1:  # this CP rank's zigzag share of every sequence, targets made on the whole one
            if parts["pos"] is None:  # the rank's share needs its global positions (rotary, the causal mask)
                parts["pos"] = torch.arange(parts["ids"].shape[1]).expand(parts["ids"].shape[0], -1)
            parts = {k: None if v is None else zigzag_split(v, pc.cp, st.cp_rank, dim=1) for k, v in parts.items()}
        target = parts["target"] if pairs is None else {"target": parts["target"], "doc": parts["doc"]}
        return StepBatch(parts["ids"], parts["pos"], target, num_targets, pairs)

    def _begin_pairs(self, batch: StepBatch, reference) -> None:
        """dpo: the batch's reference log-probs (an adapters-off or frozen-model pass runs here, on every
        rank) handed to the last stage's objective with the batch's pair counts; nothing otherwise."""
        if batch.pairs is None:
            return
        table = reference.table(self, batch)
        if self.objective is not None:
            self.objective.begin_step(batch.pairs.num_pairs, batch.pairs.chosen_tokens, table)

    def forward_backward(self, batch: StepBatch) -> tuple[float, CommTrace, float]:
        """Forward and backward over the micro-batches, then the gradient reductions: (the step's loss,
        its comm trace, seconds of forward + backward)."""
        mp, st = self.mp, self.state
        if mp is not None:
            mp.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)
        for reduce in (self.dp_reduce, self.edp_reduce):
            if reduce is not None:
                reduce.start(self.pc.num_microbatches)
        t0 = time.perf_counter()
        self._begin_pairs(batch, self.reference)
        scale = mp.scale if mp is not None else 1.0
        with CommTrace() as tr, self._training_step(scale):
            loss = self.model.step(batch.input_ids if st.is_first_stage else None, batch.target,
                                   position_ids=batch.position_ids, runtime=self.runtime,
                                   num_targets=batch.num_targets, loss_scale=scale)
        return loss, tr, time.perf_counter() - t0

    @contextlib.contextmanager
    def _training_step(self, loss_scale: float = 1.0):
        """The block of a training step's forward and backward: where run state records (FP8 amaxes and
        counts) and a MoE model's router losses join the objective (and its metrics count); every other
        pass (references, validation, timing) leaves them as they are."""
        with contextlib.ExitStack() as stack:
            if self.fp8 is not None:
                stack.enter_context(self.fp8.state.training_step())
            if self.router is not None:  # × the replicas, as model.step scales each replica's token loss
                stack.enter_context(self.router.training_step(loss_scale * self.pc.dp * self.pc.cp,
                                                              self.pc.num_microbatches))
            yield

    @property
    def run_state(self) -> checkpoint.RunState:
        """The run's state owners, saved and restored with every checkpoint."""
        return checkpoint.RunState([self.fp8.state if self.fp8 is not None else None, self.expert_bias])

    def reduce_gradients(self) -> float:
        """DP (and CP) average, then the TP-side sums; seconds spent waiting for them."""
        t0 = time.perf_counter()
        for reduce in (self.dp_reduce, self.edp_reduce):
            if reduce is not None:
                reduce.finish()
        self.model.finish_grad_sync(reduce_dp=False)
        return time.perf_counter() - t0

    def optimizer_step(self, lr: float) -> tuple[float, bool]:
        """Loss-scale bookkeeping, the global gradient norm, clipping and AdamW at ``lr``: (norm, skipped)."""
        mp, opt = self.mp, self.cfg.optimizer
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        skipped = False
        if mp is not None and mp.scaling:
            skipped = mp.found_inf()  # agreed over the whole world: every rank skips together
            mp.update_scale(skipped)
            if not skipped:
                mp.unscale_()
        if skipped:
            return float("nan"), True
        st = self.state
        norm = clip_grads_(self.model, opt.clip_grad, global_grad_norm(self.model, st.tp_group, st.pp_group,
                                                                       st.ep_group if self.pc.ep > 1 else None))
        if mp is not None:
            mp.step(self.optimizer)
        else:
            self.optimizer.step()
        return norm, False

    def validate(self) -> dict[str, float]:
        """``eval.source``'s rows, each once (at most ``eval.batches`` global batches; see ``held_out``),
        forwards only, at the run's layout and schedule (no gradients, no recompute): the token-mean loss
        and its perplexity (dpo: the mean pair loss and TRL's metrics), the same on every rank (collective)."""
        ev, st = self.cfg.eval, self.state
        total = weight = 0.0
        sums = None
        for rows in held_out(self.eval_data, ev.batches, self.pc.global_batch_size):
            batch = self.shard_batch(rows)
            self._begin_pairs(batch, self.eval_reference)
            loss = self.model.evaluate(batch.input_ids if st.is_first_stage else None, batch.target,
                                       batch.position_ids, num_targets=batch.num_targets,
                                       loss_fn=self.objective if batch.pairs is not None else None)
            total, weight = total + loss * batch.num_targets, weight + batch.num_targets
            if batch.pairs is not None:
                s = dpo.metric_sums(self, self.objective)
                sums = s if sums is None else [a + b for a, b in zip(sums, s)]
        mean = total / max(weight, 1)
        if sums is not None:
            return {"eval/loss": mean, **{f"eval/{k}": v for k, v in dpo.metric_means(sums).items()}}
        return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 700.0))}

    def _validation_due(self, last: int) -> bool:
        every = self.cfg.eval.every
        return self.eval_data is not None and (self.step_index % every == 0 or self.step_index == last)

    def train_step(self) -> dict:
        """One step: batch, forward-backward, gradient reductions, optimizer; its record."""
        cfg, t0, step = self.cfg, time.perf_counter(), self.step_index
        opt = cfg.optimizer
        lr = lr_at(step, opt.lr, opt.min_lr, opt.warmup_steps, cfg.training.steps)
        loss, tr, t_fb = self.forward_backward(self.prepare_batch(step))
        exposed = exposed_comm_s(tr)
        comm = exposed / max(t_fb - exposed, 1e-9)
        if self._logging_step(step):  # the worst rank's: one collective, only when it is shown
            comm = control.all_reduce_values([comm], "max")[0]
        if cfg.logging.trace and step == cfg.logging.trace_step:
            self._write_trace(tr)
        t_dp = self.reduce_gradients()
        norm, skipped = self.optimizer_step(lr)
        if not math.isfinite(loss):  # every rank has the same loss (the model agrees it): all stop
            last = checkpoint.latest(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else None
            raise FloatingPointError(f"loss is {loss} at step {step} ({self.pc.short()}); last good "
                                     f"checkpoint: {last or 'none'}; lower lr (now {lr:.3g}) or enable clip_grad")
        preference = dpo.reduce_metrics(self, self.objective) \
            if self.task == "dpo" and self._logging_step(step) else None
        moe = self.router.step_metrics() if self.router is not None else {}
        if self.expert_bias is not None:  # once per step, from the step's global load just reduced
            self.expert_bias.after_step(moe["moe/load"])
        dt = time.perf_counter() - t0
        timeline = self.runtime.timeline
        rec = StepRecord(step=step, loss=loss, lr=lr, grad_norm=norm, step_s=dt,
                         tokens_per_s=self.pc.global_batch_size * cfg.data.seq_length / dt, skipped=skipped,
                         mfu=self.step_flops / (dt * self.pc.world_size * self.peak), comm_ratio=comm,
                         bubble=idle_share(timeline),
                         phases=step_phases(dt, t_fb, exposed, t_dp, timeline if self.pc.pp > 1 else None),
                         loss_scale=self.mp.scale if self.mp is not None and self.mp.scaling else None,
                         preference=preference)
        self._warn_comm(rec)
        out = {**rec.as_dict(), **moe}
        if self.fp8 is not None:
            fp8_rec, moved, records = self.fp8.after_step(step)
            out.update(fp8_rec)
            if records:
                self.metrics.write({"fp8_guard": records, "layout": self.pc.short()})
            for text in moved if self.is_logger else ():
                print(text, flush=True)
        self.metrics.write({**out, "layout": self.pc.short(), "mfu_vs": self.peak_label})
        self.step_index += 1
        self.history.append(out)
        return out

    def _comm_advice(self) -> str:
        return comm_advice(self.pc, self.cfg, self.mc, self.device)

    def _warn_comm(self, rec: "StepRecord") -> None:
        """Said once, on a logging step after this trainer's first (warm-up: allocation, first GEMMs and the
        first collectives' setup make step 0's ratio meaningless)."""
        if self._first_step is None:
            self._first_step = rec.step
        if rec.step == self._first_step or not self._logging_step(rec.step):
            return
        if rec.comm_ratio > COMM_WARN and not self._warned and self.is_logger and self.narrate:
            self._warned = True
            print(f"warning: communication/compute {100 * rec.comm_ratio:.0f}% > {100 * COMM_WARN:.0f}% on the "
                  f"worst rank at {self.pc.short()} (step {rec.step}): {self._comm_advice()}", flush=True)

    def _watch(self, rec: dict) -> bool:
        """Feed the slowdown monitor; True when it reports a sustained slowdown now."""
        found = self.monitor.observe(rec) if self.monitor is not None else None
        if found is None:
            return False
        self.slowdowns.append(found)
        self.metrics.write({"slowdown": found.as_dict(), "layout": self.pc.short()})
        if self.is_logger:
            print(found.text, flush=True)
        return True

    def train(self, stop_on_slowdown: bool = False) -> list[dict]:
        """Run to ``training.stop_at_step`` (else ``training.steps``), saving every ``save_every`` steps and
        always at the step the run stops at; with ``stop_on_slowdown``, stop after the step at which
        the slowdown monitor reports."""
        cfg, ck = self.cfg, self.cfg.checkpoint
        stop = cfg.training.stop_at_step
        last = cfg.training.steps if stop is None else min(cfg.training.steps, stop)
        if self.step_index >= last:
            if self.is_logger and self.narrate:
                print(f"nothing to do: already at step {self.step_index} (training.steps {cfg.training.steps}"
                      f"{'' if stop is None else f', training.stop_at_step {stop}'}); raise training.steps to "
                      "train further", flush=True)
            return self.history
        if not ck.save_dir:
            self._say_once("note: checkpoint.save_dir is not set: the trained model is not kept (set it to keep "
                           "checkpoints to resume from and export)")
        bar = self._progress_bar()
        while self.step_index < last:
            rec = self._guarded(self.train_step, f"step {self.step_index}")
            if self._validation_due(last):
                self.model.check_inputs = True  # the held-out batches are checked like the first one
                ev = self._guarded(self.validate, f"the validation after step {self.step_index}")
                rec.update(ev)  # the history entry of the step
                self.metrics.write({"step": rec["step"], **ev, "layout": self.pc.short()})
                if self.samples is not None:  # eval.samples: greedy continuations, a text record
                    self.metrics.write(self._guarded(lambda: self.samples.record(rec["step"]),
                                                     f"the samples after step {self.step_index}"))
            self.model.check_inputs = False  # checked on the first step; the batch shape never changes
            slowed = self._watch(rec)
            if ck.save_dir and ck.save_every and self.step_index % ck.save_every == 0:
                self._guarded(self.save, f"the checkpoint save after step {self.step_index}")
            self._show(bar, rec)
            if slowed and stop_on_slowdown:
                break
        if bar is not None:
            bar.close()
        if ck.save_dir and self.saved_step != self.step_index:  # the step the run stops at, always
            self._guarded(self.save, f"the checkpoint save after step {self.step_index}")
        self._guarded(self.finish_saving, f"the checkpoint save after step {self.step_index}")
        return self.history

    def _say_once(self, text: str) -> None:
        """A line said once per process by the logging rank (a run may build several trainers)."""
        if self.is_logger and text not in _SAID:
            _SAID.add(text)
            print(text, flush=True)

    def _progress_bar(self):
        """tqdm's bar on a terminal, a plain line per logging step otherwise (:mod:`tpkernels.train.progress`)."""
        if not (self.is_logger and self.cfg.logging.progress):
            return None
        return make_progress(self.cfg.training.steps, self.step_index, f"train {self.pc.short()}")

    def _show(self, bar, rec: dict) -> None:
        if bar is not None:
            bar.show(rec, self._logging_step(rec["step"]))


def out_of_memory_advice(trainer: "Trainer", err: Exception) -> str:
    """What ran out, where, and what to change (the knobs that trade memory for time)."""
    cfg, pc, st = trainer.cfg, trainer.pc, trainer.state
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    options = []
    if pc.recompute != "full":
        options.append(f"parallel.recompute={'selective' if pc.recompute == 'none' else 'full'} (now {pc.recompute})")
    options.append(f"more pipeline stages (parallel.pp={pc.pp})")
    if not pc.zero1 and pc.dp > 1:
        options.append("parallel.zero1=true")
    if pc.micro_batch_size > 1:
        options.append(f"a smaller parallel.micro_batch_size (now {pc.micro_batch_size}, with more micro-batches)")
    if cfg.model.finetune == "full":
        options.append("model.finetune=lora")
    if cfg.model.finetune == "lora":
        options.append("model.finetune=qlora (a 4-bit base: ~0.52 bytes per weight instead of 2)")
    return (f"rank {st.rank} (pipeline stage {st.pp_rank} of {pc.pp}, {pc.short()}) ran out of memory at step "
            f"{trainer.step_index}: {first_line}. Try: {'; '.join(options)}. `tpkernels plan` predicts each "
            "layout's memory per GPU.")


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` to its last step on an initialised world (or one process); returns the history."""
    return Trainer(cfg).train()
