"""The GPU check's preflight: is this machine's software one the package runs on? (under 20 s)

    python benchmarks/preflight.py            # before the build: versions, imports, Triton, a collective
    python benchmarks/preflight.py --built    # after the build: tpkernels._C loads (with CUDA on a GPU)

Stops at the first failure with its reason and exit code 1, so that `benchmarks/gpu_check.sh`
gives the rest of a short GPU lease to fixing it instead of to an import error ten minutes in.
Without a GPU (a dry run, `make compat`) the Triton kernel runs under the interpreter and the
collective on gloo; what needs CUDA is reported as skipped.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import pkgutil
import re
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail(what: str, why: str) -> None:
    print(f"PREFLIGHT FAILED at {what}: {why}", flush=True)
    sys.exit(1)


def minimums() -> dict[str, str]:
    """pyproject.toml's lower bounds, by distribution name."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["triton"]
    out = {}
    for d in deps:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", d)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def _tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_versions() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    need_py = re.search(r">=\s*([0-9.]+)", data["project"]["requires-python"]).group(1)
    if sys.version_info[:2] < _tuple(need_py)[:2]:
        fail("versions", f"Python {sys.version.split()[0]} < {need_py} (pyproject.toml)")
    line = [f"python {sys.version.split()[0]}"]
    for dist, low in minimums().items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            fail("versions", f"{dist} is not installed (pyproject.toml asks for >= {low})")
        if _tuple(have) < _tuple(low):
            fail("versions", f"{dist} {have} < {low} (pyproject.toml's minimum)")
        line.append(f"{dist} {have}")
    print("versions: " + ", ".join(line), flush=True)


def check_imports() -> None:
    import tpkernels

    names = ["tpkernels"] + [m.name for m in pkgutil.walk_packages(tpkernels.__path__, "tpkernels.")
                             if not m.name.endswith("__main__")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (any import error is the finding)
            fail("imports", f"import {name}: {type(e).__name__}: {e}")
    print(f"imports: {len(names)} modules of tpkernels", flush=True)


def check_triton(on_gpu: bool) -> None:
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernel below
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _add_kernel(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=ok) + tl.load(y + offs, mask=ok), mask=ok)

    dev = "cuda" if on_gpu else "cpu"
    x, y = torch.randn(1000, device=dev), torch.randn(1000, device=dev)
    out = torch.full_like(x, float("nan"))
    try:
        _add_kernel[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
    except Exception as e:  # noqa: BLE001
        fail("triton", f"a vector add did not compile or run: {type(e).__name__}: {e}")
    if not torch.equal(out, x + y):
        fail("triton", "a vector add gave a wrong result")
    print(f"triton {triton.__version__}: a kernel compiled and ran on {dev}"
          f"{'' if on_gpu else ' (interpreter: no GPU here)'}", flush=True)


def check_collective(on_gpu: bool) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if on_gpu else "gloo"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(backend, init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            t = torch.ones(3, device="cuda" if on_gpu else "cpu")
            dist.all_reduce(t)
            if on_gpu:
                torch.cuda.synchronize()
            if t.tolist() != [1.0, 1.0, 1.0]:
                fail("collective", f"an all-reduce on one rank gave {t.tolist()}")
        finally:
            dist.destroy_process_group()
    print(f"collective: an all-reduce on one {backend} rank", flush=True)


def check_extension(on_gpu: bool) -> None:
    from tpkernels._extension import build_info, extension, extension_error

    if extension() is None:
        fail("extension", f"tpkernels._C does not load: {extension_error()}")
    info = build_info()
    if on_gpu and not info.get("with_cuda"):
        fail("extension", "tpkernels._C was built without CUDA on a GPU machine")
    print(f"extension: tpkernels._C loads ({'CUDA ' + info.get('cuda_archs', '') if info.get('with_cuda') else 'C++ only'})",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--built", action="store_true", help="after the build: check that tpkernels._C loads")
    args = ap.parse_args()
    t0 = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    import torch

    on_gpu = torch.cuda.is_available()
    if args.built:
        check_extension(on_gpu)
    else:
        check_versions()
        check_triton(on_gpu)  # before the imports: under the interpreter TRITON_INTERPRET must come first
        check_imports()
        check_collective(on_gpu)
        if not on_gpu:
            print("no GPU here: the CUDA steps of gpu_check.sh are skipped", flush=True)
    print(f"preflight passed in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
