#!/usr/bin/env bash
# `make gpu-check`: on a machine with NVIDIA GPUs, starting bare, run the `cuda` tests and then the GPU
# benchmark, and write one JSON + markdown result named after the device under benchmarks/results/.
#
# Python: the first of $GPU_PYTHON, the project's .venv, python3 whose torch sees a GPU (a lent GPU
# machine's own CUDA torch is kept as it is). If none does but a GPU is there, `make install` builds
# .venv-cuda with the pinned torch from PyPI, whose Linux x86-64 wheels are CUDA builds (needs network).
# Wheels carried in $WHEELS (default .whl/; `make gpu-wheels` fills it, see README "GPU") are installed
# into a private folder ahead of that python's own packages; what is still missing then comes from the
# package index if one is reachable. The project itself is imported from this checkout (PYTHONPATH).
#
# Time: $GPU_CHECK_BUDGET_S seconds in all (default 540): the tests get at most half, the benchmark
# what is left, and it skips, and lists, the cases that would overrun. Exit status: 0 when every test
# passed and every benchmark case ran or was skipped for a stated reason; 3 with no GPU (nothing run).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-540}
export PYTHONUNBUFFERED=1  # progress lines as they happen, also through a pipe
WHEELS=${WHEELS:-.whl}
say() { echo "[gpu-check $(date -u +%H:%M:%S)] $*"; }

# 1. A GPU, or a one-sentence refusal before anything is installed or run.
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
if [ -z "$gpus" ] || [ "$gpus" = 0 ]; then
    if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
        echo "make gpu-check needs an NVIDIA GPU and this machine has none (nvidia-smi lists no GPU, no /dev/nvidia*): nothing was run." >&2
        exit 3
    fi
fi

# 2. A python whose torch is a CUDA build that sees the GPU.
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
for cand in "${GPU_PYTHON:-}" .venv/bin/python python3; do
    if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    say "no python here has a CUDA torch: installing the pinned torch from PyPI into .venv-cuda (a few GB of CUDA wheels)"
    make install VENV=.venv-cuda || { echo "installing a CUDA torch failed (see above); set GPU_PYTHON to a python with one" >&2; exit 4; }
    PY=.venv-cuda/bin/python
    has_cuda "$PY" || { echo "the torch installed in .venv-cuda does not see the GPU (driver too old for its CUDA?)" >&2; exit 4; }
fi
say "python: $(command -v "$PY") ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "-", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))'))"

# 3. What the project needs beside torch (import name=distribution name): carried wheels first.
SITE=${GPU_SITE:-/tmp/fsdp2kit-gpu-site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
missing() {
    local m out=""
    for m in transformers=transformers torchao=torchao safetensors=safetensors pytest=pytest pytest_timeout=pytest-timeout; do
        "$PY" -c "import ${m%%=*}" >/dev/null 2>&1 || out="$out ${m#*=}"
    done
    echo "$out"
}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # Carried wheels always win (they come first on the path): e.g. the transformers this project is tested with.
    say "installing the wheels in $WHEELS into $SITE: $(cd "$WHEELS" && echo *.whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
need=$(missing)
if [ -n "$need" ]; then
    say "missing:$need; trying the package index"
    # shellcheck disable=SC2086  # one word per package
    "$PY" -m pip install -q --retries 1 --timeout 20 --target "$SITE" $need || true
    need=$(missing)
fi
if [ -n "$need" ]; then
    echo "make gpu-check cannot import:$need. Carry wheels: run 'make gpu-wheels' where pip works and bring .whl/ along (README, section GPU)." >&2
    exit 5
fi

# 4. The cuda tests: world 1 on NCCL, and world N when there are N GPUs (tests/cuda). GPU_CHECK_TESTS=0
#    skips them (a second benchmark run, e.g. GPU_BENCH_ARGS="--cases offload --tag offload").
results=$(mktemp -d)
junit="$results/cuda-tests.xml"
tests_rc=0
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
    test_budget=$((BUDGET / 2))
    say "cuda tests (at most ${test_budget} s)"
    timeout --signal=INT --kill-after=20 "$test_budget" \
        "$PY" -m pytest tests/cuda -m cuda -p no:cacheprovider -q -rfEs --junitxml="$junit"
    tests_rc=$?
    [ $tests_rc -eq 124 ] && say "the cuda tests ran out of their ${test_budget} s"
fi

# 5. The benchmark, with what is left of the budget.
left=$((BUDGET - (SECONDS - start) - 20))  # 20 s for the last case to overrun its estimate
say "benchmark (budget ${left} s)"
bench_args=(--end-by "$(($(date +%s) + left))")
[ "${GPU_CHECK_TESTS:-1}" != 0 ] && bench_args+=(--tests-junit "$junit")
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of options
"$PY" benchmarks/gpu_bench.py "${bench_args[@]}" ${GPU_BENCH_ARGS:-}
bench_rc=$?

say "done in $((SECONDS - start)) s: tests exit $tests_rc, benchmark exit $bench_rc; results in benchmarks/results/gpu-*"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
