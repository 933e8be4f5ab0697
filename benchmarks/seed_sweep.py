"""Seed sweep: the randomised kernel and multi-rank tests under N fresh seeds each, in one pytest session,
and a table of the (test, seed) pairs that failed with the command that replays each.

    .venv/bin/python benchmarks/seed_sweep.py -n 20                      # the default selection, 20 seeds a test
    .venv/bin/python benchmarks/seed_sweep.py -n 5 tests/test_rotary.py  # any pytest arguments instead
    make seed-sweep N=20

Every test draws its inputs from the seed ``tests/conftest.py`` gives it (and the ranks of its rank pool
are seeded with it before each call); ``--seeds N`` there repeats each collected test under N seeds of its
own from os.urandom. One session, not N runs of the suite: the rank pools start once, the Triton
interpreter imports once. A failure prints ``TPK_SEED=<seed> .venv/bin/python -m pytest '<test>'``,
which replays it. The default selection (``DEFAULT``) is the multi-rank and kernel tests that compare
against a reference under a tolerance, where a seed can find an unlucky draw (docs/testing.md has the
last sweep's command, selection and result). The exit status is pytest's: 0 when every seed passed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the kernels against the float64 oracle (FlashAttention rule), and multi-rank numerics on gloo: TP/SP
# linears (dense, NF4, FP8), GEMM+communication, context-parallel attention, pipeline schedules, model
# layouts, DPO layouts. About 1.5 minutes a seed on an idle 2-core machine; left out for time: the whole
# attention grid of test_attention_triton.py, test_gemm_comm_fused.py and test_context_parallel_model.py
# (together 1.8 minutes a seed more), and the training-job tests (test_train.py: minutes a seed).
DEFAULT = [
    "tests/test_attention_triton.py::test_seqlen_q_differs_from_seqlen_k",
    "tests/test_attention_triton.py::test_forward_backward_grid",
    "tests/test_attention_triton.py::test_sliding_windows",
    "tests/test_attention_api.py",
    "tests/test_bias_gelu_cpp.py",
    "tests/test_rms_norm_swiglu.py",
    "tests/test_layer_norm.py",
    "tests/test_rotary.py",
    "tests/test_linear_cross_entropy.py",
    "tests/test_gemm_comm.py",
    "tests/test_tp_layers.py",
    "tests/test_context_parallel.py",
    "tests/test_pipeline_runtime.py",
    "tests/test_preference_loss.py",
    "tests/test_dpo.py::test_every_layout_trains_what_one_process_trains",
    "tests/test_tp_pipeline.py",
    "tests/test_model_layouts.py",
    "tests/test_loss_normalisation.py",
    "tests/test_sequence_logps.py",
    "tests/test_nf4_linear.py",
    "tests/test_weight_grad.py",
    "tests/test_fp8_linear.py",
    "tests/test_fp8_quant.py",
    "tests/test_tp_linear_formats.py",
]
SEED_ID = re.compile(r"\[seed\d+\]|(?<=\[)seed\d+-|-seed\d+(?=[\]-])")  # as tests/conftest.py's


def pytest_selection(args: list[str]) -> list[str]:
    """A parametrised test id (``path::test[params]``) has the sweep's seed among its parameters once
    swept: it is collected by its function and kept by ``--sweep-id``."""
    out = []
    for a in args:
        if "::" in a and a.endswith("]") and "[" in a:
            out += [a[:a.index("[")], f"--sweep-id={a}"]
        else:
            out.append(a)
    return out


def replay_id(nodeid: str) -> str:
    """The test's own id: the sweep's ``seed<N>`` part of the parameters removed."""
    return SEED_ID.sub("", nodeid, count=1)


class Collector:
    """A pytest plugin: every test's outcome under its seed."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}
        self.failures: list[tuple[str, int | None, str]] = []  # (test, seed, first line of the error)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.failed or report.skipped:  # a teardown error fails a passed test
            self.outcomes[report.nodeid] = report.outcome
        if report.failed:
            seed = next((v for k, v in report.user_properties if k == "seed"), None)
            crash = getattr(report.longrepr, "reprcrash", None)  # pytest's one-line summary of the error
            why = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
            self.failures.append((replay_id(report.nodeid), seed, f"{report.when}: {why.splitlines()[0]}"[:160]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--seeds", type=int, default=20, help="seeds per test (default 20)")
    ap.epilog = "Any other arguments (tests, pytest options) go to pytest in their order; none: DEFAULT."
    args, pytest_args = ap.parse_known_args(argv)  # with no positional declared, the rest stays in order
    if args.seeds < 1:
        raise SystemExit(f"--seeds ({args.seeds}) must be a positive integer")
    os.chdir(ROOT)
    selection = pytest_args or DEFAULT
    collector = Collector()
    t0 = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--seeds", str(args.seeds), *pytest_selection(selection)],
                       plugins=[collector])
    minutes = (time.perf_counter() - t0) / 60
    runs = len(collector.outcomes)
    passed = sum(1 for o in collector.outcomes.values() if o == "passed")
    print(f"\nseed sweep: {args.seeds} seeds a test, {runs} runs ({passed} passed, {len(collector.failures)} "
          f"failed) in {minutes:.1f} min; selection: {' '.join(selection)}")
    if collector.failures:
        print("\nfailing (test, seed), each replayed by its command:")
        for test, seed, why in collector.failures:
            print(f"  {test}  seed {seed}\n      {why}\n      TPK_SEED={seed} .venv/bin/python -m pytest '{test}'")
    elif code != 0:  # 2-5: interrupted, an internal or usage error, nothing collected
        print(f"pytest stopped with exit code {int(code)} ({code.name if hasattr(code, 'name') else code}): "
              "see its output above")
    else:
        print("no failing seed")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
