# Two commands do everything on a fresh machine: `make test` and `make demo`.
# They create .venv, install the pinned requirements, build tpkernels._C, then act.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
BUILT  := $(VENV)/.tpkernels-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h') setup.py pyproject.toml
PYTEST_ARGS ?=

.PHONY: install test seed-sweep demo bench aot-check compat clean

$(DEPS): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	touch $@

$(BUILT): $(DEPS) $(SOURCES)
	$(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(BUILT)

test: install
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# the randomised kernel and multi-rank tests under N fresh seeds each; lists failing (test, seed) and how to replay
N ?= 20
seed-sweep: install
	$(BIN)/python benchmarks/seed_sweep.py -n $(N) $(PYTEST_ARGS)

demo: install
	$(BIN)/tpkernels train --config python/configs/demo_llama_tp2_pp2.yaml --nproc 4 --layout auto --autotune 3 --verify-step0

bench: install
	$(BIN)/python benchmarks/bench_bias_gelu.py
	$(BIN)/tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --seq-len 8192 --top 5

aot-check: install
	$(BIN)/python -m tpkernels.kernels.triton.aot_check --arch 80 90

# The GPU machine's software (device tool KINDS.md: Python 3.12, torch 2.11.0, triton 3.6.0, transformers
# 5.17.0) in a venv of its own, the whole CPU suite on it, then the GPU check's preflight (its CUDA steps
# skip without a GPU). Slow (torch's CUDA wheels, a second build of _C): run it at the end of each issue.
# the first python3.12 that runs (a pyenv shim is on PATH even when 3.12 is not the selected version)
PYTHON312 ?= $(shell for p in $$(command -v python3.12) $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null); do \
	$$p -c '' 2>/dev/null && echo $$p && break; done)
COMPAT := .venv-compat
compat:
	test -x $(COMPAT)/bin/python || $(PYTHON312) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q -r requirements-compat.txt
	$(COMPAT)/bin/python -m pip install -q --no-build-isolation --no-deps -e .
	$(COMPAT)/bin/python benchmarks/preflight.py
	$(COMPAT)/bin/python benchmarks/preflight.py --built
	$(COMPAT)/bin/python -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info tpkernels/_C*.so $(BUILT) $(COMPAT)
