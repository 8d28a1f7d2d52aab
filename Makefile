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

.PHONY: install test test-all demo bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: install
	$(PY) -m pytest -m "not slow"

test-all: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
