"""benchmarks/gpu_check.sh's CPU dry run: the whole script, every CUDA step skipped with its reason,
what the CPU can check run (the script's syntax, the preflight, the main job's command line through
``tpkernels train --dry-run``, the roofline), exit 0, each step's result in $OUT/steps.tsv."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    took = time.perf_counter() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    print(f"dry run took {took:.0f} s")
    with open(tmp_path / "steps.tsv") as f:
        steps = {row["step"]: row for row in csv.DictReader(f, delimiter="\t")}
    ran = {name for name, row in steps.items() if row["status"] == "ok"}
    skipped = {name for name, row in steps.items() if row["status"] == "skipped"}
    assert set(steps) == ran | skipped, steps  # nothing failed
    for name in ("this script's syntax (bash -n)", "main job's command line (tpkernels train --dry-run, the same flags)",
                 "step 0 check's command line (tpkernels train --dry-run, the same flags)",
                 "SFT's command line (tpkernels train --dry-run, the same flags)",
                 "DPO's command line (tpkernels train --dry-run, the same flags)"):
        assert name in ran, steps
    assert any(n.startswith("preflight (") for n in ran) and any(n.startswith("roofline") for n in ran), steps
    # every CUDA step says why it did not run, the build included
    for what in ("build tpkernels._C", "main job: torchrun", "step 0 vs fp64", "cuda-marked tests", "bench: attention",
                 "bench: GEMM + TP comm, virtual TP=8", "bench: context parallel, virtual", "SFT: torchrun",
                 "DPO: torchrun"):
        assert any(n.startswith(what) or what in n for n in skipped), (what, steps)
    assert out.count("skipped: dry run (GPU_CHECK_DRY_RUN=1)") == len(skipped)
    assert not (tmp_path / "build.log").exists()  # the build did not run
    # the main job's flags passed the CLI's checks: the planner's layout for one rank, packed README text
    dry = (tmp_path / "train_nccl_dry_run.log").read_text()
    assert "layout auto:" in dry and "layout: TP1" in dry and "README.md" in dry, dry
    assert "preflight passed" in (tmp_path / "preflight.log").read_text()
    # the roofline ran on the CPU: floors written, the measured column empty
    with open(tmp_path / "roofline_h200.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["floor_us"] and r["measured_us"] == "" for r in rows)
