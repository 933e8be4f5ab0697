"""Host-side collectives go through ``tpkernels.parallel.control``, which puts their tensors on the
device the group's backend takes (NCCL refuses CPU tensors; this CPU suite never meets NCCL).

* A static scan fails on any ``torch.distributed`` collective in the package outside that module
  and the data-plane functions listed below (those move model tensors, already on the model's
  device). A new entry needs a reviewer's reason.
* A ``cuda:gloo`` process group accepts only CUDA tensors, as NCCL does: the helper chooses CUDA
  for it (and CPU for gloo), and the raw CPU all-reduce that autotune used to make fails on it
  with NCCL's message.
* On gloo the helpers give the right values at world sizes 1 to 4.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# torch.distributed's collectives and point-to-point calls, and our two thin wrappers of them
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_into", "reduce_scatter_into",
}
WRAPPERS = {"all_gather_into", "reduce_scatter_into"}

# module → functions that move model data (activations, gradients, K/V, logits statistics) on the
# model's device: the data plane, not control
DATA_PLANE = {
    "tpkernels/parallel/collectives.py": {"all_gather_into", "reduce_scatter_into"},
    "tpkernels/parallel/mappings.py": {"all_reduce", "all_gather_dim", "reduce_scatter_dim", "forward", "backward"},
    "tpkernels/functional/tp_linear.py": {"backward"},
    "tpkernels/functional/gemm_comm.py": {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"},
    "tpkernels/functional/linear_cross_entropy.py": {"_all_reduce", "_chunk_pass"},
    "tpkernels/functional/vocab_parallel.py": {"_all_reduce"},
    "tpkernels/functional/context_parallel_algos.py": {"_exchange", "_direct", "_all_to_all"},
    # MoE token rows and, in the same transfer, the per-expert counts, on the model's device
    "tpkernels/functional/moe_dispatch.py": {"_all_to_all"},
    # expert TP: the received MoE rows gathered over TP and the partial results reduce-scattered back
    "tpkernels/functional/moe_expert_tp.py": {"_all_gather_rows", "_reduce_scatter_rows"},
    "tpkernels/models/grad_sync.py": {"coalesced_all_reduce", "_launch"},
    "tpkernels/pipeline/p2p.py": {"*"},  # the pipeline's P2P engine: activations and gradients
    # the TP agreement of FP8 amaxes: device tensors, in the middle of a linear's forward or backward (the
    # FP8 scales stay on the device)
    "tpkernels/quant/fp8_state.py": {"_agree_amax"},
    # the planner times the collectives themselves, on tensors of the control device
    "tpkernels/planner/measure.py": {"_allreduce_worker", "_allreduce_worker.exchange",
                                     "_contended_worker.per_iteration"},
}


def _raw_collective(call: ast.Call) -> str | None:
    """The collective a call makes directly: ``dist.X(...)`` / ``torch.distributed.X(...)``, or one of
    our wrappers called by name."""
    fn = call.func
    if isinstance(fn, ast.Attribute) and fn.attr in COLLECTIVES:
        base = fn.value
        if isinstance(base, ast.Name) and base.id == "dist":
            return fn.attr
        if isinstance(base, ast.Attribute) and base.attr == "distributed":
            return fn.attr
    if isinstance(fn, ast.Name) and fn.id in WRAPPERS:
        return fn.id
    return None


def collective_calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function as a.b, collective) of every direct collective call in ``path``."""
    found, stack = [], []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            stack.append(node.name)
            self.generic_visit(node)
            stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            name = _raw_collective(node)
            if name:
                found.append((node.lineno, ".".join(stack) or "<module>", name))
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text()))
    return found


def test_every_host_side_collective_goes_through_the_helper():
    outside = []
    for path in sorted((ROOT / "tpkernels").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tpkernels/parallel/control.py":
            continue
        allowed = DATA_PLANE.get(rel, set())
        for line, func, name in collective_calls(path):
            if "*" not in allowed and func not in allowed:
                outside.append(f"{rel}:{line} {func}() calls {name}")
    assert not outside, ("host-side collectives outside tpkernels.parallel.control (NCCL refuses CPU tensors: use "
                         "its helpers, or list a data-plane function in DATA_PLANE with a reason):\n  "
                         + "\n  ".join(outside))


def test_the_scan_sees_a_raw_collective(tmp_path):
    """The scan itself: a CPU-tensor all-reduce like autotune's old ``_agree`` is found."""
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        def _agree(flag):
            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            torch.distributed.barrier()
    """))
    assert [(f, n) for _, f, n in collective_calls(src)] == [("_agree", "all_reduce"), ("_agree", "barrier")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_device_follows_the_backend_of_a_group_that_refuses_cpu_tensors():
    """``cuda:gloo`` (CUDA tensors only, as NCCL) → the helper picks CUDA; the package's plain gloo
    subgroup → CPU. Without a GPU no CUDA collective can run, but the raw CPU all-reduce must fail
    with NCCL's refusal, which is what every autotune run on GPUs hit before the helper."""
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}")
        dist.init_process_group(backend="cuda:gloo", rank=0, world_size=1)
        from tpkernels.parallel import control
        print("world", control.control_device().type)
        print("gloo", control.control_device(dist.new_group([0], backend="gloo")).type)
        try:
            dist.all_reduce(torch.ones(1))
            print("cpu all_reduce ran")
        except RuntimeError as e:
            print("refused:", e)
        dist.destroy_process_group()
    """)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "world cuda" in lines and "gloo cpu" in lines, out.stdout
    assert any(ln.startswith("refused:") and "device type cpu" in ln for ln in lines), out.stdout


def _helpers_on_rank(rank, world):
    import torch

    from tpkernels.parallel import control

    assert control.control_device().type == "cpu"
    total, big = control.all_reduce_values([rank + 1, -rank], "sum")[0], control.all_reduce_values([rank], "max")[0]
    t = torch.full((3,), float(rank + 1))
    control.all_reduce_(t, "min")
    ints = control.all_gather_ints(torch.tensor([rank, 10 * rank]))
    objs = control.all_gather_objects({"r": rank})
    name = control.broadcast_object(f"from {rank}")
    control.barrier()
    return (total, big, t.tolist(), ints.tolist(), objs, name, control.agree_all(rank != 1),
            control.agree_any(rank == world - 1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_helpers_give_the_same_answer_on_every_rank(rank_pool, world):
    results = rank_pool(world).run(_helpers_on_rank)
    for total, big, t, ints, objs, name, all_, any_ in results:
        assert total == sum(range(1, world + 1)) and big == world - 1
        assert t == [1.0, 1.0, 1.0]
        assert ints == [[r, 10 * r] for r in range(world)]
        assert objs == [{"r": r} for r in range(world)] and name == "from 0"
        assert all_ == (world == 1) and any_ is True
