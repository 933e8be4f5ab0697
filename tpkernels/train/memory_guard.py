"""Before the model is built: does the run fit in this machine's memory? The planner's memory model
(:mod:`tpkernels.planner.memory`: weights, gradients, optimizer states, activations, logits per rank)
against the host's available RAM (CPU ranks: every local rank's share, on the one host) or each
GPU's free memory. A run that does not fit is refused with the keys that shrink it; the kernel's
OOM killer would otherwise end it minutes later without a word (the default Llama-2-7B, 6.7B
parameters in fp32, needs ~114 GiB).

    need = run_memory(cfg, world)       # MemoryNeed: per rank, on this host, what is available
    check_memory(cfg, world)            # ValueError naming the keys when it does not fit

The estimate is the planner's (16-bit weights + fp32 gradients + 12 bytes of fp32 masters and Adam
moments per trained parameter: 18 bytes; the CPU's fp32 run keeps 4 + 4 + 8 = 16, so that part errs
high by ~12% there), doubled for fp64; on a CPU each rank's process (interpreter, libraries, data:
``CPU_PROCESS_BYTES``) replaces the CUDA runtime reserve.
``training.check_memory: false`` starts anyway (an estimate, not a measurement).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tpkernels.train.config import TrainConfig

GIB = 2 ** 30
# A CPU rank's memory beyond the model: the interpreter, torch, transformers and tokenizers loaded, the data,
# allocator slack. Measured here: 0.81 GiB peak RSS for a 2-layer hidden-32 run; an 8-layer hidden-1024 Llama
# (166M parameters, fp32) peaked at 3.69 GiB, the planner's 2.71 GiB + this 1 GiB. (On a GPU the planner's own
# runtime reserve, the CUDA context and workspaces, takes its place.)
CPU_PROCESS_BYTES = 1.0 * GIB


def planner_setup(cfg: TrainConfig, global_batch: int, precision: str):
    """The planner's TrainingSetup of run ``cfg`` at ``global_batch`` sequences and planner ``precision``."""
    from tpkernels.planner import TrainingSetup  # noqa: PLC0415

    # auto: the data decides, after the layout; SFT and a cached DPO reference cost what pre-training costs
    task = cfg.training.task if cfg.training.task != "auto" else "pretrain"
    return TrainingSetup(global_batch, cfg.data.seq_length, precision=precision, finetune=cfg.model.finetune,
                         quant=cfg.model.base_quant, lora_rank=cfg.model.lora_rank,
                         overlap_grad_reduce=cfg.parallel.overlap_dp, task=task, dpo_reference=cfg.dpo.reference)


def host_available_bytes() -> int | None:
    """Memory this process can still take on the host: /proc/meminfo's MemAvailable, capped by the cgroup
    limit (a container's) less its usage; None where neither can be read (not Linux)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2 ** 60:  # "max" / a huge number: no limit
            left = max(0, int(limit) - usage)
            avail = left if avail is None else min(avail, left)
        break
    return avail


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """The planner's estimate for a run: ``per_rank`` bytes on its fullest rank (``breakdown``: GiB by
    kind), ``here`` bytes for the ranks on this machine's memory (``where``: "host" or "GPU"), what
    ``available`` there is (None: unknown) and the ``layout`` the estimate is for."""

    per_rank: float
    here: float
    available: int | None
    where: str
    local_ranks: int
    breakdown: dict
    layout: str

    @property
    def fits(self) -> bool:
        return self.available is None or self.here <= self.available

    def describe(self, verdict: bool = False) -> str:
        """One line: the estimate, its parts, what is available; ``verdict``: and whether the run would start."""
        parts = ", ".join(f"{k} {_size(v * GIB)}" for k, v in self.breakdown.items() if k != "total" and v > 0)
        ranks = f"; {_size(self.here)} for the {self.local_ranks} ranks on this host" \
            if self.where == "host" and self.local_ranks > 1 else ""
        have = "unknown" if self.available is None else _size(self.available)
        said = "" if not verdict or self.fits else (" -- does not fit: tpkernels train refuses it "
                                                     "(training.check_memory false starts anyway)")
        return (f"memory (planner estimate, {self.layout}): {_size(self.per_rank)} on the fullest rank ({parts})"
                f"{ranks}; {self.where} memory available: {have}{said}")


def _size(n: float) -> str:
    """Bytes as GiB (2 decimals) from 1 GiB up, else MiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.2f} MiB"


def run_memory(cfg: TrainConfig, world: int) -> MemoryNeed:
    """The planner's memory estimate for ``cfg`` on ``world`` ranks against this machine's memory."""
    import torch  # noqa: PLC0415

    from tpkernels.planner.memory import peak_memory, stage_memory  # noqa: PLC0415

    mc = cfg.model_config()
    # the layout's own errors first (a world it does not divide, heads it does not split), as the run says them
    cfg.parallel.validate(world_size=world, key_prefix="parallel.", **mc.layout_rules(cfg.data.seq_length))
    pc = cfg.parallel_config(world)
    gpu = torch.cuda.is_available()
    precision = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16", "fp64": "fp32"}.get(cfg.training.precision, "fp32")
    train = planner_setup(cfg, pc.global_batch_size, precision)
    scale = 2.0 if cfg.training.precision == "fp64" else 1.0
    peak = peak_memory(mc, train, pc)

    def total(m):  # the model's bytes (doubled in fp64), then the process's own
        return (m.total - m.runtime) * scale + (m.runtime if gpu else CPU_PROCESS_BYTES)

    breakdown = {k: v * scale for k, v in peak.as_gib().items() if k not in ("runtime", "total")}
    breakdown["runtime" if gpu else "process"] = (peak.runtime if gpu else CPU_PROCESS_BYTES) / GIB
    if gpu:
        free, _ = torch.cuda.mem_get_info()
        return MemoryNeed(total(peak), total(peak), free, "GPU", 1, breakdown, pc.short())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local >= world:  # every rank on this host: each stage's ranks hold that stage's share
        here = sum(total(stage_memory(mc, train, pc, s)) for s in range(pc.pp)) * (world // pc.pp)
    else:
        here = total(peak) * local
    return MemoryNeed(total(peak), here, host_available_bytes(), "host", min(local, world), breakdown, pc.short())


def check_memory(cfg: TrainConfig, world: int) -> MemoryNeed:
    """:func:`run_memory`, refused with a ValueError naming the keys to turn when it does not fit."""
    need = run_memory(cfg, world)
    if need.fits or not cfg.training.check_memory:
        return need
    mc = cfg.model_config()
    raise ValueError(
        f"the run does not fit in this machine's memory: {need.describe()}. The model is {mc.describe()} in "
        f"{cfg.training.precision}. Turn: model.name or model.layers / model.hidden / model.ffn (a smaller model; "
        f"without model flags the run builds the {TrainConfig().model.name} preset), training.precision (bf16 stores "
        "16-bit weights), model.finetune lora (trains adapters only), parallel.tp / parallel.pp on more devices "
        "(each rank holds a share), parallel.micro_batch_size or data.seq_length (activations); or "
        "training.check_memory false to start anyway (the estimate is the planner's, not a measurement)")


__all__ = ["MemoryNeed", "check_memory", "host_available_bytes", "planner_setup", "run_memory"]
