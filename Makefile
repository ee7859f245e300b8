# vramcal: two commands on a fresh machine.
#   make run   - create .venv, build the E-mini S&P 500 bars, calibrate this machine, train with the result
#   make test  - create .venv and run the test suite
# On a machine without an NVIDIA GPU the CPU build of torch 2.13.0 is installed: a wheel on this machine, else
# PyTorch's CPU wheel index, else (one line says so) PyPI's CUDA build (scripts/install_torch.sh); with a GPU,
# PyPI's torch.

PYTHON ?= python3
# One venv per interpreter, so that another Python never replaces the default one's: .venv for python3,
# .venv-python3.12 for PYTHON=python3.12 (whose torch is PyPI's CUDA build when PyTorch's CPU index has none).
VENV ?= .venv$(if $(filter python3,$(PYTHON)),,-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Earlier transformers releases the kernel-binding tests also run under (tests/transformers_versions.py): the
# lowest pyproject.toml allows and the last that calls mamba_ssm's kernels for CPU tensors; installed beside the
# venv's own (the newest), without dependencies.
TRANSFORMERS_ALSO ?= 5.23.0 5.24.0
DATA ?= data/es_1s.parquet
# With a GPU: calibrate it whole. Without one: calibrate a 2.5 GiB budget of host RAM, so the whole job
# (install, data, probe, one epoch) takes about 3.5 minutes on 2 cores with a warm pip cache; set
# HOST_CAPACITY= to use all of the host's memory (its largest trials then take minutes each on a small CPU).
HOST_CAPACITY ?= 2.5GiB
# The device (and budget) the probe calibrates and the train step trains on: the same, said to both.
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
DEVICE_ARGS ?= --gpu none $(if $(HOST_CAPACITY),--capacity $(HOST_CAPACITY))
else
DEVICE_ARGS ?= --gpu auto
endif
PROBE_ARGS ?=
# One epoch of windows 16 bars apart: 23 steps at the 2.5 GiB budget's conservative size (76), enough to compare
# the epoch's time with the forecast (the default stride, seq_len // 2, leaves 6 steps, whose time is mostly noise).
TRAIN_ARGS ?= --epochs 1 --stride 16
# make run-lm: the tiny language model over lengths 64-1024 on the standard library's own source (no download)
LM_ARGS ?= --model lm --model-arg config=configs/mamba2-lm-tiny.json --gpu none --capacity 1GiB
LM_TRAIN_ARGS ?= --max-steps 300

.PHONY: setup setup-dev run run-lm test lint clean gpu-wheels gpu-rehearsal gpu-fused-wheels

# setup: what vramcal runs with (make run); setup-dev adds what its tests need (Lightning, Accelerate, pytest,
# ruff, the PostgreSQL driver, the earlier transformers releases in TRANSFORMERS_ALSO, and mamba_ssm's fused path
# without its CUDA builds in $(VENV)/fused-kernels, which the estimate's tests put on their path (tests/fused.py):
# built once per venv, about 3 minutes the first time, then from pip's wheel cache).
FUSED_KERNELS ?= mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0 triton==3.9.0 einops==0.8.2
setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	scripts/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps mlfinpy==0.1.2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -rf $(VENV)/transformers-also
	for version in $(TRANSFORMERS_ALSO); do $(PY) -m pip install --quiet --disable-pip-version-check --no-deps \
		--target $(VENV)/transformers-also/$$version transformers==$$version || exit 1; done
	rm -rf $(VENV)/fused-kernels
	MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
		CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE $(PY) -m pip install --quiet --disable-pip-version-check --no-deps \
		--no-build-isolation --target $(VENV)/fused-kernels $(FUSED_KERNELS)
	touch $@

$(DATA): | setup
	$(PY) -m vramcal data es-sample --bar 1s --out $(DATA)

run: setup $(DATA)
	$(PY) -m vramcal probe $(DEVICE_ARGS) $(PROBE_ARGS)
	$(PY) -m vramcal train $(DEVICE_ARGS) --data $(DATA) $(TRAIN_ARGS)

run-lm: setup
	$(PY) -m vramcal probe $(LM_ARGS) --reserve 0 --seq-len 64:1024
	$(PY) -m vramcal train $(LM_ARGS) $(LM_TRAIN_ARGS)

# The suite runs in two pytest processes (pytest-xdist's worksteal; tests/conftest.py says how their threads wait):
# about 9 minutes on two cores against 13.5 in one. PYTEST_WORKERS=0 runs it in one process, PYTEST_WORKERS=auto in
# one per core.
PYTEST_WORKERS ?= 2
test: setup-dev
	$(PY) -m pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist worksteal)

lint: setup-dev
	$(PY) -m ruff check vramcal tests

clean:
	rm -rf $(VENV)

# Wheels the GPU check carries to a machine that reaches no package index (see scripts/gpu_check.sh): the
# exact versions in scripts/gpu_wheels.txt (the one place they are pinned, with the reasons), for the H200
# image's CPython 3.12, without dependencies; then every wheel's declared requirements are checked against
# the pins and the image's package list (scripts/preflight.py --wheels). The fused path's wheels stay.
GPU_WHEELS_FILE := scripts/gpu_wheels.txt
GPU_WHEEL_NAMES := $(shell sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' $(GPU_WHEELS_FILE) | tr -- '-.' '__')
gpu-wheels:
	rm -f $(foreach name,$(GPU_WHEEL_NAMES),wheels/$(name)-*.whl)
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d wheels -r $(GPU_WHEELS_FILE)
	$(PYTHON) scripts/preflight.py --wheels wheels

# The GPU check rehearsed on this CPU machine in an environment like the H200 image's (.rehearsal/).
gpu-rehearsal:
	scripts/gpu_rehearsal.sh

# Optional wheels for the fused path (--impl mamba_ssm) on the H200 image: causal-conv1d compiled for sm_90
# against torch 2.11 + CUDA 13 (about 10 minutes on 2 cores; needs nvcc 13 and `make gpu-rehearsal`'s venv),
# mamba-ssm without its Mamba-1 extension, einops. See scripts/FUSED_WHEELS.md. gpu-wheels replaces only its
# own wheels, so these stay. FUSED_ARGS=--force rebuilds.
gpu-fused-wheels:
	scripts/build_fused_wheels.sh $(FUSED_ARGS)
