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

Per config it also reports how the dots compiled (``mma_report``): each ``tl.dot`` of the TTGIR as
``wgmma`` (Hopper's warpgroup MMA, ``warp_group_dot``), ``mma.sync`` (Ampere's MMA, about half
of Hopper's tensor throughput) or ``fma`` (no tensor cores), and whether it sits in a loop (a
hot-loop dot); the PTX's ``wgmma.mma_async`` / ``mma.sync`` instruction counts, TMA bulk tensor
copies (``cp.async.bulk.tensor``) and Ampere async copies (``cp.async``); and the resident blocks
per SM that registers, shared memory and warps allow (``occupancy.blocks_per_sm``).
``violations(rows)`` lists the house rules a config breaks: a hot-loop dot of an sm_90 config
not on wgmma, or a config that spills registers (stack > 0), unless its module's
``AOT_EXCEPTIONS`` lists it with the reason; they are printed, count as failures in the exit
code, and tests/test_triton_aot.py enforces them.
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

from tpkernels.kernels.triton.occupancy import blocks_per_sm


# Largest shared memory one block can opt into (CUDA programming guide, compute capabilities table).
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\w+)[^;]*?(?:\s(0x[0-9a-f]+))?\s*;")


def loop_spills(sass: str) -> int:
    """Local-memory spill instructions (STL/LDL) inside a loop of the SASS: a loop is the address range
    from a backward branch's target to the branch. Spills outside every loop (a register saved before
    the main loop and restored after it) cost a few cycles per program; inside one, every iteration."""
    ops = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _SASS.finditer(sass)]
    loops = [(int(target, 16), addr) for addr, op, target in ops if op == "BRA" and target and int(target, 16) < addr]
    return sum(op in ("STL", "LDL") and any(lo <= addr <= hi for lo, hi in loops) for addr, op, _ in ops)


def resource_usage(cubin: bytes) -> dict:
    """{"regs": registers per thread, "stack": stack bytes per thread (> 0 means register spills),
    "loop_spills": ``loop_spills`` of its SASS} from the cuobjdump that ships with Triton; {} when it
    is not there."""
    import triton.backends.nvidia as nvidia_backend  # noqa: PLC0415

    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", out)
        if not m:
            return {}
        usage = {"regs": int(m.group(1)), "stack": int(m.group(2)), "loop_spills": 0}
        if usage["stack"]:
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
            usage["loop_spills"] = loop_spills(sass)
    return usage


_MMA_ENCODING = re.compile(r"^(#[\w.]+) = #ttg\.nvidia_mma<\{versionMajor = (\d+).*warpsPerCTA = \[(\d+), (\d+)\]"
                           r".*instrShape = \[(\d+), (\d+)")
_DOT_OP = re.compile(r"= (ttng\.warp_group_dot|tt\.dot) ")
_RESULT = re.compile(r"-> tensor<(\d+)x(\d+)x\w+, (#[\w.]+)")
_OPERAND = re.compile(r" : (?:tensor|!ttg\.memdesc)<(\d+)x(\d+)x")
_LOOP = re.compile(r"\bscf\.(for|while)\b")


