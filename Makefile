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

.PHONY: install lint fmt test test-all demo bench bench-search bench-peers soak gpu-check gpu-wheels clean

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
	$(PY) -m pytest -m "not slow" --durations=15

test-all: lint
	$(PY) -m pytest

# The main job: pre-train on the embedded corpus, stop at step 120, then a second launch resumes
# from the newest complete checkpoint, finishes at step 200 and exports; that model is fine-tuned
# on the embedded chat set (held-out loss, export), and the export answers a question.
demo: install
	rm -rf outputs/demo
	$(TORCHRUN) recipes/train.py --config recipes/configs/demo.toml --train.steps 120 --export.hf_dir ''
	@echo "=== a second launch resumes from the newest complete checkpoint ==="
	$(TORCHRUN) recipes/train.py --config recipes/configs/demo.toml
	@$(PY) recipes/summary.py outputs/demo/train.jsonl
	@echo "=== fine-tune the exported model on the embedded chat set, with a held-out loss, then export ==="
	$(TORCHRUN) recipes/train.py --config recipes/configs/demo_chat.toml
	@$(PY) recipes/summary.py outputs/demo/chat.jsonl
	@echo "=== the export, loaded with plain transformers ==="
	$(PY) recipes/generate.py outputs/demo/chat "Where does the cat sleep?"

# FSDP1 vs FSDP2 (fsdp2kit) vs DDP, side by side in one torchrun (benchmarks/README.md):
# table on stdout; JSON, markdown and PNG under benchmarks/results/. BENCH_ARGS passes options,
# e.g. make bench BENCH_ARGS="--repeats 10". bench-search re-chooses the "best" configurations.
bench: install $(VENV)/.installed-bench
	$(TORCHRUN) benchmarks/fsdp1_vs_fsdp2.py $(BENCH_ARGS)

bench-search: install $(VENV)/.installed-bench
	$(TORCHRUN) benchmarks/fsdp1_vs_fsdp2.py --search $(BENCH_ARGS)

# fsdp2kit vs transformers' native FSDP2 vs Accelerate's FSDP2 on one checkpoint, at each library's defaults
# (benchmarks/README.md, "Against other FSDP2 stacks"): loads in fresh worlds, training interleaved, 2 ranks;
# JSON, markdown and PNG under benchmarks/results/peers.*. Under flock where there is one, so that two
# timing runs on a shared machine never overlap.
BENCH_LOCK := $(shell command -v flock >/dev/null 2>&1 && echo flock /tmp/fsdp2kit-bench.lock)
bench-peers: install $(VENV)/.installed-bench
	$(BENCH_LOCK) env PYTHONPATH=. $(PY) benchmarks/peers.py --nproc $(NPROC) $(BENCH_ARGS)

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

# On a machine with NVIDIA GPUs (README, "GPU"): the `cuda` tests, then benchmarks/gpu_bench.py, in about
# 10 minutes on one GPU; one JSON + markdown result under benchmarks/results/ named after the device. No
# `install` first: the machine's own CUDA torch is used when it has one. Refuses (exit 3) without a GPU.
gpu-check:
	@bash benchmarks/gpu_check.sh

# Wheels to carry to a GPU machine that has no network, for `make gpu-check` to install from .whl/,
# for CPython $(GPU_PYVER) on x86-64 Linux: torchao (GPU images with torch, transformers and pytest
# often lack it), the transformers and peft this project is tested with (transformers' weight-conversion API
# moves between 5.x releases) and isal (the checkpoint checksums). Their own requirements are usually there;
# name others in GPU_WHEELS.
GPU_PYVER  ?= 3.12
GPU_WHEELS ?= torchao==0.18.0 transformers==5.24.0 peft==0.21.2 isal==1.9.1
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYVER) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	@ls -l .whl

# 2,000 steps of the demo recipe with a checkpoint every 100: per-rank RSS, file descriptors and
# threads after warm-up must not grow (benchmarks/results/soak.md). tests/e2e/test_soak.py (slow) checks the same.
soak: install
	PYTHONPATH=. $(PY) benchmarks/soak.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
