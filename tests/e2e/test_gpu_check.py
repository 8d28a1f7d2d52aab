"""`make gpu-check` without a GPU refuses in one sentence; the GPU benchmark's code path runs on CPU.

The GPU figures themselves need a GPU (tests/cuda, benchmarks/gpu_bench.py); what runs here is
everything around them: the refusal, and `gpu_bench.py --dry-run`, which takes every branch of the
real run (each variant, the checkpoint and load_pretrained measurements, CPU offload, the JUnit
summary of the cuda tests, the JSON and markdown files) on a tiny model in a few seconds of CPU.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.cuda.test_cuda" name="test_nccl_group[world1]" time="12.5"/>
<testcase classname="tests.cuda.test_cuda" name="test_float8_tracks_bf16[world1]" time="0.1">
<skipped message="float8 matmuls need compute capability 8.9 or newer"/></testcase>
<testcase classname="tests.cuda.test_cuda" name="test_compile_blocks_triton[world1]" time="3.0">
<failure message="AssertionError: inductor generated no kernel"/></testcase>
</testsuite></testsuites>
"""


def _has_gpu_device() -> bool:
    return torch.cuda.is_available() or bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


@pytest.mark.timeout(60)
def test_gpu_check_refuses_without_gpu():
    if _has_gpu_device():
        pytest.skip("this machine has an NVIDIA GPU (or its driver): make gpu-check would run, not refuse")
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode != 0
    assert proc.stdout == ""  # nothing was installed or run
    sentence = proc.stderr.splitlines()[0]
    assert sentence.startswith("make gpu-check needs an NVIDIA GPU and this machine has none"), proc.stderr
    assert sentence.endswith("nothing was run.")


@pytest.mark.timeout(300)
def test_gpu_bench_dry_run(tmp_path):
    junit = tmp_path / "cuda-tests.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "results"
    args = ["--dry-run", "--out-dir", str(out), "--tests-junit", str(junit), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = out.glob("gpu-dryrun-cpu-*.json")
    (md_path,) = out.glob("gpu-dryrun-cpu-*.md")
    result = json.loads(json_path.read_text())
    assert result["dry_run"] and result["device"].startswith("CPU") and result["skipped"] == []

    train = {r["variant"]: r for r in result["train"]}
    assert list(train) == ["plain", "AC selective", "compile", "float8", "float8+compile"]
    for r in [*train.values(), result["offload"]]:
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["loss_finite"] and r["mfu"] is None  # no MFU on a CPU
        assert r["memory"] == [{"max_allocated": None, "max_reserved": None}]
        assert "status" in r["planner"]  # the prediction, or why there is none
    assert result["offload"]["cpu_offload"] and result["offload"]["optimizer"] == "adamw"
    speed = result["optim_offload"]["variants"]  # on a GPU all three run; on CPU state offload is refused
    assert speed["none"]["tokens_per_s"] > 0 and speed["cpu_offload"]["tokens_per_s"] > 0, speed
    assert speed["state offload"]["status"].startswith("refused: make_optimizer(offload=True) needs CUDA"), speed
    assert "| state offload | refused" in md_path.read_text()

    ck, lp = result["checkpoint"], result["load_pretrained"]
    assert ck["status"] == "ok" and ck["rank_bytes"] > 0 and ck["async_2"]["stall_s"] > 0
    assert lp["status"] == "ok" and lp["tensors"] > 0 and lp["bytes_read_rank0"] > 0

    assert result["tests"]["tests"] == 3 and result["tests"]["passed"] == 1
    assert result["tests"]["failed"][0]["message"].startswith("AssertionError")
    text = md_path.read_text()
    assert "DRY RUN" in text and "1 passed, 1 failed, 1 skipped of 3" in text
    assert "| tiny | float8+compile | 2x32 |" in text
    assert not list((tmp_path / "work").glob("*/step_*"))  # checkpoints and exports cleaned up
