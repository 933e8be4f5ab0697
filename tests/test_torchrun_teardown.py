"""Under torchrun, a survivor of a lost rank says so in one line: the RankLostError, exit 1. The trainer
aborts the process groups before raising it (so that peers blocked in a transfer wake up); the
torchrun branch of ``tpkernels train`` must then not destroy them again (torch raises "Process group
cannot be None" over the real error)."""

from __future__ import annotations

import socket
import subprocess
import sys

from test_bad_inputs_cli import TINY

SURVIVOR = """
import sys
from tpkernels.train import cli
from tpkernels.train.failures import RankLostError, abort_process_groups

def lost(cfg, candidates=None):  # what Trainer does when a peer is gone: abort, then name it
    abort_process_groups()
    raise RankLostError("rank 1 was lost during step 3 (its process is gone); restart from step_00000002", [1])

cli.rank_main = lost
sys.exit(cli.main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_survivor_under_torchrun_prints_one_clean_message():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "CUDA_VISIBLE_DEVICES": ""}
    import os

    proc = subprocess.run([sys.executable, "-c", SURVIVOR, *TINY], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "tpkernels train: error: rank 1 was lost during step 3" in err, err
    assert "Process group cannot be None" not in err and "Traceback" not in err, err
    assert err.count("error:") == 1, err
