# commlab: `make` runs the default workflow (installing what it needs), `make test` the tests.
SHELL := /bin/bash
PY := .venv/bin/python
CORES ?= 2
FMNIST := /usr/share/datasets/fashion-mnist
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: all run test smoke report bench lint mlflow-ui system-packages clean-results slurm-up slurm-down

all: run

# The virtual environment, rebuilt when the dependencies change.
.venv/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

# Fashion-MNIST from Debian, iproute2 (network emulation) and a local SLURM cluster's daemons
# (tests/test_slurm_cluster.py, make slurm-up), when apt and root are available.
DEBIAN_PACKAGES := dataset-fashion-mnist iproute2 util-linux munge slurmctld slurmd slurm-client slurmdbd \
	mariadb-server
system-packages:
	@if [ ! -d $(FMNIST) ] || ! command -v ip >/dev/null || ! command -v slurmdbd >/dev/null \
	    || ! command -v mariadbd >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq $(DEBIAN_PACKAGES) >/dev/null || \
	      { apt-get update -qq && apt-get install -y -qq $(DEBIAN_PACKAGES) >/dev/null; }; \
	  else echo "note: install Debian's dataset-fashion-mnist (or set data.fashion_mnist.source in params.yaml)"; fi; \
	fi

# A SLURM cluster on this machine (controller + 2 nodes in namespaces, 198.19.0.0/24): docs/cluster.md.
SLURM_DIR ?= /tmp/commlab-slurm
slurm-up: .venv/.installed system-packages
	PYTHONPATH=$(CURDIR)/src $(PY) -m commlab.launch.localslurm up --dir $(SLURM_DIR)

slurm-down:
	PYTHONPATH=$(CURDIR)/src $(PY) -m commlab.launch.localslurm down --dir $(SLURM_DIR)

run: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default

smoke: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default --configfile config/smoke.yaml

test: .venv/.installed system-packages
	.venv/bin/pytest -q

report: .venv/.installed
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default --report reports/snakemake_report.html

bench: .venv/.installed system-packages
	.venv/bin/snakemake --cores $(CORES) --profile workflow/profiles/default bench

lint: .venv/.installed
	.venv/bin/ruff check src tests
	.venv/bin/snakemake --lint

mlflow-ui: .venv/.installed
	.venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000
