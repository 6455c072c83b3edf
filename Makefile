# The README's commands. Each target sets up .venv first (idempotent).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Keep freed memory in the process: 2-3x faster CPU training steps here (stack.md).
export MALLOC_MMAP_MAX_ := 0
export MALLOC_TRIM_THRESHOLD_ := 68719476736
export MALLOC_TOP_PAD_ := 1073741824
export HF_HUB_OFFLINE ?= 1
export NLTK_DATA := $(CURDIR)/$(VENV)/nltk_data
export WANDB_MODE ?= offline

.PHONY: setup demo test docs bench bench-data bench-gpu gpu-site clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/provision_nltk.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, CPU build, so nothing pulls a multi-GB CUDA wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,docs]'
	bash scripts/provision_nltk.sh $(NLTK_DATA)
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh

# The suite on TEST_WORKERS processes (pytest-xdist; tests/conftest.py keeps those that share
# something outside their tmp_path on one worker). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP) docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# The documentation site, docs/ -> site/, warnings as errors (~6 CPU-seconds; `make test` builds it
# first, so CI does). docs/configuration.md must be what scripts/gen_config_reference.py writes
# from the config schemas and conf/: run that script after changing either. No --quiet: mkdocs 1.6.1 with
# --quiet --strict exits 0 on warnings (tests/test_docs.py).
docs: $(STAMP)
	$(PY) scripts/gen_config_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# Start-up at the real data scale (docs/benchmarks/data-scale.md): 12k and 48k records, store / no store / TRL, 2-rank DDP.
bench-data: $(STAMP)
	$(PY) benchmarks/data_scale.py $(BENCH_DATA_ARGS)

# One CUDA device (docs/benchmarks/gpu.md). Runs with the interpreter given, e.g. on a GPU node
# without this venv: make bench-gpu GPU_PYTHON=python3. Where that node's image lacks hydra-core
# and omegaconf and has no package index, `make gpu-site` here first: it copies them (pure
# Python, 4 MB, the pinned versions) from this venv into .gpu-site/, which travels with the checkout.
GPU_PYTHON ?= $(PY)
SITE_PACKAGES = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
gpu-site: $(STAMP)
	rm -rf .gpu-site && mkdir -p .gpu-site
	cp -r $(SITE_PACKAGES)/hydra $(SITE_PACKAGES)/omegaconf $(SITE_PACKAGES)/antlr4 .gpu-site/

bench-gpu:
	PYTHONPATH=$(CURDIR)/src:$(CURDIR)/.gpu-site:$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu.py $(GPU_ARGS)

# Run outputs only: never data, nor the data store cache ($ROLEMRC_CACHE_DIR, ~/.cache/rolemrc).
clean:
	rm -rf outputs multirun .pytest_cache site
