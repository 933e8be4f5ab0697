"""How long the commands take to start: `tpkernels --help`, `tpkernels plan`, and a 2-step tiny run in one
process and on 2 and 4 local ranks (`--nproc`), where imports are most of the time. Each command runs
``--repeat`` times, the median is reported; the table goes to stdout and to
benchmarks/results/startup.csv. Compare two versions by running this script in each checkout, back to
back, on the same machine (the figures are CPU seconds of whatever machine runs it).

    python benchmarks/startup.py --repeat 3
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab", "97",
        "--seq-length", "16", "--steps", "2", "--progress", "false"]
COMMANDS = {
    "tpkernels --help": ["--help"],
    "tpkernels plan (Llama-3-70B, 64 H100)": ["plan", "--model", "Llama-3-70B", "--gpu", "H100-SXM", "--nodes", "8",
                                              "--global-batch", "512", "--seq-len", "8192", "--top", "3"],
    "tpkernels train, 1 process": ["train", *TINY],
    "tpkernels train --nproc 2": ["train", *TINY, "--nproc", "2"],
    "tpkernels train --nproc 4": ["train", *TINY, "--nproc", "4"],
}


def _exe() -> list[str]:
    found = shutil.which("tpkernels", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "tpkernels.cli"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.csv"))
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, argv in COMMANDS.items():
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                subprocess.run([*_exe(), *argv], cwd=work, env=env, check=True, capture_output=True)
                times.append(time.perf_counter() - t0)
            rows.append({"command": name, "median_s": round(statistics.median(times), 2),
                         "min_s": round(min(times), 2), "runs": args.repeat})
            print(f"{name:42s} {rows[-1]['median_s']:6.2f} s (min {rows[-1]['min_s']:.2f})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
