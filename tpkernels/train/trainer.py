"""The training loop: ``Trainer(cfg).train()``; ``tpkernels train`` calls it.

    cfg = TrainConfig.from_values({"model.name": "Llama-2-7B", "model.layers": 4, "model.hidden": 256,
                                   "parallel.tp": 2, "parallel.pp": 2, "training.steps": 50})
    history = Trainer(cfg).train()  # [{"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s"}, ...]

One step: this replica's rows of the global batch through ``model.step`` (the pipeline schedule
over ``num_microbatches`` micro-batches), the DP average (:class:`DataParallelGradReduce`,
overlapped with the backward by default), ``finish_grad_sync`` (SP, replicated KV, tied
embeddings), the global gradient norm and clipping, AdamW, the next learning rate. The loss
reported is the mean over the global batch (averaged over DP: one 8-byte all-reduce).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpkernels.models import ParallelTransformer, next_token_targets
from tpkernels.models.grad_sync import DataParallelGradReduce
from tpkernels.models.lora import apply_lora
from tpkernels.parallel.state import ParallelState
from tpkernels.train import checkpoint
from tpkernels.train.config import TrainConfig
from tpkernels.functional.context_parallel import zigzag_split
from tpkernels.options import flatten
from tpkernels.train.output_paths import check_output_paths
from tpkernels.train.data import make_data, rows_of_dp_rank
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
    exposed_comm_s,
    step_phases,
    idle_share,
    peak_flops,
    step_trace_events,
    write_trace,
)
from tpkernels.train.optim import clip_grads_, global_grad_norm, lr_at, make_optimizer
from tpkernels.train.precision import DTYPES, MixedPrecision


RANK0_ONLY_KEYS = ("logging.metrics_file", "logging.progress", "logging.log_every")


def agree_on_config(cfg: TrainConfig) -> None:
    """Every rank must train the same config (a rank launched with other flags would diverge without a
    word, or hang in a collective of another shape): one exchange at start, the same error on every
    rank naming the first keys that differ."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    # what only rank 0 reads may differ (each node its own metrics path)
    mine = {k: v for k, v in flatten(cfg.to_dict()).items() if k not in RANK0_ONLY_KEYS}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
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
        if cfg.model.init_from:
            self.model = ParallelTransformer.from_hf(cfg.model.init_from, self.state, config=self.mc,
                                                     device=self.device, overlap_comm=self.pc.overlap_comm,
                                                     dtype=dtype)
        else:
            self.model = ParallelTransformer(self.mc, self.state, seed=cfg.training.seed, device=self.device,
                                             overlap_comm=self.pc.overlap_comm, dtype=dtype)
        ms, opt = cfg.model, cfg.optimizer
        self.lora_layers = apply_lora(self.model, ms.lora_rank, ms.lora_alpha) if ms.finetune == "lora" else []
        self.mp = MixedPrecision(self.model, dtype, init_scale=cfg.training.initial_loss_scale) \
            if dtype != torch.float32 else None
        params = self.mp.masters if self.mp else list(self.model.parameters())
        self.optimizer = make_optimizer(params, opt.lr, opt.weight_decay, (opt.beta1, opt.beta2), opt.adam_eps,
                                        zero1_group=self.state.dp_cp_group if self.pc.zero1 else None)
        self.master_of = self.mp.master_of if self.mp else {}
        # registered after MixedPrecision's hooks: it sees the fp32 main_grad already accumulated
        # CP ranks hold replicas of the weights like DP ranks: their gradients are averaged over both
        self.dp_reduce = DataParallelGradReduce(list(self.model.parameters()), self.state.dp_cp_group,
                                                self.pc.bucket_mb, overlap=self.pc.overlap_dp) \
            if self.pc.dp * self.pc.cp > 1 else None
        self.data = make_data(cfg.data.source, seq, cfg.training.seed, self.mc.vocab_size, cfg.data.tokenizer)
        loss_fn = None
        if self.mp is not None and self.mp.scaling:  # fp16: backward of the scaled loss
            loss_fn = lambda y, t: self.model.head.loss(y, t) * self.mp.scale  # noqa: E731
        self.runtime = self.model.pipeline(self.pc.pipeline_schedule, self.pc.num_microbatches, loss_fn=loss_fn,
                                           seq_length=seq)
        self.step_index = 0
        self.history: list[dict] = []
        self.resumed_from = None
        self.step_flops = self.mc.model_flops_per_step(self.pc.global_batch_size, seq)
        self.peak, self.peak_label = peak_flops(self.device)
        self.metrics = MetricsFile(cfg.logging.metrics_file if self.state.rank == 0 else None)
        self._warned = False
        self._pending, self._ckpt_group = None, None
        at = cfg.autotune
        self.monitor = SlowdownMonitor(at.monitor_every, at.slowdown, at.sustain) if at.monitor_every else None
        self.slowdowns: list = []
        ck = cfg.checkpoint
        source = resume_dir or (ck.save_dir if ck.resume else None)
        if source:
            found = checkpoint.resume(source, self.model, self.optimizer, self.master_of)
            if found is not None:
                path, meta = found
                self.step_index, self.resumed_from = int(meta["step"]), path
                if self.mp is not None and "loss_scale" in meta:
                    self.mp.load_state_dict(meta["loss_scale"])

    def save(self) -> Path:
        """A checkpoint of the steps done so far under ``checkpoint.save_dir`` (collective). With ``async_save``
        it is written in the background and completed at the next save or at the end of ``train``."""
        self.finish_saving()
        meta = {"config": self.cfg.to_dict(), "layout": self.pc.short(), "model": self.mc.name or self.mc.model_type,
                "model_config": dataclasses.asdict(self.mc)}
        if self.mp is not None:
            meta["loss_scale"] = self.mp.state_dict()
        if self.cfg.checkpoint.async_save:
            if self._ckpt_group is None and dist.is_initialized():
                self._ckpt_group = dist.new_group(backend="gloo")
            self._pending = checkpoint.save(self.cfg.checkpoint.save_dir, self.model, self.optimizer, self.step_index,
                                            meta, self.master_of, asynchronous=True, async_group=self._ckpt_group)
            return self._pending.final
        return checkpoint.save(self.cfg.checkpoint.save_dir, self.model, self.optimizer, self.step_index, meta,
                               self.master_of)

    def finish_saving(self) -> Path | None:
        """Complete an asynchronous save in flight (collective); its path, or None."""
        pending, self._pending = self._pending, None
        return pending.finish() if pending is not None else None

    def _guarded_step(self) -> dict:
        """train_step, with a lost rank named on every survivor (and where to restart from)."""
        return self._guarded(self.train_step, f"step {self.step_index}")

    def _guarded_save(self) -> None:
        """A checkpoint save (or the completion of one in flight), a lost rank named as in a step."""
        self._guarded(self.save, f"the checkpoint save after step {self.step_index}")

    def _guarded(self, fn, during: str):
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
        events = step_trace_events(self.state.rank, tr, self.runtime.timeline)
        every = [events]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, events)
        if self.is_logger:
            write_trace(self.cfg.logging.trace, every)

    @property
    def is_logger(self) -> bool:
        return self.state.rank == 0

    def train_step(self) -> dict:
        cfg, st = self.cfg, self.state
        t0 = time.perf_counter()
        gb = self.pc.global_batch_size
        ids, pos = self.data.batch(self.step_index, gb)
        ids, pos = rows_of_dp_rank(ids, st.dp_rank, self.pc.dp), rows_of_dp_rank(pos, st.dp_rank, self.pc.dp)
        target = next_token_targets(ids, pos)
        if self.pc.cp > 1:  # this CP rank's zigzag share of every sequence, targets made on the whole one
            if pos is None:  # the rank's share needs its global positions (rotary, the causal mask)
                pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            ids, pos, target = (zigzag_split(t, self.pc.cp, st.cp_rank, dim=1) for t in (ids, pos, target))
        # ids, positions and targets stay on the host: the model checks them there once for the step
        # (no device sync) and moves them to the device itself
        opt = cfg.optimizer
        lr = lr_at(self.step_index, opt.lr, opt.min_lr, opt.warmup_steps, cfg.training.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mp = self.mp
        if mp is not None:
            mp.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)
        if self.dp_reduce is not None:
            self.dp_reduce.start(self.pc.num_microbatches)
        t_step = time.perf_counter()
        with CommTrace() as tr:
            loss = self.model.step(ids if st.is_first_stage else None, target, position_ids=pos,
                                   runtime=self.runtime)
        t_fb = time.perf_counter() - t_step
        exposed = exposed_comm_s(tr)
        comm = torch.tensor([exposed / max(t_fb - exposed, 1e-9)], dtype=torch.float64,
                            device=self.device)  # NCCL reduces device tensors only
        if dist.is_initialized() and dist.get_world_size() > 1:  # the worst rank's
            dist.all_reduce(comm, op=dist.ReduceOp.MAX)
        if cfg.logging.trace and self.step_index == cfg.logging.trace_step:
            self._write_trace(tr)
        t_dp = time.perf_counter()
        if self.dp_reduce is not None:
            self.dp_reduce.finish()
        self.model.finish_grad_sync(reduce_dp=False)
        t_dp = time.perf_counter() - t_dp
        skipped = False
        if mp is not None and mp.scaling:
            loss /= mp.scale
            skipped = mp.found_inf()  # agreed over the whole world: every rank skips together
            mp.update_scale(skipped)
            if not skipped:
                mp.unscale_()
        norm = float("nan")
        if not skipped:
            norm = clip_grads_(self.model, opt.clip_grad, global_grad_norm(self.model, st.tp_group, st.pp_group))
            if mp is not None:
                mp.step(self.optimizer)
            else:
                self.optimizer.step()
        replicas = self.pc.dp * self.pc.cp
        if replicas > 1:  # the mean over DP replicas and CP shares (equal token counts)
            t = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=st.dp_cp_group)
            loss = t.item() / replicas
        if not math.isfinite(loss):  # every rank has the same loss (the pipeline and DP share it): all stop
            last = checkpoint.latest(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else None
            raise FloatingPointError(f"loss is {loss} at step {self.step_index} ({self.pc.short()}); last good "
                                     f"checkpoint: {last or 'none'}; lower lr (now {lr:.3g}) or enable clip_grad")
        dt = time.perf_counter() - t0
        rec = {"step": self.step_index, "loss": loss, "lr": lr, "grad_norm": norm, "step_s": dt,
               "tokens_per_s": gb * cfg.data.seq_length / dt, "skipped": skipped,
               "mfu": self.step_flops / (dt * self.pc.world_size * self.peak),
               "comm_ratio": float(comm), "bubble": idle_share(self.runtime.timeline),
               "phases": step_phases(dt, t_fb, exposed, t_dp, self.runtime.timeline if self.pc.pp > 1 else None)}
        if rec["comm_ratio"] > COMM_WARN and not self._warned and self.is_logger:
            self._warned = True
            print(f"warning: communication/compute {100 * rec['comm_ratio']:.0f}% > {100 * COMM_WARN:.0f}% on the "
                  f"worst rank at {self.pc.short()}: lower parallel.tp ({self.pc.tp})", flush=True)
        if mp is not None and mp.scaling:
            rec["loss_scale"] = mp.scale
        self.metrics.write({**rec, "layout": self.pc.short(), "mfu_vs": self.peak_label})
        self.step_index += 1
        self.history.append(rec)
        return rec

    def train(self, stop_on_slowdown: bool = False) -> list[dict]:
        """Run to ``training.stop_at_step`` (else ``training.steps``), saving as configured; with
        ``stop_on_slowdown``, stop (and save) after the step at which the slowdown monitor reports."""
        cfg = self.cfg
        steps, ck = cfg.training.steps, cfg.checkpoint
        bar = None
        if self.is_logger and cfg.logging.progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=steps, initial=self.step_index, desc=f"train {self.pc.short()}", unit="step")
        stop = cfg.training.stop_at_step
        last = steps if stop is None else min(steps, stop)
        while self.step_index < last:
            rec = self._guarded_step()
            self.model.check_inputs = False  # checked on the first step; the batch shape never changes
            if self.monitor is not None:
                found = self.monitor.observe(rec)
                if found is not None:
                    self.slowdowns.append(found)
                    self.metrics.write({"slowdown": found.as_dict(), "layout": self.pc.short()})
                    if self.is_logger:
                        print(found.text, flush=True)
                    if stop_on_slowdown:
                        break
            if ck.save_dir and ck.save_every and self.step_index % ck.save_every == 0:
                self._guarded_save()
            if bar is not None:
                bar.update(1)
                if rec["step"] % cfg.logging.log_every == 0 or self.step_index == steps:
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", gnorm=f"{rec['grad_norm']:.3f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}", step_s=f"{rec['step_s']:.3f}",
                                    mfu=f"{100 * rec['mfu']:.1f}%", comm=f"{100 * rec['comm_ratio']:.0f}%",
                                    bubble=f"{100 * rec['bubble']:.0f}%")
        if bar is not None:
            bar.close()
        if ck.save_dir and not (ck.save_every and self.step_index % ck.save_every == 0) and \
                (self.history or self.resumed_from is None):
            self._guarded_save()
        self._guarded(self.finish_saving, f"the checkpoint save after step {self.step_index}")
        return self.history


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
    return (f"rank {st.rank} (pipeline stage {st.pp_rank} of {pc.pp}, {pc.short()}) ran out of memory at step "
            f"{trainer.step_index}: {first_line}. Try: {'; '.join(options)}. `tpkernels plan` predicts each "
            "layout's memory per GPU.")


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` to its last step on an initialised world (or one process); returns the history."""
    return Trainer(cfg).train()
