# kiln: `make run` renders a small prompt suite on the tiny models; `make test` runs the suite.
# Everything installs into .venv. torch: a torch the system Python already has (a GPU box) is
# kept and used; otherwise $(TORCH) from $(TORCH_INDEX) or PyPI. The upscalers load through
# spandrel, which imports torchvision, so $(TORCH) is a torch with its matching torchvision.
# PyPI's torch on Linux x86_64 is the CUDA build (about 5.5 GB with its nvidia-* wheels; it runs
# on a CPU too); on macOS it is the CPU/MPS build. For the CPU-only wheels on Linux:
# make TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed
TORCH ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?=
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)

# The suite runs in TEST_JOBS pytest-xdist workers (on 2 cores, most tests wait on a subprocess
# or Redis; README "The test suite"), each with its own private redis-server. A file's tests
# stay on one worker (--dist loadfile), so a module fixture (an S3 server, a worker process) is
# started once. (--dist loadgroup does not group here: pytest 9.2 with pytest-xdist 3.8 ran
# explicitly grouped tests on three workers.) It prints the slowest tests and files and writes
# every file's time to
# run/test-durations.md. `make test` leaves out the tests marked slow (the compile, soak, chaos
# and multi-worker kill drills, the fuzzers, the bench matrix); `make test-slow` runs only them
# and .ci/run runs both; `make test-all` runs everything in one session.
# Tests marked serial run first, alone: they count Redis commands against the budget, and on a
# loaded machine what runs by the clock (the sweep, lease pushes) would count against it.
TEST_JOBS ?= 3
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=25 \
	--file-durations=run/test-durations.md
SERIAL := $(PY) -m pytest -q -m serial

.PHONY: install run test test-all test-slow test-docker bench lint gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(PY) -m pip install -q -e '.[worker,api,dev]'
	$(PY) -m pip install -q --no-deps 'rq-exporter==3.1.0'
	@# spandrel and torchsde without their dependencies: they are torch and torchvision (kept as
	@# they are: a resolver would swap the user's torch for the newest), and the worker extra's
	@# einops, safetensors, numpy, scipy and trampoline. torchsde: the dpmpp_sde sampler.
	$(PY) -m pip install -q --no-deps 'spandrel==0.4.2' 'torchsde==0.2.6'
	@touch $(STAMP)

run: $(STAMP)
	$(PY) bench/demo.py

test: $(STAMP)
	$(SERIAL)
	$(PYTEST) -m "not serial and not slow"

test-all: $(STAMP)
	$(SERIAL)
	$(PYTEST) -m "not serial"

test-slow: $(STAMP)
	$(PYTEST) -m slow

# Not in CI: builds the gateway and worker images (the CUDA torch is GBs) and renders a tiny
# txt2img and upscale in the worker image on CPU (docker/test-docker.sh says how).
test-docker:
	bash docker/test-docker.sh

bench: $(STAMP)
	$(KILN) bench

gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

lint: $(STAMP)
	$(VENV)/bin/ruff check worker api_client tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf outputs run models .pytest_cache .mypy_cache .ruff_cache
