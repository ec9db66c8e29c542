# fastload: `make demo` and `make test` work from a fresh clone with only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV := .venv
XLA_VENV := .venv-xla
PY := $(VENV)/bin/python
XLA_PY := $(XLA_VENV)/bin/python
PIP := -m pip install -q --disable-pip-version-check
# The CPU torch wheel lies in /opt/wheels on these machines; elsewhere pip takes it from the index.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
CONSTRAINTS := requirements/constraints.txt
URL ?=

.PHONY: help env xla-env test test-main test-xla test-load soak demo lint bench bench-quick bytecode docs clean gpu-check gpu-wheels gpu-rehearse

help:
	@echo "make demo   - the main job on an embedded default dataset (or URL=s3://bucket/prefix)"
	@echo "make test   - install everything the tests need and run the whole suite (main + XLA env)"
	@echo "make lint   - ruff + mypy --strict"
	@echo "make bench  - benchmarks (writes benchmarks/results, the plots in docs/img)"
	@echo "make docs   - build the docs site into site/ (mkdocs --strict)"
	@echo "make soak   - the long soak test (FASTLOAD_SOAK_EPOCHS=12)"
	@echo "make test-load - the reliability, fetch and server tests beside 10 busy processes"
	@echo "make gpu-check - on a GPU machine: the cuda tests and the GPU benchmark (no venv needed)"
	@echo "make gpu-wheels - fetch into .whl/ the wheels gpu-check needs on a machine without network"
	@echo "make gpu-rehearse - here, before device time: gpu-check's imports as on the GPU image"

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) requirements/bench.txt requirements/docs.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
		|| { echo "fastload needs Python >= 3.10 as '$(PYTHON)' (set PYTHON=...)"; exit 2; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null \
		|| { echo "'$(PYTHON)' lacks venv/ensurepip: install python3-venv"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) $(FIND_LINKS) -c $(CONSTRAINTS) torch
	$(PY) $(PIP) $(FIND_LINKS) -c $(CONSTRAINTS) -e ".[dev]"
	$(PY) $(PIP) $(FIND_LINKS) -c $(CONSTRAINTS) -r requirements/bench.txt
	$(PY) $(PIP) --no-deps -c $(CONSTRAINTS) mosaicml-streaming
	@# litdata pulls torchvision; the registry's is a CUDA build that cannot load beside the CPU
	@# torch, and torchmetrics (so Lightning) imports it whenever it is installed
	$(PY) -c 'import torchvision' 2>/dev/null || $(PY) -m pip uninstall -y -q torchvision
	$(PY) $(PIP) $(FIND_LINKS) -c $(CONSTRAINTS) -r requirements/docs.txt
	@touch $@

env: $(VENV)/.installed

$(XLA_VENV)/.installed: pyproject.toml requirements/xla.txt
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_PY) $(PIP) -c requirements/xla.txt torch torch_xla numpy fsspec pytest pytest-timeout hypothesis
	$(XLA_PY) $(PIP) -c requirements/xla.txt -e .
	@touch $@

xla-env: $(XLA_VENV)/.installed

test: test-main test-xla

# Two pytest workers (pytest-xdist; each starts its own loopback servers): the suite waits on
# servers and sleeps far more than it computes, so two workers finish in about half the time
# on 2 cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test-main: env bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow and not xla" --ignore=tests/xla $(PYTEST_ARGS)

test-xla: xla-env
	PJRT_DEVICE=CPU $(XLA_PY) -m pytest -m xla -p no:cacheprovider tests/xla $(PYTEST_ARGS)

LOAD_TESTS := tests/test_reliability.py tests/test_fetch.py tests/test_servers.py tests/test_proxy.py

test-load: env
	$(PY) -m tests.under_load --load 10 -m "not slow and not xla" -p no:cacheprovider $(LOAD_TESTS) $(PYTEST_ARGS)

soak: env
	$(PY) -m pytest -m slow -s tests/test_reliability.py $(PYTEST_ARGS)

docs: env
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

demo: env
	$(PY) examples/demo.py $(if $(URL),--url $(URL),)

lint: env
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: env bytecode
	$(PY) -m benchmarks $(BENCH_ARGS)

# fastload is installed editable: where PYTHONDONTWRITEBYTECODE is set (this machine sets it),
# every process (each reader of the benchmarks, each forkserver, each CLI call of the tests)
# compiled its source again, about 60 ms, while the peers load their installed bytecode.
bytecode: env
	$(PY) -m compileall -q src tests benchmarks

# On a GPU machine as it is (python3 with a CUDA torch, no network): see benchmarks/gpu_check.sh.
gpu-check:
	bash benchmarks/gpu_check.sh

# the packages the GPU image lacks made unimportable: the cuda tests collect, the benchmark runs
gpu-rehearse: env
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PY) -m benchmarks.gpu_rehearse -m pytest -p pytest_timeout \
		-p no:cacheprovider -m cuda tests/test_device.py -q
	$(PY) -m benchmarks.gpu_rehearse -m benchmarks.gpu --device cpu --quick --out /tmp/gpu-rehearsal.json

# fastload's dependencies that a CUDA image may lack, as Python 3.12 x86-64 wheels.
GPU_WHEELS := crc32c==2.9.post0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

bench-quick: env bytecode
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) $(XLA_VENV) .pytest_cache .mypy_cache .ruff_cache site
