# Trident: `make serve` serves the demo model in every mode; `make test` runs the suite.
# Both set everything up on a fresh machine first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

CUDART  = $(VENV)/lib/python3.11/site-packages/nvidia/cuda_runtime/lib
SERVE_ARGS ?=

.PHONY: install perf-tools serve test bench bench-serve clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing Trident and its dependencies into $(VENV) (first run takes a few minutes)"
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@# the `nixl` import shim: with its dependencies it would pull CUDA torch and both CUDA variants
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps nixl==1.5.1
	@touch $(STAMP)

# perf_analyzer (from the tritonclient wheel) needs Debian's libb64 and a CUDA runtime library to start.
perf-tools: install
	@ldconfig -p | grep -q libb64.so.0d || { apt-get update -qq && apt-get install -y -qq libb64-0d; }
	@test -f $(CUDART)/libcudart.so.12 || $(PY) -m pip install --quiet --disable-pip-version-check nvidia-cuda-runtime-cu12

serve: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident serve $(SERVE_ARGS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

bench: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench transfer
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench decode

bench-serve: perf-tools
	HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=$(CUDART) $(PY) clients/perf/bench_modes.py

clean:
	rm -rf $(VENV) .pytest_cache
