# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# With your own torch build (CUDA, nightly), run e.g. `make test TORCH=` to keep it, or name
# another spec with `make test TORCH='torch==2.13.0'`.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
NPROC  ?= 2

export OMP_NUM_THREADS ?= 1

TORCHRUN := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: install lint fmt test test-all demo bench bench-search soak clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# ruff's configuration is in pyproject.toml; `make fmt` applies what `make lint` asks for.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -m "not slow"

test-all: lint
	$(PY) -m pytest

# The main job: train on the embedded corpus, stop at step 120, then a second launch resumes
# from the newest complete checkpoint and finishes at step 200.
demo: install
	rm -rf outputs/demo
	$(TORCHRUN) recipes/train.py --config recipes/configs/demo.toml --train.steps 120
	@echo "=== a second launch resumes from the newest complete checkpoint ==="
	$(TORCHRUN) recipes/train.py --config recipes/configs/demo.toml
	@$(PY) recipes/summary.py outputs/demo/train.jsonl

# FSDP1 vs FSDP2 (fsdp2kit) vs DDP, side by side in one torchrun (benchmarks/README.md):
# table on stdout; JSON, markdown and PNG under benchmarks/results/. BENCH_ARGS passes options,
# e.g. make bench BENCH_ARGS="--repeats 10". bench-search re-chooses the "best" configurations.
bench: install $(VENV)/.installed-bench
	$(TORCHRUN) benchmarks/fsdp1_vs_fsdp2.py $(BENCH_ARGS)

bench-search: install $(VENV)/.installed-bench
	$(TORCHRUN) benchmarks/fsdp1_vs_fsdp2.py --search $(BENCH_ARGS)

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

# 2,000 steps of the demo recipe with a checkpoint every 100: per-rank RSS, file descriptors and
# threads after warm-up must not grow (benchmarks/results/soak.md). tests/e2e/test_soak.py (slow) checks the same.
soak: install
	PYTHONPATH=. $(PY) benchmarks/soak.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
