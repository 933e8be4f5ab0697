"""Host reads of a training step: a fixed few per step, none per micro-batch.

On a GPU every read of a device tensor's value (``item``, ``tolist``, ``bool``, ``int``, ``float``)
stalls the host until the device catches up. The step reads two values: the loss and the gradient
norm (clipping); on logging steps (``logging.log_every``) of a multi-rank run the worst rank's
comm/compute ratio (+1 for the DP×CP sum of the reported loss, +1 for the fp16 overflow check). The
loss's denominator, the global count of targets, is counted on the host from the batch. The inputs are checked once per step
on the host, where they are born (tpkernels.models.inputs, given host tensors: no device
read), so the layers check nothing per micro-batch. Counted here by patching those methods on
the step path of our code (torch's own optimizer internals and the CPU-only reference kernels,
which never run on a GPU, are left out)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from tpkernels.train import TrainConfig, Trainer

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
# read host tensors by design: the trainer passes host tensors, documents are found on the host, and a
# device copy of those boundaries is trusted by varlen attention (check_cu_seqlens reads host tensors only)
# (the data layer's batch and the trainer's counts of it are host tensors too)
HOST_CHECKS = ("_check_ranges", "_positions", "stage_target", "from_documents", "check_cu_seqlens", "prepare_batch",
               "shard_batch", "stream_rows")
PER_STEP = 2  # loss, gradient norm; a logging step of several ranks adds the worst rank's comm/compute ratio


def _config(microbatches: int, source: str = "random", log_every: int = 10, **parallel) -> TrainConfig:
    return TrainConfig.from_values({
        "model": {"name": "Llama-2-7B", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48,
                  "vocab": 300},
        "data": {"seq_length": 32, "source": source}, "logging": {"progress": False, "log_every": log_every},
        "training": {"steps": 4}, "parallel": {"num_microbatches": microbatches, **parallel}})


def count_reads(trainer: Trainer) -> collections.Counter:
    """The host reads one train_step makes from tpkernels code, by (method, file, function)."""
    from tpkernels.parallel.consistency import check_ranks

    counts = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        original = saved[name]

        def read(self, *a, **k):
            frame = traceback.extract_stack(limit=3)[-2]
            where = frame.filename.replace("\\", "/")
            if "/tpkernels/" in where and "/kernels/reference.py" not in where and "/site-packages/torch/" not in \
                    where:
                counts[(name, where.rsplit("/tpkernels/", 1)[-1], frame.name)] += 1
            return original(self, *a, **k)
        return read

    with check_ranks(False):  # the per-op cross-rank check is the debug switch, off in production
        trainer.train_step()  # warm: caches, first-call work
        trainer.train_step()  # the first step after the warm-up logs (the comm/compute ratio is judged there)
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        try:
            trainer.train_step()
        finally:
            for name, f in saved.items():
                setattr(torch.Tensor, name, f)
    return counts


def _on_device(counts) -> int:
    return sum(v for (name, _, fn), v in counts.items() if fn not in HOST_CHECKS)


@pytest.mark.parametrize("source", ["random", "packed"])
def test_a_step_reads_the_device_a_fixed_few_times_whatever_its_microbatches(tmp_path, source):
    if source == "packed":
        (tmp_path / "docs.txt").write_text("a short document\n\n" * 60 + "another one, a bit longer\n\n" * 40)
        source = str(tmp_path / "docs.txt")
    one, four = (count_reads(Trainer(_config(m, source))) for m in (1, 4))
    assert _on_device(one) == _on_device(four) == PER_STEP, (one, four)
    assert {fn for (_, _, fn) in four} - set(HOST_CHECKS) <= {"step", "clip_grads_"}, four


def _tp_worker(rank, world, microbatches, log_every=10):
    counts = count_reads(Trainer(_config(microbatches, log_every=log_every, tp=2, sequence_parallel=True)))
    return _on_device(counts), sorted(str(k) for k in counts)


def test_tensor_parallel_steps_read_no_more(rank_pool):
    """The counted step is step 2: not a logging step at log_every 10, one at log_every 1 (+ the
    comm/compute ratio's all-reduce)."""
    one, four = (rank_pool(2).run(_tp_worker, m, timeout=300) for m in (1, 4))
    assert [c for c, _ in one] == [c for c, _ in four] == [PER_STEP] * 2, (one, four)
    logged = rank_pool(2).run(_tp_worker, 2, 1, timeout=300)
    assert [c for c, _ in logged] == [PER_STEP + 1] * 2, logged
    assert all("all_reduce_values" in " ".join(names) for _, names in logged), logged


def test_host_tensors_are_checked_on_the_host():
    """The inputs' checks read host tensors: the trainer hands the model its CPU batch."""
    trainer = Trainer(_config(2))
    seen = []
    batch = trainer.model._batch

    def spy(input_ids, *a, **k):
        seen.append(input_ids.device.type)
        return batch(input_ids, *a, **k)

    trainer.model._batch = spy
    trainer.train_step()
    assert seen == ["cpu"]
