"""What tpkernels._C was built with, checked from the binary itself."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpkernels
from tpkernels._extension import extension

pytestmark = pytest.mark.skipif(extension() is None, reason="tpkernels._C is not built")
EXPECTED_ARCHS = os.environ.get("TPKERNELS_CUDA_ARCHS", "80;90").replace("+PTX", "").split(";")


def _cuobjdump() -> str | None:
    try:
        import triton  # noqa: PLC0415

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def test_build_info_is_consistent():
    info = tpkernels.build_info()
    assert info["version"] == tpkernels.__version__
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["cpu_capability"] in ("default", "avx2", "avx512")
    if "OpenMP" in torch.__config__.parallel_info():
        # Without -fopenmp, at::parallel_for in our kernels silently runs on one thread.
        assert info["cpu_openmp"], "CPU kernels were compiled without OpenMP: they would run single-threaded"
    assert info["with_cuda"] == (torch.version.cuda is not None and os.environ.get("TPKERNELS_SKIP_CUDA_BUILD") != "1")


@pytest.mark.skipif(torch.version.cuda is None, reason="torch has no CUDA: the extension is built C++-only")
def test_extension_holds_cubins_for_sm80_and_sm90():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither in the triton package nor on PATH)")
    so = extension().__file__
    out = subprocess.run([tool, "--list-elf", so], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for arch in EXPECTED_ARCHS:
        assert f"sm_{arch}.cubin" in out.stdout, f"no sm_{arch} cubin in {so}:\n{out.stdout}"
    assert tpkernels.build_info()["cuda_archs"].split(";") == EXPECTED_ARCHS
    # The kernels are really in there (names are mangled, so look for the stem).
    sass = subprocess.run([tool, "--list-text", so], capture_output=True, text=True, timeout=120).stdout
    assert "bias_gelu_fwd_kernel" in sass and "bias_gelu_bwd_kernel" in sass


def test_cpu_isa_variant_override_gives_same_results():
    # ATEN_CPU_CAPABILITY=default forces the plain-ISA build of the kernels; it must agree with
    # the vectorised one to within a few ulps (different erf/exp approximations).
    code = ("import torch, tpkernels, sys; torch.manual_seed(0); x=torch.randn(37,129); b=torch.randn(129);"
            "torch.save((tpkernels.build_info()['cpu_capability'], tpkernels.bias_gelu(x,b)), sys.argv[1])")
    results = {}
    for cap in ("default", None):
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tpk_isa_{os.getpid()}_{cap}.pt"
        r = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        results[cap] = torch.load(path)
        path.unlink()
    assert results["default"][0] == "default"
    torch.testing.assert_close(results["default"][1], results[None][1], rtol=1e-5, atol=1e-6)


def test_tpkernels_info_command(capsys):
    r = subprocess.run([sys.executable, "-m", "tpkernels.cli", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for needle in ("torch", "triton", "extension", "bias_gelu", "gpus"):
        assert needle in r.stdout
    import json

    from tpkernels.cli import main

    capsys.readouterr()
    assert main(["info", "--json"]) in (0, None)  # --json in this process (the command ran as one above)
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["bias_gelu"]["cpu"] == "cpp"
