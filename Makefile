# kiln: `make run` renders a small prompt suite on the tiny models; `make test` runs the suite.
# Everything installs into .venv. torch: a torch the system Python already has (a GPU box) is
# kept and used; otherwise the CPU wheel torch==2.13.0, never a multi-GB CUDA build by accident.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)

.PHONY: install run test test-fast bench lint gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) bench/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(KILN) bench

gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

lint: $(STAMP)
	$(VENV)/bin/ruff check worker api_client tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf outputs run models .pytest_cache .mypy_cache .ruff_cache
