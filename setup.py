"""Build script for tpkernels and its compiled extension ``tpkernels._C``.

What gets built:
  * C++ CPU kernels, always. Each vectorised kernel file is compiled three times
    (DEFAULT, AVX2, AVX512, as ATen does) and the fastest one the CPU supports
    is picked at run time.
  * CUDA kernels, when torch was built with CUDA and ``nvcc`` is found, even on a
    machine without a GPU (so CI proves every .cu file compiles and links).

Environment variables:
  TPKERNELS_SKIP_CUDA_BUILD=1   build the C++ CPU kernels only.
  TPKERNELS_CUDA_ARCHS="80;90"  SM architectures, one explicit -gencode each; a
                                "+PTX" suffix (e.g. "90+PTX") also embeds PTX.
  MAX_JOBS                      parallel compile jobs; default from cores and free RAM.
  NVCC_THREADS                  nvcc --threads (arches compiled in parallel); default 2.
  CUDA_HOME                     CUDA toolkit; default: found from the ``nvcc`` on PATH.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "80;90"


def log(msg: str) -> None:
    print(f"[tpkernels setup] {msg}", file=sys.stderr, flush=True)


def find_cuda_home() -> str | None:
    """The toolkit that holds nvcc.

    torch guesses ``dirname(dirname(which nvcc))``, which is wrong when ``nvcc``
    on PATH is a wrapper script (here /usr/local/bin/nvcc execs the real one).
    ``nvcc --dryrun`` prints the real install folder as ``_HERE_``.
    """
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "tpkernels_probe.cu"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"_HERE_=(\S+)", out.stdout + out.stderr)
    if m:
        return str(Path(m.group(1)).resolve().parent)
    return str(Path(nvcc).resolve().parent.parent)


def nvidia_wheel_include_dirs() -> list[str]:
    """cuBLAS/cuSPARSE headers ship in the ``nvidia`` wheels, not the system toolkit."""
    try:
        import nvidia  # noqa: F401  (namespace package installed with torch's CUDA build)
    except ImportError:
        return []
    dirs = []
    for base in getattr(sys.modules["nvidia"], "__path__", []):
        for inc in sorted(Path(base).glob("*/include")):
            dirs.append(str(inc))
    return dirs


def default_max_jobs() -> int:
    """One job per core, but at most one per 3 GiB of free RAM (nvcc + ATen headers)."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free_gib = int(info["MemAvailable"].split()[0]) / (1024 * 1024)
        return max(1, min(cores, int(free_gib // 3)))
    except (OSError, KeyError, ValueError):
        return cores


# Per-file ISA flags for the vectorised CPU kernels (file suffix -> flags), x86-64 only.
CPU_ISA_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def isa_flags(source: str) -> list[str] | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return next((f for suffix, f in CPU_ISA_FLAGS.items() if source.endswith(suffix)), None)


def with_isa_variants(build_ext_cls):
    """BuildExtension that compiles the *_avx2.cpp / *_avx512.cpp sources with their own flags.

    torch's BuildExtension passes one set of C++ flags to every source; the ISA variants need
    extra -m flags, so they are compiled first (with the same torch flags plus theirs) and
    linked in as extra objects.
    """

    class BuildExtensionWithIsa(build_ext_cls):
        def build_extension(self, ext):
            variants = [s for s in ext.sources if isa_flags(s)]
            for src in variants:
                args = dict(ext.extra_compile_args)
                args["cxx"] = list(args.get("cxx", [])) + isa_flags(src)
                ext.extra_objects += self.compiler.compile(
                    [src], output_dir=self.build_temp, macros=ext.define_macros,
                    include_dirs=ext.include_dirs, extra_postargs=args, depends=ext.depends)
            ext.sources = [s for s in ext.sources if s not in variants]
            super().build_extension(ext)

    return BuildExtensionWithIsa


def parse_cuda_archs(spec: str) -> tuple[list[str], list[str]]:
    """'80;90+PTX' -> (['-gencode=arch=compute_80,code=sm_80', ...], ['80', '90'])."""
    flags, archs = [], []
    for item in re.split(r"[;, ]+", spec.strip()):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        arch = item.removesuffix("+PTX").replace(".", "")
        if not arch.isdigit():
            raise ValueError(f"TPKERNELS_CUDA_ARCHS ({spec!r}) must list SM numbers like '80;90', got {item!r}")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
        archs.append(arch)
    if not archs:
        raise ValueError(f"TPKERNELS_CUDA_ARCHS ({spec!r}) names no architecture")
    return flags, archs


def extension_modules():
    if os.environ.get("CUDA_HOME") is None:
        home = find_cuda_home()
        if home:
            os.environ["CUDA_HOME"] = home  # must be set before torch.utils.cpp_extension is imported
    os.environ.setdefault("MAX_JOBS", str(default_max_jobs()))

    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cpu_sources = ["csrc/extension.cpp", "csrc/common/cpu_isa.cpp", "csrc/gelu/bias_gelu_cpu.cpp",
                   "csrc/llama/llama_ops_cpu.cpp", "csrc/layer_norm/layer_norm_cpu.cpp",
                   "csrc/quant/nf4_linear_cpu.cpp",
                   # DEFAULT first: for inline functions shared by the variants the linker keeps
                   # the first definition, so the plain-ISA copy wins (ATen does the same).
                   "csrc/gelu/bias_gelu_cpu_default.cpp", "csrc/gelu/bias_gelu_cpu_avx2.cpp",
                   "csrc/gelu/bias_gelu_cpu_avx512.cpp",
                   "csrc/llama/llama_cpu_default.cpp", "csrc/llama/llama_cpu_avx2.cpp",
                   "csrc/llama/llama_cpu_avx512.cpp",
                   "csrc/layer_norm/layer_norm_cpu_default.cpp", "csrc/layer_norm/layer_norm_cpu_avx2.cpp",
                   "csrc/layer_norm/layer_norm_cpu_avx512.cpp"]
    # The C++ standard flag comes from torch.utils.cpp_extension (c++17 or c++20 per torch version).
    # -fopenmp: at::parallel_for is an inline OpenMP loop in torch's headers; without the flag
    # the pragma is ignored and every CPU kernel silently runs on one thread.
    cxx_flags = ["-O3", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas", "-fopenmp"]
    link_flags = ["-fopenmp"]
    macros = [("TPKERNELS_VERSION", f'"{_version()}"')]

    skip_reason = None
    if os.environ.get("TPKERNELS_SKIP_CUDA_BUILD", "0") == "1":
        skip_reason = "TPKERNELS_SKIP_CUDA_BUILD=1"
    elif torch.version.cuda is None:
        skip_reason = f"torch {torch.__version__} is a CPU-only build"
    elif CUDA_HOME is None or not Path(CUDA_HOME, "bin", "nvcc").exists():
        skip_reason = "nvcc not found (set CUDA_HOME or put nvcc on PATH)"

    if skip_reason:
        log(f"building C++ CPU kernels only: {skip_reason}")
        return [CppExtension("tpkernels._C", cpu_sources,
                             extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags,
                             define_macros=macros)], BuildExtension

    gencode, archs = parse_cuda_archs(os.environ.get("TPKERNELS_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
    nvcc_threads = os.environ.get("NVCC_THREADS", "2")
    log(f"building C++ CPU + CUDA kernels with {CUDA_HOME} for sm_{', sm_'.join(archs)} "
        f"(MAX_JOBS={os.environ['MAX_JOBS']}, NVCC_THREADS={nvcc_threads})")
    macros += [("TPKERNELS_WITH_CUDA", "1"), ("TPKERNELS_CUDA_ARCHS", f'"{";".join(archs)}"')]
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr",
                  f"--threads={nvcc_threads}", *gencode]
    cuda_sources = cpu_sources + ["csrc/gelu/bias_gelu_cuda.cu", "csrc/comm/comm_signals.cu", "csrc/comm/peer_copy.cu",
                                  "csrc/comm/tile_reduce.cu"]
    ext = CUDAExtension("tpkernels._C", cuda_sources, include_dirs=nvidia_wheel_include_dirs(),
                        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags,
                        define_macros=macros)
    return [ext], BuildExtension


def _version() -> str:
    text = (ROOT / "tpkernels" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


ext_modules, build_ext = extension_modules()

setup(
    version=_version(),
    packages=find_packages(include=["tpkernels", "tpkernels.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": with_isa_variants(build_ext).with_options(use_ninja=True)},
)
