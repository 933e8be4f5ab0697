# Two commands do everything on a fresh machine: `make test` and `make demo`.
# They create .venv, install the pinned requirements, build tpkernels._C, then act.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
BUILT  := $(VENV)/.tpkernels-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h') setup.py pyproject.toml
PYTEST_ARGS ?=

.PHONY: install test demo bench aot-check clean

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

demo: install
	$(BIN)/tpkernels train --config python/configs/demo_llama_tp2_pp2.yaml --nproc 4 --verify-step0

bench: install
	$(BIN)/python benchmarks/bench_bias_gelu.py
	$(BIN)/tpkernels plan --model Llama-3-70B --gpu H100-SXM --nodes 8 --global-batch 512 --seq-len 8192 --top 5

aot-check: install
	$(BIN)/python -m tpkernels.kernels.triton.aot_check --arch 80 90

clean:
	rm -rf build *.egg-info tpkernels/_C*.so $(BUILT)
