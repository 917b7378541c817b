# commlab: `make` runs the default workflow (installing what it needs), `make test` the tests.
SHELL := /bin/bash
PY := .venv/bin/python
CORES ?= 2
FMNIST := /usr/share/datasets/fashion-mnist
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
# Snakemake and its jobs run this checkout's commlab in .venv: its bin/ first on PATH (the jobs call
# `python`, `dvc`), and src/ on PYTHONPATH (also for --use-conda jobs, whose environment holds only
# the third-party packages).
export PATH := $(CURDIR)/.venv/bin:$(PATH)
export PYTHONPATH := $(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: all run test test-gpu bench-gpu smoke report bench lint mlflow-ui system-packages test-packages apt-run apt-test \
    clean-results slurm-up slurm-down

all: run

# The virtual environment, rebuilt when the dependencies change.
.venv/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

# Debian packages, installed when apt and root are available and one of them is missing.
# What the default run needs: Fashion-MNIST, iproute2 and util-linux (emulated links for the
# speed claims), and a C compiler (the CPU's one-pass selection kernel, built on first use;
# without one commlab warns and selects with numpy). What the tests add: a local SLURM cluster's daemons (tests/test_slurm_cluster.py,
# make slurm-up) and chromium (the report view test).
RUN_PACKAGES := dataset-fashion-mnist iproute2 util-linux gcc
TEST_PACKAGES := $(RUN_PACKAGES) munge slurmctld slurmd slurm-client slurmdbd mariadb-server chromium
define apt_install
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq $(1) >/dev/null || \
	    { apt-get update -qq && apt-get install -y -qq $(1) >/dev/null; }; \
	else echo "note: install Debian's $(1) (or set data.fashion_mnist.source in params.yaml)"; fi
endef

system-packages:
	@if [ ! -d $(FMNIST) ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null || \
	  ! command -v cc >/dev/null; then \
	  $(MAKE) --no-print-directory apt-run; fi

test-packages: system-packages
	@if ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null || ! command -v chromium >/dev/null; then \
	  $(MAKE) --no-print-directory apt-test; fi

apt-run:
	$(call apt_install,$(RUN_PACKAGES))

apt-test:
	$(call apt_install,$(TEST_PACKAGES))

# A SLURM cluster on this machine (controller + 2 nodes in namespaces, 198.19.0.0/24): docs/cluster.md.
SLURM_DIR ?= /tmp/commlab-slurm
slurm-up: .venv/.installed test-packages
	$(PY) -m commlab.testing.localslurm up --dir $(SLURM_DIR)

slurm-down:
	$(PY) -m commlab.testing.localslurm down --dir $(SLURM_DIR)

run: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default

smoke: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default --configfile config/smoke.yaml

test: .venv/.installed test-packages
	.venv/bin/pytest -q

# The GPU suite: tests/test_gpu_*.py, marked gpu, each skipping cleanly without CUDA. On a machine whose own Python
# has PyTorch with CUDA: make test-gpu PY=python3 (the project's sources are put on its path).
test-gpu: $(if $(filter .venv/bin/python,$(PY)),.venv/.installed)
	$(PY) -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_*.py

# The GPU benchmarks, each report naming the device, in $(GPU_BENCH_DIR) (not reports/bench, whose
# CPU files the paper reports read): the selectors against one read of the tensor at 10M and 100M
# elements, NCCL's allreduce and ssgd against DDP as a world of one. make bench-gpu PY=python3 as above.
GPU_BENCH_DIR ?= reports/bench/gpu
bench-gpu: $(if $(filter .venv/bin/python,$(PY)),.venv/.installed)
	@$(PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'make bench-gpu: no CUDA device here')"
	$(PY) -m commlab bench selection --devices cuda --sizes 10000000 100000000 --out-dir $(GPU_BENCH_DIR)
	$(PY) -m commlab bench collectives --backend nccl --workers 1 --check-mbit 0 --out-dir $(GPU_BENCH_DIR)
	$(PY) -m commlab bench throughput --workers 1 --networks loopback --methods ssgd ddp --repeats 3 \
	    --out-dir $(GPU_BENCH_DIR)

report: .venv/.installed
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default --report reports/snakemake_report.html

bench: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default bench

lint: .venv/.installed
	.venv/bin/ruff check src tests
	.venv/bin/snakemake --lint
	.venv/bin/snakefmt --check workflow Snakefile

# MLflow 3.17 opens in its GenAI view unless the address asks for the training runs.
mlflow-ui: .venv/.installed
	@echo "training runs: http://127.0.0.1:5000/#/experiments?workflowType=machine_learning"
	.venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000
