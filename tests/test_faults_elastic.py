"""Faults through torch's elastic launcher, as it promises: a rank SIGKILLed in mid-step under
``max_restarts`` restarts the group, which resumes from the latest complete checkpoint exactly; two
launcher agents of two processes each meet by c10d rendezvous on localhost, as two nodes would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from test_train import small
from tpkernels.train.launch import launch

KW = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, steps=8)


def _train(kw: dict, victim: int | None, at_step: int):
    """One rank of a run; on the first attempt ``victim`` kills itself (SIGKILL) in mid-step
    ``at_step``: after its backward, before the gradient reductions its peers wait in."""
    import torch.distributed as dist

    from tpkernels.train.trainer import Trainer

    trainer = Trainer(small(**kw))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    finish = trainer.model.finish_grad_sync

    def dying(*a, **k):
        if attempt == 0 and dist.get_rank() == victim and trainer.step_index == at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(*a, **k)

    trainer.model.finish_grad_sync = dying
    history = trainer.train()
    weights = trainer.model.to_hf_state_dict()
    return attempt, [h["step"] for h in history], [h["loss"] for h in history], weights


def _train_uninterrupted(rank, world, kw):
    """The reference run on the session's rank pool (an elastic launch of 4 ranks costs ~10 s of start-up
    on 2 cores; the same config gives the same losses and weights under either launcher)."""
    return _train(kw, None, 0)


def _merged(outs) -> dict:
    return {k: v for o in outs for k, v in o[3].items()}


def test_a_rank_killed_mid_step_restarts_the_group_which_resumes_exactly(tmp_path, rank_pool):
    full = rank_pool(4).run(_train_uninterrupted, KW, timeout=300)
    again = launch(_train, 4, {**KW, "save_dir": str(tmp_path), "save_every": 2}, 1, 5, max_restarts=1)
    assert [o[0] for o in again] == [1, 1, 1, 1], "every rank runs a second attempt"
    assert again[0][1] == [4, 5, 6, 7], "the restart resumes from step 4, the latest complete checkpoint"
    assert again[0][2] == full[0][2][4:], "the same losses as the uninterrupted run"
    a, b = _merged(full), _merged(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the same final weights"


def _wait_listening(port: int, proc, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launcher_agents_meet_by_c10d_rendezvous_as_two_nodes_would(tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` twice on localhost: the demo's model at
    TP2×PP2 (a TP group inside each "node", the pipeline across them) equals the single-process step 0."""
    from tpkernels.train.cli import single_process_loss
    from tpkernels.train.config import TrainConfig

    root = Path(__file__).resolve().parents[1]
    config = str(root / "python" / "configs" / "demo_llama_tp2_pp2.yaml")
    flags = ["--steps", "2", "--warmup-steps", "1", "--progress", "false", "--save-dir", str(tmp_path / "ck"), "--save-every", "0"]
    port = _free_port()
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tpk-{port}",
               "-m", "tpkernels.train", "--config", config, *flags,
               "--metrics-file", str(tmp_path / f"metrics{node}.jsonl")]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"}))
        if node == 0:  # the first agent hosts the rendezvous store: the second joins once it listens
            _wait_listening(port, agents[0])
    outs = []
    for a in agents:
        try:
            outs.append(a.communicate(timeout=600))
        finally:
            a.kill()
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    lines = [json.loads(line) for n in range(2) if (tmp_path / f"metrics{n}.jsonl").is_file()
             for line in (tmp_path / f"metrics{n}.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1], "rank 0 (on one of the agents) logs each step once"
    os.chdir(root)  # the config's data source is the README, relative to the repository
    cfg = TrainConfig.load(config, {"training.steps": 2, "optimizer.warmup_steps": 1})
    want = single_process_loss(cfg, cfg.parallel_config(4).global_batch_size)
    assert abs(lines[0]["loss"] - want) <= 1e-5 * max(1.0, abs(want)), (lines[0]["loss"], want)
    assert (tmp_path / "ck" / "step_00000002" / "meta.json").is_file()
    assert any("TP2 PP2 DP1 mbs2 SP: 2 steps: loss" in out for out, _ in outs)



def _kill_in_save_worker(rank, world, folder, victim):
    from tpkernels.train import checkpoint
    from tpkernels.train.failures import RankLostError
    from tpkernels.train.trainer import Trainer

    trainer = Trainer(small(tp=2, pp=2, num_microbatches=2, steps=4, save_dir=folder, save_every=2))
    real = checkpoint.save

    def dying_save(*a, **k):
        if rank == victim and trainer.step_index == 4:
            os._exit(3)  # dies with the save half-way: its peers are inside DCP's collectives
        return real(*a, **k)

    checkpoint.save = dying_save
    t0 = time.monotonic()
    try:
        trainer.train()
    except RankLostError as e:
        return e.ranks, str(e), time.monotonic() - t0
    return None, "finished", time.monotonic() - t0


def test_a_rank_lost_during_a_save_is_named_and_the_previous_checkpoint_kept(tmp_path):
    from tpkernels.parallel.local_ranks import RankExited
    from tpkernels.testing.distributed import RankPool

    from tpkernels.train.checkpoint import latest

    # a pool of its own with a 15 s process-group timeout: a survivor blocked in a gloo send to a rank
    # that left the collective waits for it (the launcher would kill it at once), and the call returns
    # when it has (rank 0 took the whole timeout + ~5 s; ranks 1 and 3, the ones checked, ~5 s). 15 s
    # leaves the start-up rendezvous and the steps' collectives 3x what they took at a load of 10.
    pool = RankPool(4, timeout=15.0).start()
    try:
        out = pool.run(_kill_in_save_worker, str(tmp_path), 2, expect_exit={2}, timeout=120)
    finally:
        pool.close()
    assert isinstance(out[2], RankExited)
    for r in (1, 3):  # rank 0 may be blocked in a gloo send to one of them until the group's timeout
        ranks, msg, took = out[r]
        assert ranks == [2] and "during the checkpoint save after step 4" in msg, (r, msg)
        assert took < 60, (r, took)
        assert "the last complete checkpoint is" in msg and "step_00000002" in msg, msg
    assert latest(tmp_path).name == "step_00000002"
