# Trident: `make test` sets everything up on a fresh machine and runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: install test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing Trident and its dependencies into $(VENV) (first run takes a few minutes)"
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@# the `nixl` import shim: with its dependencies it would pull CUDA torch and both CUDA variants
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps nixl==1.5.1
	@touch $(STAMP)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

bench: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench transfer
	HF_HUB_OFFLINE=1 $(VENV)/bin/trident bench decode

clean:
	rm -rf $(VENV) .pytest_cache