def mma_report(ttgir: str, ptx: str) -> dict:
    """How the dots of one compiled kernel run. ``dots``: one entry per dot of the TTGIR, in order,
    {"op": "wgmma" | "mma.sync" | "fma", "hot": inside a loop (scf.for / scf.while), "mnk": "MxNxK",
    "replicated": how many warp groups compute the same tile (> 1: a tile smaller than the warps'
    footprint, e.g. 8 warps on a 64-row wgmma: both warpgroups do the same work)};
    ``wgmma`` / ``mma_sync``: instructions in the PTX; ``tma``: bulk tensor copies (TMA) in the PTX;
    ``cp_async``: Ampere-style asynchronous copies (pipelined loads without TMA)."""
    encodings = {}  # name -> (version, warps along M, warps along N, instruction M, instruction N)
    for line in ttgir.splitlines():
        m = _MMA_ENCODING.match(line)
        if m:
            encodings[m.group(1)] = tuple(int(g) for g in m.groups()[1:])
    dots, scopes = [], []  # scopes: one entry per open region, True for a loop body
    for line in ttgir.splitlines():
        op = _DOT_OP.search(line)
        if op:
            res, arg = _RESULT.search(line), _OPERAND.search(line)
            enc = encodings.get(res.group(3)) if res else None
            if op.group(1) == "ttng.warp_group_dot":
                kind = "wgmma"
            else:
                kind = {3: "wgmma", 2: "mma.sync"}.get(enc[0] if enc else None, "fma")
            mnk = f"{res.group(1)}x{res.group(2)}x{arg.group(2)}" if res and arg else "?"
            repl = 1
            if enc and res:  # warps whose tile lies past the result hold copies: the same MMAs done again
                m, n = int(res.group(1)), int(res.group(2))
                repl = max(1, enc[1] * enc[3] // m) * max(1, enc[2] * enc[4] // n)
            dots.append({"op": kind, "hot": any(scopes), "mnk": mnk, "replicated": repl})
        net = line.count("{") - line.count("}")  # attribute dicts open and close on their line
        if net > 0:
            scopes.extend([bool(_LOOP.search(line))] + [False] * (net - 1))
        elif net < 0:
            del scopes[net:]
    return {"dots": dots, "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
            "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx)),
            "tma": len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
            "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\b", ptx))}


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
                               regs=usage.get("regs"), stack=usage.get("stack"), loop_spills=usage.get("loop_spills"),
                               **mma_report(compiled.asm["ttgir"], compiled.asm["ptx"]))
                    row["blocks_per_sm"], row["occupancy_limit"] = blocks_per_sm(
                        arch, options.get("num_warps", 4), row["regs"], meta.shared)
                    limit = MAX_SHARED_BYTES.get(arch)
                    if limit is not None and meta.shared > limit:
                        row.update(ok=False, error=f"needs {meta.shared} B of shared memory, sm_{arch} allows {limit}")
                    else:
                        row.update(ok=True)
                except Exception as e:  # report every failure, not just the first
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                results.append(row)
    return results


def _exception(row: dict, rule: str) -> str | None:
    """The reason row's module gives for breaking ``rule`` ("mma.sync" or "spill") in its
    ``AOT_EXCEPTIONS`` {(rule, kernel name, "K=V,..." constants the row must all have, "arch=sm_90"
    among them to name one arch): reason}, or None."""
    excused = getattr(importlib.import_module(row["module"]), "AOT_EXCEPTIONS", {})
    have = set(row["constants"].split(",")) | {f"arch={row['arch']}"}
    for (r, kernel, needs), reason in excused.items():
        if r == rule and kernel == row["kernel"] and set(filter(None, needs.split(","))) <= have:
            return reason
    return None


def violations(rows: list[dict]) -> list[str]:
    """One line per compiled config that breaks a rule without an exception: a hot-loop dot of an
    sm_90 config that is not a wgmma (mma.sync or FMA), or register spills (stack > 0) on any arch.
    An excused spill still breaks the rule when a spill instruction sits inside a loop."""
    out = []
    for r in rows:
        if not r.get("ok"):
            continue
        name = f"{r['arch']} {r['kernel']} {r['constants']} w{r.get('num_warps')}s{r.get('num_stages', '-')}"
        slow = [d for d in r.get("dots", ()) if d["hot"] and d["op"] != "wgmma"]
        if r["arch"] == "sm_90" and slow and _exception(r, "mma.sync") is None:
            out.append(f"{name}: hot-loop dots not on wgmma: " + ", ".join(f"{d['op']} {d['mnk']}" for d in slow))
        if r.get("stack") and (_exception(r, "spill") is None or r.get("loop_spills")):
            out.append(f"{name}: spills ({r['stack']} B of stack per thread, {r.get('loop_spills')} "
                       "spill instructions inside loops)")
    return out


def _hot(r: dict) -> str:
    """Hot-loop dots as "3/3" (on wgmma / in loops), "no dots", or "4/4 (×2)" when warps repeat a tile."""
    hot = [d for d in r["dots"] if d["hot"]]
    if not hot:
        return "no dots"
    repl = max(d["replicated"] for d in hot)
    return f"{sum(d['op'] == 'wgmma' for d in hot)}/{len(hot)}" + (f" (×{repl})" if repl > 1 else "")


