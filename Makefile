# kiln: `make run` renders a small prompt suite on the tiny models; `make test` runs the suite.
# Everything installs into .venv. torch: a torch the system Python already has (a GPU box) is
# kept and used; otherwise $(TORCH) from $(TORCH_INDEX) or PyPI. PyPI's torch on Linux x86_64 is
# the CUDA build (about 3 GB with its nvidia-* wheels); on macOS it is the CPU/MPS build. For the
# CPU-only wheel on Linux: make TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)

.PHONY: install run test test-fast bench lint gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH)'
	$(PY) -m pip install -q -e '.[worker,dev]'
	$(PY) -m pip install -q --no-deps 'rq-exporter==3.1.0'
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
