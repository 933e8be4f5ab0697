"""Compile every shipped Triton kernel configuration for given GPU targets, without a GPU.

    python -m tpkernels.kernels.triton.aot_check --arch 80 90 [--json]

The interpreter (TRITON_INTERPRET=1) accepts code the GPU compiler rejects (wrong constexpr
use, unsupported dtype casts, too much shared memory...). This runs the real compiler pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) for each (kernel, signature, constants)
listed by the kernel modules' ``compile_specs(arch)`` (an optional fifth element names the
arguments the JIT would specialize as divisible by 16 at run time: pointers and strides of
aligned tensors; without it the compiler cannot vectorize or pipeline the loads, and the report
would not be the kernel that runs), and prints registers, spills and shared
memory of each. A config fails when it does not compile, or when it needs more shared memory
than one block may use on that arch (the launch would fail with "out of resources"); register
spills are reported, not failed. Exit code 1 if any fails. Must run with TRITON_INTERPRET unset
(the kernels must be JITFunctions, not interpreted ones): it clears the variable before importing
them. ``--full`` asks modules for their whole variant cross product (minutes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback


# Largest shared memory one block can opt into (CUDA programming guide, compute capabilities table).
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def resource_usage(cubin: bytes) -> dict:
    """{"regs": registers per thread, "stack": stack bytes per thread (> 0 means register spills)} from
    the cuobjdump that ships with Triton; {} when it is not there."""
    import triton.backends.nvidia as nvidia_backend  # noqa: PLC0415

    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(m.group(1)), "stack": int(m.group(2))} if m else {}


def compile_all(archs: list[int], modules: list[str] | None = None, warp_size: int = 32,
                full: bool = False) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("aot_check needs TRITON_INTERPRET unset; run it in its own process")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from tpkernels.kernels.triton import KERNEL_MODULES  # noqa: PLC0415

    results = []
    for mod_name in modules or KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for arch in archs:
            for kernel, signature, constants, options, *divisible in mod.compile_specs(arch, full=full):
                row = {"module": mod_name, "kernel": kernel.__name__, "arch": f"sm_{arch}",
                       "signature": ",".join(f"{k}:{v}" for k, v in signature.items() if v != "constexpr"),
                       "constants": ",".join(f"{k}={v}" for k, v in constants.items()), **options}
                try:
                    names = list(signature)
                    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (divisible[0] if divisible else ())}
                    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, warp_size), options=options)
                    meta = compiled.metadata
                    usage = resource_usage(compiled.asm["cubin"])
                    row.update(cubin_bytes=len(compiled.asm["cubin"]), shared=meta.shared,
                               regs=usage.get("regs"), stack=usage.get("stack"))
                    limit = MAX_SHARED_BYTES.get(arch)
                    if limit is not None and meta.shared > limit:
                        row.update(ok=False, error=f"needs {meta.shared} B of shared memory, sm_{arch} allows {limit}")
                    else:
                        row.update(ok=True)
                except Exception as e:  # report every failure, not just the first
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions (default: 80 90)")
    ap.add_argument("--module", nargs="*", help="only these kernel modules")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    ap.add_argument("--full", action="store_true", help="every variant of every config (slow)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    results = compile_all(args.arch, args.module, full=args.full)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = (f"ok  cubin={r['cubin_bytes']}B shared={r['shared']}B regs={r['regs']} "
                      f"stack={r['stack']}B" if r["ok"] else f"FAIL {r['error']}")
            opts = f"w{r['num_warps']}s{r.get('num_stages', '-')}"
            print(f"{r['arch']:6} {r['kernel']:24} {r['constants']:70} {opts:6} {status}")
        print(f"{sum(r['ok'] for r in results)} compiled, {sum(not r['ok'] for r in results)} failed")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
