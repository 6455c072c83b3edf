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

.PHONY: setup demo demo-rl test docs bench bench-data bench-gpu gpu-site gpu-wheels gpu-check clean

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

# GRPO on the sample rule-bearing prompts from the demo's SFT model, TRL's GRPOTrainer beside
# rolemrc's objective=grpo (CPU, minutes): outputs/grpo_demo/<time>/grpo_demo.{json,png}. Extra arguments
# in DEMO_RL_ARGS, e.g. DEMO_RL_ARGS="--sft outputs/demo/<run>/sft/export --steps 60"; the published
# figures: DEMO_RL_ARGS="--json benchmarks/results/grpo_demo.json".
demo-rl: $(STAMP)
	$(PY) benchmarks/grpo_demo.py $(DEMO_RL_ARGS)

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

# rolemrc vs TRL side by side (docs/benchmarks/speed.md): SFT, DPO, SimPO, ORPO, KTO, reward-model, GRPO and
# RLOO throughput, FLOPs, peak RSS (BENCH_ARGS="--only kto,grpo": some rows only).
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# Start-up at the real data scale (docs/benchmarks/data-scale.md): 12k and 48k records, store / no store / TRL, 2-rank DDP.
bench-data: $(STAMP)
	$(PY) benchmarks/data_scale.py $(BENCH_DATA_ARGS)

# One CUDA device (docs/benchmarks/gpu.md). Runs with the interpreter given, e.g. on a GPU node
# without this venv: make bench-gpu GPU_PYTHON=python3. Where that node's image lacks packages
# and has no package index, `make gpu-wheels` here first: it downloads into .whl/ (git-ignored)
# the py3.12 wheels the device image lacks (GPU_WHEELS), which travel with the checkout
# (carry .whl) and install there into /tmp/site (GPU_SITE; `make gpu-check` does this itself).
# GPU_WHEELS_EXTRA=transformers-pins adds transformers/tokenizers at our pins, for an image
# whose versions do not serve.
GPU_PYTHON ?= $(PY)
GPU_SITE ?= /tmp/site
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19 liger-kernel==0.8.5
GPU_WHEELS_EXTRA ?=
GPU_WHEEL_PIN_transformers-pins := transformers==5.23.0 tokenizers==0.23.3
GPU_WHEELS_LIMIT_MIB := 64
PIP_DOWNLOAD := $(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform any -d .whl
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PIP_DOWNLOAD) $(GPU_WHEELS) $(foreach x,$(GPU_WHEELS_EXTRA),$(GPU_WHEEL_PIN_$(x)))
	# antlr4-python3-runtime 4.9.3 (hydra's and omegaconf's pin) is published as an sdist only:
	# built here into a pure-Python wheel
	$(PYTHON) -m pip wheel -q --no-deps --no-binary=:all: -w .whl antlr4-python3-runtime==4.9.3
	@ls -l .whl | awk 'NR>1 {printf "  %9d  %s\n", $$5, $$9}'
	@whl=$$(du -cb .whl/*.whl | tail -1 | cut -f1); \
	 tree=$$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1); \
	 total=$$((whl + tree)); \
	 printf 'wheels %.1f MiB + tracked checkout %.1f MiB = %.1f MiB of the %d MiB a device call carries\n' \
	   $$(echo "$$whl/1048576" | bc -l) $$(echo "$$tree/1048576" | bc -l) $$(echo "$$total/1048576" | bc -l) \
	   $(GPU_WHEELS_LIMIT_MIB); \
	 if [ $$total -gt $$(( $(GPU_WHEELS_LIMIT_MIB) * 1048576 )) ]; then \
	   echo "error: .whl/ and the checkout exceed $(GPU_WHEELS_LIMIT_MIB) MiB" >&2; exit 1; fi

# Where no wheels were carried, the old way still works: hydra/omegaconf/antlr4 copied from this venv.
SITE_PACKAGES = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
gpu-site: $(STAMP)
	rm -rf .gpu-site && mkdir -p .gpu-site
	cp -r $(SITE_PACKAGES)/hydra $(SITE_PACKAGES)/omegaconf $(SITE_PACKAGES)/antlr4 .gpu-site/

# Installs .whl/ (if present) into $(GPU_SITE), then runs the benchmark with it on the path.
define gpu_install
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl || exit 1; fi
endef
bench-gpu:
	@$(gpu_install)
	PYTHONPATH=$(CURDIR)/src:$(GPU_SITE):$(CURDIR)/.gpu-site:$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu.py $(GPU_ARGS)

# The prepared GPU check (docs/benchmarks/gpu.md): parts tests, memory, speed into
# benchmarks/results/gpu_check.json, ~8 minutes on one H100; rerun to finish what was cut short.
gpu-check:
	@$(gpu_install)
	PYTHONPATH=$(CURDIR)/src:$(GPU_SITE):$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Run outputs only: never data, nor the data store cache ($ROLEMRC_CACHE_DIR, ~/.cache/rolemrc).
clean:
	rm -rf outputs multirun .pytest_cache site
