"""No input runs code: the package's source holds no ``eval``/``exec``, no ``shell=True``, no bare
unpickling, no ``torch.load`` without ``weights_only=True`` and no YAML loader but the safe one.
The one unpickler (DCP's checkpoint metadata) goes through an allow-list; this test fails on any
new call so that a reviewer decides, not an accident."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("tpkernels", "python", "benchmarks") for p in (ROOT / d).rglob("*.py")] + [ROOT / "setup.py"]

# (pattern, what is wrong); a line is exempt only if listed in ALLOWED with its reason
RULES = [
    (re.compile(r"(?<![\w.])eval\("), "eval runs text as code"),
    (re.compile(r"(?<![\w.])exec\("), "exec runs text as code"),
    (re.compile(r"shell\s*=\s*True"), "a shell parses the command: use an argument list"),
    (re.compile(r"os\.system\(|os\.popen\("), "a shell parses the command: use subprocess with a list"),
    (re.compile(r"pickle\.loads?\(|marshal\.loads?\(|(?<!\w)Unpickler\((?!.*allow)"), "unpickling runs code"),
    (re.compile(r"torch\.load\((?!.*weights_only\s*=\s*True)"), "torch.load without weights_only=True runs code"),
    (re.compile(r"yaml\.(unsafe_load|full_load|load_all)\(|yaml\.load\((?!.*Loader=StrictLoader)"),
     "YAML tags can build Python objects: use the safe loader"),
]
ALLOWED = {
    # the allow-list unpickler itself: find_class refuses every global that is not DCP metadata
    ("tpkernels/train/checkpoint_files.py", "class _MetadataUnpickler(pickle.Unpickler):"),
}


def test_no_call_that_could_run_an_input_as_code():
    found = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if code.lstrip().startswith(('"', "'", "``")):
                continue  # docstring prose
            for rule, why in RULES:
                if rule.search(code) and (rel, line.strip()) not in ALLOWED:
                    found.append(f"{rel}:{n}: {line.strip()} ({why})")
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_are_for():
    bad = ["x = eval(s)", "exec(code)", "subprocess.run(cmd, shell=True)", "os.system('ls')", "pickle.loads(b)",
           "torch.load(f)", "torch.load(f, weights_only=False)", "yaml.load(text)", "yaml.unsafe_load(t)"]
    good = ["model.eval()", "torch.load(f, weights_only=True)", "yaml.load(text, Loader=StrictLoader)",
            "subprocess.run([sys.executable, '-c', 'pass'])", "evaluate(x)"]
    assert all(any(r.search(b) for r, _ in RULES) for b in bad)
    assert not any(r.search(g) for g in good for r, _ in RULES)
