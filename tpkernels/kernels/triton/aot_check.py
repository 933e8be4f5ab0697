"""Compile every shipped Triton kernel configuration for given GPU targets, without a GPU.

    python -m tpkernels.kernels.triton.aot_check --arch 80 90 [--json]

The interpreter (TRITON_INTERPRET=1) accepts code the GPU compiler rejects (wrong constexpr
use, unsupported dtype casts, too much shared memory...). This runs the real compiler pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) for each (kernel, signature, constants)
listed by the kernel modules' ``compile_specs()``, and prints registers, spills and shared
memory of each. Exit code 1 if any fails. Must run with TRITON_INTERPRET unset (the kernels
must be JITFunctions, not interpreted ones): it clears the variable before importing them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback


def compile_all(archs: list[int], modules: list[str] | None = None, warp_size: int = 32) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("aot_check needs TRITON_INTERPRET unset; run it in its own process")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from tpkernels.kernels.triton import KERNEL_MODULES  # noqa: PLC0415

    results = []
    for mod_name in modules or KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for kernel, signature, constants, num_warps in mod.compile_specs():
            for arch in archs:
                row = {"module": mod_name, "kernel": kernel.__name__, "arch": f"sm_{arch}",
                       "signature": ",".join(f"{k}:{v}" for k, v in signature.items() if v != "constexpr"),
                       "constants": ",".join(f"{k}={v}" for k, v in constants.items()), "num_warps": num_warps}
                try:
                    src = ASTSource(fn=kernel, signature=signature, constexprs=constants)
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, warp_size),
                                              options={"num_warps": num_warps})
                    meta = compiled.metadata
                    row.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]), shared=meta.shared,
                               n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
                except Exception as e:  # report every failure, not just the first
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions (default: 80 90)")
    ap.add_argument("--module", nargs="*", help="only these kernel modules")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    results = compile_all(args.arch, args.module)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = (f"ok  cubin={r['cubin_bytes']}B shared={r['shared']}B" if r["ok"] else f"FAIL {r['error']}")
            print(f"{r['arch']:6} {r['kernel']:28} {r['constants']:40} {status}")
        print(f"{sum(r['ok'] for r in results)} compiled, {sum(not r['ok'] for r in results)} failed")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
