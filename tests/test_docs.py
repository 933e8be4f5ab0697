"""Every code block of README.md and docs/*.md runs, so the documentation cannot go stale.

A page becomes one script, its blocks in order: ``python`` blocks as they are (one namespace per
page, like a notebook), each ``bash`` line through the shell (``tpkernels`` on the PATH, the
repository's python/, benchmarks/ and docs/ beside the working folder). ``text`` blocks are
output, not code. A block that cannot run here says why in its info string,
```` ```bash {not-tested: needs 8 GPUs} ````, and may only hold commands of the kinds listed in
``UNTESTABLE`` (the suite and its set-up, installs, multi-GPU launches, benchmarks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from subprocess_lanes import lanes

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNTESTABLE = ("make ", "pip ", "torchrun ", "python benchmarks/", "bash benchmarks/",
              "python -m tpkernels.kernels.triton.aot_check", "tpkernels.kernels.triton.")
FENCE = re.compile(r"^(\s*)```(\S*)\s*(\{not-tested:\s*(.*?)\})?\s*$")


def blocks(page: Path) -> list[tuple[str, str | None, str, int]]:
    """(language, not-tested reason or None, code, line) of each fenced block of ``page``."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(2):
            indent, lang, reason = m.group(1), m.group(2), m.group(4) if m.group(3) else None
            j = i + 1
            while not lines[j].strip().startswith("```"):
                j += 1
            code = textwrap.dedent("\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]))
            out.append((lang, reason, code, i + 1))
            i = j + 1
            continue
        i += 1
    return out


def commands(code: str) -> list[str]:
    """The shell commands of a bash block (continuation lines joined, comment lines dropped)."""
    out, cur = [], ""
    for line in code.splitlines():
        if cur:
            line = cur + " " + line.strip()
            cur = ""
        if line.rstrip().endswith("\\"):
            cur = line.rstrip()[:-1]
            continue
        if line.strip() and not line.strip().startswith("#"):
            out.append(line.strip())
    return out


def script_of(page: Path) -> str:
    parts = ["import subprocess as _sp\n\n\ndef _sh(cmd):\n    print('$', cmd, flush=True)\n"
             "    _sp.run(cmd, shell=True, check=True)\n\n"]
    for lang, reason, code, line in blocks(page):
        if lang == "python" and reason is None:
            parts.append(f"# ---- {page.name}:{line}\n{code}\n")
        elif lang in ("bash", "sh") and reason is None:
            parts += [f"_sh({cmd!r})\n" for cmd in commands(code)]
    return "".join(parts)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_code_that_runs_or_says_why_not(page):
    for lang, reason, code, line in blocks(page):
        where = f"{page.name}:{line}"
        assert lang in ("python", "bash", "sh", "text"), f"{where}: a ```{lang} block (python, bash or text)"
        if reason is not None:
            assert lang in ("bash", "sh") and reason.strip(), f"{where}: only shell blocks may be not-tested, with why"
            for cmd in commands(code):
                assert cmd.startswith(UNTESTABLE), f"{where}: {cmd!r} can run here: test it"


def _runnable(page: Path) -> bool:
    return any(b[0] in ("python", "bash", "sh") and b[1] is None for b in blocks(page))


def run_page(page: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The page's script, run in ``tmp_path`` (its own folder: pages write chat/, runs/ and the like)."""
    for name in ("python", "benchmarks", "docs", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "page.py").write_text(script_of(page))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TQDM_DISABLE": "1",
           # one intra-op thread per process: the pages' models are tiny, and on 2 shared cores (the suite's
           # background compiles, a launch's other ranks) OpenMP threads that spin-wait for a busy core made a
           # 2-step run 8x slower (its steps 1.42 s -> 0.17 s, the command 23 s -> 14 s, measured at load 7)
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory):
    """Every selected page's run, two at a time (tests/subprocess_lanes.py)."""
    def job(page):  # in a lane's thread: a folder of its own from mkdtemp (thread-safe)
        folder = Path(tempfile.mkdtemp(prefix=f"{page.stem}_", dir=tmp_path_factory.getbasetemp()))
        return run_page(page, folder) if _runnable(page) else None

    with lanes(request, "test_page_code_runs", "page", job) as runs:
        yield runs


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_code_runs(page, page_runs, request):
    if not _runnable(page):
        pytest.skip(f"{page.name} holds no runnable block")  # tables, prose and not-tested commands only
    r = page_runs[request.node.nodeid].result()
    assert r.returncode == 0, f"{page.name}:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"


def test_readme_is_the_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
            assert (page.parent / target).is_file(), (page.name, target)


def test_the_readme_lists_every_environment_variable():
    from tpkernels import env_vars

    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- env-vars:", 1)[1].split("-->", 1)[1].split("<!-- /env-vars -->", 1)[0].strip()
    assert table == env_vars.markdown_table(), "regenerate the README's table from tpkernels.env_vars.markdown_table()"