def _dots(r: dict) -> str:
    return f"hot wgmma {_hot(r)} ptx wgmma={r['wgmma']} mma.sync={r['mma_sync']} tma={r['tma']}"


def markdown(rows: list[dict]) -> str:
    """The docs/kernels.md table: one line per compiled config of a kernel with dots (per arch, the
    kernels in the order compiled), then one line per kernel without dots (ranges over its configs)."""
    lines = ["| arch | kernel | variant | warps, stages | hot dots on wgmma | PTX wgmma / mma.sync | TMA | regs "
             "| stack B (in loops) | shared KiB | blocks/SM (limit) |", "|" + "---|" * 11]
    plain: dict = {}
    for r in rows:
        if not r["ok"]:
            continue
        if not r["dots"]:
            plain.setdefault((r["arch"], r["kernel"]), []).append(r)
            continue
        items = [c.split("=") for c in r["constants"].split(",")]
        types = dict(a.split(":") for a in r["signature"].split(",") if ":" in a)
        const = " ".join([next(t[1:] for t in types.values() if t.startswith("*"))]
                         + [f"{k.replace('BLOCK_', '').replace('HEADDIM', 'hd')}={v}" for k, v in items
                            if k.startswith(("BLOCK", "HEADDIM", "MODE")) and k != "BLOCK_D"]
                         + [k.lower() for k, v in items if v == "True"]
                         + (["fp32 out"] if types.get("DK") == "*fp32" else []))
        stack = f"{r['stack']} ({r['loop_spills']})" if r["stack"] else "0"
        lines.append(f"| {r['arch']} | `{r['kernel']}` | {const} | {r.get('num_warps', 4)}, {r.get('num_stages', '-')} "
                     f"| {_hot(r)} | {r['wgmma']} / {r['mma_sync']} | {'yes' if r['tma'] else 'no'} | {r['regs']} "
                     f"| {stack} | {r['shared'] / 1024:.1f} | {r['blocks_per_sm']} ({r['occupancy_limit']}) |")

    def span(values, fmt="{}"):
        lo, hi = min(values), max(values)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"

    for (arch, kernel), rs in plain.items():
        lines.append(f"| {arch} | `{kernel}` | {len(rs)} configs | {span([r.get('num_warps', 4) for r in rs])}, - "
                     f"| no dots | 0 / 0 | {'yes' if any(r['tma'] for r in rs) else 'no'} | {span([r['regs'] for r in rs])} "
                     f"| {span([r['stack'] for r in rs])} | {span([r['shared'] / 1024 for r in rs], '{:.1f}')} "
                     f"| {span([r['blocks_per_sm'] for r in rs])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions (default: 80 90)")
    ap.add_argument("--module", nargs="*", help="only these kernel modules")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    ap.add_argument("--markdown", action="store_true", help="print the docs/kernels.md table instead")
    ap.add_argument("--full", action="store_true", help="every variant of every config (slow)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    results = compile_all(args.arch, args.module, full=args.full)
    broken = violations(results)
    if args.json:
        print(json.dumps(results))
    elif args.markdown:
        print(markdown(results))
    else:
        for r in results:
            status = (f"ok  shared={r['shared']}B regs={r['regs']} stack={r['stack']}B "
                      f"blocks/SM={r['blocks_per_sm']}({r['occupancy_limit']}) {_dots(r)}" if r["ok"]
                      else f"FAIL {r['error']}")
            opts = f"w{r.get('num_warps', 4)}s{r.get('num_stages', '-')}"
            print(f"{r['arch']:6} {r['kernel']:24} {r['constants']:70} {opts:6} {status}")
        print("\n".join(broken))
        print(f"{sum(r['ok'] for r in results)} compiled, {sum(not r['ok'] for r in results)} failed, "
              f"{len(broken)} rule violations (hot-loop mma.sync on sm_90, spills)")
    return 0 if all(r["ok"] for r in results) and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
