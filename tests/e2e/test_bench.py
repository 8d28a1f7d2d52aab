"""The benchmark runs end to end under torchrun on a tiny model and writes what it promises.

Throughput numbers are not checked (a test machine is shared and noisy); the JSON keys that
readers rely on, the loss-parity check and the memory ordering that sharding guarantees are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # `make test-all`: ~30 s, and `make bench` itself exercises the same path
@pytest.mark.timeout(300)
def test_bench_tiny(tmp_path):
    best = tmp_path / "best.json"
    best.write_text(
        json.dumps(
            {
                "fsdp1": {"strategy": "SHARD_GRAD_OP", "forward_prefetch": True, "compile": False},
                "fsdp2": {"strategy": "SHARD_GRAD_OP", "forward_prefetch": False, "compile": False},
                "chosen_by": "test",
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "benchmarks" / "fsdp1_vs_fsdp2.py"),
        "--sizes",
        "demo:32,demo:64",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--best-configs",
        str(best),
        "--out-dir",
        str(tmp_path / "results"),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed to load" not in proc.stdout + proc.stderr
    files = sorted(p.suffix for p in (tmp_path / "results").iterdir())
    assert files == [".json", ".md", ".png"]
    result = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    assert list(result["sizes"]) == ["demo:32", "demo:64"]
    assert result["loss_parity_ok"]
    for size in result["sizes"].values():
        assert set(size["ratios"]) >= {"fsdp2_over_fsdp1", "best_fsdp2_over_best_fsdp1", "fsdp2_over_ddp"}
        vs = size["variants"]
        for v in vs.values():
            assert v["tokens_per_s_per_rank"] > 0 and v["peak_memory_bytes_per_rank"] > 0
        # sharded state: half of DDP's parameters + Adam state between steps, on two ranks
        assert vs["fsdp2"]["resident_bytes_per_rank"] < 0.6 * vs["ddp"]["resident_bytes_per_rank"]
        assert vs["fsdp1"]["resident_bytes_per_rank"] < 0.6 * vs["ddp"]["resident_bytes_per_rank"]
    assert set(result["verdict"]) == {"fsdp2_over_fsdp1", "best_fsdp2_over_best_fsdp1", "fsdp2_over_ddp"}
